// StreamBarrierProxy: barrier(stream) among ranks that cannot reach each other's GPU memory
// (other nodes, GPUs without peer access), without the host waiting for the GPU. When the
// stream reaches the barrier, a host function (cudaLaunchHostFunc) hands the barrier to a
// proxy thread, which meets the other ranks over MPI (a Bootstrap of its own, so the wait
// is bounded by MESHMEM_TIMEOUT and names the ranks that never came) and then writes the
// barrier's number into a pinned host word; the stream waits for that word
// (cuStreamWaitValue64) before it goes on. Under capture (CapturedHandoff) a kernel rings the
// barrier's doorbell on every replay (the thread polls them while captured barriers exist)
// and waits for the number the thread gave it.
//
// Destruction waits for the device's work (a stream may wait for a barrier only this proxy
// meets), bounded by twice MESHMEM_TIMEOUT: a stream that never finishes (a user's kernel, a
// stream memory wait for a signal that never comes) must not hang ~Comm. Past that bound the
// proxy releases every barrier it was given, unmet, and leaves what host functions and stream
// waits still read (the mapped word, the queue of arrivals) to a thread that frees it once the
// device is idle.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "bootstrap.hpp"
#include "cuda/runtime/block_pool.hpp"
#include "cuda/runtime/kernels.hpp"

namespace meshmem::detail {

template <class Owner>
struct HandoffBoard;
class GpuDevice;

class StreamBarrierProxy {
 public:
  // Collective over `parent` (duplicates its communicator for the proxy's meetings).
  // `on_failure` hears each failed meeting's message (from the proxy thread), so that the
  // Comm's next call raises it, not only the next barrier.
  // `device_facts`: the device's wait settings, for the waits of captured barriers
  // (CapturedHandoff); it outlives this.
  StreamBarrierProxy(MPI_Comm parent, int device, std::chrono::milliseconds timeout, const std::string& what,
                     std::function<void(const std::string&)> on_failure, const GpuDevice& device_facts);
  StreamBarrierProxy(const StreamBarrierProxy&) = delete;
  StreamBarrierProxy& operator=(const StreamBarrierProxy&) = delete;
  // Waits for this device's work (every barrier enqueued here must have been met), at most
  // twice MESHMEM_TIMEOUT, then stops the proxy thread (see the top of this file).
  ~StreamBarrierProxy();

  // Enqueues one barrier on `stream`. Raises first the error of an earlier barrier whose
  // meeting failed (after a timeout that barrier released its stream, so that the stream
  // did not hang; the Comm refuses collectives from then on).
  void enqueue(cudaStream_t stream, const std::string& what);
  // The same into `graph`, captured on `stream`: on every replay a kernel rings a doorbell
  // that hands a barrier to the proxy and waits until it is met (or until the device's
  // timeout). Each captured barrier holds one of kCapturedBarriers doorbells while its graph
  // exists.
  void capture(cudaStream_t stream, cudaGraph_t graph, const std::string& what);

  // For CapturedHandoff (the proxy's thread, at a doorbell): queues a barrier the stream has
  // reached and returns its number.
  std::uint64_t arrive_captured();

  static constexpr std::size_t kCapturedBarriers = 256;

 private:
  struct Shared;
  struct Arrival {
    Shared* shared;
    std::uint64_t number;
    bool reached = false;  // the stream passed its earlier work
  };
  // What host functions and the streams' waits read: it outlives the proxy where the
  // device's work did not end in time (then freed once it did).
  struct Shared {
    std::mutex mutex;
    std::condition_variable wake;
    std::deque<Arrival> pending;  // in barrier order; references stay valid at both ends
    // Mapped host memory: [0] the last barrier met, then (64 bytes on) the doorbells of
    // captured barriers (the board's; kept with the word while the device may still run).
    PooledBlock memory;
    std::uint64_t* released = nullptr;
  };
  static void CUDART_CB reached(void* arrival);
  void serve();
  void raise_failure(const std::string& what);

  Bootstrap boot_;
  int device_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
  std::uint64_t released_device_ = 0;  // shared_->released for the stream (CUdeviceptr)
  std::uint64_t enqueued_ = 0;         // under shared_->mutex
  std::string failure_;                // a failed meeting's message, raised once (under shared_->mutex)
  std::function<void(const std::string&)> on_failure_;
  const GpuDevice& device_facts_;
  std::shared_ptr<HandoffBoard<StreamBarrierProxy>> board_;  // shared with captured graphs
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace meshmem::detail
