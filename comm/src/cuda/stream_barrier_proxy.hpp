// StreamBarrierProxy: barrier(stream) among ranks that cannot reach each other's GPU memory
// (other nodes, GPUs without peer access), without the host waiting for the GPU. When the
// stream reaches the barrier, a host function (cudaLaunchHostFunc) hands the barrier to a
// proxy thread, which meets the other ranks over MPI (a Bootstrap of its own, so the wait
// is bounded by MESHMEM_TIMEOUT and names the ranks that never came) and then writes the
// barrier's number into a pinned host word; the stream waits for that word
// (cuStreamWaitValue64) before it goes on. Under capture (CapturedHandoff) a host node hands
// the barrier over on every replay and a wait kernel waits for the number it got.
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

#include "../bootstrap.hpp"
#include "kernels.hpp"

namespace meshmem::detail {

template <class Owner>
struct HandoffBoard;

class StreamBarrierProxy {
 public:
  // Collective over `parent` (duplicates its communicator for the proxy's meetings).
  // `on_failure` hears each failed meeting's message (from the proxy thread), so that the
  // Comm's next call raises it, not only the next barrier.
  // `limit` and `early` are the device's, for the wait kernels of captured barriers.
  StreamBarrierProxy(MPI_Comm parent, std::chrono::milliseconds timeout, const std::string& what,
                     std::function<void(const std::string&)> on_failure, cuda::WaitLimit limit, bool early);
  StreamBarrierProxy(const StreamBarrierProxy&) = delete;
  StreamBarrierProxy& operator=(const StreamBarrierProxy&) = delete;
  // Waits for this device's work (every barrier enqueued here must have been met), then
  // stops the proxy thread.
  ~StreamBarrierProxy();

  // Enqueues one barrier on `stream`. Raises first the error of an earlier barrier whose
  // meeting failed (after a timeout that barrier released its stream, so that the stream
  // did not hang; the Comm refuses collectives from then on).
  void enqueue(cudaStream_t stream, const std::string& what);
  // The same into `graph`, captured on `stream`: on every replay a host node hands a barrier
  // to the proxy and a wait kernel waits until it is met (or until the device's timeout).
  // Each captured barrier holds one of kTicketWords words while its graph exists.
  void capture(cudaStream_t stream, cudaGraph_t graph, const std::string& what);

  // For CapturedHandoff (host nodes, user-object destructors; they may not call CUDA):
  // queues a barrier the stream has reached and returns its number; gives a ticket word back.
  std::uint64_t arrive_captured();
  void release_ticket_word(std::size_t word);

  static constexpr std::size_t kTicketWords = 256;

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
  // Pinned host words: [0] the last barrier met, then kTicketWords ticket words of captured
  // barriers (each written by its host node, read by its wait kernel).
  std::unique_ptr<std::uint64_t, FreeHost> released_;
  std::uint64_t released_device_ = 0;  // its address for the stream (CUdeviceptr)
  std::uint64_t enqueued_ = 0;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Arrival> pending_;        // in barrier order; references stay valid at both ends
  std::string failure_;                // a failed meeting's message, raised once
  std::function<void(const std::string&)> on_failure_;
  cuda::WaitLimit limit_;
  bool early_;
  std::vector<std::size_t> free_tickets_;  // under mutex_
  std::shared_ptr<HandoffBoard<StreamBarrierProxy>> board_;  // shared with captured graphs
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace meshmem::detail
