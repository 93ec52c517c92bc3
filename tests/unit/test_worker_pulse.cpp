// WorkerPulse: what a timeout message says about a worker thread of meshmem's own (its loop's
// last turn, sleeping, its published state), and the process's list of pulses.
#include "worker_pulse.hpp"

#include <gtest/gtest.h>

#include <memory>
#include <string>

using meshmem::detail::describe_worker_pulses;
using meshmem::detail::register_worker_pulse;
using meshmem::detail::WorkerPulse;

namespace {
constexpr std::int64_t kSecond = 1'000'000'000;

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }
}  // namespace

TEST(WorkerPulse, ATurningLoopIsNotCalledStuck) {
  WorkerPulse pulse("agent 0");
  pulse.turn(10 * kSecond);
  const std::string s = pulse.describe(10 * kSecond + kSecond / 2);
  EXPECT_TRUE(has(s, "agent 0: its loop last turned 0.5 s ago")) << s;
  EXPECT_FALSE(has(s, "not returned")) << s;
}

TEST(WorkerPulse, ALoopThatStoppedTurningIsCalledStuckInACall) {
  WorkerPulse pulse("agent 0");
  pulse.turn(10 * kSecond);
  const std::string s = pulse.describe(22 * kSecond);
  EXPECT_TRUE(has(s, "has not turned for 12.0 s: it is inside a call that has not returned")) << s;
}

TEST(WorkerPulse, ASleepingWorkerIsNotCalledStuck) {
  WorkerPulse pulse("agent 0");
  pulse.turn(10 * kSecond);
  pulse.sleep(11 * kSecond);
  std::string s = pulse.describe(30 * kSecond);
  EXPECT_TRUE(has(s, "waits for work (since 19.0 s)")) << s;
  EXPECT_FALSE(has(s, "not returned")) << s;
  pulse.turn(31 * kSecond);  // woken: turning again
  s = pulse.describe(31 * kSecond);
  EXPECT_TRUE(has(s, "last turned 0.0 s ago")) << s;
}

TEST(WorkerPulse, AStoppedWorkerIsCalledStoppedNotStuck) {
  WorkerPulse pulse("agent 0");
  pulse.turn(10 * kSecond);
  pulse.publish("2 for rank 1", 10 * kSecond);
  pulse.stop();
  const std::string s = pulse.describe(30 * kSecond);
  EXPECT_EQ(s, "agent 0: stopped");
}

TEST(WorkerPulse, ThePublishedStateComesWithItsAge) {
  WorkerPulse pulse("agent 0");
  pulse.turn(5 * kSecond);
  EXPECT_FALSE(has(pulse.describe(5 * kSecond), "what it held")) << pulse.describe(5 * kSecond);
  pulse.publish("2 for rank 1", 4 * kSecond);
  const std::string s = pulse.describe(7 * kSecond);
  EXPECT_TRUE(has(s, "; what it held 3.0 s ago: 2 for rank 1")) << s;
}

TEST(WorkerPulse, TheProcessListHoldsLivePulsesOnly) {
  auto first = std::make_shared<WorkerPulse>("agent A");
  auto second = std::make_shared<WorkerPulse>("agent B");
  register_worker_pulse(first);
  register_worker_pulse(second);
  first->turn(kSecond);
  second->turn(kSecond);
  std::string s = describe_worker_pulses(kSecond);
  EXPECT_TRUE(has(s, "; agent A: ")) << s;
  EXPECT_TRUE(has(s, "; agent B: ")) << s;
  second.reset();  // its owner left
  s = describe_worker_pulses(kSecond);
  EXPECT_TRUE(has(s, "; agent A: ")) << s;
  EXPECT_FALSE(has(s, "agent B")) << s;
  first.reset();
  EXPECT_EQ(describe_worker_pulses(kSecond), "");
}
