// ProgressWatch: whether work enqueued on a stream of meshmem's own has stopped moving, seen
// from the host through a count that only grows (copies done, words the GPU wrote). The
// staging agent keeps one per stream (staging_agent.hpp). No CUDA here, so it is unit-tested
// anywhere.
#pragma once

#include <chrono>
#include <cstdint>

namespace meshmem::detail {

template <class Clock>
class ProgressWatch {
 public:
  enum class Seen {
    Nothing,     // idle, moving, or not held long enough (yet)
    Held,        // work pending and the count unmoved for `held_after`: once per stall
    MovesAgain,  // a stall reported before has ended (the count moved, or nothing is pending)
  };

  // One look: `done` the count now, `pending` whether work is enqueued that has not run.
  Seen observe(std::uint64_t done, bool pending, typename Clock::time_point now, typename Clock::duration held_after) {
    const bool was_reported = reported_;
    if (!pending || !active_ || done != done_) {
      // Idle, or a new start: the stall (if any) is over. Time counts from the first look
      // with work pending, not from the last idle look (the watch may have slept since).
      active_ = pending;
      done_ = done;
      since_ = now;
      reported_ = false;
      return was_reported ? Seen::MovesAgain : Seen::Nothing;
    }
    if (reported_ || now - since_ < held_after) return Seen::Nothing;
    reported_ = true;
    return Seen::Held;
  }
  // How long the count has not moved (while pending).
  typename Clock::duration unmoved_for(typename Clock::time_point now) const {
    return active_ ? now - since_ : typename Clock::duration{};
  }

 private:
  bool active_ = false;
  std::uint64_t done_ = 0;
  typename Clock::time_point since_{};
  bool reported_ = false;
};

}  // namespace meshmem::detail
