// StepTrace (comm/src/step_trace.hpp): off it records and writes nothing; on it keeps every
// thread's steps in that thread's order up to its capacity, counts the ones past it, and says
// why a file could not be written.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "step_trace.hpp"

namespace meshmem::detail {
namespace {

std::string temp_path(const char* name) {
  return std::string(::testing::TempDir()) + "step_trace_" + name + "_" + std::to_string(::getpid());
}

std::vector<std::string> lines_of(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

TEST(StepTrace, OffRecordsAndWritesNothing) {
  StepTrace off;
  EXPECT_FALSE(off.on());
  off.record('S', 1, 2, 3);
  EXPECT_EQ(off.recorded(), 0u);
  EXPECT_NE(off.write(), "");
  StepTrace none("", 0);  // what the agent makes where MESHMEM_STAGED_TRACE is off
  EXPECT_FALSE(none.on());
}

TEST(StepTrace, KeepsEveryThreadsStepsInItsOrder) {
  const std::string path = temp_path("threads");
  constexpr int kThreads = 2, kSteps = 1000;
  {
    StepTrace trace(path, kThreads * kSteps);
    ASSERT_TRUE(trace.on());
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t)
      threads.emplace_back([&, t] {
        for (int i = 0; i < kSteps; ++i) trace.record(t == 0 ? 'P' : 'I', t, static_cast<std::uint64_t>(i), -i);
      });
    for (std::thread& th : threads) th.join();
    EXPECT_EQ(trace.recorded(), static_cast<std::size_t>(kThreads * kSteps));
    ASSERT_EQ(trace.write(), "");
  }
  const auto lines = lines_of(path);
  std::remove(path.c_str());
  ASSERT_EQ(lines.size(), static_cast<std::size_t>(kThreads * kSteps + 1));
  EXPECT_NE(lines[0].find("2000 steps kept, 0 dropped"), std::string::npos) << lines[0];
  std::map<int, std::uint64_t> next_id;
  std::map<int, long long> last_ns;
  for (std::size_t k = 1; k < lines.size(); ++k) {
    std::istringstream in(lines[k]);
    long long ns = 0, aux = 0;
    char step = 0;
    int peer = -1;
    std::uint64_t id = 0;
    ASSERT_TRUE(in >> ns >> step >> peer >> id >> aux) << lines[k];
    ASSERT_TRUE(peer == 0 || peer == 1) << lines[k];
    EXPECT_EQ(step, peer == 0 ? 'P' : 'I') << lines[k];
    EXPECT_EQ(id, next_id[peer]) << "thread " << peer << "'s steps out of order: " << lines[k];
    EXPECT_EQ(aux, -static_cast<long long>(id)) << lines[k];
    EXPECT_GE(ns, last_ns[peer]) << lines[k];
    EXPECT_GT(ns, 0) << lines[k];
    next_id[peer] = id + 1;
    last_ns[peer] = ns;
  }
  EXPECT_EQ(next_id[0], static_cast<std::uint64_t>(kSteps));
  EXPECT_EQ(next_id[1], static_cast<std::uint64_t>(kSteps));
}

TEST(StepTrace, CountsWhatIsPastItsCapacity) {
  const std::string path = temp_path("capacity");
  StepTrace trace(path, 10);
  for (int i = 0; i < 25; ++i) trace.record('S', 3, static_cast<std::uint64_t>(i));
  EXPECT_EQ(trace.recorded(), 25u);
  ASSERT_EQ(trace.write(), "");
  const auto lines = lines_of(path);
  std::remove(path.c_str());
  ASSERT_EQ(lines.size(), 11u);
  EXPECT_NE(lines[0].find("10 steps kept, 15 dropped"), std::string::npos) << lines[0];
  EXPECT_EQ(lines[10].substr(lines[10].find(' ')), " S 3 9 0");  // the first ten are kept
}

TEST(StepTrace, SaysWhyItCannotWrite) {
  StepTrace trace("/nonexistent-dir-of-meshmem/trace.0", 4);
  trace.record('R', 0, 1);
  const std::string problem = trace.write();
  EXPECT_NE(problem.find("/nonexistent-dir-of-meshmem/trace.0"), std::string::npos) << problem;
}

}  // namespace
}  // namespace meshmem::detail
