#include "worker_pulse.hpp"

#include "backoff.hpp"

#include <algorithm>
#include <chrono>
#include <vector>

namespace meshmem::detail {

namespace {
std::string seconds(std::int64_t ns) { return describe_seconds(std::chrono::nanoseconds(ns)); }

// Leaked: workers (and timeout messages) may outlive static destruction.
std::mutex& board_m = *new std::mutex;
std::vector<std::weak_ptr<WorkerPulse>>& board = *new std::vector<std::weak_ptr<WorkerPulse>>;
}  // namespace

void WorkerPulse::publish(std::string state, std::int64_t now_ns) {
  std::lock_guard<std::mutex> lock(m_);
  state_ = std::move(state);
  state_ns_ = now_ns;
}

std::string WorkerPulse::describe(std::int64_t now_ns) const {
  const std::int64_t turned = turn_ns_.load(std::memory_order_relaxed);
  const bool sleeping = sleeping_.load(std::memory_order_relaxed);
  std::string s = name_ + ": ";
  if (stopped_.load(std::memory_order_relaxed)) return s + "stopped";
  if (sleeping)
    s += "it waits for work (since " + seconds(now_ns - turned) + ")";
  else if (now_ns - turned >= kStuckNs)
    s += "its loop has not turned for " + seconds(now_ns - turned) + ": it is inside a call that has not returned";
  else
    s += "its loop last turned " + seconds(now_ns - turned) + " ago";
  std::lock_guard<std::mutex> lock(m_);
  if (!state_.empty()) s += "; what it held " + seconds(now_ns - state_ns_) + " ago: " + state_;
  return s;
}

void register_worker_pulse(const std::shared_ptr<WorkerPulse>& pulse) {
  std::lock_guard<std::mutex> lock(board_m);
  board.erase(std::remove_if(board.begin(), board.end(), [](const auto& w) { return w.expired(); }), board.end());
  board.push_back(pulse);
}

std::string describe_worker_pulses(std::int64_t now_ns) {
  std::vector<std::shared_ptr<WorkerPulse>> live;
  {
    std::lock_guard<std::mutex> lock(board_m);
    for (const auto& w : board)
      if (auto p = w.lock()) live.push_back(std::move(p));
  }
  std::string s;
  for (const auto& p : live) s += "; " + p->describe(now_ns);
  return s;
}

std::int64_t pulse_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string describe_worker_pulses() { return describe_worker_pulses(pulse_now_ns()); }

}  // namespace meshmem::detail
