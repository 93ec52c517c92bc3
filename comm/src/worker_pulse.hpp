// WorkerPulse: what a thread of meshmem's own (the staging agent) last did, readable from any
// thread: when its loop last turned, whether it sleeps for lack of work, and the state it last
// published. A timeout error raised on a caller's thread adds it (describe_worker_pulses), so
// a stall inside the worker shows there: a call of its own that does not return (its loop
// stops turning), or work it holds but cannot move (its state). The worker's own stream watch
// cannot see the first: it runs on that thread.
//
// Times are steady-clock nanoseconds passed in, so the unit tests choose them. CUDA-free.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

namespace meshmem::detail {

class WorkerPulse {
 public:
  explicit WorkerPulse(std::string name) : name_(std::move(name)) {}

  // Each turn of the worker's loop (cheap: one relaxed store each).
  void turn(std::int64_t now_ns) noexcept {
    sleeping_.store(false, std::memory_order_relaxed);
    turn_ns_.store(now_ns, std::memory_order_relaxed);
  }
  // Before the worker waits for work without a bound: an old turn then means nothing.
  void sleep(std::int64_t now_ns) noexcept {
    turn_ns_.store(now_ns, std::memory_order_relaxed);
    sleeping_.store(true, std::memory_order_relaxed);
  }
  void publish(std::string state, std::int64_t now_ns);
  // The worker's thread has ended (its owner may live on): described as stopped.
  void stop() noexcept { stopped_.store(true, std::memory_order_relaxed); }

  // "the staging agent of rank 0: its loop last turned 0.0 s ago; what it held 0.1 s ago: ..."
  std::string describe(std::int64_t now_ns) const;

  // A loop not turned for this long is said to be stuck inside a call.
  static constexpr std::int64_t kStuckNs = 1'000'000'000;

 private:
  const std::string name_;
  std::atomic<std::int64_t> turn_ns_{0};
  std::atomic<bool> sleeping_{true};
  std::atomic<bool> stopped_{false};
  mutable std::mutex m_;
  std::string state_;
  std::int64_t state_ns_ = 0;
};

// The process's pulses, for timeout messages: a worker registers its own (kept weakly: it
// leaves with its owner).
void register_worker_pulse(const std::shared_ptr<WorkerPulse>& pulse);
// "; " and each live pulse's description, or "" if none.
std::string describe_worker_pulses(std::int64_t now_ns);
std::string describe_worker_pulses();  // now
std::int64_t pulse_now_ns();

}  // namespace meshmem::detail
