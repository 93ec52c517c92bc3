// Backoff's steps (comm/src/backoff.hpp), read from its step function: no timing.
#include <gtest/gtest.h>

#include "backoff.hpp"

using meshmem::detail::Backoff;
using std::chrono::microseconds;
using std::chrono::milliseconds;
using std::chrono::seconds;

TEST(Backoff, DefaultStepsEndAtOneMillisecond) {
  const microseconds longest = Backoff::kLongest;
  EXPECT_EQ(Backoff::sleep_after(microseconds(0), longest), microseconds(0));  // yields
  EXPECT_EQ(Backoff::sleep_after(microseconds(199), longest), microseconds(0));
  EXPECT_EQ(Backoff::sleep_after(microseconds(200), longest), microseconds(20));
  EXPECT_EQ(Backoff::sleep_after(milliseconds(5), longest), microseconds(100));
  EXPECT_EQ(Backoff::sleep_after(milliseconds(50), longest), microseconds(300));
  EXPECT_EQ(Backoff::sleep_after(milliseconds(200), longest), microseconds(1000));
  EXPECT_EQ(Backoff::sleep_after(seconds(100), longest), microseconds(1000));
}

// MESHMEM_MPI_IDLE_SLEEP below the steps: every step is capped by it.
TEST(Backoff, AShorterLongestCapsEveryStep) {
  EXPECT_EQ(Backoff::sleep_after(milliseconds(5), microseconds(50)), microseconds(50));
  EXPECT_EQ(Backoff::sleep_after(milliseconds(50), microseconds(250)), microseconds(250));
  EXPECT_EQ(Backoff::sleep_after(seconds(1), microseconds(250)), microseconds(250));
  EXPECT_EQ(Backoff::sleep_after(milliseconds(1), microseconds(250)), microseconds(20));
}

// Above 1 ms it is the sleep of a long wait only (it used to be capped at 1 ms).
TEST(Backoff, ALongerLongestIsTheSleepOfALongWait) {
  EXPECT_EQ(Backoff::sleep_after(milliseconds(50), milliseconds(5)), microseconds(300));
  EXPECT_EQ(Backoff::sleep_after(seconds(1), milliseconds(5)), milliseconds(5));
}

TEST(Backoff, ZeroNeverSleeps) {
  for (const auto waited : {microseconds(0), microseconds(500), microseconds(5000), microseconds(50000),
                            microseconds(5000000)})
    EXPECT_EQ(Backoff::sleep_after(waited, microseconds(0)), microseconds(0)) << waited.count() << " us";
}

// Deadline::until is what waits on a condition variable wait to: the deadline's end, or far
// ahead (a year) where no timeout is set, never now.
TEST(Deadline, UntilIsTheEndOrAYearAheadWithoutATimeout) {
  using meshmem::detail::Deadline;
  using meshmem::ipc::AwakeClock;
  const auto before = AwakeClock::now();
  const Deadline two(seconds(2));
  const auto after = AwakeClock::now();
  EXPECT_GE(two.until(), before + seconds(2));
  EXPECT_LE(two.until(), after + seconds(2));
  const Deadline none(milliseconds(0));
  EXPECT_GE(none.until(), after + std::chrono::hours(24 * 364));
  EXPECT_FALSE(none.expired());
}
