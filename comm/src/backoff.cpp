#include "backoff.hpp"

#include <sched.h>

#include <string>
#include <thread>

namespace meshmem::detail {

void Backoff::pause() {
  ++polls_;
  if (polls_ < 64) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    return;
  }
  if (polls_ < 2048) {
    sched_yield();
    return;
  }
  // Past a few thousand polls the peer is not about to answer: sleep, growing to 1 ms.
  const std::uint64_t over = polls_ - 2048;
  const auto us = std::chrono::microseconds(over < 10 ? 5 : over < 100 ? 50 : over < 1000 ? 200 : 1000);
  std::this_thread::sleep_for(us);
}

Deadline::Deadline(std::chrono::milliseconds timeout)
    : timeout_(timeout), end_(std::chrono::steady_clock::now() + timeout) {}

bool Deadline::expired() const {
  return timeout_.count() != 0 && std::chrono::steady_clock::now() >= end_;
}

std::chrono::milliseconds Deadline::remaining() const {
  if (timeout_.count() == 0) return std::chrono::milliseconds(0);
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      end_ - std::chrono::steady_clock::now());
  return left.count() > 0 ? left : std::chrono::milliseconds(1);
}

std::string describe_timeout(std::chrono::milliseconds timeout) {
  if (timeout.count() == 0) return "forever";
  const auto ms = timeout.count();
  if (ms % 1000 == 0) return std::to_string(ms / 1000) + " s";
  return std::to_string(ms) + " ms";
}

}  // namespace meshmem::detail
