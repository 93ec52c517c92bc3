// Backoff for host-side polling loops. Several ranks often share few cores (CI runs 4 ranks
// on 2), so a waiter spins briefly, then yields, then sleeps with growing intervals, and a
// wait that sees progress starts over fast.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "meshmem/ipc/awake_clock.hpp"

namespace meshmem::detail {

class Backoff {
 public:
  // The longest sleep unless told otherwise.
  static constexpr std::chrono::microseconds kLongest{1000};

  Backoff() = default;
  // Sleeps no longer than `longest`, the sleep of a wait that has lasted 200 ms or more (the
  // shorter steps before it are capped by it too); 0: never sleeps, yields (a core per waiter).
  explicit Backoff(std::chrono::microseconds longest) : longest_(longest) {}
  // One step of waiting: pause, yield or sleep depending on how long this wait has lasted
  // (by the clock, not by the number of polls: a yield costs from 0.4 us to a time slice).
  void pause();
  void reset() { polls_ = 0; }
  // What pause() does once a wait has lasted `waited` (past its first 64 polls): sleeps this
  // long, or yields where it is zero.
  static std::chrono::microseconds sleep_after(std::chrono::steady_clock::duration waited,
                                               std::chrono::microseconds longest);

 private:
  std::uint64_t polls_ = 0;
  std::chrono::steady_clock::time_point start_;
  std::chrono::microseconds longest_ = kLongest;
};

// Sets this thread's timer slack to 1 us, so that short sleeps of a polling thread are not
// stretched to the default 50 us.
void tighten_timer_slack();

// A deadline from a timeout; zero means none. Measured on the AwakeClock: time in which this
// whole process was stopped (a suspended job) does not count.
class Deadline {
 public:
  explicit Deadline(std::chrono::milliseconds timeout);
  bool expired() const;
  std::chrono::milliseconds timeout() const { return timeout_; }
  std::chrono::milliseconds remaining() const;  // zero when none is set
  // The time a wait_until may wait to: the end, or a year from now where none is set.
  ipc::AwakeClock::time_point until() const;

 private:
  std::chrono::milliseconds timeout_;
  ipc::AwakeClock::time_point end_;
};

// "2.5 s" etc. for messages.
std::string describe_timeout(std::chrono::milliseconds timeout);
// An age or a duration to a tenth of a second ("12.3 s"; negative counts as 0), for messages.
std::string describe_seconds(std::chrono::nanoseconds duration);

}  // namespace meshmem::detail
