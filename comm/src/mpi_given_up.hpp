// GivenUpRequests: what the mpi transport keeps of the calls it gave up on (a peer stalled or
// dead past MESHMEM_TIMEOUT, a window freed mid-transfer): MPI requests that could not be
// cancelled, with the memory they read or write, until MPI ends them; and messages that may
// still come for those calls, received and dropped so that their senders complete. The
// progress thread sweeps both.
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "window_state.hpp"

namespace meshmem::detail {

class GivenUpRequests {
 public:
  static constexpr std::uint64_t kNoWindow = ~std::uint64_t(0);
  explicit GivenUpRequests(int rank) : rank_(rank) {}
  GivenUpRequests(const GivenUpRequests&) = delete;
  GivenUpRequests& operator=(const GivenUpRequests&) = delete;
  // At teardown: requests still pending keep their memory for the life of the process.
  ~GivenUpRequests();

  // `r` and the memory it uses (`keep`) stay until it ends. `window`: the window whose memory
  // it reads or writes (kNoWindow: none), kept with it should the window be freed first.
  void keep_until_done(MPI_Request r, const std::shared_ptr<void>& keep, std::uint64_t window = kNoWindow);
  // A message that may still come (tag `tag` from `source` on `comm`) for a call that gave up.
  void drop_later(MPI_Comm comm, int source, int tag);
  // Window `id` is freed: the requests that use its memory keep `memory` until they end.
  // Returns how many do.
  std::size_t hold_window(std::uint64_t id, const std::shared_ptr<WindowMemory>& memory);
  // Whether sweep() has anything to do (read without the lock).
  bool pending() const { return pending_.load(std::memory_order_acquire); }
  // The progress thread: forgets the requests that ended, drops the late messages that came.
  void sweep();

 private:
  struct Kept {
    MPI_Request request;
    std::shared_ptr<void> keep;
    std::uint64_t window;
  };
  struct Stale {
    MPI_Comm comm;
    int source;
    int tag;
  };
  int rank_;
  std::mutex m_;
  std::vector<Kept> kept_;
  std::vector<Stale> stale_;
  std::atomic<bool> pending_{false};
};

}  // namespace meshmem::detail
