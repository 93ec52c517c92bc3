// A peer stopped past MESHMEM_TIMEOUT (SIGSTOP: a debugger, preemption, a stalled node) that
// then resumes: host windows through the MPI transport. A call that timed out writes nothing
// afterwards (a get's destination stays as it was, a put is not applied later with whatever
// its source then holds), later calls with that peer fail at once instead of waiting a whole
// timeout each, and both ranks tear down. Two ranks on one machine (rank 0 stops and resumes
// rank 1 by pid). And the opposite case: the whole job stopped past the timeout and resumed
// is not a stalled peer. Run under ASan+UBSan in CI as well.
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <meshmem/meshmem.hpp>

#include "job_suspend.hpp"
#include "mpi_test.hpp"

using namespace meshmem;
using meshmem::test::first_not;
using meshmem::test::kPoison;
using meshmem::test::pattern;

namespace {

constexpr std::chrono::milliseconds kTimeout{1000};

// Whether process `pid` is stopped (state T in /proc/PID/stat).
bool stopped(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(in, line);
  const auto close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'T';
}

class Stall : public meshmem::test::MpiTest {
 protected:
  void SetUp() override {
    if (meshmem::test::world_size() != 2) GTEST_SKIP() << "two ranks on one machine";
    const pid_t mine = getpid();
    MPI_Allgather(&mine, 1, MPI_INT, pids, 1, MPI_INT, MPI_COMM_WORLD);
    char host[2][64] = {};
    gethostname(host[meshmem::test::world_rank()], 63);
    MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, host, 64, MPI_CHAR, MPI_COMM_WORLD);
    if (std::string(host[0]) != host[1]) GTEST_SKIP() << "the ranks are on different hosts";
    me = meshmem::test::world_rank();
    seed = meshmem::test::shared_seed();
  }
  Options options() const {
    Options o = Options::from_environment();
    o.timeout = kTimeout;
    o.set("MESHMEM_TRANSPORTS", "mpi");
    return o;
  }
  // Rank 1 stops itself; rank 0 returns once it is stopped.
  void stop_rank1() {
    MPI_Barrier(MPI_COMM_WORLD);
    if (me == 1) {
      raise(SIGSTOP);
      return;
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!stopped(pids[1]) && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ASSERT_TRUE(stopped(pids[1])) << "rank 1 did not stop";
  }
  // Rank 0 resumes rank 1, then both give rank 1's progress thread time to serve what it
  // found waiting (the calls rank 0 gave up on).
  void resume_rank1() {
    if (me == 0) kill(pids[1], SIGCONT);
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    MPI_Barrier(MPI_COMM_WORLD);
  }
  pid_t pids[2] = {0, 0};
  int me = 0;
  std::uint64_t seed = 0;
};

template <class F>
std::string timeout_message(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Timeout) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error raised";
  return "";
}

TEST_F(Stall, GetThatTimedOutWritesNothingLater) {
  const std::size_t bytes = (std::size_t(8) << 20) + 13;
  Comm c(MPI_COMM_WORLD, options());
  Window w = c.alloc(bytes, Memory::Host);
  const auto data = pattern(seed, 1, bytes);
  if (me == 1) std::memcpy(w.local(), data.data(), bytes);
  std::vector<unsigned char> dst(bytes, kPoison);
  stop_rank1();
  if (me == 0) {
    const std::string first = timeout_message([&] { c.get(dst.data(), w, 1, 0, bytes); });
    EXPECT_NE(first.find("nothing will be written into the destination"), std::string::npos) << first;
    // The peer is failed for this Comm: the next call says so at once.
    const auto t0 = std::chrono::steady_clock::now();
    const std::string again = timeout_message([&] { c.get(dst.data(), w, 1, 0, 64); });
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(500));
    EXPECT_NE(again.find("no longer waits for it"), std::string::npos) << again;
  }
  resume_rank1();
  if (me == 0) EXPECT_EQ(first_not(dst.data(), kPoison, bytes), -1) << "the get that timed out wrote into its destination later";
}

TEST_F(Stall, PutThatTimedOutIsNotAppliedLater) {
  const std::size_t bytes = (std::size_t(8) << 20) + 13;
  Comm c(MPI_COMM_WORLD, options());
  Window w = c.alloc(bytes, Memory::Host);
  std::memset(w.local(), kPoison, bytes);
  auto src = pattern(seed, 2, bytes);
  stop_rank1();
  if (me == 0) {
    const std::string first = timeout_message([&] { c.put(w, 1, 0, src.data(), bytes); });
    if (first.find("do not reuse it") == std::string::npos) {
      // The source may be reused: what a late put would carry now.
      const auto other = pattern(seed, 3, bytes);
      std::memcpy(src.data(), other.data(), bytes);
    }
  }
  resume_rank1();
  MPI_Barrier(MPI_COMM_WORLD);
  if (me == 1) EXPECT_EQ(first_not(w.local(), kPoison, bytes), -1) << "the put that timed out was applied later";
}

// The whole job suspended (both ranks stopped, as a scheduler's suspend or a debugger's
// all-stop does) for longer than the timeout, while rank 0 waits in a barrier that rank 1 has
// not reached yet, then resumed: no Timeout, and the Comm goes on working. Before the timeouts
// were measured on the AwakeClock, the barrier failed with a Timeout blaming rank 1.
class WholeJobSuspend : public Stall, public ::testing::WithParamInterface<const char*> {
 protected:
  static constexpr std::chrono::milliseconds kTimeout{2000};
  static constexpr std::chrono::milliseconds kStopped{5000};
  Options suspend_options() const {
    Options o = Options::from_environment();
    o.timeout = kTimeout;
    if (std::string(GetParam()) != "default") o.set("MESHMEM_TRANSPORTS", GetParam());
    return o;
  }
};

TEST_P(WholeJobSuspend, ABarrierWaitingAcrossTheSuspendDoesNotTimeOut) {
  Comm c(MPI_COMM_WORLD, suspend_options());
  const std::size_t bytes = (std::size_t(1) << 20) + 7;
  Window w = c.alloc(bytes, Memory::Host);
  std::memset(w.local(), kPoison, bytes);
  c.barrier();
  pid_t suspender = -1;
  const auto t0 = std::chrono::steady_clock::now();
  if (me == 0) {
    suspender = meshmem::test::suspend_job_after({pids[1], pids[0]}, std::chrono::milliseconds(200), kStopped);
    ASSERT_GT(suspender, 0) << "fork: " << std::strerror(errno);
  } else {
    // Still asleep when the job is stopped; arrives once it is continued.
    std::this_thread::sleep_for(std::chrono::milliseconds(800));
  }
  EXPECT_NO_THROW(c.barrier()) << "rank " << me << ": a suspend of the whole job was taken for a stalled peer";
  const auto waited = std::chrono::steady_clock::now() - t0;
  if (me == 0) {
    int status = 0;
    ASSERT_EQ(waitpid(suspender, &status, 0), suspender);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    // The barrier did span the suspend: otherwise this test proves nothing.
    EXPECT_GE(waited, kStopped) << "rank 0 left the barrier before the job was suspended";
  }
  // The Comm still works: a put from each rank into the other, checked byte by byte.
  const auto data = pattern(seed, 10 + static_cast<unsigned>(me), bytes);
  c.put(w, 1 - me, 0, data.data(), bytes);
  c.quiet();
  c.barrier();
  const auto expect = pattern(seed, 10 + static_cast<unsigned>(1 - me), bytes);
  EXPECT_EQ(std::memcmp(w.local(), expect.data(), bytes), 0) << "rank " << me << ": the put after the resume";
}

INSTANTIATE_TEST_SUITE_P(Routes, WholeJobSuspend, ::testing::Values("default", "mpi"));

}  // namespace
