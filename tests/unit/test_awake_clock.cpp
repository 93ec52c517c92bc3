// The AwakeClock that every meshmem timeout is measured with: it keeps time while the process
// runs or sleeps, and does not count a stop of the whole process (a suspended job), so a
// resumed job does not time out on time in which nothing could have answered.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "meshmem/ipc/awake_clock.hpp"

using meshmem::ipc::AwakeClock;
using namespace std::chrono;

namespace {

double seconds_of(nanoseconds d) { return duration<double>(d).count(); }

}  // namespace

TEST(AwakeClock, KeepsTimeWhileTheProcessRunsOrSleeps) {
  const auto a0 = AwakeClock::now();
  const auto s0 = steady_clock::now();
  const auto gone0 = AwakeClock::not_counted();
  std::this_thread::sleep_for(milliseconds(600));
  const auto awake = AwakeClock::now() - a0;
  const auto steady = steady_clock::now() - s0;
  EXPECT_EQ(AwakeClock::not_counted(), gone0) << "a sleeping process lost time";
  EXPECT_NEAR(seconds_of(awake), seconds_of(steady), 0.01);
  EXPECT_GE(awake, milliseconds(600));
}

TEST(AwakeClock, NeverGoesBackAcrossThreads) {
  std::vector<std::thread> threads;
  std::vector<int> backwards(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      auto last = AwakeClock::now();
      const auto until = steady_clock::now() + milliseconds(400);
      while (steady_clock::now() < until) {
        const auto now = AwakeClock::now();
        if (now < last) ++backwards[static_cast<std::size_t>(t)];
        last = now;
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(backwards[static_cast<std::size_t>(t)], 0) << "thread " << t;
}

// A child process (its own clock, restarted after fork) is stopped with SIGSTOP for 2 s and
// continued: its AwakeClock advances by well under that, a steady clock by all of it.
TEST(AwakeClock, DoesNotCountAStopOfTheWholeProcess) {
  (void)AwakeClock::now();  // the parent's watcher runs: the child must start its own
  int to_child[2], to_parent[2];
  ASSERT_EQ(pipe(to_child), 0);
  ASSERT_EQ(pipe(to_parent), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const auto a0 = AwakeClock::now();
    const auto s0 = steady_clock::now();
    std::this_thread::sleep_for(milliseconds(100));
    char c = 'r';
    if (write(to_parent[1], &c, 1) != 1) _exit(2);
    if (read(to_child[0], &c, 1) != 1) _exit(3);  // the parent stops and continues us meanwhile
    const std::int64_t result[2] = {duration_cast<nanoseconds>(AwakeClock::now() - a0).count(),
                                    duration_cast<nanoseconds>(steady_clock::now() - s0).count()};
    if (write(to_parent[1], result, sizeof result) != static_cast<ssize_t>(sizeof result)) _exit(4);
    _exit(0);
  }
  // The child's ends close here, so that a child that dies reads as end of file, not a hang
  // (seen under TSan, which kills a child that starts a thread after a multithreaded fork).
  close(to_parent[1]);
  close(to_child[0]);
  char c = 0;
  ASSERT_EQ(read(to_parent[0], &c, 1), 1) << "the child died before it was stopped";
  ASSERT_EQ(kill(child, SIGSTOP), 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, WUNTRACED), child);
  ASSERT_TRUE(WIFSTOPPED(status));
  std::this_thread::sleep_for(seconds(2));
  ASSERT_EQ(kill(child, SIGCONT), 0);
  c = 'c';
  ASSERT_EQ(write(to_child[1], &c, 1), 1);
  std::int64_t result[2] = {0, 0};
  ASSERT_EQ(read(to_parent[0], result, sizeof result), static_cast<ssize_t>(sizeof result));
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  for (int fd : {to_child[1], to_parent[0]}) close(fd);
  const double awake = seconds_of(nanoseconds(result[0]));
  const double steady = seconds_of(nanoseconds(result[1]));
  EXPECT_GE(steady, 2.0);
  // 0.1 s of its own sleep, plus up to 0.25 s that a stop costs, plus scheduling.
  EXPECT_LT(awake, 0.9) << "the stop was counted (steady " << steady << " s)";
  EXPECT_GE(awake, 0.1);
}

// A published word follows now() (for GPU waits, which read it from pinned memory) until it
// is unpublished.
TEST(AwakeClock, APublishedWordFollowsTheClockUntilUnpublished) {
  std::int64_t word = 0;
  ASSERT_TRUE(AwakeClock::publish(&word)) << "no watcher runs";
  const std::int64_t first = __atomic_load_n(&word, __ATOMIC_RELAXED);
  EXPECT_GT(first, 0);
  std::this_thread::sleep_for(milliseconds(300));
  const std::int64_t later = __atomic_load_n(&word, __ATOMIC_RELAXED);
  const std::int64_t now = duration_cast<nanoseconds>(AwakeClock::now().time_since_epoch()).count();
  EXPECT_GE(later - first, duration_cast<nanoseconds>(milliseconds(200)).count());
  EXPECT_LE(now - later, duration_cast<nanoseconds>(milliseconds(150)).count()) << "written every 50 ms";
  AwakeClock::unpublish(&word);
  const std::int64_t stopped = __atomic_load_n(&word, __ATOMIC_RELAXED);
  std::this_thread::sleep_for(milliseconds(200));
  EXPECT_EQ(__atomic_load_n(&word, __ATOMIC_RELAXED), stopped) << "written after unpublish";
}
