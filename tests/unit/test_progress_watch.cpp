// ProgressWatch (comm/src/progress_watch.hpp): when the staging agent reports one of its
// streams as held back in a GPU queue.
#include <gtest/gtest.h>

#include <chrono>

#include "progress_watch.hpp"

using meshmem::detail::ProgressWatch;
using Clock = std::chrono::steady_clock;
using Seen = ProgressWatch<Clock>::Seen;
using std::chrono::milliseconds;

namespace {
const Clock::time_point t0{};
constexpr auto kAfter = milliseconds(2000);
}  // namespace

TEST(ProgressWatch, IdleOrMovingIsNeverHeld) {
  ProgressWatch<Clock> w;
  EXPECT_EQ(w.observe(0, false, t0, kAfter), Seen::Nothing);
  EXPECT_EQ(w.observe(0, false, t0 + milliseconds(10000), kAfter), Seen::Nothing);
  // Pending work whose count moves at every look, looks 1.5 s apart: never held.
  for (int i = 1; i <= 10; ++i) {
    const auto at = t0 + milliseconds(10000 + 1500 * i);
    EXPECT_EQ(w.observe(static_cast<std::uint64_t>(i), true, at, kAfter), Seen::Nothing) << i;
  }
}

TEST(ProgressWatch, UnmovedPendingWorkIsHeldOnceAfterTheBound) {
  ProgressWatch<Clock> w;
  EXPECT_EQ(w.observe(5, true, t0, kAfter), Seen::Nothing);
  EXPECT_EQ(w.observe(5, true, t0 + milliseconds(1999), kAfter), Seen::Nothing);
  EXPECT_EQ(w.observe(5, true, t0 + milliseconds(2000), kAfter), Seen::Held);
  EXPECT_EQ(w.unmoved_for(t0 + milliseconds(2500)), milliseconds(2500));
  // Reported once per stall.
  EXPECT_EQ(w.observe(5, true, t0 + milliseconds(9000), kAfter), Seen::Nothing);
  // It moves: said once, then a new stall needs the whole bound again.
  EXPECT_EQ(w.observe(6, true, t0 + milliseconds(9100), kAfter), Seen::MovesAgain);
  EXPECT_EQ(w.observe(6, true, t0 + milliseconds(11000), kAfter), Seen::Nothing);
  EXPECT_EQ(w.observe(6, true, t0 + milliseconds(11100), kAfter), Seen::Held);
  // The work ends: moves again, then idle.
  EXPECT_EQ(w.observe(7, false, t0 + milliseconds(11200), kAfter), Seen::MovesAgain);
  EXPECT_EQ(w.observe(7, false, t0 + milliseconds(20000), kAfter), Seen::Nothing);
}

// The agent sleeps while idle: work that appears after a long idle spell is timed from the
// first look that sees it pending, not from the last idle look.
TEST(ProgressWatch, TimeCountsFromTheFirstLookWithWorkPending) {
  ProgressWatch<Clock> w;
  EXPECT_EQ(w.observe(3, false, t0, kAfter), Seen::Nothing);
  EXPECT_EQ(w.observe(3, true, t0 + milliseconds(60000), kAfter), Seen::Nothing);  // same count, just pending
  EXPECT_EQ(w.observe(3, true, t0 + milliseconds(61000), kAfter), Seen::Nothing);
  EXPECT_EQ(w.observe(3, true, t0 + milliseconds(62000), kAfter), Seen::Held);
}
