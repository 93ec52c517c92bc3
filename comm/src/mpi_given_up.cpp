#include "mpi_given_up.hpp"

#include <algorithm>
#include <utility>

#include "log.hpp"

namespace meshmem::detail {

GivenUpRequests::~GivenUpRequests() {
  std::lock_guard<std::mutex> lock(m_);
  if (kept_.empty()) return;
  static auto* forever = new std::vector<Kept>();
  static std::mutex forever_m;
  std::lock_guard<std::mutex> keep_lock(forever_m);
  for (auto& k : kept_) forever->push_back(std::move(k));
  log(LogLevel::Warn, "mpi transport on rank " + std::to_string(rank_) + ": " + std::to_string(kept_.size()) +
                          " request(s) given up on after a timeout still pending at teardown; their memory is kept");
}

void GivenUpRequests::keep_until_done(MPI_Request r, const std::shared_ptr<void>& keep, std::uint64_t window) {
  std::lock_guard<std::mutex> lock(m_);
  kept_.push_back(Kept{r, keep, window});
  pending_.store(true, std::memory_order_release);
}

void GivenUpRequests::drop_later(MPI_Comm comm, int source, int tag) {
  std::lock_guard<std::mutex> lock(m_);
  stale_.push_back(Stale{comm, source, tag});
  pending_.store(true, std::memory_order_release);
}

std::size_t GivenUpRequests::hold_window(std::uint64_t id, const std::shared_ptr<WindowMemory>& memory) {
  std::lock_guard<std::mutex> lock(m_);
  std::size_t held = 0;
  for (Kept& k : kept_) {
    if (k.window != id) continue;
    k.keep = std::make_shared<std::pair<std::shared_ptr<void>, std::shared_ptr<WindowMemory>>>(k.keep, memory);
    ++held;
  }
  return held;
}

void GivenUpRequests::sweep() {
  std::lock_guard<std::mutex> lock(m_);
  kept_.erase(std::remove_if(kept_.begin(), kept_.end(),
                             [](Kept& k) {
                               int done = 0;
                               return MPI_Test(&k.request, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done;
                             }),
              kept_.end());
  for (const Stale& s : stale_) {
    for (;;) {  // a payload may come in several messages
      int found = 0;
      MPI_Message message = MPI_MESSAGE_NULL;
      MPI_Status status;
      if (MPI_Improbe(s.source, s.tag, s.comm, &found, &message, &status) != MPI_SUCCESS || !found) break;
      int count = 0;
      MPI_Get_count(&status, MPI_BYTE, &count);
      std::vector<char> sink(static_cast<std::size_t>(std::max(count, 1)));
      (void)MPI_Mrecv(sink.data(), count, MPI_BYTE, &message, MPI_STATUS_IGNORE);
      log(LogLevel::Warn, "mpi transport on rank " + std::to_string(rank_) + ": dropped " + std::to_string(count) +
                              " late byte(s) from rank " + std::to_string(s.source) + " for a call that had given up");
    }
  }
  pending_.store(!kept_.empty() || !stale_.empty(), std::memory_order_release);
}

}  // namespace meshmem::detail
