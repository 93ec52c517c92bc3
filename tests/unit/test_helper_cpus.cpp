// Where meshmem's busy threads run (comm/src/helper_cpus.hpp): the decision from plain facts
// (a rank bound to one core, hardware threads, other ranks' cores, `inherit`), and a real
// thread placed by its creator under a Comm's decision while the caller keeps its binding.
// No GPU, no MPI; the thread cases skip where this process may use a single CPU.
#include <gtest/gtest.h>
#include <pthread.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "helper_cpus.hpp"

using meshmem::detail::cpus_of_this_thread;
using meshmem::detail::HelperCpusScope;
using meshmem::detail::HelperPlacement;
using meshmem::detail::parse_cpu_list;
using meshmem::detail::place_helper_thread;
using meshmem::detail::plan_helper_cpus;
using meshmem::detail::print_cpu_list;

namespace {

using Cpus = std::vector<int>;
const Cpus kNode = parse_cpu_list("0-15");

bool bind_this_thread(const Cpus& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0;
}

}  // namespace

TEST(HelperCpus, CpuListsRoundTrip) {
  EXPECT_EQ(parse_cpu_list("0-3,8,10-11"), (Cpus{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_EQ(print_cpu_list({0, 1, 2, 3, 8, 10, 11}), "0-3,8,10-11");
  EXPECT_EQ(parse_cpu_list("5"), (Cpus{5}));
  EXPECT_EQ(parse_cpu_list("4x"), (Cpus{}));   // not a list
  EXPECT_EQ(parse_cpu_list("3-1"), (Cpus{}));
  EXPECT_EQ(parse_cpu_list(""), (Cpus{}));
}

// Two ranks bound to CPUs 0 and 1 of a 16-CPU node: the helpers get 2-15.
TEST(HelperCpus, HelpersLeaveTheRanksCores) {
  const HelperPlacement p = plan_helper_cpus(false, {0}, {0}, kNode, 0, {0, 1});
  EXPECT_EQ(print_cpu_list(p.cpus), "2-15");
  EXPECT_NE(p.text.find("helper threads on CPUs 2-15 (NUMA node 0 of CPU 0"), std::string::npos) << p.text;
}

// One rank per CPU on the whole node: nothing is left, the helpers stay, and it is said.
TEST(HelperCpus, AFullNodeKeepsTheHelpersOnTheirRank) {
  const HelperPlacement p = plan_helper_cpus(false, {3}, {3}, kNode, 0, kNode);
  EXPECT_TRUE(p.cpus.empty());
  EXPECT_NE(p.text.find("stay on CPU 3"), std::string::npos) << p.text;
}

// Bound to both hardware threads of one core (--bind-to core with SMT): still one core.
TEST(HelperCpus, HardwareThreadsOfOneCoreCountAsOneCore) {
  const HelperPlacement p = plan_helper_cpus(false, {0, 8}, {0, 8}, kNode, 0, {0, 8});
  EXPECT_EQ(print_cpu_list(p.cpus), "1-7,9-15");
}

// Several cores, `inherit`, or no node known: the creator's mask.
TEST(HelperCpus, OtherwiseTheHelpersKeepTheCreatorsCpus) {
  EXPECT_TRUE(plan_helper_cpus(false, {0, 1}, {0}, kNode, 0, {}).cpus.empty());
  EXPECT_TRUE(plan_helper_cpus(true, {0}, {0}, kNode, 0, {0}).cpus.empty());
  EXPECT_TRUE(plan_helper_cpus(false, {0}, {0}, {}, -1, {0}).cpus.empty());
  EXPECT_EQ(plan_helper_cpus(false, {0, 1}, {0}, kNode, 0, {}).text, "");
}

// A real thread: created under a placement (as while a Comm is made) on a thread bound to
// one CPU, it is moved by its creator; the creator keeps its CPU; outside the scope, or with
// an empty placement, a new thread inherits.
TEST(HelperCpus, TheCreatorPlacesItsThread) {
  const Cpus all = cpus_of_this_thread();
  if (all.size() < 2) GTEST_SKIP() << "this process may use " << all.size() << " CPU(s)";
  Cpus helper, creator_after, outside;
  std::thread rank([&] {
    ASSERT_TRUE(bind_this_thread({all[0]}));
    const HelperPlacement placement{Cpus(all.begin() + 1, all.end()), "test"};
    {
      HelperCpusScope scope(placement);
      std::atomic<bool> read{false};  // the thread lives until its mask is read
      std::thread t([&] {
        while (!read.load()) std::this_thread::yield();
      });
      place_helper_thread(t, "test helper");
      cpu_set_t set;
      CPU_ZERO(&set);
      ASSERT_EQ(pthread_getaffinity_np(t.native_handle(), sizeof set, &set), 0);
      for (int c = 0; c < CPU_SETSIZE; ++c)
        if (CPU_ISSET(c, &set)) helper.push_back(c);
      read = true;
      t.join();
    }
    creator_after = cpus_of_this_thread();
    std::thread t([&] { outside = cpus_of_this_thread(); });
    place_helper_thread(t, "test helper");  // no placement in force: nothing
    t.join();
  });
  rank.join();
  EXPECT_EQ(helper, Cpus(all.begin() + 1, all.end()));
  EXPECT_EQ(creator_after, (Cpus{all[0]}));
  EXPECT_EQ(outside, (Cpus{all[0]}));
}
