// StreamBarrierProxy: barrier(stream) among ranks that cannot reach each other's GPU memory
// (other nodes, GPUs without peer access), without the host waiting for the GPU. When the
// stream reaches the barrier, a host function (cudaLaunchHostFunc) hands the barrier to a
// proxy thread, which meets the other ranks over MPI (a Bootstrap of its own, so the wait
// is bounded by MESHMEM_TIMEOUT and names the ranks that never came) and then writes the
// barrier's number into a pinned host word; the stream waits for that word
// (cuStreamWaitValue64) before it goes on.
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

#include "../bootstrap.hpp"

namespace meshmem::detail {

class StreamBarrierProxy {
 public:
  // Collective over `parent` (duplicates its communicator for the proxy's meetings).
  // `on_failure` hears each failed meeting's message (from the proxy thread), so that the
  // Comm's next call raises it, not only the next barrier.
  StreamBarrierProxy(MPI_Comm parent, std::chrono::milliseconds timeout, const std::string& what,
                     std::function<void(const std::string&)> on_failure);
  StreamBarrierProxy(const StreamBarrierProxy&) = delete;
  StreamBarrierProxy& operator=(const StreamBarrierProxy&) = delete;
  // Waits for this device's work (every barrier enqueued here must have been met), then
  // stops the proxy thread.
  ~StreamBarrierProxy();

  // Enqueues one barrier on `stream`. Raises first the error of an earlier barrier whose
  // meeting failed (after a timeout that barrier released its stream, so that the stream
  // did not hang; the Comm refuses collectives from then on).
  void enqueue(cudaStream_t stream, const std::string& what);

 private:
  struct Arrival {
    StreamBarrierProxy* proxy;
    std::uint64_t number;
    bool reached = false;  // the stream passed its earlier work
  };
  static void CUDART_CB reached(void* arrival);
  void serve();
  void raise_failure(const std::string& what);

  struct FreeHost {
    void operator()(std::uint64_t* p) const noexcept { (void)cudaFreeHost(p); }
  };

  Bootstrap boot_;
  std::unique_ptr<std::uint64_t, FreeHost> released_;  // pinned host word: the last barrier met
  std::uint64_t released_device_ = 0;  // its address for the stream (CUdeviceptr)
  std::uint64_t enqueued_ = 0;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Arrival> pending_;        // in barrier order; references stay valid at both ends
  std::string failure_;                // a failed meeting's message, raised once
  std::function<void(const std::string&)> on_failure_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace meshmem::detail
