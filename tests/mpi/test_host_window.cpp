// Host-memory windows between ranks: every op with fresh random data, poisoned
// destinations, every byte checked, sizes 1 B .. 64 MiB with unaligned offsets. CTest runs
// this binary under several placements (one node, simulated nodes, MPI only) and both
// descriptor-passing mechanisms, and across hosts made by launch/meshmem-hosts; the
// expectations below follow the environment and the hostnames.
#include <dirent.h>
#include <unistd.h>

#include <algorithm>

#include <cstdlib>
#include <fstream>
#include <meshmem/meshmem.hpp>

#include "mpi_test.hpp"

using namespace meshmem;
using meshmem::test::first_difference;
using meshmem::test::first_not;
using meshmem::test::kPoison;
using meshmem::test::pattern;

namespace {

class HostWindow : public meshmem::test::MpiTest {
 protected:
  Comm comm{MPI_COMM_WORLD};
  int me = comm.rank();
  int n = comm.size();
  std::uint64_t seed = meshmem::test::shared_seed();
};

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// 1024 and 1025: the largest put the mpi transport sends inside its request, and the smallest it does not.
const std::size_t kSizes[] = {1, 7, 8, 13, 1024, 1025, 4096, 4099, 65536 + 17, (1u << 20) + 5};
constexpr std::size_t kBig = 64u << 20;
constexpr std::size_t kGuard = 64;

// Unaligned offset of source `s`'s slot in a window of slots of `size` bytes.
std::size_t slot_offset(int s, std::size_t size) {
  const std::size_t slot = size + 2 * kGuard + 8;
  return static_cast<std::size_t>(s) * slot + kGuard + static_cast<std::size_t>(s * 3 + 1) % 8;
}
std::size_t slots_bytes(int n, std::size_t size) { return static_cast<std::size_t>(n) * (size + 2 * kGuard + 8); }

std::uint64_t key(std::size_t size, int from, int to, int tag = 0) {
  return (static_cast<std::uint64_t>(size) << 24) ^ (static_cast<std::uint64_t>(from) << 12) ^
         static_cast<std::uint64_t>(to) ^ (static_cast<std::uint64_t>(tag) << 56);
}

// Expected image of a window after puts from `sources` into their slots.
std::vector<unsigned char> expected_slots(std::uint64_t seed, int n, int me, std::size_t size,
                                          const std::vector<int>& sources) {
  std::vector<unsigned char> img(slots_bytes(n, size), kPoison);
  for (int s : sources) {
    auto data = pattern(seed, key(size, s, me), size);
    std::memcpy(img.data() + slot_offset(s, size), data.data(), size);
  }
  return img;
}

void put_and_check(Comm& comm, std::uint64_t seed, std::size_t size, bool every_pair) {
  const int me = comm.rank();
  const int n = comm.size();
  Window win = comm.alloc(slots_bytes(n, size), Memory::Host);
  std::memset(win.local(), kPoison, win.size());
  comm.barrier();  // nobody's put may land before the poison
  std::vector<int> targets, sources;
  for (int t = 0; t < n; ++t) {
    if (every_pair || t == (me + 1) % n) targets.push_back(t);
    if (every_pair || t == (me + n - 1) % n) sources.push_back(t);
  }
  for (int t : targets) {
    auto data = pattern(seed, key(size, me, t), size);
    comm.put(win, t, slot_offset(me, size), data.data(), size);
    std::memset(data.data(), 0, size);  // the source may be reused once put returns
  }
  comm.barrier();
  auto img = expected_slots(seed, n, me, size, sources);
  const long long diff = first_difference(win.local(), img.data(), img.size());
  EXPECT_EQ(diff, -1) << "put of " << size << " bytes: window of rank " << me
                      << " differs at byte " << diff;
  comm.barrier();  // the window is freed next; nobody may still be reading
}

}  // namespace

// The node every rank should be on, from the hostnames (one node per host, as launched by
// mpirun or launch/meshmem-hosts), each split into MESHMEM_SIMULATE_NODES contiguous groups of
// (nearly) equal size; nodes numbered in rank order.
static std::vector<int> expected_nodes(int n) {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  std::vector<char> all(static_cast<std::size_t>(n) * sizeof(name));
  MPI_Allgather(name, sizeof(name), MPI_CHAR, all.data(), sizeof(name), MPI_CHAR, MPI_COMM_WORLD);
  std::vector<std::string> host_of;
  for (int r = 0; r < n; ++r) host_of.emplace_back(all.data() + static_cast<std::size_t>(r) * sizeof(name));
  const std::string sim = env("MESHMEM_SIMULATE_NODES");
  const int split = sim.empty() ? 1 : std::atoi(sim.c_str());
  std::vector<std::pair<std::string, int>> seen;  // (host, group) in order of first rank
  std::vector<int> node(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    const int on_host = static_cast<int>(std::count(host_of.begin(), host_of.end(), host_of[r]));
    const int before = static_cast<int>(std::count(host_of.begin(), host_of.begin() + r, host_of[r]));
    const int groups = std::min(split, on_host);
    const std::pair<std::string, int> key{host_of[r], before * groups / on_host};
    auto it = std::find(seen.begin(), seen.end(), key);
    if (it == seen.end()) it = seen.insert(seen.end(), key);
    node[static_cast<std::size_t>(r)] = static_cast<int>(it - seen.begin());
  }
  return node;
}

TEST_F(HostWindow, TopologyTransportsAndMappings) {
  const std::vector<int> nodes = expected_nodes(n);
  EXPECT_EQ(comm.node_count(), 1 + *std::max_element(nodes.begin(), nodes.end()));
  const bool mpi_only = env("MESHMEM_TRANSPORTS") == "mpi";
  Window win = comm.alloc(64, Memory::Host);
  for (int r = 0; r < n; ++r) {
    const bool same = comm.node_of(r) == comm.node();
    EXPECT_EQ(comm.node_of(r), nodes[static_cast<std::size_t>(r)]) << "rank " << r;
    const TransportKind want = (!mpi_only && same) ? TransportKind::Shm : TransportKind::Mpi;
    EXPECT_EQ(comm.transport(r, Memory::Host), want) << "rank " << me << " -> " << r;
    EXPECT_EQ(win.peer(r) != nullptr, want == TransportKind::Shm || r == me) << "rank " << me << " -> " << r;
  }
  const std::string fd = env("MESHMEM_FD_PASSING");
  if (fd == "socket") EXPECT_EQ(comm.fd_passing(), FdPassing::Socket);
  if (fd == "pidfd") EXPECT_EQ(comm.fd_passing(), FdPassing::Pidfd);
  if (me == 0)
    std::printf("placement: %d node(s), fd passing %s, rank 0 -> rank %d via %s\n", comm.node_count(),
                to_string(comm.fd_passing()), n - 1, to_string(comm.transport(n - 1, Memory::Host)));
}

TEST_F(HostWindow, PutEveryPairEverySize) {
  for (std::size_t size : kSizes) put_and_check(comm, seed, size, true);
}

TEST_F(HostWindow, PutRing64MiB) { put_and_check(comm, seed, kBig, false); }

TEST_F(HostWindow, GetEveryPairEverySizeAnd64MiB) {
  std::vector<std::size_t> sizes(std::begin(kSizes), std::end(kSizes));
  sizes.push_back(kBig);
  for (std::size_t size : sizes) {
    const std::size_t bytes = size + 2 * kGuard + 16;
    Window win = comm.alloc(bytes, Memory::Host);
    auto mine = pattern(seed, key(size, me, 0, 1), bytes);
    std::memcpy(win.local(), mine.data(), bytes);
    comm.barrier();
    for (int t = 0; t < n; ++t) {
      if (size == kBig && t != (me + 1) % n) continue;
      const std::size_t off = kGuard + static_cast<std::size_t>(t * 5 + me + 1) % 16;
      std::vector<unsigned char> dst(size + 2 * kGuard, kPoison);
      comm.get(dst.data() + kGuard, win, t, off, size);
      auto theirs = pattern(seed, key(size, t, 0, 1), bytes);
      EXPECT_EQ(first_difference(dst.data() + kGuard, theirs.data() + off, size), -1)
          << "get of " << size << " bytes from rank " << t << " at offset " << off;
      EXPECT_EQ(first_not(dst.data(), kPoison, kGuard), -1) << "get wrote before dst";
      EXPECT_EQ(first_not(dst.data() + kGuard + size, kPoison, kGuard), -1) << "get wrote past dst";
    }
    comm.barrier();
  }
}

// Data must be visible when its signal is: the receiver checks every byte as soon as the
// signal arrives, many times, with sizes that take different paths.
TEST_F(HostWindow, PutSignalRingDataVisibleWithSignal) {
  const std::size_t sizes[] = {1, 8, 100, 4097, 65539, (1u << 20) + 3};
  const std::size_t max = (1u << 20) + 3 + 16;
  Window win = comm.alloc(max, Memory::Host);
  Signals sig = comm.alloc_signals(2, Memory::Host);  // 0: data ready, 1: data consumed
  const int right = (me + 1) % n;
  const int left = (me + n - 1) % n;
  const int iterations = 60;
  for (int it = 0; it < iterations; ++it) {
    const std::size_t size = sizes[it % 6];
    const std::size_t off = static_cast<std::size_t>(it) % 13;
    // Wait until the right neighbour consumed the previous message before overwriting it.
    comm.wait_until(sig, 1, Cmp::GE, static_cast<std::uint64_t>(it));
    auto data = pattern(seed, key(size, me, right, it), size);
    comm.put_signal(win, right, off, data.data(), size, sig, 0, static_cast<std::uint64_t>(it + 1), SignalOp::Set);
    comm.wait_until(sig, 0, Cmp::GE, static_cast<std::uint64_t>(it + 1));
    auto want = pattern(seed, key(size, left, me, it), size);
    const long long diff = first_difference(static_cast<char*>(win.local()) + off, want.data(), size);
    ASSERT_EQ(diff, -1) << "iteration " << it << ": data from rank " << left << " not complete when its signal arrived";
    comm.signal(sig, left, 1, static_cast<std::uint64_t>(it + 1), SignalOp::Set);
  }
  comm.barrier();
}

TEST_F(HostWindow, SignalAddFromEveryRank) {
  Signals sig = comm.alloc_signals(3, Memory::Host);
  const int rounds = 25;
  for (int k = 0; k < rounds; ++k)
    for (int t = 0; t < n; ++t) comm.signal(sig, t, 2, static_cast<std::uint64_t>(me + 1), SignalOp::Add);
  const std::uint64_t want = static_cast<std::uint64_t>(rounds) * n * (n + 1) / 2;
  comm.wait_until(sig, 2, Cmp::EQ, want);
  EXPECT_EQ(sig.read(2), want);
  EXPECT_EQ(sig.read(0), 0u);  // neighbours untouched
  EXPECT_EQ(sig.read(1), 0u);
  comm.barrier();
}

// Halo rows with put_signal (Set 1) from both neighbours, then one wait_until_all_then_set:
// rows complete, both words 0 afterwards, and parity words keep iteration i+2's signal from
// arriving before the reset of iteration i.
TEST_F(HostWindow, WaitUntilAllThenSetResetsAfterTheWait) {
  const std::size_t row = 1000 + 3;
  Window win = comm.alloc(4 * row, Memory::Host);        // [parity][from left, from right]
  Signals sig = comm.alloc_signals(4, Memory::Host);     // word parity * 2 + (0 left, 1 right)
  const int right = (me + 1) % n;
  const int left = (me + n - 1) % n;
  std::memset(win.local(), kPoison, win.size());
  comm.barrier();
  for (int it = 0; it < 40; ++it) {
    const std::size_t p = static_cast<std::size_t>(it % 2);
    auto to_right = pattern(seed, key(row, me, right, it), row);
    auto to_left = pattern(seed, key(row, me, left, it) ^ 0x77, row);
    comm.put_signal(win, right, (p * 2 + 0) * row, to_right.data(), row, sig, p * 2 + 0, 1, SignalOp::Set);
    comm.put_signal(win, left, (p * 2 + 1) * row, to_left.data(), row, sig, p * 2 + 1, 1, SignalOp::Set);
    comm.wait_until_all_then_set(sig, p * 2, 2, Cmp::EQ, 1, 0);
    EXPECT_EQ(sig.read(p * 2), 0u) << "iteration " << it;
    EXPECT_EQ(sig.read(p * 2 + 1), 0u) << "iteration " << it;
    auto from_left = pattern(seed, key(row, left, me, it), row);
    auto from_right = pattern(seed, key(row, right, me, it) ^ 0x77, row);
    const char* base = static_cast<const char*>(win.local()) + p * 2 * row;
    ASSERT_EQ(first_difference(base, from_left.data(), row), -1) << "iteration " << it << ": the row from the left";
    ASSERT_EQ(first_difference(base + row, from_right.data(), row), -1) << "iteration " << it << ": the row from the right";
  }
  comm.barrier();
}

TEST_F(HostWindow, WaitUntilComparisons) {
  Signals sig = comm.alloc_signals(1, Memory::Host);
  comm.signal(sig, me, 0, 5, SignalOp::Set);
  comm.quiet();
  comm.wait_until(sig, 0, Cmp::EQ, 5);
  comm.wait_until(sig, 0, Cmp::NE, 4);
  comm.wait_until(sig, 0, Cmp::GT, 4);
  comm.wait_until(sig, 0, Cmp::GE, 5);
  comm.wait_until(sig, 0, Cmp::LT, 6);
  comm.wait_until(sig, 0, Cmp::LE, 5);
  EXPECT_EQ(sig.read(0), 5u);
  comm.barrier();
}

// quiet() alone (no meshmem barrier) makes puts complete at their targets.
TEST_F(HostWindow, QuietCompletesPuts) {
  const std::size_t size = 300000 + 3;
  Window win = comm.alloc(size, Memory::Host);
  std::memset(win.local(), kPoison, size);
  comm.barrier();
  const int right = (me + 1) % n;
  auto data = pattern(seed, key(size, me, right, 7), size);
  comm.put(win, right, 0, data.data(), size);
  comm.quiet();
  MPI_Barrier(MPI_COMM_WORLD);
  auto want = pattern(seed, key(size, (me + n - 1) % n, me, 7), size);
  EXPECT_EQ(first_difference(win.local(), want.data(), size), -1);
  comm.barrier();
}

// A put and a get between a rank and its own window whose source and destination overlap act
// like memmove, on every route (issue 13: the same-node route used memcpy on the overlapping
// ranges; through MPI the send and receive buffers overlapped).
TEST_F(HostWindow, SelfPutAndGetWithOverlappingRangesActLikeMemmove) {
  // Large, and small enough that the mpi transport sends the bytes inside the request.
  for (const auto& [size, shift] : {std::pair<std::size_t, std::size_t>{3 * 65536 + 17, 4099}, {1000, 7}}) {
    const std::size_t bytes = size - shift;
    Window win = comm.alloc(size, Memory::Host);
    auto* base = static_cast<unsigned char*>(win.local());
    const auto data = pattern(seed, key(size, me, me, 21), size);
    for (int forward = 0; forward < 2; ++forward) {
      std::memcpy(base, data.data(), size);
      std::vector<unsigned char> want(data);
      // forward: the window's bytes move up by `shift` (source below the destination), else down.
      const std::size_t from = forward ? 0 : shift, to = forward ? shift : 0;
      std::memmove(want.data() + to, want.data() + from, bytes);
      comm.put(win, me, to, base + from, bytes);
      comm.quiet();
      EXPECT_EQ(first_difference(base, want.data(), size), -1)
          << (forward ? "put moving up" : "put moving down") << ", " << bytes << " bytes";
      std::memcpy(base, data.data(), size);
      comm.get(base + to, win, me, from, bytes);
      EXPECT_EQ(first_difference(base, want.data(), size), -1)
          << (forward ? "get moving up" : "get moving down") << ", " << bytes << " bytes";
    }
    comm.barrier();
  }
}

namespace {
int count_mappings() {
  std::ifstream maps("/proc/self/maps");
  int lines = 0;
  for (std::string line; std::getline(maps, line);) lines += line.find("meshmem-window") != std::string::npos;
  return lines;
}
}  // namespace

TEST_F(HostWindow, AllocFreeCyclesReleaseEverything) {
  { Window warm = comm.alloc(4096, Memory::Host); }
  const int fds = meshmem::test::count_fds();
  const int maps = count_mappings();
  for (int cycle = 0; cycle < 20; ++cycle) {
    Window win = comm.alloc((1u << 20) + static_cast<std::size_t>(cycle), Memory::Host);
    Signals sig = comm.alloc_signals(4, Memory::Host);
    const int v = cycle + me;
    comm.put(win, (me + 1) % n, 0, &v, sizeof(v));
    comm.barrier();
    EXPECT_GT(count_mappings(), maps);
    if (cycle % 2) win.free();  // explicit free and destructor both release
  }
  EXPECT_EQ(meshmem::test::count_fds(), fds);
  EXPECT_EQ(count_mappings(), maps);
}
