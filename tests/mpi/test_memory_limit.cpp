// Host windows larger than the memory a rank may take (issue 13, defect 6): every rank of the
// collective alloc raises meshmem's Error naming the size, the limit and where it comes from,
// nothing is killed, nothing hangs, and the Comm then makes a smaller window whose data is right.
//
// MemoryCgroup.*: run under tests/mpi/in_memory_cgroup.sh, which puts the whole job (mpirun
// and its ranks) into a new memory cgroup and names it in MESHMEM_TEST_MEMORY_CGROUP; without
// it they skip. Before the fix the kernel's OOM killer ended a rank while it faulted in its part.
// AddressSpaceLimit.*: RLIMIT_AS (ulimit -v), set by each rank on itself.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <sstream>
#include <string>
#include <vector>

#include <meshmem/meshmem.hpp>

#include "mpi_test.hpp"

using namespace meshmem;
using meshmem::test::first_difference;
using meshmem::test::pattern;

namespace {

// Runs `f`, expects an Error of `code` whose message contains every piece of `parts`; returns
// the message.
template <class F>
std::string expect_error(F&& f, ErrorCode code, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no error raised (expected " << to_string(code) << ")";
    return {};
  } catch (const Error& e) {
    if (meshmem::test::world_rank() == 0) std::printf("  rank 0 got: %s\n", e.what());
    EXPECT_EQ(e.code(), code) << e.what();
    for (const auto& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "'" << p << "' not in: " << e.what();
    return e.what();
  }
}

std::string read_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::uint64_t read_u64(const std::string& path) {
  const std::string line = read_line(path);
  if (line.empty()) ADD_FAILURE() << "cannot read " << path;
  return line.empty() ? 0 : std::strtoull(line.c_str(), nullptr, 10);
}

std::string str(std::size_t v) { return std::to_string(v); }

// A fresh window of `bytes` on every rank: each rank puts its pattern into the last MiB (at
// most) of its right neighbour's window and reads its left neighbour's back through a get;
// every byte of that checked. (Only that much: the copies are charged to the cgroup too.)
void small_window_works(Comm& comm, std::size_t bytes) {
  const int me = comm.rank(), n = comm.size();
  const int right = (me + 1) % n, left = (me + n - 1) % n;
  const std::uint64_t seed = meshmem::test::shared_seed();
  const std::size_t checked = std::min(bytes, std::size_t(1) << 20), at = bytes - checked;
  Window win = comm.alloc(bytes, Memory::Host);
  ASSERT_EQ(win.size(), bytes);
  comm.barrier();
  const std::vector<unsigned char> mine = pattern(seed, static_cast<std::uint64_t>(me), checked);
  comm.put(win, right, at, mine.data(), checked);
  comm.barrier();
  const std::vector<unsigned char> from_left = pattern(seed, static_cast<std::uint64_t>(left), checked);
  EXPECT_EQ(first_difference(static_cast<const char*>(win.local()) + at, from_left.data(), checked), -1)
      << "left neighbour's put";
  std::vector<unsigned char> got(checked, 0);
  comm.get(got.data(), win, right, at, checked);
  EXPECT_EQ(first_difference(got.data(), mine.data(), checked), -1) << "get of what this rank put into its right neighbour";
  comm.barrier();
}

// ---- memory cgroup ------------------------------------------------------------------------

class MemoryCgroup : public meshmem::test::MpiTest {
 protected:
  void SetUp() override {
    const char* dir = std::getenv("MESHMEM_TEST_MEMORY_CGROUP");
    if (dir == nullptr || *dir == '\0')
      GTEST_SKIP() << "not in a memory cgroup made for the test (run it through tests/mpi/in_memory_cgroup.sh)";
    cgroup = dir;
    v2 = access((cgroup + "/memory.max").c_str(), F_OK) == 0;
    limit_file = v2 ? "memory.max" : "memory.limit_in_bytes";
    limit = read_u64(cgroup + "/" + limit_file);
    // The wrapper moved itself into the cgroup before starting mpirun: this rank is in it.
    const std::string leaf = cgroup.substr(cgroup.rfind('/') + 1);
    std::ifstream in("/proc/self/cgroup");
    bool inside = false;
    for (std::string line; std::getline(in, line);) {
      const auto a = line.find(':'), b = line.find(':', a + 1);
      const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
      const bool memory_line = v2 ? controllers.empty() : ("," + controllers + ",").find(",memory,") != std::string::npos;
      if (memory_line && path.size() >= leaf.size() && path.compare(path.size() - leaf.size(), leaf.size(), leaf) == 0)
        inside = true;
    }
    ASSERT_TRUE(inside) << "this rank is not in " << cgroup;
    ASSERT_GT(limit, 0u);
  }
  // Bytes charged to the cgroup now (page cache included: at most what meshmem counts).
  std::uint64_t usage() const { return read_u64(cgroup + (v2 ? "/memory.current" : "/memory.usage_in_bytes")); }

  std::string cgroup, limit_file;
  bool v2 = false;
  std::uint64_t limit = 0;
  Comm comm{MPI_COMM_WORLD};
  int me = comm.rank();
  int n = comm.size();
};

// Each rank's part alone is larger than the cgroup's limit.
TEST_F(MemoryCgroup, AWindowLargerThanTheLimitFailsOnEveryRank) {
  const std::size_t bytes = limit + (std::size_t(1) << 20);
  const auto t0 = std::chrono::steady_clock::now();
  expect_error([&] { (void)comm.alloc(bytes, Memory::Host); }, ErrorCode::System,
               {"comm.alloc", "rank " + std::to_string(me), "host window of " + str(bytes) + " bytes",
                "limit of " + str(limit) + " bytes", cgroup + "/" + limit_file});
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  small_window_works(comm, std::size_t(1) << 20);
}

// Each rank's part fits, but the node's ranks share the cgroup: together they do not fit.
TEST_F(MemoryCgroup, TheRanksOfANodeShareTheLimit) {
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  std::uint64_t used = usage(), most = 0;
  MPI_Allreduce(&used, &most, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  ASSERT_LT(most, limit);
  // Fits alone (also where meshmem counts less in use: it leaves out page cache the kernel
  // can drop), in whole pages so that the parts add up to the bytes the message names.
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const std::size_t part = (limit - most) / 4 * 3 / page * page;
  ASSERT_GT(part * static_cast<std::size_t>(n), limit)
      << "the job already uses " << most << " of the cgroup's " << limit << " bytes: no part fits alone and not together";
  expect_error([&] { (void)comm.alloc(part, Memory::Host); }, ErrorCode::System,
               {"comm.alloc", "rank " + std::to_string(me), "host window of " + str(part) + " bytes",
                str(n) + " ranks' parts", str(part * static_cast<std::size_t>(n)) + " bytes",
                "limit of " + str(limit) + " bytes", cgroup + "/" + limit_file});
  // A window that fits for all of them together is made.
  small_window_works(comm, (limit - most) / static_cast<std::size_t>(4 * n));
}

// ---- RLIMIT_AS ----------------------------------------------------------------------------

class AddressSpaceLimit : public meshmem::test::MpiTest {
 protected:
  void TearDown() override {
    if (lowered) EXPECT_EQ(setrlimit(RLIMIT_AS, &saved), 0) << "restoring RLIMIT_AS";
    meshmem::test::MpiTest::TearDown();
  }
  // Lowers this process's soft RLIMIT_AS to what it maps now plus `room`.
  void lower_by(std::uint64_t room) {
    std::istringstream statm(read_line("/proc/self/statm"));
    std::uint64_t pages = 0;
    statm >> pages;
    ASSERT_GT(pages, 0u);
    ASSERT_EQ(getrlimit(RLIMIT_AS, &saved), 0);
    rlimit lower = saved;
    lower.rlim_cur = pages * static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE)) + room;
    if (saved.rlim_cur != RLIM_INFINITY && saved.rlim_cur < lower.rlim_cur) GTEST_SKIP() << "RLIMIT_AS is lower already";
    ASSERT_EQ(setrlimit(RLIMIT_AS, &lower), 0);
    lowered = true;
    limit = lower.rlim_cur;
  }
  Comm comm{MPI_COMM_WORLD};
  int me = comm.rank();
  int n = comm.size();
  rlimit saved{};
  bool lowered = false;
  std::uint64_t limit = 0;
};

constexpr std::uint64_t kRoom = std::uint64_t(512) << 20;

TEST_F(AddressSpaceLimit, AWindowLargerThanTheLimitFailsOnEveryRank) {
  lower_by(kRoom);
  if (IsSkipped() || HasFatalFailure()) return;
  const std::size_t bytes = 2 * kRoom;
  expect_error([&] { (void)comm.alloc(bytes, Memory::Host); }, ErrorCode::System,
               {"comm.alloc", "rank " + std::to_string(me), "host window of " + str(bytes) + " bytes", "RLIMIT_AS"});
  small_window_works(comm, std::size_t(1) << 20);
}

// The part fits, but the node peers' parts are mapped here too (shm): together they do not.
TEST_F(AddressSpaceLimit, ThePeersPartsMappedHereCount) {
  int mapped = 0;
  for (int r = 0; r < n; ++r)
    if (r != me && comm.transport(r, Memory::Host) == TransportKind::Shm) ++mapped;
  int everywhere = 0;
  MPI_Allreduce(&mapped, &everywhere, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (everywhere == 0) GTEST_SKIP() << "some rank maps no peer's part (no shm route)";
  lower_by(kRoom);
  if (IsSkipped() || HasFatalFailure()) return;
  const std::size_t part = kRoom / 10 * 6;
  expect_error([&] { (void)comm.alloc(part, Memory::Host); }, ErrorCode::System,
               {"comm.alloc", "host window of " + str(part) + " bytes", "RLIMIT_AS", "node peer"});
  small_window_works(comm, std::size_t(1) << 20);
}

// A window larger than the machine's memory (MemAvailable + SwapFree) on every rank. RLIMIT_AS
// is lowered first, so that without the check mmap fails (and the test with it) instead of
// the global OOM killer ending some process of this machine.
TEST_F(AddressSpaceLimit, AWindowLargerThanTheMachineFailsOnEveryRank) {
  std::uint64_t available = 0;
  std::ifstream meminfo("/proc/meminfo");
  for (std::string key; meminfo >> key;) {
    std::uint64_t kib = 0;
    meminfo >> kib;
    if (key == "MemAvailable:" || key == "SwapFree:") available += kib * 1024;
    meminfo.ignore(1 << 10, '\n');
  }
  ASSERT_GT(available, 0u);
  lower_by(kRoom);
  if (IsSkipped() || HasFatalFailure()) return;
  const std::size_t bytes = available + available / 4;
  const std::string why = expect_error([&] { (void)comm.alloc(bytes, Memory::Host); }, ErrorCode::System,
                                       {"comm.alloc", "rank " + std::to_string(me), "host window of " + str(bytes) + " bytes"});
  // A memory cgroup of the job's own (a container's limit) may be tighter than the machine.
  EXPECT_TRUE(why.find("this machine's available memory (MemAvailable + SwapFree") != std::string::npos ||
              why.find("memory cgroup") != std::string::npos)
      << why;
  small_window_works(comm, std::size_t(1) << 20);
}

}  // namespace
