// What keeps stream-ordered synchronisation right and bounded on one device:
//   DeviceFaultRecord  where device-side waits report a timeout, read by the next host call
//   StreamSequence     runs one object's stream work in call order across the caller's streams
// (WindowReleaser, which frees window memory, is window_releaser.hpp.)
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda/runtime/block_pool.hpp"
#include "cuda/runtime/kernels.hpp"

namespace meshmem::detail {

class DeviceFaultRecord {
 public:
  DeviceFaultRecord(int device, std::chrono::milliseconds timeout, const std::string& what);
  ~DeviceFaultRecord();
  DeviceFaultRecord(const DeviceFaultRecord&) = delete;
  DeviceFaultRecord& operator=(const DeviceFaultRecord&) = delete;

  cuda::WaitLimit limit() const { return cuda::WaitLimit{device_, timeout_ns_, awake_device_}; }
  // Raises Error(Timeout) for a device wait that timed out since the last check (and clears
  // it). One read of pinned memory when there is none: every stream call checks.
  // `where()` makes the message's prefix, only when there is a fault (this runs on every call).
  template <class Where>
  void raise_if_set(Where&& where) {
    if (__atomic_load_n(&host_->code, __ATOMIC_ACQUIRE) != 0) raise(where());
  }
  // A barrier(stream) whose meeting a host thread gave up on (across nodes): the next call
  // raises it as it raises a device wait's timeout. Where a device wait's timeout is already
  // recorded, that one is raised first and this is dropped (the barrier's own next call
  // raises it too). CPU and GPU claim the record with separate atomics (not atomic with
  // each other over PCIe): two timeouts in the same instant may mix their fields.
  void report_host_barrier(const std::string& failure);

 private:
  [[noreturn]] void raise(const std::string& where);
  PooledBlock memory_;  // the record, then the AwakeClock word (mapped host memory)
  cuda::DeviceFault* host_ = nullptr;
  std::mutex host_failure_m_;
  std::string host_failure_;  // HostBarrier's message
  cuda::DeviceFault* device_ = nullptr;
  std::int64_t* awake_host_ = nullptr;  // the AwakeClock word, published while this lives
  const std::int64_t* awake_device_ = nullptr;
  std::chrono::milliseconds timeout_;
  std::uint64_t timeout_ns_;
};

// cudaDeviceSynchronize of the current device, tried again every millisecond while CUDA
// refuses it because a stream of the device captures a graph (and, measured on H200 with
// CUDA 13, that capture is invalidated whatever this thread's capture mode). For meshmem's
// threads that give memory or communicators back once the device's earlier work is done.
cudaError_t synchronize_device_between_captures();

// For a thread of meshmem's whose CUDA calls touch only its own streams, and events recorded
// outside captures: the application may capture a graph in global mode on another thread
// meanwhile, and those calls must not be refused (cudaErrorStreamCaptureUnsupported). (The
// calls that MPI or NCCL make on such a thread are theirs: relaxed for them too.)
void relax_capture_mode_of_this_thread() noexcept;

// The k-th call of an object (a barrier, a halo plan) must run on the GPU after the
// (k-1)-th, whatever streams they were given: otherwise a later call's flags could release
// an earlier one. An event after each call; a call on another stream than the last waits
// for it. Not during graph capture (docs/semantics.md "CUDA graphs": order graphs and eager calls of
// one object on different streams yourself).
class StreamSequence {
 public:
  explicit StreamSequence(const std::string& what);
  ~StreamSequence();
  StreamSequence(const StreamSequence&) = delete;
  StreamSequence& operator=(const StreamSequence&) = delete;
  void before(cudaStream_t stream, bool capturing, const char* call, int rank);
  void after(cudaStream_t stream, bool capturing, const char* call, int rank);

 private:
  cudaEvent_t event_ = nullptr;
  cudaStream_t last_ = nullptr;
  bool recorded_ = false;
};

}  // namespace meshmem::detail
