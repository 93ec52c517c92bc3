#include "backoff.hpp"

#include <sched.h>
#include <sys/prctl.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>

namespace meshmem::detail {

void Backoff::pause() {
  if (polls_++ == 0) start_ = std::chrono::steady_clock::now();
  if (polls_ < 64) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    return;
  }
  const auto us = sleep_after(std::chrono::steady_clock::now() - start_, longest_);
  if (us.count() == 0)
    sched_yield();
  else
    std::this_thread::sleep_for(us);
}

std::chrono::microseconds Backoff::sleep_after(std::chrono::steady_clock::duration waited,
                                               std::chrono::microseconds longest) {
  using std::chrono::microseconds;
  using std::chrono::milliseconds;
  if (waited < microseconds(200)) return microseconds(0);
  // The peer is not about to answer: sleep, longer the longer the wait, `longest` from 200 ms on.
  const auto us = waited < milliseconds(2)     ? microseconds(20)
                  : waited < milliseconds(20)  ? microseconds(100)
                  : waited < milliseconds(200) ? microseconds(300)
                                               : longest;
  return std::min(us, longest);
}

void tighten_timer_slack() { (void)prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0); }

Deadline::Deadline(std::chrono::milliseconds timeout)
    : timeout_(timeout), end_(ipc::AwakeClock::now() + timeout) {}

bool Deadline::expired() const {
  return timeout_.count() != 0 && ipc::AwakeClock::now() >= end_;
}

ipc::AwakeClock::time_point Deadline::until() const {
  return timeout_.count() == 0 ? ipc::AwakeClock::now() + std::chrono::hours(24 * 365) : end_;
}

std::chrono::milliseconds Deadline::remaining() const {
  if (timeout_.count() == 0) return std::chrono::milliseconds(0);
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      end_ - ipc::AwakeClock::now());
  return left.count() > 0 ? left : std::chrono::milliseconds(1);
}

std::string describe_seconds(std::chrono::nanoseconds duration) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f s", static_cast<double>(std::max<std::int64_t>(duration.count(), 0)) / 1e9);
  return text;
}

std::string describe_timeout(std::chrono::milliseconds timeout) {
  if (timeout.count() == 0) return "forever";
  const auto ms = timeout.count();
  if (ms % 1000 == 0) return std::to_string(ms / 1000) + " s";
  return std::to_string(ms) + " ms";
}

}  // namespace meshmem::detail
