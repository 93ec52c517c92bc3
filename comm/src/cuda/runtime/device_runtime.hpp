// CudaDeviceRuntime: the device side of a Comm on one CUDA device (DeviceRuntime of
// ../device_runtime.hpp): facts about the device gathered once, device window memory,
// stream waits on this rank's signal words, halo copy plans, and the barrier(stream)
// variant.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "device_interface.hpp"
#include "transport.hpp"
#include "cuda/runtime/block_pool.hpp"
#include "cuda/runtime/device_sync.hpp"
#include "meshmem/ipc/cuda_driver.hpp"
#include "cuda/proxy/nccl_library.hpp"

namespace meshmem::detail {

// Enqueues stream memory operations in order, 256 per driver call (the driver's limit).
// The error message (call, rank) is built only when a call fails: this is a hot path.
void run_stream_batch(std::vector<CUstreamBatchMemOpParams>& ops, Stream stream, const char* call, int rank);
// One stream write of `value` to `address`. It comes with a memory barrier first (the v2
// batch API has no way to leave it out), so the copies and writes before it land first.
CUstreamBatchMemOpParams stream_write_op(std::uint64_t* address, std::uint64_t value);
// One stream wait until the word at `address` compares with `value` as `flags` say
// (CU_STREAM_WAIT_VALUE_GEQ or _EQ, with CU_STREAM_WAIT_VALUE_FLUSH where wanted).
CUstreamBatchMemOpParams stream_wait_op(const std::uint64_t* address, std::uint64_t value, unsigned flags);


// Sets `device` current for the life of the object (the staged transport drives several GPUs).
class CurrentDevice {
 public:
  explicit CurrentDevice(int device);
  ~CurrentDevice();
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  int previous_ = -1;
};

class Deadline;

// Whether every piece of work on `stream` ended before `deadline` (polled with a backoff); a
// CUDA error of the stream raises Error(Cuda) naming `call`.
bool stream_ends_by(cudaStream_t stream, const Deadline& deadline, const char* call, const std::string& what);

class OwnedStream {
 public:
  explicit OwnedStream(const std::string& what);
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  ~OwnedStream();
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// An event for ordering only (no timing), destroyed with the object.
class OwnedEvent {
 public:
  explicit OwnedEvent(const std::string& what);
  OwnedEvent(const OwnedEvent&) = delete;
  OwnedEvent& operator=(const OwnedEvent&) = delete;
  ~OwnedEvent();
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

class CudaDeviceRuntime final : public DeviceRuntime {
 public:
  // Collective over the Comm.
  CudaDeviceRuntime(const CommContext& ctx, int device);

  int device() const override { return device_; }
  std::string describe() const override { return description_; }
  void create_local(WindowState& state, const std::string& what) override;
  void publish(WindowState& state, const std::string& what) override;
  DeviceEntry enter(Stream stream, bool capture, const char* call) override;
  void leave(const DeviceEntry& entry) noexcept override;
  void wait_until(const WindowState& sig, std::size_t index, std::size_t count, Cmp cmp, std::uint64_t value,
                  std::optional<std::uint64_t> then, Stream stream, const char* call) override;
  std::uint64_t read_word(const WindowState& sig, std::size_t index) override;
  void write_words(const WindowState& sig, std::size_t index, std::size_t count, std::uint64_t value,
                   const char* call) override;
  std::unique_ptr<DeviceHaloPlan> make_halo_plan(const DeviceHaloSpec& spec) override;
  void retire(WindowState& state, const char* call) override;
  void retire_all(const std::vector<WindowState*>& states, const char* call) noexcept override;
  std::unique_ptr<StreamBarrier> make_barrier(const CommContext& ctx, const BarrierContext& bctx) override;
  void note_own_stream_route(const std::string& route) override;
  void tearing_down() noexcept override { live_.reset(); }

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
  // MESHMEM_HALO_SENDS=concurrent: halo plans send to their transport neighbours on lanes.
  bool halo_sends_at_once() const { return halo_sends_at_once_; }
  int rank() const { return rank_; }

 private:
  std::string where(const char* call) const { return std::string(call) + " on rank " + std::to_string(rank_); }
  static std::string device_of(CUcontext context);

  int rank_;
  int size_;
  int device_;
  CUcontext context_ = nullptr;  // device_'s primary context: a stream of any other is refused
  std::string description_;
  std::size_t granularity_ = 0;
  bool shared_gpu_ = false;
  bool shared_in_comm_ = false;
  std::vector<std::string> bus_ids_;
  bool any_shared_ = false;
  unsigned wait_flags_ = 0;
  bool wait_kernel_ = false;  // MESHMEM_STREAM_WAIT resolved
  bool early_launch_ = false;
  bool halo_sends_at_once_ = false;
  std::chrono::milliseconds timeout_;
  OwnedStream setup_stream_;
  std::optional<LiveCommMark> live_;  // NCCL destroys that run while this Comm lives warn
  WindowReleaser releaser_;  // before fault_: its last synchronisation frees fault_'s memory
  DeviceFaultRecord fault_;
};

}  // namespace meshmem::detail
