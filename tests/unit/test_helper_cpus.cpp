// Where meshmem's busy threads run (comm/src/helper_cpus.hpp): a Comm made on a thread bound
// to one CPU moves the helper threads started after it to that CPU's NUMA node; with more
// CPUs, or MESHMEM_HELPER_CPUS=inherit, they keep the creator's mask. No GPU, no MPI; skipped
// where the machine has a single CPU (or the CPU's node has only it).
#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "helper_cpus.hpp"

using meshmem::Options;
using meshmem::detail::parse_cpu_list;
using meshmem::detail::place_helper_thread;
using meshmem::detail::print_cpu_list;
using meshmem::detail::settle_helper_cpus;

namespace {

std::vector<int> cpus_of_this_thread() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (pthread_getaffinity_np(pthread_self(), sizeof set, &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

bool bind_this_thread(const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0;
}

// Runs `body` on a new thread bound to `cpus` (the user's rank thread), and returns.
void on_thread_bound_to(const std::vector<int>& cpus, const std::function<void()>& body) {
  std::thread t([&] {
    ASSERT_TRUE(bind_this_thread(cpus));
    body();
  });
  t.join();
}

// The CPUs a helper thread started now from this thread ends on.
std::vector<int> helper_cpus_from_here() {
  std::vector<int> got;
  std::thread helper([&] {
    place_helper_thread("test helper");
    got = cpus_of_this_thread();
  });
  helper.join();
  return got;
}

}  // namespace

TEST(HelperCpus, CpuListsRoundTrip) {
  EXPECT_EQ(parse_cpu_list("0-3,8,10-11"), (std::vector<int>{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_EQ(print_cpu_list({0, 1, 2, 3, 8, 10, 11}), "0-3,8,10-11");
  EXPECT_EQ(parse_cpu_list("5"), (std::vector<int>{5}));
  EXPECT_EQ(parse_cpu_list(""), (std::vector<int>{}));
}

TEST(HelperCpus, HelpersLeaveTheCallersOneCpu) {
  const std::vector<int> all = cpus_of_this_thread();
  if (all.size() < 2) GTEST_SKIP() << "this process may use " << all.size() << " CPU(s)";
  std::string text;
  std::vector<int> got, caller_after;
  on_thread_bound_to({all[0]}, [&] {
    text = settle_helper_cpus(Options{});
    got = helper_cpus_from_here();
    caller_after = cpus_of_this_thread();
  });
  if (text.empty()) GTEST_SKIP() << "CPU " << all[0] << "'s NUMA node has no other CPU this machine reports";
  EXPECT_NE(text.find("helper threads on CPUs "), std::string::npos) << text;
  EXPECT_GT(got.size(), 1u) << "the helper stayed on " << print_cpu_list(got) << " (" << text << ")";
  EXPECT_EQ(caller_after, (std::vector<int>{all[0]})) << "the caller's binding changed";
  on_thread_bound_to(all, [&] { EXPECT_EQ(settle_helper_cpus(Options{}), ""); });  // reset for other cases
}

TEST(HelperCpus, InheritKeepsTheCreatorsCpu) {
  const std::vector<int> all = cpus_of_this_thread();
  if (all.size() < 2) GTEST_SKIP() << "this process may use " << all.size() << " CPU(s)";
  Options inherit;
  inherit.set("MESHMEM_HELPER_CPUS", "inherit");
  std::vector<int> got;
  on_thread_bound_to({all[0]}, [&] {
    EXPECT_EQ(settle_helper_cpus(inherit), "");
    got = helper_cpus_from_here();
  });
  EXPECT_EQ(got, (std::vector<int>{all[0]}));
}

TEST(HelperCpus, SeveralCpusAreLeftAlone) {
  const std::vector<int> all = cpus_of_this_thread();
  if (all.size() < 2) GTEST_SKIP() << "this process may use " << all.size() << " CPU(s)";
  const std::vector<int> two{all[0], all[1]};
  std::vector<int> got;
  on_thread_bound_to(two, [&] {
    EXPECT_EQ(settle_helper_cpus(Options{}), "");
    got = helper_cpus_from_here();
  });
  EXPECT_EQ(got, two);
}
