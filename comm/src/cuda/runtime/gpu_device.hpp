// GpuDevice: one rank's CUDA device as the transports and the barrier see it: facts gathered
// once when the Comm is made (granularity, who shares the GPU, bus ids, wait flags), where
// device-side waits report a timeout, and the stream's wait for the end of a transfer that a
// host thread carries out. GpuDevice (device_runtime.hpp) owns it.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/runtime/device_sync.hpp"
#include "cuda/runtime/kernels.hpp"

namespace meshmem::detail {

struct CommContext;
class DeviceRuntime;

class GpuDevice {
 public:
  // Collective over the Comm.
  GpuDevice(const CommContext& ctx, int device);
  GpuDevice(const GpuDevice&) = delete;
  GpuDevice& operator=(const GpuDevice&) = delete;

  int rank() const { return rank_; }
  int device() const { return device_; }
  CUcontext context() const { return context_; }
  // "device 0 (NVIDIA H200, 0000:18:00.0), stream waits kernel, ...": `middle` goes before the
  // GPU queues and module loading.
  std::string describe(const std::string& middle = "") const { return head_ + middle + tail_; }
  // Every rank's window parts are rounded to this (the largest granularity of the ranks).
  std::size_t granularity() const { return granularity_; }
  // Some rank of the Comm shares its GPU with another.
  bool any_shared_gpu() const { return any_shared_; }
  // Another rank of the Comm, on any node, uses this rank's GPU (same UUID): ranks of other
  // simulated nodes, or of containers of this machine given the same GPU.
  bool gpu_shared_in_comm() const { return shared_in_comm_; }
  // Every rank's GPU as a PCI bus id ("0000:1b:00.0"), by rank: the way to name a peer's GPU
  // across processes that number their devices differently (gathered once, at construction).
  const std::vector<std::string>& bus_ids() const { return bus_ids_; }
  // Extra flags of stream waits (flush of remote writes where the device can).
  unsigned wait_flags() const { return wait_flags_; }
  // Where device-side waits report a timeout, and the timeout.
  cuda::WaitLimit wait_limit() const { return fault_.limit(); }
  std::chrono::milliseconds timeout() const { return timeout_; }
  DeviceFaultRecord& faults() { return fault_; }
  // Makes `stream` wait until *done (pinned or mapped host memory) reaches `ticket`: the end
  // of a transfer that a host thread carries out with rank `peer`. A polling kernel that gives
  // up after MESHMEM_TIMEOUT, or, where MESHMEM_STREAM_WAIT resolves to memop (this rank's GPU
  // is shared: a polling kernel would hold the time-sliced GPU from the very ranks the
  // transfer needs) and `owner_ends_it` (the transfer's owner ends it at the timeout, whatever
  // the peer does), cuStreamWaitValue64, which holds no SM. Where `ready` is given (host
  // memory mapped here), *ready is set to `ticket` first, once the stream's earlier work is
  // done: the host thread carrying out the transfer starts on that.
  // `until`, where not 0, is what *done must reach instead of `ticket` (*ready still gets
  // `ticket`): a staged put with source completion waits for its source read. `give_up`: a
  // wait kernel that times out marks *done given up (cuda::kTransferGivenUp), for a reader
  // that drops what comes later.
  void wait_for_ticket(std::uint64_t* done, std::uint64_t ticket, int peer, cudaStream_t stream, bool owner_ends_it,
                       const std::string& what, std::uint64_t* ready = nullptr, std::uint64_t until = 0,
                       bool give_up = false) const;
  bool waits_with_kernel() const { return wait_kernel_; }
  // A barrier(stream) across nodes gave up (its proxy thread): the next call raises it.
  void report_barrier_failure(const std::string& failure) { fault_.report_host_barrier(failure); }
  // MESHMEM_EARLY_LAUNCH resolved: launch meshmem's kernels as programmatic dependent launches.
  bool early_launch() const { return early_launch_; }

 private:
  int rank_;
  int device_;
  CUcontext context_ = nullptr;  // device_'s primary context: a stream of any other is refused
  std::string head_, tail_;      // of describe()
  std::size_t granularity_ = 0;
  bool shared_gpu_ = false;
  bool shared_in_comm_ = false;
  std::vector<std::string> bus_ids_;
  bool any_shared_ = false;
  unsigned wait_flags_ = 0;
  bool wait_kernel_ = false;  // MESHMEM_STREAM_WAIT resolved
  bool early_launch_ = false;
  std::chrono::milliseconds timeout_;
  DeviceFaultRecord fault_;
};

// The GpuDevice of a Comm's device runtime; null where device windows are unavailable
// (`runtime` null). Defined with GpuDevice, the only DeviceRuntime of the GPU part.
GpuDevice* gpu_device_of(DeviceRuntime* runtime);

}  // namespace meshmem::detail
