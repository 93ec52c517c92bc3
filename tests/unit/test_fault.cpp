// MESHMEM_FAULT (comm/src/fault.hpp): what the knob accepts and refuses, and what each action
// does when a point is reached. No MPI: the plans are made from Options directly.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <meshmem/config.hpp>
#include <meshmem/error.hpp>
#include <string>
#include <thread>

#include "fault.hpp"
#include "knobs.hpp"

using namespace meshmem;
using meshmem::detail::FaultPlan;
using meshmem::detail::FaultPoint;
using meshmem::detail::faults_taken;

namespace {

Options with_faults(const std::string& value) {
  Options o;
  o.set("MESHMEM_FAULT", value);
  return o;
}

// The canonical text the knob keeps for `value`.
std::string canonical(const std::string& value) {
  return meshmem::detail::find_knob("MESHMEM_FAULT")->text(with_faults(value));
}

void expect_refused(const std::string& value, const std::string& because) {
  try {
    with_faults(value);
    ADD_FAILURE() << "MESHMEM_FAULT='" << value << "' was accepted";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    EXPECT_NE(what.find("MESHMEM_FAULT='" + value + "' is not valid"), std::string::npos) << what;
    EXPECT_NE(what.find(because), std::string::npos) << what;
    // Every point is named, so that a misspelt one is easy to correct.
    EXPECT_NE(what.find("comm.start, comm.joined, fd.exchange, mpi.put.after_header, mpi.serve.put, "
                        "mpi.serve.get, mpi.serve.flush"),
              std::string::npos)
        << what;
  }
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST(Fault, AcceptedValuesAndTheirCanonicalText) {
  EXPECT_EQ(canonical("none"), "none");
  EXPECT_EQ(canonical("2:mpi.put.after_header:kill"), "2:mpi.put.after_header:kill");
  EXPECT_EQ(canonical(" 1:Comm.Start:delay=2500 , 0:mpi.serve.get:stop=60000:hit=3"),
            "1:comm.start:delay=2500,0:mpi.serve.get:stop=60000:hit=3");
  EXPECT_EQ(canonical("0:fd.exchange:kill:hit=1"), "0:fd.exchange:kill");
  // Unset, nothing is armed; the knob does not decide routes, so ranks may differ in it.
  EXPECT_EQ(meshmem::detail::find_knob("MESHMEM_FAULT")->text(Options{}), "none");
  EXPECT_FALSE(meshmem::detail::find_knob("MESHMEM_FAULT")->must_agree());
  EXPECT_FALSE(FaultPlan().armed());
  EXPECT_FALSE(FaultPlan(Options{}, 0, 4).armed());
}

TEST(Fault, MalformedValuesAreRefusedNamingTheProblem) {
  expect_refused("2:mpi.put.afterheader:kill", "'mpi.put.afterheader' is not a fault point");
  expect_refused("2:mpi.put:kill", "'mpi.put' is not a fault point");
  expect_refused("x:comm.start:kill", "'x' is not a rank");
  expect_refused("-1:comm.start:kill", "'-1' is not a rank");
  expect_refused("1:comm.start", "does not have 3 or 4 fields");
  expect_refused("1:comm.start:kill:hit=2:more", "does not have 3 or 4 fields");
  expect_refused("1:comm.start:crash", "'crash' is not an action");
  expect_refused("1:comm.start:delay", "'delay' is not an action");
  expect_refused("1:comm.start:kill=3", "'kill=3' is not an action");
  expect_refused("1:comm.start:delay=1s", "'1s' is not a number of milliseconds");
  expect_refused("1:comm.start:delay=-5", "'-5' is not a number of milliseconds");
  expect_refused("1:comm.start:stop=0", "'0' is not a number of milliseconds");
  expect_refused("1:comm.start:delay=3600001", "'3600001' is not a number of milliseconds");
  expect_refused("1:comm.start:kill:hit=0", "'hit=0' is not hit=<n>");
  expect_refused("1:comm.start:kill:after=2", "'after=2' is not hit=<n>");
  expect_refused("1:comm.start:kill,", "an entry is empty");
  expect_refused(",1:comm.start:kill", "an entry is empty");
  expect_refused(" ", "it is empty");
  expect_refused("1:comm.start:fail", "'comm.start' cannot fail");
  expect_refused("1:leaders.enqueue:fail=1", "'fail=1' is not an action");
}

// `fail` (only where the point can fail): hit() says so on its hit, once; other hits and
// delays do not.
TEST(Fault, FailTellsTheCallerOnItsHit) {
  EXPECT_EQ(canonical("0:leaders.enqueue:fail:hit=2"), "0:leaders.enqueue:fail:hit=2");
  const FaultPlan plan(with_faults("0:leaders.enqueue:fail:hit=2,0:proxy.header:delay=1"), 0, 2);
  const std::uint64_t before = faults_taken(FaultPoint::LeadersEnqueue);
  EXPECT_FALSE(plan.hit(FaultPoint::LeadersEnqueue));
  EXPECT_TRUE(plan.hit(FaultPoint::LeadersEnqueue));
  EXPECT_FALSE(plan.hit(FaultPoint::LeadersEnqueue));
  EXPECT_FALSE(plan.hit(FaultPoint::ProxyHeader));
  EXPECT_EQ(faults_taken(FaultPoint::LeadersEnqueue), before + 1);
  EXPECT_FALSE(FaultPlan().hit(FaultPoint::LeadersEnqueue));
}

TEST(Fault, ARankOutsideTheCommIsRefusedWhenThePlanIsMade) {
  const Options o = with_faults("0:comm.start:delay=1,3:mpi.serve.get:kill");
  EXPECT_TRUE(FaultPlan(o, 0, 4).armed());
  EXPECT_FALSE(FaultPlan(o, 1, 4).armed());  // no entry for rank 1
  try {
    FaultPlan plan(o, 0, 3);
    ADD_FAILURE() << "a plan naming rank 3 of a 3-rank Comm was made";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("entry '3:mpi.serve.get:kill' names rank 3, but the Comm has 3 rank(s)"),
              std::string::npos)
        << e.what();
  }
}

// Each entry acts once, on its hit; other ranks' entries and other points do nothing here.
TEST(Fault, DelayActsOnceOnItsHit) {
  const FaultPlan plan(with_faults("0:mpi.serve.put:delay=300:hit=2,1:mpi.serve.put:delay=5000"), 0, 2);
  const std::uint64_t before = faults_taken(FaultPoint::MpiServePut);
  const std::uint64_t over = meshmem::detail::faults_over(FaultPoint::MpiServePut);
  auto t0 = std::chrono::steady_clock::now();
  plan.hit(FaultPoint::MpiServePut);  // hit 1
  plan.hit(FaultPoint::MpiServeGet);
  EXPECT_LT(seconds_since(t0), 0.25);
  EXPECT_EQ(faults_taken(FaultPoint::MpiServePut), before);
  t0 = std::chrono::steady_clock::now();
  plan.hit(FaultPoint::MpiServePut);  // hit 2: sleeps
  EXPECT_GE(seconds_since(t0), 0.3);
  EXPECT_EQ(faults_taken(FaultPoint::MpiServePut), before + 1);
  EXPECT_EQ(meshmem::detail::faults_over(FaultPoint::MpiServePut), over + 1);
  t0 = std::chrono::steady_clock::now();
  plan.hit(FaultPoint::MpiServePut);  // hit 3: done already
  EXPECT_LT(seconds_since(t0), 0.25);
  // A copy shares the hit count (the Comm hands copies to its parts).
  const FaultPlan again(with_faults("0:mpi.serve.flush:delay=200:hit=2"), 0, 1);
  const FaultPlan copy = again;
  again.hit(FaultPoint::MpiServeFlush);
  t0 = std::chrono::steady_clock::now();
  copy.hit(FaultPoint::MpiServeFlush);
  EXPECT_GE(seconds_since(t0), 0.2);
}

// A stop holds the thread until resume_stopped_faults(), which a test calls once it sees the
// stop counted; a stop nobody resumes ends after its longest time.
TEST(Fault, StopHoldsTheThreadUntilResumed) {
  const FaultPlan plan(with_faults("0:mpi.serve.get:stop=60000,0:mpi.serve.get:stop=300:hit=2"), 0, 1);
  const std::uint64_t before = faults_taken(FaultPoint::MpiServeGet);
  const auto t0 = std::chrono::steady_clock::now();
  std::thread stopped([&] { plan.hit(FaultPoint::MpiServeGet); });
  while (faults_taken(FaultPoint::MpiServeGet) == before && seconds_since(t0) < 30)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_EQ(faults_taken(FaultPoint::MpiServeGet), before + 1);
  const std::uint64_t over = meshmem::detail::faults_over(FaultPoint::MpiServeGet);
  meshmem::detail::resume_stopped_faults();
  stopped.join();
  EXPECT_EQ(meshmem::detail::faults_over(FaultPoint::MpiServeGet), over + 1);
  EXPECT_LT(seconds_since(t0), 30.0);
  const auto t1 = std::chrono::steady_clock::now();
  plan.hit(FaultPoint::MpiServeGet);  // hit 2: nobody resumes it
  EXPECT_GE(seconds_since(t1), 0.3);
  EXPECT_LT(seconds_since(t1), 30.0);
}

// kill ends the process at once, by SIGKILL, as a crash would: nothing after the point runs.
TEST(Fault, KillEndsTheProcessBySigkill) {
  const FaultPlan plan(with_faults("0:comm.joined:kill"), 0, 1);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    plan.hit(FaultPoint::CommJoined);
    std::_Exit(0);  // reached only if the kill did not happen
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status)) << "the child exited with " << WEXITSTATUS(status);
  EXPECT_EQ(WTERMSIG(status), SIGKILL);
}
