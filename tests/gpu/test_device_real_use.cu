// Device windows used the way applications use them: barriers and halo exchanges on two
// alternating streams, CUDA graphs captured once and replayed hundreds of times with a rank
// that is late on every replay, Signals::read on device signals, teardown behind a wait
// that cannot complete, device waits for peers that never come, another device current and
// a stream of another device. Fresh random data every round, destinations poisoned first,
// every byte checked. Skipped without a GPU.
//
// Only API calls that c57ba70 had are used outside the MESHMEM_TEST_NEW_API part, so that
// the file also builds against c57ba70 (where these tests fail or hang).
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <functional>
#include <initializer_list>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <meshmem/device/device.cuh>
#include <meshmem/meshmem.hpp>

#include "gpu_test.hpp"
#include "mpi_test.hpp"

using namespace meshmem;
using meshmem::test::DeviceBuffer;
using meshmem::test::fill_now;
using meshmem::test::first_difference;
using meshmem::test::to_host;
using meshmem::test::upload;
using meshmem::test::kPoison;
using meshmem::test::pattern;

namespace {

// Sets an environment variable for the life of the object (the Comm reads MESHMEM_* when
// it is made).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_.c_str(), old_.c_str(), 1);
    else unsetenv(name_.c_str());
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

__device__ std::uint64_t now_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins for *ns (device memory: a graph replay reads the value of that replay) or `fixed`.
__global__ void spin_kernel(const std::uint64_t* ns, std::uint64_t fixed) {
  const std::uint64_t wait = ns != nullptr ? *reinterpret_cast<const volatile std::uint64_t*>(ns) : fixed;
  const std::uint64_t start = now_ns();
  while (now_ns() - start < wait) {
  }
}

// Runs until the host sets *flag (mapped pinned memory).
__global__ void wait_for_host_flag(const std::uint64_t* flag) {
  while (*reinterpret_cast<const volatile std::uint64_t*>(flag) == 0) {
  }
}

// Spins for `ns`, then traps: the process's GPU context fails for good (a sticky error).
__global__ void spin_then_trap(std::uint64_t ns) {
  const std::uint64_t start = now_ns();
  while (now_ns() - start < ns) {
  }
  __trap();
}

// Writes `value` into word `index` of `target`'s part of a window through the device API.
__global__ void store_into_peer(device::WindowView view, int target, std::size_t offset, std::uint64_t value) {
  *device::peer_ptr<std::uint64_t>(view, target, offset) = value;
}

std::uint64_t key(int round, int from, int to) {
  return (static_cast<std::uint64_t>(round) << 24) ^ (static_cast<std::uint64_t>(from) << 12) ^ static_cast<std::uint64_t>(to);
}

// Waits for `stream` without hanging the test: false after `seconds`.
bool finishes(cudaStream_t stream, int seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  while (cudaStreamQuery(stream) == cudaErrorNotReady) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return cudaStreamSynchronize(stream) == cudaSuccess;
}

// Whether environment variable `name` is `value` (the entries that run a test set it).
bool env_is(const char* name, const std::string& value) {
  const char* v = std::getenv(name);
  return v != nullptr && value == v;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// After transfers with a rank that was killed: the next quiet must raise, naming the end of
// that rank's process.
void expect_process_end_reported(Comm& comm, cudaStream_t stream, int dead, const char* what) {
  try {
    comm.quiet(stream);
    ADD_FAILURE() << what << " was not reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(dead) + "'s process"), std::string::npos)
        << what << ": " << e.what();
  }
}

// The last collective before `victim` dies (killed by a fault point as the survivors' next
// transfers reach it): every rank meets, then the victim waits to be killed.
void meet_then_await_the_kill(Comm& comm, cudaStream_t stream, int me, int victim) {
  comm.barrier(stream);
  CUDA_OK(cudaStreamSynchronize(stream));
  MPI_Barrier(MPI_COMM_WORLD);
  if (me == victim) {
    std::this_thread::sleep_for(std::chrono::seconds(60));  // killed long before
    std::_Exit(0);
  }
}

class RealUse : public meshmem::test::MpiTest {
 protected:
  void SetUp() override {
    const std::string why = meshmem::test::select_gpu_on_every_rank();
    if (!why.empty()) GTEST_SKIP() << why;
    cudaGetDevice(&device);
    seed = meshmem::test::shared_seed();
    ASSERT_EQ(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking), cudaSuccess);
  }
  // Why a case that forces the staged transport between node peers cannot run in this entry
  // ("" where it can): entries that split the ranks into simulated nodes leave them no node
  // peers, and their barrier across nodes (nccl) then refuses the Comm.
  static std::string staged_cannot_be_forced() {
    const char* nodes = std::getenv("MESHMEM_SIMULATE_NODES");
    if (nodes != nullptr && std::string(nodes) != "1")
      return "forces the staged transport between node peers: this entry splits the ranks into simulated nodes";
    return "";
  }
  // Whether rank 0 reaches every one of `targets` through the staged transport, agreed by every rank.
  bool rank0_reaches_through_staged(std::initializer_list<int> targets) {
    int staged = 1;
    if (me == 0)
      for (int t : targets) staged &= t < n && comm->transport(t, Memory::Device) == TransportKind::Staged ? 1 : 0;
    MPI_Bcast(&staged, 1, MPI_INT, 0, MPI_COMM_WORLD);
    return staged != 0;
  }
  void make_comm() {
    comm = std::make_unique<Comm>(MPI_COMM_WORLD);
    me = comm->rank();
    n = comm->size();
    right = (me + 1) % n;
    left = (me + n - 1) % n;
  }
  void TearDown() override {
    // A failed case may leave its capture open: end it, so that the next case starts clean.
    for (cudaStream_t s : {s0, s1}) test::end_open_capture(s);
    comm.reset();
    if (s0) cudaStreamDestroy(s0);
    if (s1) cudaStreamDestroy(s1);
    MpiTest::TearDown();
  }

  // A 64-byte put to rank 1 at `at` (or get from there) on s0, ended: through the staged channels
  // that earlier transfers with rank 1 took, after them, so once it ended those were carried out
  // or dropped. A call may first raise the timeout of an earlier transfer (`after` names them).
  void fence(Window& win, std::size_t at, bool get, const char* after) {
    DeviceBuffer tail(64);
    bool ended = false;
    std::string last;
    for (int tries = 0; tries < 3 && !ended; ++tries) {
      try {
        if (get)
          comm->get(tail.p, win, 1, at, tail.bytes, s0);
        else
          comm->put(win, 1, at, tail.p, tail.bytes, s0);
        comm->quiet(s0);
        CUDA_OK(cudaStreamSynchronize(s0));
        ended = true;
      } catch (const Error& e) {
        last = e.what();
      }
    }
    EXPECT_TRUE(ended) << "the fence transfer after " << after << " failed: " << last;
  }

  std::unique_ptr<Comm> comm;
  int device = -1, me = 0, n = 1, right = 0, left = 0;
  std::uint64_t seed = 0;
  cudaStream_t s0 = nullptr, s1 = nullptr;
};

// ---- several streams ----

class TwoStreams : public RealUse, public ::testing::WithParamInterface<const char*> {};

// Round k runs on stream k % 2, the even rounds behind a long kernel: the streams' work
// overlaps and finishes out of call order. Each round every rank puts fresh data into its
// own slot of every rank's window, then barrier(stream), then a snapshot of the round's
// slots: the barrier must have waited for every rank's put of that round.
TEST_P(TwoStreams, AlternatingBarriersSeeEveryPut) {
  ScopedEnv variant("MESHMEM_BARRIER", GetParam());
  make_comm();
  constexpr int kRounds = 40;
  constexpr std::size_t kSlot = 4096;
  const std::size_t round_bytes = static_cast<std::size_t>(n) * kSlot;
  Window win = comm->alloc(kRounds * round_bytes);
  CUDA_OK(fill_now(win.local(), kPoison, kRounds * round_bytes));
  DeviceBuffer src(kRounds * round_bytes), snap(kRounds * round_bytes);
  for (int k = 0; k < kRounds; ++k)
    for (int t = 0; t < n; ++t) {
      auto d = pattern(seed, key(k, me, t), kSlot);
      CUDA_OK(upload(src.c() + k * round_bytes + t * kSlot, d.data(), kSlot));
    }
  comm->barrier(s0);  // every rank poisoned its window
  CUDA_OK(cudaStreamSynchronize(s0));
  for (int k = 0; k < kRounds; ++k) {
    cudaStream_t s = k % 2 ? s1 : s0;
    if (k % 2 == 0) spin_kernel<<<1, 1, 0, s>>>(nullptr, 200000 + 40000ull * me);
    for (int t = 0; t < n; ++t)
      comm->put(win, t, k * round_bytes + me * kSlot, src.c() + k * round_bytes + t * kSlot, kSlot, s);
    comm->barrier(s);
    CUDA_OK(cudaMemcpyAsync(snap.c() + k * round_bytes, static_cast<char*>(win.local()) + k * round_bytes, round_bytes,
                            cudaMemcpyDeviceToDevice, s));
  }
  ASSERT_TRUE(finishes(s0, 60) && finishes(s1, 60)) << "the streams did not finish within 60 s (a barrier hangs)";
  const auto got = to_host(snap.p, snap.bytes);
  int bad = 0;
  for (int k = 0; k < kRounds; ++k)
    for (int r = 0; r < n; ++r) {
      const auto want = pattern(seed, key(k, r, me), kSlot);
      const long long at = first_difference(got.data() + k * round_bytes + r * kSlot, want.data(), kSlot);
      if (at >= 0 && ++bad <= 3)
        ADD_FAILURE() << "round " << k << " (stream " << k % 2 << "): rank " << r << "'s put was not there after the barrier (byte " << at << ")";
    }
  EXPECT_EQ(bad, 0) << "rounds x senders whose put a barrier let pass";
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
}

// A ring halo on alternating streams: round k writes fresh data into slot k of the send
// area, exchanges, and snapshots slot k of both halos. Every exchange copies the whole send
// area, so slot k holds poison until the neighbour's round-k data lands.
TEST_P(TwoStreams, AlternatingHaloExchangesSeeEveryHalo) {
  ScopedEnv variant("MESHMEM_BARRIER", GetParam());
  make_comm();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  constexpr int kRounds = 40;
  constexpr std::size_t kSlot = 2048, kArea = kRounds * kSlot;
  // [send][from left][from right]
  Window win = comm->alloc(3 * kArea);
  CUDA_OK(fill_now(win.local(), kPoison, 3 * kArea));
  std::vector<HaloRegion> sends = {HaloRegion{right, 0, kArea, kArea}, HaloRegion{left, 0, 2 * kArea, kArea}};
  HaloExchange halo = comm->make_halo(win, sends);
  DeviceBuffer src(kArea), snap(2 * kArea);
  for (int k = 0; k < kRounds; ++k) {
    auto d = pattern(seed, key(k, me, 0), kSlot);
    CUDA_OK(upload(src.c() + k * kSlot, d.data(), kSlot));
  }
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
  char* mine = static_cast<char*>(win.local());
  for (int k = 0; k < kRounds; ++k) {
    cudaStream_t s = k % 2 ? s1 : s0;
    if (k % 2 == 0) spin_kernel<<<1, 1, 0, s>>>(nullptr, 200000 + 40000ull * me);
    CUDA_OK(cudaMemcpyAsync(mine + k * kSlot, src.c() + k * kSlot, kSlot, cudaMemcpyDeviceToDevice, s));
    halo.exchange(s);
    CUDA_OK(cudaMemcpyAsync(snap.c() + k * kSlot, mine + kArea + k * kSlot, kSlot, cudaMemcpyDeviceToDevice, s));
    CUDA_OK(cudaMemcpyAsync(snap.c() + kArea + k * kSlot, mine + 2 * kArea + k * kSlot, kSlot, cudaMemcpyDeviceToDevice, s));
  }
  ASSERT_TRUE(finishes(s0, 60) && finishes(s1, 60)) << "the streams did not finish within 60 s (an exchange hangs)";
  const auto got = to_host(snap.p, snap.bytes);
  int bad = 0;
  for (int k = 0; k < kRounds; ++k) {
    const auto from_left = pattern(seed, key(k, left, 0), kSlot);
    const auto from_right = pattern(seed, key(k, right, 0), kSlot);
    if (first_difference(got.data() + k * kSlot, from_left.data(), kSlot) >= 0 && ++bad <= 3)
      ADD_FAILURE() << "round " << k << ": the halo from rank " << left << " was stale after the exchange";
    if (first_difference(got.data() + kArea + k * kSlot, from_right.data(), kSlot) >= 0 && ++bad <= 3)
      ADD_FAILURE() << "round " << k << ": the halo from rank " << right << " was stale after the exchange";
  }
  EXPECT_EQ(bad, 0) << "stale halos";
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
}

INSTANTIATE_TEST_SUITE_P(Barriers, TwoStreams, ::testing::Values("auto", "kernel", "meeting", "flag", "event"),
                         [](const auto& info) { return std::string(info.param); });

// ---- CUDA graphs ----

constexpr int kReplays = 200;
constexpr std::uint64_t kLateNs = 300000;

// Graph replays: before each, every rank poisons what it checks and loads fresh data, and
// the ranks meet on the host; then rank (replay % n) is late by kLateNs inside the graph.
class GraphReplay : public RealUse {
 protected:
  // One replay: this replay's late rank set, the ranks meet on the host, the graph runs to its end.
  ::testing::AssertionResult replay(cudaGraphExec_t exec, DeviceBuffer& delay, int rep) {
    const std::uint64_t ns = rep % n == me ? kLateNs : 0;
    if (cudaMemcpy(delay.p, &ns, sizeof(ns), cudaMemcpyHostToDevice) != cudaSuccess)
      return ::testing::AssertionFailure() << "replay " << rep << ": setting the delay failed";
    MPI_Barrier(MPI_COMM_WORLD);
    const cudaError_t rc = cudaGraphLaunch(exec, s0);
    if (rc != cudaSuccess) return ::testing::AssertionFailure() << "replay " << rep << ": cudaGraphLaunch: " << cudaGetErrorString(rc);
    if (!finishes(s0, 60)) return ::testing::AssertionFailure() << "replay " << rep << " did not finish within 60 s";
    return ::testing::AssertionSuccess();
  }
  cudaGraphExec_t instantiate(cudaGraph_t graph) {
    cudaGraphExec_t exec = nullptr;
    EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    cudaGraphDestroy(graph);
    return exec;
  }
  // ManyChainedPuts*: see there.
  void many_chained_puts(std::size_t barrier_every);
  // HaloExchangeReplaysWaitForTheLateRank and the per-thread stream's: see there.
  void halo_replays_wait_for_the_late_rank(cudaStream_t s);
  // Whether the Comm's barrier(stream) is the hierarchical one across nodes (NCCL's all-reduce).
  bool comm_barrier_is_hierarchical() const {
    return comm->device_info().find("barrier(stream) hierarchical") != std::string::npos;
  }
};

void GraphReplay::many_chained_puts(std::size_t barrier_every) {
  if (!comm) make_comm();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  constexpr std::size_t kPieces = 96, kPiece = 1031, kBytes = kPieces * kPiece;
  constexpr int kChainReplays = 10;
  Window win = comm->alloc(kBytes);
  DeviceBuffer src(kBytes);
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
  CUDA_OK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeGlobal));
  std::size_t barriers = 0;
  for (std::size_t i = 0; i < kPieces; ++i) {
    comm->put(win, right, i * kPiece, static_cast<char*>(src.p) + i * kPiece, kPiece, s0);
    if (barrier_every != 0 && i % barrier_every == barrier_every - 1 && i + 1 < kPieces) {
      comm->barrier(s0);
      ++barriers;
    }
  }
  comm->barrier(s0);  // every put has landed after it
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(s0, &graph));
  cudaGraphExec_t exec = instantiate(graph);
  ASSERT_NE(exec, nullptr);
  for (int rep = 0; rep < kChainReplays; ++rep) {
    CUDA_OK(fill_now(win.local(), kPoison, kBytes));
    auto d = pattern(seed, key(rep, me, 7), kBytes);
    CUDA_OK(upload(src.p, d.data(), kBytes));
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = std::chrono::steady_clock::now();
    CUDA_OK(cudaGraphLaunch(exec, s0));
    const double launch_s = seconds_since(t0);
    // About a millisecond; the stall lasted MESHMEM_TIMEOUT.
    EXPECT_LT(launch_s, 2.0) << "cudaGraphLaunch of " << kPieces << " chained puts and " << barriers + 1
                              << " barriers, replay " << rep;
    ASSERT_TRUE(finishes(s0, 60)) << "replay " << rep << " did not finish within 60 s";
    EXPECT_NO_THROW(comm->quiet(s0)) << "replay " << rep;
    const auto got = to_host(win.local(), kBytes);
    const auto want = pattern(seed, key(rep, left, 7), kBytes);
    EXPECT_EQ(first_difference(got.data(), want.data(), kBytes), -1) << "replay " << rep << ": the data from rank " << left;
    MPI_Barrier(MPI_COMM_WORLD);
  }
  cudaGraphExecDestroy(exec);
}

// A graph replayed after its Comm was destroyed (a user's mistake, but one a teardown order
// makes easily). Where its puts are doorbells (staged, nccl, mpi-device), each replay's kernel
// rang memory that ~Comm had given back (a later Comm's doorbells may reuse it) and waited a
// whole MESHMEM_TIMEOUT for an answer that never comes (for ever with MESHMEM_TIMEOUT=0). It
// ends at once now, and a later Comm's graph, replayed in between, delivers every byte.
TEST_F(GraphReplay, AReplayAfterItsCommIsGoneEndsAtOnce) {
  ScopedEnv timeout("MESHMEM_TIMEOUT", "20");
  make_comm();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  const TransportKind route = comm->transport(right, Memory::Device);
  if (route == TransportKind::Ipc)
    GTEST_SKIP() << "the route to rank " << right << " is ipc: a captured put is a copy into the peer's mapping, "
                 << "which ~Comm unmaps (nothing of meshmem's is left to run)";
  constexpr std::size_t kBytes = 65536 + 13;
  DeviceBuffer src(kBytes);
  cudaGraphExec_t orphan = nullptr;
  {
    Window win = comm->alloc(kBytes);
    comm->barrier(s0);
    CUDA_OK(cudaStreamSynchronize(s0));
    CUDA_OK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeGlobal));
    comm->put(win, right, 0, src.p, kBytes, s0);
    cudaGraph_t graph = nullptr;
    CUDA_OK(cudaStreamEndCapture(s0, &graph));
    orphan = instantiate(graph);
    ASSERT_NE(orphan, nullptr);
    CUDA_OK(cudaGraphLaunch(orphan, s0));  // while the Comm lives: a put like any other
    ASSERT_TRUE(finishes(s0, 60));
    comm->quiet(s0);
    CUDA_OK(cudaStreamSynchronize(s0));
    MPI_Barrier(MPI_COMM_WORLD);
  }
  comm.reset();
  make_comm();  // a later Comm, with doorbells of its own
  Window win = comm->alloc(kBytes);
  DeviceBuffer src2(kBytes);
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
  CUDA_OK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeGlobal));
  comm->put(win, right, 0, src2.p, kBytes, s0);
  comm->barrier(s0);
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(s0, &graph));
  cudaGraphExec_t exec = instantiate(graph);
  ASSERT_NE(exec, nullptr);
  for (int rep = 0; rep < 4; ++rep) {
    CUDA_OK(fill_now(win.local(), kPoison, kBytes));
    auto d = pattern(seed, key(rep, me, 11), kBytes);
    CUDA_OK(upload(src2.p, d.data(), kBytes));
    MPI_Barrier(MPI_COMM_WORLD);
    CUDA_OK(cudaGraphLaunch(exec, s0));
    ASSERT_TRUE(finishes(s0, 60)) << "replay " << rep << " of the later Comm's graph";
    EXPECT_NO_THROW(comm->quiet(s0)) << "replay " << rep;
    const auto want = pattern(seed, key(rep, left, 11), kBytes);
    auto got = to_host(win.local(), kBytes);
    EXPECT_EQ(first_difference(got.data(), want.data(), kBytes), -1)
        << "replay " << rep << " of the later Comm's graph: the data from rank " << left;
    // New data in the later graph's source, not replayed: a put of the later Comm set off by
    // the orphan's doorbell would bring it.
    auto next = pattern(seed, key(rep, me, 12), kBytes);
    CUDA_OK(upload(src2.p, next.data(), kBytes));
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = std::chrono::steady_clock::now();
    CUDA_OK(cudaGraphLaunch(orphan, s1));
    const bool ended = finishes(s1, 60);
    const double orphan_s = seconds_since(t0);
    EXPECT_TRUE(ended) << "replay " << rep << " of a graph whose Comm is gone did not end within 60 s";
    EXPECT_LT(orphan_s, 5.0) << "replay " << rep << " of a graph whose Comm is gone (route " << to_string(route)
                             << ") took " << orphan_s << " s (MESHMEM_TIMEOUT is 20 s)";
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    MPI_Barrier(MPI_COMM_WORLD);
    got = to_host(win.local(), kBytes);
    EXPECT_EQ(first_difference(got.data(), want.data(), kBytes), -1)
        << "after replay " << rep << " of the graph whose Comm is gone, the later Comm's window changed";
    MPI_Barrier(MPI_COMM_WORLD);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphExecDestroy(orphan);
}

// Graphs destroyed as soon as they are launched, while their puts still run (destroying a
// launched graph is allowed; CUDA ends it first): every put arrives whole, and the words a
// destroyed graph's transfer still writes are not handed to the next graph's transfers
// (a staged agent keeps a released graph's done word until its last transfer ends).
TEST_F(GraphReplay, GraphsDestroyedWhileTheirPutsRunLoseNothing) {
  make_comm();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  constexpr int kGraphs = 4;
  constexpr std::size_t kBytes = (16u << 20) + 7;
  Window win = comm->alloc(kGraphs * kBytes);
  DeviceBuffer src(kGraphs * kBytes);  // graph g's source at g * kBytes
  for (int round = 0; round < 3; ++round) {
    CUDA_OK(fill_now(win.local(), kPoison, kGraphs * kBytes));
    for (int g = 0; g < kGraphs; ++g) {
      const auto d = pattern(seed, key(round, me, 30 + g), kBytes);
      CUDA_OK(upload(src.c() + g * kBytes, d.data(), kBytes));
    }
    comm->barrier(s0);
    CUDA_OK(cudaStreamSynchronize(s0));
    MPI_Barrier(MPI_COMM_WORLD);
    for (int g = 0; g < kGraphs; ++g) {
      CUDA_OK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeGlobal));
      comm->put(win, right, g * kBytes + (g % 2), src.c() + g * kBytes, kBytes - (g % 2), s0);
      cudaGraph_t graph = nullptr;
      CUDA_OK(cudaStreamEndCapture(s0, &graph));
      cudaGraphExec_t exec = instantiate(graph);
      ASSERT_NE(exec, nullptr);
      CUDA_OK(cudaGraphLaunch(exec, s0));
      CUDA_OK(cudaGraphExecDestroy(exec));  // its put still runs
    }
    ASSERT_TRUE(finishes(s0, 60)) << "round " << round << ": the destroyed graphs' puts did not end";
    EXPECT_NO_THROW(comm->quiet(s0)) << "round " << round;
    comm->barrier(s0);
    ASSERT_TRUE(finishes(s0, 60)) << "round " << round << ": the barrier after the destroyed graphs";
    MPI_Barrier(MPI_COMM_WORLD);
    const auto got = to_host(win.local(), kGraphs * kBytes);
    for (int g = 0; g < kGraphs; ++g) {
      const auto want = pattern(seed, key(round, left, 30 + g), kBytes);
      const std::size_t skip = g % 2;
      EXPECT_EQ(first_difference(got.data() + g * kBytes + skip, want.data(), kBytes - skip), -1)
          << "round " << round << ": the put of destroyed graph " << g << " from rank " << left;
      if (skip) EXPECT_EQ(got[g * kBytes], kPoison) << "round " << round << ": a byte before graph " << g << "'s put";
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

class GraphBarrier : public GraphReplay, public ::testing::WithParamInterface<const char*> {};

TEST_P(GraphBarrier, ReplaysWaitForTheLateRank) {
  ScopedEnv variant("MESHMEM_BARRIER", GetParam());
  make_comm();
  constexpr std::size_t kSlot = 1024;
  const std::size_t bytes = static_cast<std::size_t>(n) * kSlot;
  Window win = comm->alloc(bytes);
  DeviceBuffer src(kSlot), snap(bytes), delay(sizeof(std::uint64_t));
  CUDA_OK(fill_now(delay.p, 0, delay.bytes));
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
  const std::string variant_name = GetParam();
  CUDA_OK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeGlobal));
  spin_kernel<<<1, 1, 0, s0>>>(static_cast<const std::uint64_t*>(delay.p), 0);
  for (int t = 0; t < n; ++t) comm->put(win, t, me * kSlot, src.p, kSlot, s0);
  // Where some pairs are staged the barrier is the kernel over the staging pool whatever
  // MESHMEM_BARRIER says (capturable).
  const bool pool_barrier = comm->device_info().find("flags in the staging pool") != std::string::npos;
  // Across nodes the barrier is hierarchical (NCCL) or the proxy thread's, whatever MESHMEM_BARRIER
  // says (both capturable).
  const bool across_nodes = comm->node_count() > 1;
  if ((variant_name == "flag" || variant_name == "event") && !pool_barrier && !across_nodes) {
    // Not capturable: a clear error before the capture is touched.
    try {
      comm->barrier(s0);
      ADD_FAILURE() << "barrier(stream) with MESHMEM_BARRIER=" << variant_name << " was captured";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Unsupported) << e.what();
      EXPECT_NE(std::string(e.what()).find("graph"), std::string::npos) << e.what();
    }
    cudaStreamCaptureStatus status{};
    CUDA_OK(cudaStreamIsCapturing(s0, &status));
    EXPECT_EQ(status, cudaStreamCaptureStatusActive) << "the refused barrier invalidated the capture";
    cudaGraph_t graph = nullptr;
    CUDA_OK(cudaStreamEndCapture(s0, &graph));
    cudaGraphDestroy(graph);
    MPI_Barrier(MPI_COMM_WORLD);
    return;
  }
  comm->barrier(s0);
  CUDA_OK(cudaMemcpyAsync(snap.p, win.local(), bytes, cudaMemcpyDeviceToDevice, s0));
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(s0, &graph));
  cudaGraphExec_t exec = instantiate(graph);
  ASSERT_NE(exec, nullptr);
  int bad = 0;
  for (int rep = 0; rep < kReplays; ++rep) {
    CUDA_OK(fill_now(win.local(), kPoison, bytes));
    auto d = pattern(seed, key(rep, me, 0), kSlot);
    CUDA_OK(upload(src.p, d.data(), kSlot));
    ASSERT_TRUE(replay(exec, delay, rep));
    const auto got = to_host(snap.p, bytes);
    for (int r = 0; r < n; ++r) {
      const auto want = pattern(seed, key(rep, r, 0), kSlot);
      if (first_difference(got.data() + r * kSlot, want.data(), kSlot) >= 0 && ++bad <= 3)
        ADD_FAILURE() << "replay " << rep << ": rank " << r << "'s put was not there after the captured barrier";
    }
    MPI_Barrier(MPI_COMM_WORLD);  // nobody poisons before every rank checked
  }
  EXPECT_EQ(bad, 0) << "replays x senders the captured barrier let pass";
  cudaGraphExecDestroy(exec);
}

INSTANTIATE_TEST_SUITE_P(Barriers, GraphBarrier, ::testing::Values("auto", "kernel", "meeting", "flag", "event"),
                         [](const auto& info) { return std::string(info.param); });

void GraphReplay::halo_replays_wait_for_the_late_rank(cudaStream_t s) {
  make_comm();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  constexpr std::size_t kArea = 8192;
  Window win = comm->alloc(3 * kArea);  // [send][from left][from right]
  HaloExchange halo = comm->make_halo(win, {HaloRegion{right, 0, kArea, kArea}, HaloRegion{left, 0, 2 * kArea, kArea}});
  DeviceBuffer src(kArea), snap(2 * kArea), delay(sizeof(std::uint64_t));
  CUDA_OK(fill_now(delay.p, 0, delay.bytes));
  char* mine = static_cast<char*>(win.local());
  int bad = 0;
  // Uncaptured exchanges, with this round's late rank, before the capture and after the
  // replays (where ranks share a GPU they wait with stream memory operations until the plan
  // is captured, then in the kernel, which counted the replays).
  bool eager_ok = true;
  auto eager_rounds = [&](int first) {
    for (int rep = first; rep < first + 4; ++rep) {
      CUDA_OK(fill_now(mine + kArea, kPoison, 2 * kArea));
      auto d = pattern(seed, key(rep, me, 0), kArea);
      CUDA_OK(upload(src.p, d.data(), kArea));
      MPI_Barrier(MPI_COMM_WORLD);
      spin_kernel<<<1, 1, 0, s>>>(nullptr, rep % n == me ? kLateNs : 0);
      CUDA_OK(cudaMemcpyAsync(mine, src.p, kArea, cudaMemcpyDeviceToDevice, s));
      halo.exchange(s);
      CUDA_OK(cudaMemcpyAsync(snap.p, mine + kArea, 2 * kArea, cudaMemcpyDeviceToDevice, s));
      if (!finishes(s, 60)) {
        ADD_FAILURE() << "uncaptured exchange " << rep << " did not end within 60 s";
        eager_ok = false;
        return;
      }
      const auto got = to_host(snap.p, 2 * kArea);
      if (first_difference(got.data(), pattern(seed, key(rep, left, 0), kArea).data(), kArea) >= 0 && ++bad <= 3)
        ADD_FAILURE() << "uncaptured exchange " << rep << ": stale halo from rank " << left;
      if (first_difference(got.data() + kArea, pattern(seed, key(rep, right, 0), kArea).data(), kArea) >= 0 && ++bad <= 3)
        ADD_FAILURE() << "uncaptured exchange " << rep << ": stale halo from rank " << right;
      MPI_Barrier(MPI_COMM_WORLD);
    }
  };
  eager_rounds(1000);
  if (HasFatalFailure() || !eager_ok) return;  // an assertion in the lambda returned from it only
  comm->barrier(s);
  CUDA_OK(cudaStreamSynchronize(s));
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  spin_kernel<<<1, 1, 0, s>>>(static_cast<const std::uint64_t*>(delay.p), 0);
  CUDA_OK(cudaMemcpyAsync(mine, src.p, kArea, cudaMemcpyDeviceToDevice, s));
  halo.exchange(s);
  CUDA_OK(cudaMemcpyAsync(snap.p, mine + kArea, 2 * kArea, cudaMemcpyDeviceToDevice, s));
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec = instantiate(graph);
  ASSERT_NE(exec, nullptr);
  for (int rep = 0; rep < kReplays; ++rep) {
    CUDA_OK(fill_now(mine + kArea, kPoison, 2 * kArea));
    auto d = pattern(seed, key(rep, me, 0), kArea);
    CUDA_OK(upload(src.p, d.data(), kArea));
    ASSERT_TRUE(replay(exec, delay, rep));
    const auto got = to_host(snap.p, 2 * kArea);
    const auto from_left = pattern(seed, key(rep, left, 0), kArea);
    const auto from_right = pattern(seed, key(rep, right, 0), kArea);
    if (first_difference(got.data(), from_left.data(), kArea) >= 0 && ++bad <= 3)
      ADD_FAILURE() << "replay " << rep << ": stale halo from rank " << left;
    if (first_difference(got.data() + kArea, from_right.data(), kArea) >= 0 && ++bad <= 3)
      ADD_FAILURE() << "replay " << rep << ": stale halo from rank " << right;
    MPI_Barrier(MPI_COMM_WORLD);
  }
  eager_rounds(2000);
  if (HasFatalFailure() || !eager_ok) return;
  EXPECT_EQ(bad, 0) << "stale halos in " << kReplays << " replays and 8 uncaptured exchanges";
  cudaGraphExecDestroy(exec);
  EXPECT_NO_THROW(comm->quiet(s));
}

TEST_F(GraphReplay, HaloExchangeReplaysWaitForTheLateRank) { halo_replays_wait_for_the_late_rank(s0); }
// The per-thread default stream can be captured too (the legacy one cannot).
TEST_F(GraphReplay, HaloExchangeCapturedOnThePerThreadStreamReplays) {
  halo_replays_wait_for_the_late_rank(cudaStreamPerThread);
}

// A halo exchange whose neighbour never comes: the stream goes on at the time limit and the
// Comm's next call raises Timeout naming that neighbour. Where ranks share a GPU the waits
// are stream memory operations, and a watch thread keeps the limit (HaloWatch).
TEST_F(RealUse, HaloExchangeWithANeighbourThatNeverComesTimesOut) {
  ScopedEnv timeout("MESHMEM_TIMEOUT", "2");
  make_comm();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  constexpr std::size_t kArea = 4096;
  Window win = comm->alloc(3 * kArea);  // [send][from left][from right]
  HaloExchange halo = comm->make_halo(win, {HaloRegion{right, 0, kArea, kArea}, HaloRegion{left, 0, 2 * kArea, kArea}});
  halo.exchange(s0);  // every rank: the first exchange passes
  ASSERT_TRUE(finishes(s0, 30));
  EXPECT_NO_THROW(comm->quiet(s0));
  MPI_Barrier(MPI_COMM_WORLD);
  if (me == 0) {
    const auto t0 = std::chrono::steady_clock::now();
    halo.exchange(s0);  // rank 0 alone
    spin_kernel<<<1, 1, 0, s0>>>(nullptr, 1000);  // the next step queued behind, as a user's is
    // (with one GPU queue, gpu.halo_release_one_queue, the watch's release is queued behind both)
    CUDA_OK(cudaGetLastError());
    EXPECT_TRUE(finishes(s0, 20)) << "the exchange whose neighbours never came did not end";
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_GE(waited, 1.5) << "the exchange passed without its neighbours";
    try {
      comm->quiet(s0);
      ADD_FAILURE() << "the timed-out exchange was not reported";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Timeout) << e.what();
      const std::string m = e.what();
      EXPECT_TRUE(m.find("halos of exchange 2 from rank " + std::to_string(left) + " ") != std::string::npos ||
                  m.find("halos of exchange 2 from rank " + std::to_string(right) + " ") != std::string::npos)
          << m;
    }
    // Released by a watch thread (waits as stream memory operations), whose writes stand in
    // for the late neighbour's: the exchange is failed for good, before anything is enqueued.
    if (comm->device_info().find("stream waits memop") != std::string::npos) {
      try {
        halo.exchange(s0);
        ADD_FAILURE() << "an exchange after the released one was enqueued";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::Timeout) << e.what();
        EXPECT_NE(std::string(e.what()).find("written by the watch"), std::string::npos) << e.what();
      }
      EXPECT_EQ(halo.exchanges(), 2u) << "a refused exchange was counted";
      EXPECT_TRUE(finishes(s0, 5));
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// put_signal + wait_until in a graph: the values are those of the capture on every replay,
// so the receiver resets its word after the wait (README "CUDA Graphs").
TEST_F(GraphReplay, PutSignalWaitUntilWithResetReplays) {
  make_comm();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  constexpr std::size_t kBytes = 4096 + 8;
  Window win = comm->alloc(kBytes);
  Signals sig = comm->alloc_signals(1);
  DeviceBuffer src(kBytes), snap(kBytes), delay(sizeof(std::uint64_t));
  CUDA_OK(fill_now(delay.p, 0, delay.bytes));
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
  CUDA_OK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeGlobal));
  spin_kernel<<<1, 1, 0, s0>>>(static_cast<const std::uint64_t*>(delay.p), 0);
  comm->put_signal(win, right, 0, src.p, kBytes, sig, 0, 1, SignalOp::Set, s0);
  comm->wait_until(sig, 0, Cmp::EQ, 1, s0);
  CUDA_OK(cudaMemcpyAsync(snap.p, win.local(), kBytes, cudaMemcpyDeviceToDevice, s0));
  comm->signal(sig, me, 0, 0, SignalOp::Set, s0);
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(s0, &graph));
  cudaGraphExec_t exec = instantiate(graph);
  ASSERT_NE(exec, nullptr);
  int bad = 0;
  for (int rep = 0; rep < kReplays; ++rep) {
    CUDA_OK(fill_now(win.local(), kPoison, kBytes));
    auto d = pattern(seed, key(rep, me, 1), kBytes);
    CUDA_OK(upload(src.p, d.data(), kBytes));
    ASSERT_TRUE(replay(exec, delay, rep));
    const auto got = to_host(snap.p, kBytes);
    const auto want = pattern(seed, key(rep, left, 1), kBytes);
    if (first_difference(got.data(), want.data(), kBytes) >= 0 && ++bad <= 3)
      ADD_FAILURE() << "replay " << rep << ": the data from rank " << left << " was not there after wait_until";
    MPI_Barrier(MPI_COMM_WORLD);
  }
  EXPECT_EQ(bad, 0);
  cudaGraphExecDestroy(exec);
}

// Two instantiations of one captured graph replayed at the same time, on two streams: each
// replay of a step a host thread carries out (here a staged put_signal with Add, forced) is its
// own transfer. Their kernels shared the step's doorbell: two that advanced its rung at once
// were taken up as one transfer (one Add for two replays), and a gated step's second ring could
// close the gate the first one's stream still waited on. Both memory waits (the kernel's, and
// the gate of ranks sharing a GPU). Every rank's word must count every replay of its left
// neighbour's two graphs, and the data must land.
class TwoInstantiations : public GraphReplay, public ::testing::WithParamInterface<const char*> {};

TEST_P(TwoInstantiations, ReplayedAtOnceEachReplayIsItsOwnTransfer) {
  constexpr int kRounds = 40;
  if (const std::string why = staged_cannot_be_forced(); !why.empty()) GTEST_SKIP() << why;
  ScopedEnv timeout("MESHMEM_TIMEOUT", "10");
  ScopedEnv wait("MESHMEM_STREAM_WAIT", GetParam());
  ScopedEnv transports("MESHMEM_TRANSPORTS", "staged,shm,mpi");
  make_comm();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  ASSERT_EQ(comm->transport(right, Memory::Device), TransportKind::Staged) << "the route to rank " << right;
  constexpr std::size_t kBytes = 65536 + 24;  // over a stream-filled put's 64 KiB: the agent's copy
  Window win = comm->alloc(kBytes);
  Signals sig = comm->alloc_signals(1);
  DeviceBuffer src(kBytes);
  const auto mine = pattern(seed, key(9, me, 9), kBytes);
  CUDA_OK(upload(src.p, mine.data(), kBytes));
  CUDA_OK(fill_now(win.local(), kPoison, kBytes));
  CUDA_OK(fill_now(sig.local(), 0, sizeof(std::uint64_t)));
  comm->barrier();
  CUDA_OK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeThreadLocal));
  comm->put_signal(win, right, 0, src.p, kBytes, sig, 0, 1, SignalOp::Add, s0);
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(s0, &graph));
  cudaGraphExec_t a = nullptr, b = nullptr;
  CUDA_OK(cudaGraphInstantiate(&a, graph, 0));
  CUDA_OK(cudaGraphInstantiate(&b, graph, 0));
  CUDA_OK(cudaGraphDestroy(graph));
  bool finished = true;
  for (int round = 0; round < kRounds && finished; ++round) {
    MPI_Barrier(MPI_COMM_WORLD);
    CUDA_OK(cudaGraphLaunch(a, s0));
    CUDA_OK(cudaGraphLaunch(b, s1));
    finished = finishes(s0, 60) && finishes(s1, 60);
  }
  EXPECT_TRUE(finished) << "a round of the two graphs did not finish within 60 s";
  std::string error;
  try {
    comm->quiet(s0);
    comm->quiet(s1);
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_EQ(error, "") << "the replays raised";
  comm->barrier();  // every rank's replays landed (their streams passed their puts)
  std::uint64_t count = 0;
  CUDA_OK(cudaMemcpy(&count, sig.local(), sizeof(count), cudaMemcpyDeviceToHost));
  EXPECT_EQ(count, std::uint64_t(2 * kRounds)) << "Adds from rank " << left << "'s two graphs, one per replay";
  const auto got = to_host(win.local(), kBytes);
  const auto want = pattern(seed, key(9, left, 9), kBytes);
  EXPECT_EQ(first_difference(got.data(), want.data(), kBytes), -1) << "the data from rank " << left;
  cudaGraphExecDestroy(a);
  cudaGraphExecDestroy(b);
  MPI_Barrier(MPI_COMM_WORLD);
}

INSTANTIATE_TEST_SUITE_P(Waits, TwoInstantiations, ::testing::Values("kernel", "memop"),
                         [](const auto& info) { return std::string(info.param); });

// A graph of many puts in a chain on one stream (with `barrier_every`, a barrier(stream) after
// every that many), then a barrier. Where a host thread carries the transfers (staged, nccl,
// mpi-device) or the barriers (the proxy's) out, a host node per step made cudaGraphLaunch
// wait for the host nodes (from about 32 in a chain, bench/queue_lab chain) while holding a
// lock that the thread's copies and launches wait for: every replay stalled until
// MESHMEM_TIMEOUT. The launch returns at once, and every replay delivers fresh data.
TEST_F(GraphReplay, ManyChainedPutsLaunchAtOnceAndReplay) { many_chained_puts(0); }

TEST_F(GraphReplay, ManyChainedPutsAndBarriersLaunchAtOnceAndReplay) {
  // The hierarchical barrier across nodes captures NCCL's all-reduce, whose host nodes chain;
  // a graph holds at most 16 of them (the next test): 96 / 6 = 16 barriers there, 32 elsewhere.
  make_comm();
  many_chained_puts(comm_barrier_is_hierarchical() ? 6 : 3);
}

// NCCL's captured all-reduce brings a host node of its own, and they chain: with 32 hierarchical
// barriers among 96 nccl puts every replay stalled until MESHMEM_TIMEOUT (cudaGraphLaunch waited
// for the host nodes while holding the nccl proxy's NCCL calls). So the 17th of a graph raises
// Unsupported on every rank before it touches the capture, and the capture ends valid: its 16
// barriers and their puts replay right.
TEST_F(GraphReplay, TheSeventeenthHierarchicalBarrierOfAGraphIsRefused) {
  make_comm();
  if (!comm_barrier_is_hierarchical())
    GTEST_SKIP() << "barrier(stream) is not the hierarchical one across nodes here: " << comm->device_info();
  constexpr std::size_t kPieces = 16, kPiece = 1031, kBytes = kPieces * kPiece;
  Window win = comm->alloc(kBytes);
  DeviceBuffer src(kBytes);
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
  CUDA_OK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeGlobal));
  for (std::size_t i = 0; i < kPieces; ++i) {
    comm->put(win, right, i * kPiece, static_cast<char*>(src.p) + i * kPiece, kPiece, s0);
    comm->barrier(s0);
  }
  try {
    comm->barrier(s0);
    ADD_FAILURE() << "the 17th hierarchical barrier of a graph was captured";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Unsupported) << e.what();
    EXPECT_NE(std::string(e.what()).find("16 hierarchical barriers"), std::string::npos) << e.what();
  }
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(s0, &graph), cudaSuccess) << "the refusal invalidated the capture";
  cudaGraphExec_t exec = instantiate(graph);
  ASSERT_NE(exec, nullptr);
  for (int rep = 0; rep < 3; ++rep) {
    CUDA_OK(fill_now(win.local(), kPoison, kBytes));
    auto d = pattern(seed, key(rep, me, 13), kBytes);
    CUDA_OK(upload(src.p, d.data(), kBytes));
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = std::chrono::steady_clock::now();
    CUDA_OK(cudaGraphLaunch(exec, s0));
    EXPECT_LT(seconds_since(t0), 2.0) << "cudaGraphLaunch of 16 hierarchical barriers, replay " << rep;
    ASSERT_TRUE(finishes(s0, 60)) << "replay " << rep << " did not finish within 60 s";
    EXPECT_NO_THROW(comm->quiet(s0)) << "replay " << rep;
    const auto got = to_host(win.local(), kBytes);
    const auto want = pattern(seed, key(rep, left, 13), kBytes);
    EXPECT_EQ(first_difference(got.data(), want.data(), kBytes), -1) << "replay " << rep << ": the data from rank " << left;
    MPI_Barrier(MPI_COMM_WORLD);
  }
  cudaGraphExecDestroy(exec);
  // The count is per capture: the next one holds 16 again.
  CUDA_OK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeGlobal));
  for (std::size_t i = 0; i < kPieces; ++i) EXPECT_NO_THROW(comm->barrier(s0)) << "barrier " << i << " of a new capture";
  graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(s0, &graph), cudaSuccess);
  cudaGraphDestroy(graph);
}

#ifdef MESHMEM_TEST_NEW_API  // wait_until_all_then_set, device_info
// The halo pattern of examples/03_jacobi --halo=meshmem-putsignal, captured once: a row to
// each neighbour with put_signal (Set 1), then one wait_until_all_then_set that waits for
// both words and resets them to 0. Each replay the late rank is another; the received rows
// must be that replay's and the words 0 afterwards. Both stream waits (polling kernel and
// stream memory operations), a fused (small) and a copy-engine (large) put_signal.
class WaitThenSet : public GraphReplay, public ::testing::WithParamInterface<std::tuple<const char*, std::size_t>> {};

TEST_P(WaitThenSet, HaloRowsReplayWithReset) {
  ScopedEnv wait("MESHMEM_STREAM_WAIT", std::get<0>(GetParam()));
  make_comm();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  const std::size_t kBytes = std::get<1>(GetParam());
  Window win = comm->alloc(2 * kBytes);  // [0]: the row from the left, [1]: from the right
  Signals sig = comm->alloc_signals(2);  // word 0: from the left, 1: from the right
  DeviceBuffer src(2 * kBytes), snap(2 * kBytes), delay(sizeof(std::uint64_t));
  CUDA_OK(fill_now(delay.p, 0, delay.bytes));
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
  CUDA_OK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeGlobal));
  spin_kernel<<<1, 1, 0, s0>>>(static_cast<const std::uint64_t*>(delay.p), 0);
  // src[0]: the row for the right neighbour (its row "from the left"), src[1]: for the left.
  comm->put_signal(win, right, 0, src.p, kBytes, sig, 0, 1, SignalOp::Set, s0);
  comm->put_signal(win, left, kBytes, static_cast<char*>(src.p) + kBytes, kBytes, sig, 1, 1, SignalOp::Set, s0);
  comm->wait_until_all_then_set(sig, 0, 2, Cmp::EQ, 1, 0, s0);
  CUDA_OK(cudaMemcpyAsync(snap.p, win.local(), 2 * kBytes, cudaMemcpyDeviceToDevice, s0));
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(s0, &graph));
  cudaGraphExec_t exec = instantiate(graph);
  ASSERT_NE(exec, nullptr);
  int bad = 0;
  for (int rep = 0; rep < kReplays; ++rep) {
    CUDA_OK(fill_now(snap.p, kPoison, 2 * kBytes));
    auto to_right = pattern(seed, key(rep, me, right), kBytes);
    auto to_left = pattern(seed, key(rep, me, left) ^ 0x5555, kBytes);
    CUDA_OK(upload(src.p, to_right.data(), kBytes));
    CUDA_OK(upload(static_cast<char*>(src.p) + kBytes, to_left.data(), kBytes));
    ASSERT_TRUE(replay(exec, delay, rep));
    const auto got = to_host(snap.p, 2 * kBytes);
    const auto from_left = pattern(seed, key(rep, left, me), kBytes);
    const auto from_right = pattern(seed, key(rep, right, me) ^ 0x5555, kBytes);
    if ((first_difference(got.data(), from_left.data(), kBytes) >= 0 ||
         first_difference(got.data() + kBytes, from_right.data(), kBytes) >= 0) &&
        ++bad <= 3)
      ADD_FAILURE() << "replay " << rep << ": a neighbour's row of this replay was not there after the wait";
    EXPECT_EQ(sig.read(0), 0u) << "replay " << rep << ": word 0 not reset";
    EXPECT_EQ(sig.read(1), 0u) << "replay " << rep << ": word 1 not reset";
    MPI_Barrier(MPI_COMM_WORLD);
  }
  EXPECT_EQ(bad, 0);
  cudaGraphExecDestroy(exec);
}

INSTANTIATE_TEST_SUITE_P(Waits, WaitThenSet,
                         ::testing::Combine(::testing::Values("kernel", "memop"),
                                            ::testing::Values(std::size_t{264}, std::size_t{32768 + 8})),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param)) + "_" + std::to_string(std::get<1>(info.param));
                         });

// Writes a pattern of (round, rank) into `bytes` bytes of `p`.
__global__ void produce(unsigned char* p, std::size_t bytes, int round, int rank) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < bytes; i += gridDim.x * blockDim.x)
    p[i] = static_cast<unsigned char>(round * 31 + rank * 17 + i * 7);
}

// Checks a round's row (made by `produce` on rank `from`) copied to `snap`: counts a wrong
// round in *bad and reports the first three.
void check_row(const void* snap, std::size_t bytes, int round, int from, const char* what, int* bad) {
  const auto got = to_host(snap, bytes);
  std::vector<unsigned char> want(bytes);
  for (std::size_t i = 0; i < bytes; ++i) want[i] = static_cast<unsigned char>(round * 31 + from * 17 + i * 7);
  const long long at = first_difference(got.data(), want.data(), bytes);
  if (at >= 0 && ++*bad <= 3)
    ADD_FAILURE() << "round " << round << ": " << what << " rank " << from << " differs at byte " << at << " (0x"
                  << std::hex << int(got[at]) << " instead of 0x" << int(want[at]) << std::dec << ")";
}

// MESHMEM_EARLY_LAUNCH: meshmem's kernels are set up while the previous kernel on the stream
// runs, and must not act before it ends. Each round a rank tells its left neighbour "go"
// only after poisoning its own window on its stream (the round's late rank poisons late);
// the neighbour's stream waits for "go" (wait kernel), then puts a row made by a kernel just
// before (put_signal, one early-launched kernel). A put that ran before the wait was over
// would land before the poison and be lost; one that ran before `produce` would carry
// the last round's row.
TEST_F(RealUse, EarlyLaunchedKernelsWaitForThePreviousKernel) {
  ScopedEnv wait("MESHMEM_STREAM_WAIT", "kernel");
  make_comm();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  if (comm->device_info().find("early launch") == std::string::npos)
    GTEST_SKIP() << "early launch is off here (" << comm->device_info() << ")";
  constexpr std::size_t kBytes = 4096 + 24;
  Window win = comm->alloc(kBytes);
  Signals sig = comm->alloc_signals(2);  // 0: "go" from the right, 1: the row from the left
  DeviceBuffer src(kBytes), snap(kBytes);
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
  int bad = 0;
  for (int round = 0; round < kReplays; ++round) {
    const std::uint64_t r = static_cast<std::uint64_t>(round) + 1;
    if (round % n == me) spin_kernel<<<1, 1, 0, s0>>>(nullptr, kLateNs);
    CUDA_OK(cudaMemsetAsync(win.local(), kPoison, kBytes, s0));
    comm->signal(sig, left, 0, r, SignalOp::Set, s0);
    produce<<<4, 256, 0, s0>>>(static_cast<unsigned char*>(src.p), kBytes, round, me);
    comm->wait_until(sig, 0, Cmp::GE, r, s0);
    comm->put_signal(win, right, 0, src.p, kBytes, sig, 1, r, SignalOp::Set, s0);
    comm->wait_until(sig, 1, Cmp::GE, r, s0);
    CUDA_OK(cudaMemcpyAsync(snap.p, win.local(), kBytes, cudaMemcpyDeviceToDevice, s0));
    ASSERT_TRUE(finishes(s0, 60)) << "round " << round << " did not finish within 60 s";
    check_row(snap.p, kBytes, round, left, "the row from", &bad);
  }
  EXPECT_EQ(bad, 0) << "rounds with a wrong row, of " << kReplays;
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
}

// Early launch between two of meshmem's own kernels: copy kernels let the next kernel start
// early (it must then wait for them on the GPU). Each round a rank copies a fresh row into
// its own window (put_signal to itself: one single-block copy kernel, slow at this size) and
// at once puts that window on to its right neighbour (a put: a many-block copy kernel that
// reads what the first writes, and would overtake it), then signals. A second kernel that
// did not wait would forward the poison.
TEST_F(RealUse, EarlyLaunchedCopyWaitsForThePreviousCopy) {
  ScopedEnv wait("MESHMEM_STREAM_WAIT", "kernel");
  ScopedEnv fused("MESHMEM_FUSED_SIGNAL_MAX", "8388608");  // both copies on the SMs
  ScopedEnv sm("MESHMEM_SM_COPY_MAX", "8388608");
  make_comm();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  if (comm->device_info().find("early launch") == std::string::npos)
    GTEST_SKIP() << "early launch is off here (" << comm->device_info() << ")";
  constexpr std::size_t kBytes = (4 << 20) + 24;
  Window stage = comm->alloc(kBytes), win = comm->alloc(kBytes);
  Signals sig = comm->alloc_signals(3);  // 0: "go" from the right, 1: the row from the left, 2: own stage
  DeviceBuffer src(kBytes), snap(kBytes);
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
  int bad = 0;
  for (int round = 0; round < kReplays; ++round) {
    const std::uint64_t r = static_cast<std::uint64_t>(round) + 1;
    CUDA_OK(cudaMemsetAsync(win.local(), kPoison, kBytes, s0));
    comm->signal(sig, left, 0, r, SignalOp::Set, s0);
    produce<<<64, 256, 0, s0>>>(static_cast<unsigned char*>(src.p), kBytes, round, me);
    CUDA_OK(cudaMemsetAsync(stage.local(), kPoison, kBytes, s0));
    comm->wait_until(sig, 0, Cmp::GE, r, s0);
    comm->put_signal(stage, me, 0, src.p, kBytes, sig, 2, r, SignalOp::Set, s0);
    comm->put(win, right, 0, stage.local(), kBytes, s0);
    comm->signal(sig, right, 1, r, SignalOp::Set, s0);
    comm->wait_until(sig, 1, Cmp::GE, r, s0);
    CUDA_OK(cudaMemcpyAsync(snap.p, win.local(), kBytes, cudaMemcpyDeviceToDevice, s0));
    ASSERT_TRUE(finishes(s0, 60)) << "round " << round << " did not finish within 60 s";
    check_row(snap.p, kBytes, round, left, "the row forwarded by", &bad);
  }
  EXPECT_EQ(bad, 0) << "rounds with a wrong row, of " << kReplays;
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
}

#endif  // MESHMEM_TEST_NEW_API

// ---- streams that wait while meshmem's own streams move the data ----

// A stream that waits (a polling kernel with work behind it, or a stream memory wait) holds
// the GPU queue it shares with other streams of its process, and the staged, nccl and
// mpi-device transfers run on such streams of meshmem's (the agent's, the proxy's) once the
// caller's stream waits for them. Each rank puts eight rows with put_signal to its right on
// s1, behind a 200 ms kernel, then makes eight streams that each wait for one row's signal
// from the left with a memset behind the wait: eight waiting streams fill CUDA's default eight
// queues by the time meshmem's streams move the rows. The test's own s1 is older than the
// waiting streams, so its work is ahead of theirs in any queue they share, and on ipc (copy
// kernels on s1) this passes with any number of queues. meshmem asks for 32 queues when the
// program starts (MESHMEM_GPU_QUEUES): every row must land and every wait end. Kernel waits,
// so that a stall ends in MESHMEM_TIMEOUT (10 s) rather than hanging the test.
TEST_F(RealUse, TransfersRunWhileEightStreamsWait) {
  ScopedEnv timeout("MESHMEM_TIMEOUT", "10");
  ScopedEnv wait("MESHMEM_STREAM_WAIT", "kernel");
  make_comm();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  constexpr int kWaiting = 8;
  constexpr std::size_t kBytes = (64 << 10) + 24;
  Window win = comm->alloc(kWaiting * kBytes);
  Signals sig = comm->alloc_signals(kWaiting);
  DeviceBuffer src(kWaiting * kBytes), marks(kWaiting);
  const auto mine = pattern(seed, key(0, me, 8), kWaiting * kBytes);
  CUDA_OK(upload(src.p, mine.data(), mine.size()));
  CUDA_OK(fill_now(win.local(), kPoison, kWaiting * kBytes));
  CUDA_OK(fill_now(marks.p, 0, kWaiting));
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
  struct Streams {  // destroyed on every path out of the test
    std::vector<cudaStream_t> s;
    ~Streams() {
      for (cudaStream_t x : s) cudaStreamDestroy(x);
    }
  } waiting;
  spin_kernel<<<1, 1, 0, s1>>>(nullptr, 200'000'000);
  CUDA_OK(cudaGetLastError());
  for (int i = 0; i < kWaiting; ++i)
    comm->put_signal(win, right, i * kBytes, static_cast<const char*>(src.p) + i * kBytes, kBytes, sig,
                     static_cast<std::size_t>(i), 1, SignalOp::Set, s1);
  for (int i = 0; i < kWaiting; ++i) {
    cudaStream_t s = nullptr;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    waiting.s.push_back(s);
    comm->wait_until(sig, static_cast<std::size_t>(i), Cmp::GE, 1, s);
    CUDA_OK(cudaMemsetAsync(static_cast<char*>(marks.p) + i, 1, 1, s));
  }
  // One deadline for all: the waits time out on the GPU after 10 s, the transfers by then too.
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  const auto seconds_left = [&] {
    const auto left_s = std::chrono::duration_cast<std::chrono::seconds>(end - std::chrono::steady_clock::now());
    return std::max(1, static_cast<int>(left_s.count()));
  };
  bool ended = true;
  for (cudaStream_t s : waiting.s) ended = finishes(s, seconds_left()) && ended;
  ended = finishes(s1, seconds_left()) && ended;
  ASSERT_TRUE(ended) << "rank " << me << ": the puts to rank " << right << " or the waits for rank " << left
                     << "'s did not end within 60 s (route " << to_string(comm->transport(right, Memory::Device)) << ")";
  std::string error;
  try {
    comm->quiet(s0);  // raises a wait's or a transfer's timeout, if one came
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_EQ(error, "") << "rank " << me << ": route " << to_string(comm->transport(right, Memory::Device));
  const auto got = to_host(win.local(), kWaiting * kBytes);
  const auto want = pattern(seed, key(0, left, 8), kWaiting * kBytes);
  const long long bad = first_difference(got.data(), want.data(), kWaiting * kBytes);
  EXPECT_LT(bad, 0) << "rank " << me << ": byte " << bad << " from rank " << left << " differs";
  const auto m = to_host(marks.p, kWaiting);
  for (int i = 0; i < kWaiting; ++i) EXPECT_EQ(m[i], 1) << "the work behind wait " << i << " did not run";
  MPI_Barrier(MPI_COMM_WORLD);
}

// A kernel of the application launched for the first time while a transfer to this rank is
// in flight. Under CUDA's lazy module loading (the default) that launch loads the kernel's
// module, and loading waits for the GPU to be idle; the staged, nccl and mpi-device
// transfers are ended by a thread of this process whose driver calls wait behind that
// launch, so the transfer stalled until MESHMEM_TIMEOUT (ipc's copy kernels were queued
// before). meshmem asks for eager loading when the program starts (MESHMEM_MODULE_LOADING).
// Each rank in turn waits on s0 for a row from its left neighbour and launches a kernel
// never launched in this process on s1; the neighbour puts the row 300 ms later. The row
// must land and the launch end long before the timeout (10 s, kernel waits so that a stall
// ends in it rather than hanging the test).
__global__ void first_launched_by_the_waiter(unsigned char* mark) { *mark = 1; }

TEST_F(RealUse, AKernelFirstLaunchedWhileATransferIsInFlightDoesNotStallIt) {
  ScopedEnv timeout("MESHMEM_TIMEOUT", "10");
  ScopedEnv wait("MESHMEM_STREAM_WAIT", "kernel");
  make_comm();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  // Lazy loading is the documented limit only where the user chose it (the variable, or
  // MESHMEM_MODULE_LOADING=keep); anywhere else meshmem's request did not take: a failure.
  const std::string info = comm->device_info();
  const bool lazy = info.find("module loading lazy") != std::string::npos;
  const bool chosen = info.find("(CUDA_MODULE_LOADING, the user's") != std::string::npos ||
                      info.find("MESHMEM_MODULE_LOADING=keep") != std::string::npos;
  int skip = lazy && chosen ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &skip, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);  // every rank or none
  if (skip) GTEST_SKIP() << "lazy module loading chosen by the user on some rank (here: " << info << ")";
  EXPECT_FALSE(lazy) << "rank " << me << ": meshmem's request for eager loading did not take: " << info;
  constexpr std::size_t kBytes = (1 << 20) + 24;
  Window win = comm->alloc(kBytes);
  Signals sig = comm->alloc_signals(1);
  DeviceBuffer src(kBytes), mark(1);
  const auto mine = pattern(seed, key(0, me, 9), kBytes);
  CUDA_OK(upload(src.p, mine.data(), mine.size()));
  CUDA_OK(fill_now(mark.p, 0, 1));
  for (int turn = 0; turn < n; ++turn) {
    const std::uint64_t r = static_cast<std::uint64_t>(turn) + 1;
    CUDA_OK(fill_now(win.local(), kPoison, kBytes));
    comm->barrier(s0);
    CUDA_OK(cudaStreamSynchronize(s0));
    MPI_Barrier(MPI_COMM_WORLD);
    if (me == turn) {
      comm->wait_until(sig, 0, Cmp::GE, r, s0);
      const auto t0 = std::chrono::steady_clock::now();
      first_launched_by_the_waiter<<<1, 1, 0, s1>>>(static_cast<unsigned char*>(mark.p));
      CUDA_OK(cudaGetLastError());
      const bool launched = finishes(s1, 60);
      const bool received = finishes(s0, 60);
      const double took = seconds_since(t0);
      // No ASSERT in a turn: every rank must reach the turn's closing barrier.
      if (!launched || !received) {
        ADD_FAILURE() << "rank " << me << ": the first launch or the wait for rank " << left
                      << " did not end within 60 s";
        MPI_Barrier(MPI_COMM_WORLD);
        continue;
      }
      std::string error;
      try {
        comm->quiet(s0);
      } catch (const Error& e) {
        error = e.what();
      }
      EXPECT_EQ(error, "") << "rank " << me << ": route " << to_string(comm->transport(left, Memory::Device));
      EXPECT_LT(took, 5.0) << "rank " << me << ": the first launch and the row from rank " << left << " took " << took
                           << " s (route " << to_string(comm->transport(left, Memory::Device)) << ", "
                           << comm->device_info() << ")";
      const auto got = to_host(win.local(), kBytes);
      const auto want = pattern(seed, key(0, left, 9), kBytes);
      const long long bad = first_difference(got.data(), want.data(), kBytes);
      EXPECT_LT(bad, 0) << "rank " << me << ": byte " << bad << " from rank " << left << " differs";
      EXPECT_EQ(to_host(mark.p, 1)[0], 1) << "the first-launched kernel did not run";
    } else if (right == turn) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      comm->put_signal(win, turn, 0, src.p, kBytes, sig, 0, r, SignalOp::Set, s0);
      EXPECT_TRUE(finishes(s0, 60)) << "rank " << me << ": the put to rank " << turn << " did not end within 60 s";
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
}

// ---- Signals::read, teardown, late and missing peers ----

TEST_F(RealUse, SignalsReadOnDeviceSignals) {
  make_comm();
  Signals sig = comm->alloc_signals(3);
  const std::uint64_t value = (seed & 0xffffffffu) * 16 + static_cast<std::uint64_t>(me);
  comm->signal(sig, right, 2, value, SignalOp::Set, s0);
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
  EXPECT_EQ(sig.read(2), (seed & 0xffffffffu) * 16 + static_cast<std::uint64_t>(left));
  EXPECT_EQ(sig.read(0), 0u);
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
}

// Every rank's stream waits for a signal that its right neighbour sends only after its own
// Window::free: the free cannot wait for the GPU for ever (stream waits of the memop kind
// never time out on the GPU, so only the free's bound ends this).
TEST_F(RealUse, FreeBehindAPendingWaitIsBounded) {
  ScopedEnv timeout("MESHMEM_TIMEOUT", "2");
  ScopedEnv wait("MESHMEM_STREAM_WAIT", "memop");
  make_comm();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  Signals sig = comm->alloc_signals(1);
  Window data = comm->alloc(1 << 20);
  comm->wait_until(sig, 0, Cmp::GE, 1, s0);
  const auto t0 = std::chrono::steady_clock::now();
  std::string what;
  try {
    data.free();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Timeout) << e.what();
    what = e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(seconds, 15.0) << "Window::free behind a pending wait took " << seconds << " s";
  EXPECT_FALSE(data.valid());
  if (!what.empty()) EXPECT_NE(what.find("Window::free"), std::string::npos) << what;
  comm->signal(sig, left, 0, 1, SignalOp::Set, s1);
  EXPECT_TRUE(finishes(s0, 30)) << "the wait did not end after the signal came";
  CUDA_OK(cudaStreamSynchronize(s1));
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
}

// A staged transfer whose end the staging agent's lane cannot run, held in the GPU queue
// behind the caller's own stream wait (one queue per process: its entry gpu.staged_held_lane),
// ends at MESHMEM_TIMEOUT all the same, with an error naming the held lane, although its stream
// waits with a stream memory wait (MESHMEM_STREAM_WAIT=memop, the default where ranks share a
// GPU), which cannot time out by itself; what was held still lands afterwards. Before the
// agent watched its lanes (e037a20) such a stream waited for ever: the soak's first signal
// Add with one queue, still waiting after 60 s on 1 x H100.
TEST_F(RealUse, ATransferHeldOnTheAgentsLaneEndsAtTheTimeout) {
  if (!env_is("CUDA_DEVICE_MAX_CONNECTIONS", "1"))
    GTEST_SKIP() << "needs one GPU queue per process (CUDA_DEVICE_MAX_CONNECTIONS=1, as its entry "
                    "gpu.staged_held_lane sets): then the caller's wait holds the agent's lane";
  ScopedEnv timeout("MESHMEM_TIMEOUT", "4");
  make_comm();
  if (comm->transport(me, Memory::Device) != TransportKind::Staged)
    GTEST_SKIP() << "this rank reaches itself through " << to_string(comm->transport(me, Memory::Device))
                 << ", not staged";
  Signals sig = comm->alloc_signals(1);
  CUDA_OK(fill_now(sig.local(), 0, sizeof(std::uint64_t)));
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
  MPI_Barrier(MPI_COMM_WORLD);

  spin_kernel<<<1, 1, 0, s0>>>(nullptr, 200'000'000);  // the agent starts it after the wait is queued
  CUDA_OK(cudaGetLastError());
  const auto t0 = std::chrono::steady_clock::now();
  comm->signal(sig, me, 0, 5, SignalOp::Add, s0);
  const bool went_on = finishes(s0, 40);
  const double seconds = seconds_since(t0);
  EXPECT_TRUE(went_on) << "the stream still waits for the held transfer after 40 s (MESHMEM_TIMEOUT=4)";
  if (!went_on) std::_Exit(1);  // nothing here can end that wait: the job's other rank is told by MPI
  std::string error;
  try {
    comm->quiet(s0);
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_GT(seconds, 3.5) << "the signal ended before the timeout: nothing held the lane, the test proves nothing";
  EXPECT_LT(seconds, 20.0);
  EXPECT_NE(error.find("ended from the host"), std::string::npos) << error;
  EXPECT_NE(error.find("lane of device " + std::to_string(device)), std::string::npos) << error;
  // The wait is gone from the queue: the held Add runs and the signal lands.
  std::uint64_t value = 0;
  for (int i = 0; i < 200 && value != 5; ++i) {
    CUDA_OK(cudaMemcpy(&value, sig.local(), sizeof(value), cudaMemcpyDeviceToHost));
    if (value != 5) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(value, 5u) << "the held signal Add did not land within 10 s of the timeout";
  CUDA_OK(cudaDeviceSynchronize());
  MPI_Barrier(MPI_COMM_WORLD);
}

// ~Comm while a stream of the user's still runs (a kernel that waits for the test's host
// flag) must not wait for it for ever: README says every part of ~Comm that waits for the
// device is bounded by MESHMEM_TIMEOUT (here 2 s; a barrier proxy's by twice that). And what
// meshmem leaves running (the threads that free its memory once the kernel ends) must not
// hold up the user's other CUDA calls: a copy on another stream runs meanwhile.
// Before meshmem's small GPU memory came from the block pool (cuda/block_pool.hpp), ~Comm
// returned only when the kernel ended (40 s, at 7f51411 on 1 x H100, every route): it
// called cudaFree, which waits for every kernel of the device and, while it waits, makes
// other threads' CUDA calls wait too.
TEST_F(RealUse, DestroyingTheCommBehindARunningKernelIsBounded) {
  ScopedEnv timeout("MESHMEM_TIMEOUT", "2");
  make_comm();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
  const std::string route = to_string(comm->transport(right, Memory::Device));
  std::uint64_t* flag = nullptr;
  CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(&flag), sizeof(std::uint64_t), cudaHostAllocMapped));
  *flag = 0;
  std::uint64_t* flag_device = nullptr;
  CUDA_OK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&flag_device), flag, 0));
  wait_for_host_flag<<<1, 1, 0, s1>>>(flag_device);
  CUDA_OK(cudaGetLastError());
  // Sets the flag after 40 s at the latest: ends as soon as the test set it itself.
  std::thread release([flag] {
    const auto latest = std::chrono::steady_clock::now() + std::chrono::seconds(40);
    while (__atomic_load_n(flag, __ATOMIC_ACQUIRE) == 0 && std::chrono::steady_clock::now() < latest)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    __atomic_store_n(flag, 1, __ATOMIC_RELEASE);
  });
  const auto t0 = std::chrono::steady_clock::now();
  comm.reset();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // The kernel still runs: a copy of another stream neither waits to be issued nor to run.
  std::vector<unsigned char> src = pattern(seed, 7, 1 << 20), back(1 << 20, 0xAB);
  DeviceBuffer buf(1 << 20);
  const auto t1 = std::chrono::steady_clock::now();
  CUDA_OK(cudaMemcpyAsync(buf.p, src.data(), src.size(), cudaMemcpyHostToDevice, s0));
  CUDA_OK(cudaMemcpyAsync(back.data(), buf.p, back.size(), cudaMemcpyDeviceToHost, s0));
  const bool copied = finishes(s0, 10);
  const double copy_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  const bool kernel_ran_on = cudaStreamQuery(s1) == cudaErrorNotReady;
  __atomic_store_n(flag, 1, __ATOMIC_RELEASE);
  release.join();
  EXPECT_TRUE(finishes(s1, 30)) << "the user's kernel did not end after its flag was set";
  CUDA_OK(cudaFreeHost(flag));
  EXPECT_LT(seconds, 20.0) << "~Comm behind a running kernel took " << seconds << " s (route to rank " << right
                           << ": " << route << ")";
  EXPECT_TRUE(copied) << "a copy of another stream did not end while the kernel ran, after ~Comm (route " << route << ")";
  EXPECT_LT(copy_seconds, 5.0) << "route " << route;
  EXPECT_TRUE(kernel_ran_on) << "the kernel ended before the copy was checked: the check proves nothing";
  EXPECT_EQ(first_difference(back.data(), src.data(), src.size()), -1);
  MPI_Barrier(MPI_COMM_WORLD);
}

// A signal that never comes: the device wait gives up after MESHMEM_TIMEOUT, the stream goes
// on, and the next call raises Error(Timeout) naming the signal. (The kernel wait: auto's
// choice except where ranks share a GPU, which takes the memop wait of the case above.)
TEST_F(RealUse, DeviceWaitForASignalThatNeverComesTimesOut) {
  ScopedEnv timeout("MESHMEM_TIMEOUT", "2");
  ScopedEnv wait("MESHMEM_STREAM_WAIT", "kernel");
  make_comm();
  Signals sig = comm->alloc_signals(4);
  if (me == 0) {
    comm->wait_until(sig, 3, Cmp::GE, 7, s0);
    EXPECT_TRUE(finishes(s0, 30)) << "the device wait did not time out";
    try {
      comm->quiet(s0);
      ADD_FAILURE() << "the timed-out device wait was not reported";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Timeout) << e.what();
      EXPECT_NE(std::string(e.what()).find("signal 3"), std::string::npos) << e.what();
    }
    comm->quiet(s0);  // reported once
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// A peer that never reaches its barrier(stream): the GPU barrier gives up and the next call
// names the peer. (The kernel barrier: auto's choice except where ranks share a GPU, where
// the host meeting times out instead. Across nodes the proxy thread's meeting times out and
// releases the stream, and the next call, not only the next barrier, raises it: before
// this was so, the quiet below passed.)
TEST_F(RealUse, BarrierWithAPeerThatNeverComesTimesOut) {
  ScopedEnv timeout("MESHMEM_TIMEOUT", "2");
  ScopedEnv barrier("MESHMEM_BARRIER", "kernel");
  make_comm();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  if (me == 0) {
    comm->barrier(s0);
    EXPECT_TRUE(finishes(s0, 30)) << "the device barrier did not time out";
    try {
      comm->quiet(s0);
      ADD_FAILURE() << "the timed-out barrier was not reported";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Timeout) << e.what();
      const std::string m = e.what();
      EXPECT_TRUE(m.find("waited for rank") != std::string::npos || m.find("rank(s) 1") != std::string::npos)
          << m;
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// The same with the barrier captured into a graph that only rank 0 replays: the replay ends
// (the wait gives up) and the Comm's next call names the rank that never came. Across nodes
// this is the proxy thread's captured hand-off (its meeting times out and releases the wait).
// Then the Comm goes while the graph lives, and the next Comm's puts and barriers are whole.
TEST_F(RealUse, CapturedBarrierWithAPeerThatNeverComesTimesOut) {
  std::optional<ScopedEnv> timeout(std::in_place, "MESHMEM_TIMEOUT", "2");  // this Comm's, not the next one's
  ScopedEnv barrier("MESHMEM_BARRIER", "kernel");
  make_comm();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeGlobal));
  comm->barrier(s0);
  CUDA_OK(cudaStreamEndCapture(s0, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphDestroy(graph));
  if (me == 0) {
    const auto t0 = std::chrono::steady_clock::now();
    CUDA_OK(cudaGraphLaunch(exec, s0));
    EXPECT_TRUE(finishes(s0, 30)) << "the captured barrier did not time out";
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_GE(waited, 1.5) << "the replay passed the barrier without its peers";
    try {
      comm->quiet(s0);
      ADD_FAILURE() << "the timed-out captured barrier was not reported";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Timeout) << e.what();
      const std::string m = e.what();
      EXPECT_TRUE(m.find("waited for rank 1") != std::string::npos || m.find("rank(s) 1") != std::string::npos)
          << m;
    }
    // While the graph still exists, a further barrier raises the earlier failure or times out
    // again; it must not hang (NCCL's abort waits for the graphs that captured its
    // communicator, and the hierarchical barrier's watchdog once held its lock there).
    const auto t1 = std::chrono::steady_clock::now();
    try {
      comm->barrier(s0);
    } catch (const Error&) {
    }
    EXPECT_TRUE(finishes(s0, 30)) << "the barrier after the timed-out one did not end";
    try {
      comm->quiet(s0);
    } catch (const Error&) {
    }
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count(), 30.0);
  }
  // ~Comm while the graph that captured its barrier still exists returns (NCCL's destroy of a
  // communicator waits for such graphs), on the rank that timed out and on the one that never
  // replayed; the graph is destroyed after.
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t2 = std::chrono::steady_clock::now();
  comm.reset();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t2).count(), 30.0)
      << "~Comm with a live graph that captured its barrier";
  CUDA_OK(cudaGraphExecDestroy(exec));
  MPI_Barrier(MPI_COMM_WORLD);
  // The next Comm loses nothing to what that teardown left behind (its NCCL communicators'
  // destroys, which waited for the graph: run during this Comm's transfers, they held up its
  // proxy threads' CUDA calls until the transfers' time limit, and puts were missing after
  // the barrier).
  timeout.reset();
  make_comm();
  constexpr std::size_t kSlot = 4096;
  const std::size_t bytes = static_cast<std::size_t>(n) * kSlot;
  Window win = comm->alloc(bytes);
  DeviceBuffer src(kSlot), snap(bytes);
  int bad = 0;
  for (int round = 0; round < 40; ++round) {
    CUDA_OK(fill_now(win.local(), kPoison, bytes));
    const auto d = pattern(seed, key(round, me, 21), kSlot);
    CUDA_OK(upload(src.p, d.data(), kSlot));
    MPI_Barrier(MPI_COMM_WORLD);
    for (int t = 0; t < n; ++t) comm->put(win, t, me * kSlot, src.p, kSlot, s0);
    comm->barrier(s0);
    CUDA_OK(cudaMemcpyAsync(snap.p, win.local(), bytes, cudaMemcpyDeviceToDevice, s0));
    ASSERT_TRUE(finishes(s0, 60)) << "round " << round << " of the next Comm";
    const auto got = to_host(snap.p, bytes);
    for (int r = 0; r < n; ++r) {
      const auto want = pattern(seed, key(round, r, 21), kSlot);
      if (first_difference(got.data() + r * kSlot, want.data(), kSlot) >= 0 && ++bad <= 3)
        ADD_FAILURE() << "round " << round << " of the next Comm: rank " << r << "'s put was not there after barrier(stream)";
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
  EXPECT_EQ(bad, 0) << "rounds x senders whose put the next Comm's barrier let pass";
  EXPECT_NO_THROW(comm->quiet(s0));
}

// A put to a rank whose proxy thread (nccl or mpi-device transport) stops, before it handles
// the put's header, for longer than the timeout: the put's stream is released within the
// timeout, not when the peer wakes up, and the next put raises Timeout naming the rank. With
// kernel waits the wait kernel gives up; with memop waits (cuStreamWaitValue64, the choice
// where ranks share a GPU) the proxy's watchdog ends the transfer. The same for a staged
// transfer through the channel of a peer whose staging agent stops as it takes the
// transfer's descriptor: with memop waits this rank's agent ends the (small) put
// (end_overdue); the get keeps its wait kernel (its last copy is this rank's own). Nothing of a
// staged transfer lands after its timeout: the stopped agent, once it goes on, drops the put's
// chunk, and this rank's agent the get's answer (a given-up wait marks the done word).
class StoppedProxy : public RealUse, public ::testing::WithParamInterface<const char*> {
 protected:
  // Rank 1's proxy thread (staged: its staging agent) stops for kStopMs at its first header
  // (descriptor), with a 2 s timeout; rank 0 runs `transfer` (one put or get to rank 1 on s0)
  // twice: the first one's stream must go on after the timeout, not after the stop, and the
  // second must raise Timeout naming rank 1.
  enum class Lands { Unchecked, NotAfterTimeoutOfPut, NotAfterTimeoutOfGet };
  void transfer_ends_in_the_timeout(const char* what, const std::function<void(Window&, DeviceBuffer&)>& transfer,
                                    bool staged = false, Lands lands = Lands::Unchecked) {
    constexpr int kStopMs = 6000;
    ScopedEnv timeout("MESHMEM_TIMEOUT", "2");
    ScopedEnv wait("MESHMEM_STREAM_WAIT", GetParam());
    const std::string plan = (staged ? "1:staged.carry:stop=" : "1:proxy.header:stop=") + std::to_string(kStopMs);
    if (staged) {
      if (const std::string why = staged_cannot_be_forced(); !why.empty()) GTEST_SKIP() << why;
    }
    ScopedEnv fault("MESHMEM_FAULT", plan.c_str());
    std::optional<ScopedEnv> transports, channels;
    if (staged) {
      transports.emplace("MESHMEM_TRANSPORTS", "staged,shm,mpi");
      channels.emplace("MESHMEM_STAGING_CHANNELS", "always");  // through rank 1's agent
    }
    make_comm();
    const TransportKind route = n >= 2 && me == 0 ? comm->transport(1, Memory::Device) : TransportKind::Mpi;
    int proxied = n >= 2 && me == 0 &&
                  (staged ? route == TransportKind::Staged
                          : route == TransportKind::Nccl || route == TransportKind::MpiDevice);
    MPI_Bcast(&proxied, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (!proxied)
      GTEST_SKIP() << (staged ? "needs rank 0 to reach rank 1 through the staged transport"
                              : "needs rank 0 to reach rank 1 through the nccl or mpi-device transport");
    constexpr std::size_t kBytes = 4096;
    Window win = comm->alloc(2 * kBytes);  // the second half for the fence below
    DeviceBuffer buf(kBytes);
    // Fresh random bytes in the source (rank 0's buffer for a put, the window for a get), the
    // destination poisoned: nothing of the timed-out transfer may ever land there.
    std::vector<unsigned char> fresh(kBytes);
    std::mt19937 gen(std::random_device{}());
    for (auto& b : fresh) b = static_cast<unsigned char>(gen() % 255 + 1) ^ kPoison;  // never the poison
    const bool is_get = lands == Lands::NotAfterTimeoutOfGet;
    CUDA_OK(is_get ? upload(win.local(), fresh.data(), kBytes) : fill_now(win.local(), kPoison, kBytes));
    CUDA_OK(is_get ? fill_now(buf.p, kPoison, kBytes) : upload(buf.p, fresh.data(), kBytes));
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = std::chrono::steady_clock::now();
    if (me == 0) {
      transfer(win, buf);
      EXPECT_TRUE(finishes(s0, 30)) << "the " << what << "'s stream never went on";
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      EXPECT_GE(waited, 1.5) << "the " << what << " ended before its target handled it";
      EXPECT_LT(waited, kStopMs / 1000.0 - 1) << "the " << what << "'s stream waited for the stopped peer, not for the timeout";
      try {
        transfer(win, buf);
        CUDA_OK(cudaStreamSynchronize(s0));
        comm->quiet(s0);
        ADD_FAILURE() << "the timed-out " << what << " was not reported";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::Timeout) << e.what();
        EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
      }
    }
    // Everyone waits for the stopped thread to go on before the Comm is freed.
    const auto left = std::chrono::milliseconds(kStopMs + 500) - (std::chrono::steady_clock::now() - t0);
    if (left.count() > 0) std::this_thread::sleep_for(left);
    MPI_Barrier(MPI_COMM_WORLD);
    if (lands == Lands::Unchecked) return;
    // The stopped agent went on 0.5 s ago. A fence: one more transfer of the same kind through
    // the same channels (a put's chunks from rank 0 to rank 1; a get's request there and its
    // answer back), carried out in order, so once it ended every descriptor of the timed-out
    // transfer was carried out or dropped, and the copies of those carried out are done.
    if (me == 0) fence(win, kBytes, is_get, "the timed-out one");
    MPI_Barrier(MPI_COMM_WORLD);
    CUDA_OK(cudaDeviceSynchronize());
    const int checker = is_get ? 0 : 1;
    if (me == checker) {
      const auto got = to_host(is_get ? buf.p : win.local(), kBytes);
      std::size_t landed = 0;
      for (unsigned char b : got) landed += b != kPoison;
      EXPECT_EQ(landed, 0u) << landed << " of " << kBytes << " bytes of the timed-out " << what
                            << " landed after its timeout";
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
};

TEST_P(StoppedProxy, PutToAPeerWhoseProxyStopsEndsInTheTimeout) {
  transfer_ends_in_the_timeout("put", [&](Window& win, DeviceBuffer& src) { comm->put(win, 1, 0, src.p, src.bytes, s0); });
}

// The same for a get: its answer would come only after the stopped thread goes on.
TEST_P(StoppedProxy, GetFromAPeerWhoseProxyStopsEndsInTheTimeout) {
  transfer_ends_in_the_timeout("get", [&](Window& win, DeviceBuffer& dst) { comm->get(dst.p, win, 1, 0, dst.bytes, s0); });
}

// Staged (forced): rank 1's agent stops as it takes the put's last chunk (the get's request).
TEST_P(StoppedProxy, StagedPutToAPeerWhoseAgentStopsEndsInTheTimeout) {
  transfer_ends_in_the_timeout(
      "staged put", [&](Window& win, DeviceBuffer& src) { comm->put(win, 1, 0, src.p, src.bytes, s0); }, true,
      Lands::NotAfterTimeoutOfPut);
}

TEST_P(StoppedProxy, StagedGetFromAPeerWhoseAgentStopsEndsInTheTimeout) {
  transfer_ends_in_the_timeout(
      "staged get", [&](Window& win, DeviceBuffer& dst) { comm->get(dst.p, win, 1, 0, dst.bytes, s0); }, true,
      Lands::NotAfterTimeoutOfGet);
}

INSTANTIATE_TEST_SUITE_P(Waits, StoppedProxy, ::testing::Values("kernel", "memop"),
                         [](const auto& info) { return std::string(info.param); });

// A small staged put's stream fills its slot (MESHMEM_STAGING_STREAM_FILL) once the slot's
// previous put ended. Rank 1's agent stops for 6 s at the first chunk it takes (rank 0's put
// P1), with a 2 s timeout: P1's stream goes on after its timeout, and P2 on the same stream
// finds the slot still held (rank 1 may still copy P1 out of it) and is copied by rank 0's
// agent instead (before, P2 was written over P1's bytes in the slot after the wait for the
// slot timed out, and P1's range got P2's data; rank 0's log says "fill slot is retired"
// now). Both puts time out before rank 1 goes on (P1's fill kernel, and P2's wait kernel, give
// up and mark the done word, kTransferGivenUp, with either wait: a stream-filled put keeps its
// kernel), so rank 1 drops both: nothing lands after a timeout, and neither range ever holds
// the other put's bytes. (Until the given-up mark, both landed at 6 s, with either wait.)
class StalledFill : public RealUse, public ::testing::WithParamInterface<const char*> {};

TEST_P(StalledFill, StreamFilledPutBehindATimedOutOneLeavesItsSlotAlone) {
  constexpr int kStopMs = 6000;
  if (const std::string why = staged_cannot_be_forced(); !why.empty()) GTEST_SKIP() << why;
  ScopedEnv timeout("MESHMEM_TIMEOUT", "2");
  ScopedEnv wait("MESHMEM_STREAM_WAIT", GetParam());
  ScopedEnv transports("MESHMEM_TRANSPORTS", "staged,shm,mpi");
  ScopedEnv fill("MESHMEM_STAGING_STREAM_FILL", "on");
  ScopedEnv channels("MESHMEM_STAGING_CHANNELS", "always");  // through rank 1's agent
  const std::string plan = "1:staged.carry:stop=" + std::to_string(kStopMs);
  ScopedEnv fault("MESHMEM_FAULT", plan.c_str());
  make_comm();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  ASSERT_TRUE(rank0_reaches_through_staged({1})) << "rank 0's route to rank 1";
  constexpr std::size_t kBytes = 4096 + 5, kSecond = 8192;
  Window win = comm->alloc(3 * kSecond);  // the third part for the fence
  DeviceBuffer a(kBytes), b(kBytes);
  const auto want_a = pattern(seed, 71, kBytes), want_b = pattern(seed, 72, kBytes);
  CUDA_OK(cudaMemcpy(a.p, want_a.data(), kBytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(b.p, want_b.data(), kBytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(win.local(), kPoison, 2 * kSecond));
  CUDA_OK(cudaDeviceSynchronize());
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t0 = std::chrono::steady_clock::now();
  if (me == 0) {
    comm->put(win, 1, 0, a.p, kBytes, s0);        // P1: taken by rank 1's agent, which stops
    comm->put(win, 1, kSecond, b.p, kBytes, s0);  // P2: the slot is P1's until P1 ends
    CUDA_OK(cudaStreamSynchronize(s0));
    try {
      comm->quiet(s0);
      ADD_FAILURE() << "P1's timeout was not reported";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Timeout) << e.what();
    }
  }
  // Rank 1's agent goes on at 6 s and drops both. A fence put after them through the same
  // channel: once it ended, rank 1 carried out or dropped both, and its copies are done.
  const auto left = std::chrono::milliseconds(kStopMs + 500) - (std::chrono::steady_clock::now() - t0);
  if (left.count() > 0) std::this_thread::sleep_for(left);
  if (me == 0) fence(win, 2 * kSecond, false, "P1 and P2");
  MPI_Barrier(MPI_COMM_WORLD);
  CUDA_OK(cudaDeviceSynchronize());
  if (me == 1) {
    std::vector<unsigned char> got(2 * kSecond);
    CUDA_OK(cudaMemcpy(got.data(), win.local(), got.size(), cudaMemcpyDeviceToHost));
    const auto landed = [&](std::size_t at) {
      return static_cast<std::size_t>(
          std::count_if(got.begin() + static_cast<std::ptrdiff_t>(at),
                        got.begin() + static_cast<std::ptrdiff_t>(at + kBytes), [](unsigned char c) { return c != kPoison; }));
    };
    EXPECT_EQ(landed(0), 0u) << "bytes of P1 (or of P2 over it) landed after P1's timeout ("
                             << (first_difference(got.data(), want_b.data(), kBytes) == -1 ? "P2's bytes" : "not P2's")
                             << ")";
    EXPECT_EQ(landed(kSecond), 0u) << "bytes of P2 landed after its timeout";
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// A reader that took a stream-filled put before it was given up copies it out of the fill slot
// whenever it gets to it, also after later puts of that stream to another rank ended: rank 1's
// agent takes rank 0's put P1 (not yet marked) and then sleeps 6 s before it enqueues the copy
// (MESHMEM_FAULT 1:staged.copy_in:delay), with a 2 s timeout. Rank 0's stream goes on at P1's
// timeout; P2 (to rank 2, same stream) finds the slot held by P1, is copied by rank 0's agent
// and ends; P3 (to rank 2, same stream) waited for P2 only. Before slots were retired, P3's
// kernel filled the slot once P2 ended, and rank 1 copied P3's bytes into P1's range at 6 s.
// Now the slot is never filled again: P1's range holds P1's own bytes (taken before the mark,
// they land), and P2 and P3 land whole.
TEST_P(StalledFill, ASlotHeldByATimedOutPutIsNeverFilledAgain) {
  constexpr int kDelayMs = 6000;
  if (const std::string why = staged_cannot_be_forced(); !why.empty()) GTEST_SKIP() << why;
  ScopedEnv timeout("MESHMEM_TIMEOUT", "2");
  ScopedEnv wait("MESHMEM_STREAM_WAIT", GetParam());
  ScopedEnv transports("MESHMEM_TRANSPORTS", "staged,shm,mpi");
  ScopedEnv fill("MESHMEM_STAGING_STREAM_FILL", "on");
  ScopedEnv channels("MESHMEM_STAGING_CHANNELS", "always");
  const std::string plan = "1:staged.copy_in:delay=" + std::to_string(kDelayMs);
  ScopedEnv fault("MESHMEM_FAULT", plan.c_str());
  make_comm();
  if (n < 3) GTEST_SKIP() << "needs three ranks: a reader that stalls and another";
  ASSERT_TRUE(rank0_reaches_through_staged({1, 2})) << "rank 0's routes to ranks 1 and 2";
  constexpr std::size_t kBytes = 4096 + 5, kPart = 8192;
  Window win = comm->alloc(3 * kPart);  // the third part for the fence
  DeviceBuffer p1(kBytes), p2(kBytes), p3(kBytes);
  const auto want1 = pattern(seed, 81, kBytes), want2 = pattern(seed, 82, kBytes), want3 = pattern(seed, 83, kBytes);
  CUDA_OK(cudaMemcpy(p1.p, want1.data(), kBytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(p2.p, want2.data(), kBytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(p3.p, want3.data(), kBytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(win.local(), kPoison, 2 * kPart));
  CUDA_OK(cudaDeviceSynchronize());
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t0 = std::chrono::steady_clock::now();
  if (me == 0) {
    comm->put(win, 1, 0, p1.p, kBytes, s0);      // P1: rank 1 takes it, then sleeps before its copy
    comm->put(win, 2, 0, p2.p, kBytes, s0);      // P2: the slot is P1's until P1 ends
    comm->put(win, 2, kPart, p3.p, kBytes, s0);  // P3: waits for P2 only
    CUDA_OK(cudaStreamSynchronize(s0));
    try {
      comm->quiet(s0);
      ADD_FAILURE() << "P1's timeout was not reported";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Timeout) << e.what();
    }
    comm->quiet(s0);  // P2 and P3 ended
  }
  // Rank 1's agent enqueues P1's copy at 6 s; a fence put through the same channel after it.
  const auto left = std::chrono::milliseconds(kDelayMs + 500) - (std::chrono::steady_clock::now() - t0);
  if (left.count() > 0) std::this_thread::sleep_for(left);
  if (me == 0) fence(win, 2 * kPart, false, "P1");
  MPI_Barrier(MPI_COMM_WORLD);
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<unsigned char> got(2 * kPart);
  CUDA_OK(cudaMemcpy(got.data(), win.local(), got.size(), cudaMemcpyDeviceToHost));
  if (me == 1) {
    // Rank 1 took P1 before the mark (the delay comes after that check): P1 lands, from its slot.
    const bool poisoned = std::all_of(got.begin(), got.begin() + kBytes, [](unsigned char c) { return c == kPoison; });
    EXPECT_EQ(first_difference(got.data(), want1.data(), kBytes), -1)
        << "P1's range holds "
        << (first_difference(got.data(), want3.data(), kBytes) == -1 ? "P3's bytes (its fill reused P1's slot)"
            : poisoned ? "the poison (rank 1 did not take P1 before its timeout: the case did not happen)"
                       : "bytes of neither P1, P3 nor the poison");
  }
  if (me == 2) {
    EXPECT_EQ(first_difference(got.data(), want2.data(), kBytes), -1) << "P2";
    EXPECT_EQ(first_difference(got.data() + kPart, want3.data(), kBytes), -1) << "P3";
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

INSTANTIATE_TEST_SUITE_P(Waits, StalledFill, ::testing::Values("kernel", "memop"),
                         [](const auto& info) { return std::string(info.param); });

// A peer killed with SIGKILL while this rank still has work that needs it: a device wait
// for its signal and a barrier(stream) end on the GPU and are reported as Error(Timeout)
// naming the signal / the peer, and Window::free and ~Comm end within a bound. Run only by
// gpu.killed_peer (mpirun --enable-recovery, so that the job outlives the killed rank);
// the survivor cannot meet a dead rank in MPI_Finalize, so it ends its process here.
TEST_F(RealUse, KilledPeerGivesErrorsNotHangs) {
  if (!env_is("MESHMEM_TEST_KILL_PEER", "1"))
    GTEST_SKIP() << "kills a rank: run by gpu.killed_peer (MESHMEM_TEST_KILL_PEER=1, mpirun --enable-recovery)";
  ScopedEnv timeout("MESHMEM_TIMEOUT", "2");
  ScopedEnv wait("MESHMEM_STREAM_WAIT", "kernel");
  ScopedEnv barrier("MESHMEM_BARRIER", "kernel");
  make_comm();
  if (n != 2) GTEST_SKIP() << "written for two ranks (one survivor, one victim)";
  Signals sig = comm->alloc_signals(2);
  Window data = comm->alloc(1 << 20);
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
  MPI_Barrier(MPI_COMM_WORLD);
  if (me == 1) std::raise(SIGKILL);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the victim is gone

  // The error must contain one of `needles`.
  auto expect_timeout = [&](const char* what, const std::vector<std::string>& needles) {
    try {
      comm->quiet(s0);
      ADD_FAILURE() << what << " behind a killed peer was not reported";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Timeout) << e.what();
      const std::string m = e.what();
      EXPECT_TRUE(std::any_of(needles.begin(), needles.end(),
                              [&](const std::string& n) { return m.find(n) != std::string::npos; }))
          << m;
    }
  };
  // A wait for a signal that the dead rank would have sent.
  comm->wait_until(sig, 1, Cmp::GE, 1, s0);
  EXPECT_TRUE(finishes(s0, 30)) << "the device wait for the killed peer's signal did not time out";
  expect_timeout("wait_until(stream)", {"signal 1"});
  // A barrier the dead rank never reaches.
  comm->barrier(s0);
  EXPECT_TRUE(finishes(s0, 30)) << "barrier(stream) with a killed peer did not time out";
  // On one node the barrier kernel names the rank; across nodes the leaders' watchdog (or the
  // proxy thread's meeting) does.
  expect_timeout("barrier(stream)", {"waited for rank 1", "rank(s) 1"});
  // Teardown: free meets the (dead) peer on the host, ~Comm too; both bounded.
  auto t0 = std::chrono::steady_clock::now();
  try {
    data.free();
    ADD_FAILURE() << "Window::free with a killed peer returned without an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Timeout) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank(s) 1 did not arrive"), std::string::npos) << e.what();
  }
  EXPECT_LT(seconds_since(t0), 15.0) << "Window::free with a killed peer";
  EXPECT_FALSE(data.valid());
  t0 = std::chrono::steady_clock::now();
  sig = Signals();
  comm.reset();
  EXPECT_LT(seconds_since(t0), 30.0) << "~Signals and ~Comm with a killed peer";
  const bool failed = HasFailure();
  std::printf("[ killed peer ] %s: rank 0 outlived rank 1 and every call ended\n", failed ? "FAILED" : "PASSED");
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(failed ? 1 : 0);
}

// Three ranks of one node through the staged transport; rank 2 dies (MESHMEM_FAULT
// 2:staged.carry:kill: as its agent takes the first chunk of rank 0's 32 MiB put) while rank
// 0's staging slots hold that put's chunks. Rank 0's put is reported; its next put, to rank 1,
// arrives whole (fresh data, poisoned window, every byte checked); a later put to rank 2 is
// reported again. Before, the slots a dead reader held stayed held for good: every later
// staged transfer of rank 0, to any peer, timed out. Both survivors print a verdict line
// (mpirun --enable-recovery exits 0 whatever the ranks return). Run by
// gpu.killed_reader_staged.
TEST_F(RealUse, KilledReaderLeavesTheStagingSlotsToOthers) {
  if (!env_is("MESHMEM_TEST_KILL_READER", "1"))
    GTEST_SKIP() << "kills a rank: run by gpu.killed_reader_staged (MESHMEM_TEST_KILL_READER=1, mpirun "
                    "--enable-recovery)";
  // Longer than a killed process with a GPU context may take to end (its pidfd says so only
  // then): with 2 s, once on 4 x H200 (aa3e264) the first put's stall was reported before the
  // process end was seen.
  ScopedEnv timeout("MESHMEM_TIMEOUT", "5");
  ScopedEnv wait("MESHMEM_STREAM_WAIT", "kernel");
  ScopedEnv fault("MESHMEM_FAULT", "2:staged.carry:kill");
  make_comm();
  ASSERT_EQ(n, 3) << "written for three ranks (rank 2 is killed)";
  for (int r = 0; r < n; ++r)
    if (r != me) ASSERT_EQ(comm->transport(r, Memory::Device), TransportKind::Staged) << "rank " << r;
  constexpr std::size_t kBig = std::size_t(32) << 20, kSmall = (std::size_t(12) << 20) + 5, kOffset = 3;
  constexpr std::size_t kBytes = kBig + 64;
  Window win = comm->alloc(kBytes);
  Signals sig = comm->alloc_signals(1);
  CUDA_OK(fill_now(win.local(), kPoison, kBytes));
  DeviceBuffer src(kBig);
  const auto data = pattern(seed, key(1, 0, 1), kSmall);
  CUDA_OK(upload(src.p, data.data(), kSmall));
  meet_then_await_the_kill(*comm, s0, me, 2);  // rank 2 dies at rank 0's first chunk
  // Everything from here runs under a catch-all: a call that raises must not leave the test
  // body for TearDown, whose MPI_Allgather would wait for the dead rank for ever.
  const auto survivor = [&] {
    auto expect_reported = [&](const char* what) { expect_process_end_reported(*comm, s0, 2, what); };
    if (me == 0) {
      comm->put(win, 2, 0, src.p, kBig, s0);
      EXPECT_TRUE(finishes(s0, 30)) << "the put to the killed rank did not end";
      expect_reported("the put to the killed rank");
      comm->put_signal(win, 1, kOffset, src.p, kSmall, sig, 0, 1, SignalOp::Set, s0);
      EXPECT_TRUE(finishes(s0, 30)) << "the put to rank 1 did not end";
      EXPECT_NO_THROW(comm->quiet(s0)) << "the put to rank 1, after rank 2 died holding staging slots";
      comm->put(win, 2, 0, src.p, 1 << 20, s0);
      EXPECT_TRUE(finishes(s0, 30)) << "the second put to the killed rank did not end";
      expect_reported("the second put to the killed rank");
    } else {
      const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (sig.read(0) != 1 && std::chrono::steady_clock::now() < end)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      EXPECT_EQ(sig.read(0), 1u) << "rank 0's put_signal did not arrive within 30 s";
      const auto got = to_host(win.local(), kBytes);
      std::size_t wrong = 0, first = kBytes;
      for (std::size_t i = 0; i < kBytes; ++i) {
        const bool inside = i >= kOffset && i < kOffset + kSmall;
        const unsigned char want = inside ? data[i - kOffset] : static_cast<unsigned char>(kPoison);
        if (got[i] != want && wrong++ == 0) first = i;
      }
      EXPECT_EQ(wrong, 0u) << "bytes wrong in rank 1's window, the first at " << first;
    }
    // Teardown with a dead peer: bounded.
    const auto t0 = std::chrono::steady_clock::now();
    try {
      win.free();
    } catch (const Error&) {  // the dead rank did not arrive: reported, and freed
    }
    try {
      sig.free();
    } catch (const Error&) {
    }
    comm.reset();
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0)
        << "free and ~Comm with a killed peer";
  };
  try {
    survivor();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "rank " << me << " raised: " << e.what();
  }
  const bool failed = HasFailure();
  std::printf("[ killed reader ] rank %d %s\n", me, failed ? "FAILED" : "PASSED");
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(failed ? 1 : 0);
}

// Rank 0's GPU context fails (a kernel traps) while its staged puts wait on their stream for
// the source to be ready: the ready words are never written. The staging agent must end those
// transfers with the context's error, seen by the next quiet() within seconds (it looks every
// 100 ms), not leave them waiting for ever (MESHMEM_TIMEOUT is 60 s here and is not what ends
// them); then free and ~Comm on both ranks end. One put goes through the agent's copy, one
// small one through the stream fill (on here). Run by gpu.sticky_error_staged (it spoils
// rank 0's process for every later test); both ranks print a verdict.
TEST_F(RealUse, FailedContextEndsStagedTransfersWaitingForTheirStream) {
  if (!env_is("MESHMEM_TEST_STICKY_ERROR", "1"))
    GTEST_SKIP() << "makes a sticky CUDA error: run by gpu.sticky_error_staged (MESHMEM_TEST_STICKY_ERROR=1)";
  // Under MPS a trap is fatal to every client of the GPU, rank 1 included.
  if (std::getenv("CUDA_MPS_PIPE_DIRECTORY") != nullptr || access("/tmp/nvidia-mps/control", F_OK) == 0)
    GTEST_SKIP() << "an MPS server may serve this GPU: a trap there ends every client's context";
  ScopedEnv timeout("MESHMEM_TIMEOUT", "60");
  ScopedEnv fill("MESHMEM_STAGING_STREAM_FILL", "on");  // the small put through the fill
  make_comm();
  ASSERT_EQ(n, 2) << "written for two ranks";
  ASSERT_EQ(comm->transport(1 - me, Memory::Device), TransportKind::Staged);
  constexpr std::size_t kBytes = std::size_t(8) << 20;
  Window win = comm->alloc(kBytes);
  DeviceBuffer src(kBytes);
  CUDA_OK(fill_now(src.p, 1, kBytes));
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
  MPI_Barrier(MPI_COMM_WORLD);
  const auto run = [&] {
    if (me == 0) {
      spin_then_trap<<<1, 1, 0, s0>>>(300'000'000);  // 300 ms: both puts are enqueued behind it first
      CUDA_OK(cudaGetLastError());
      comm->put(win, 1, 0, src.p, kBytes, s0);
      comm->put(win, 1, 3, src.p, 4099, s0);
      const auto t0 = std::chrono::steady_clock::now();
      std::string error;
      while (error.empty() && seconds_since(t0) < 20) {
        try {
          comm->quiet();
        } catch (const Error& e) {
          error = e.what();
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      EXPECT_NE(error.find("the GPU context failed"), std::string::npos)
          << (error.empty() ? std::string("no error within 20 s") : error);
      EXPECT_LT(seconds_since(t0), 5.0) << "the failed context was reported late";
    }
    MPI_Barrier(MPI_COMM_WORLD);
    // Teardown with one rank's context failed: bounded on both ranks; rank 0's calls may raise.
    const auto t0 = std::chrono::steady_clock::now();
    try {
      win.free();
    } catch (const Error& e) {
      if (me == 1) ADD_FAILURE() << "rank 1's Window::free raised: " << e.what();
    }
    comm.reset();
    EXPECT_LT(seconds_since(t0), 30.0) << "free and ~Comm with rank 0's context failed";
  };
  try {
    run();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "rank " << me << " raised: " << e.what();
  }
  const bool failed = HasFailure();
  std::printf("[ sticky error ] rank %d %s\n", me, failed ? "FAILED" : "PASSED");
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(failed ? 1 : 0);
}

// Two ranks of one node through the staged transport; rank 1 dies while rank 0's get from it
// is posted and not answered in full: MESHMEM_TEST_KILL_OWNER=carry kills it as its agent
// takes the get's request from the channel (1:staged.carry:kill: nothing answered),
// =answer after it posted the answer's second chunk of three (1:staged.answer:kill:hit=2).
// =end: rank 1 answers in full, but rank 0's agent cannot enqueue the end of the answer's last
// chunk (0:staged.ends_in:fail); rank 1 dies 3 s later (before, that get counted as answered
// once its end was queued, so it waited for MESHMEM_TIMEOUT: 20.0 s on 1 x H200).
// Rank 0's get must end soon after rank 1's process did, reported with the process's end
// (=end: or the failed enqueue, which comes first), not after MESHMEM_TIMEOUT (here 20 s; for
// ever with 0): before, only a put's done word was ended from here when its reader died. A
// later get from the dead rank fails at once. Run by gpu.killed_owner_staged,
// gpu.killed_owner_midway_staged and gpu.killed_owner_end_failed_staged (mpirun
// --enable-recovery); rank 0 prints the verdict.
TEST_F(RealUse, KilledOwnerEndsTheGetsItOwed) {
  const char* how = std::getenv("MESHMEM_TEST_KILL_OWNER");
  const std::string mode = how == nullptr ? "" : how;
  if (mode != "carry" && mode != "answer" && mode != "end")
    GTEST_SKIP() << "kills a rank: run by gpu.killed_owner_staged, gpu.killed_owner_midway_staged and "
                    "gpu.killed_owner_end_failed_staged (MESHMEM_TEST_KILL_OWNER=carry, answer or end, mpirun "
                    "--enable-recovery)";
  ScopedEnv timeout("MESHMEM_TIMEOUT", "20");
  ScopedEnv wait("MESHMEM_STREAM_WAIT", "kernel");
  ScopedEnv fault("MESHMEM_FAULT", mode == "carry"    ? "1:staged.carry:kill"
                                   : mode == "answer" ? "1:staged.answer:kill:hit=2"
                                                      : "0:staged.ends_in:fail");
  ScopedEnv chunk("MESHMEM_STAGING_CHUNK", "4194304");  // the get's answer is three chunks
  make_comm();
  ASSERT_EQ(n, 2) << "written for two ranks (rank 1 is killed)";
  ASSERT_EQ(comm->transport(1 - me, Memory::Device), TransportKind::Staged);
  constexpr std::size_t kBytes = (std::size_t(8) << 20) + 7;
  Window win = comm->alloc(kBytes);
  CUDA_OK(fill_now(win.local(), 0x5A, kBytes));
  DeviceBuffer dst(kBytes);
  CUDA_OK(fill_now(dst.p, kPoison, kBytes));
  if (mode == "end") {
    // Its agent answers the get meanwhile (milliseconds); then it dies, as in a crash.
    comm->barrier(s0);
    CUDA_OK(cudaStreamSynchronize(s0));
    MPI_Barrier(MPI_COMM_WORLD);
    if (me == 1) {
      std::this_thread::sleep_for(std::chrono::seconds(3));
      std::raise(SIGKILL);
    }
  } else {
    meet_then_await_the_kill(*comm, s0, me, 1);  // rank 1 dies at rank 0's get request (or midway through its answer)
  }
  // Under a catch-all: a call that raises must not leave for TearDown's collectives.
  const auto survivor = [&] {
    auto expect_reported = [&](const char* what) { expect_process_end_reported(*comm, s0, 1, what); };
    auto t0 = std::chrono::steady_clock::now();
    comm->get(dst.p, win, 1, 3, kBytes - 3, s0);
    EXPECT_TRUE(finishes(s0, 40)) << "the get from the killed rank did not end";
    const double first = seconds_since(t0);
    EXPECT_LT(first, 10.0) << "the get from the killed rank ended only after " << first
                           << " s: it waited for MESHMEM_TIMEOUT (20 s) instead of the process's end";
    if (mode == "end") {
      try {
        comm->quiet(s0);
        ADD_FAILURE() << "the get whose end could not be enqueued was not reported";
      } catch (const Error& e) {
        const std::string message = e.what();
        EXPECT_TRUE(message.find("staged.ends_in") != std::string::npos ||
                    message.find("rank 1's process") != std::string::npos)
            << message;
      }
    } else {
      expect_reported("the get from the killed rank");
    }
    t0 = std::chrono::steady_clock::now();
    comm->get(dst.p, win, 1, 0, 4096, s0);
    EXPECT_TRUE(finishes(s0, 40)) << "the second get from the killed rank did not end";
    EXPECT_LT(seconds_since(t0), 5.0) << "the second get from the killed rank";
    expect_reported("the second get from the killed rank");
    t0 = std::chrono::steady_clock::now();
    try {
      win.free();
    } catch (const Error&) {  // the dead rank did not arrive: reported, and freed
    }
    comm.reset();
    EXPECT_LT(seconds_since(t0), 60.0) << "free and ~Comm with a killed peer";
  };
  try {
    survivor();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "rank 0 raised: " << e.what();
  }
  const bool failed = HasFailure();
  std::printf("[ killed owner ] rank 0 %s (%s)\n", failed ? "FAILED" : "PASSED", mode.c_str());
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(failed ? 1 : 0);
}

// The leader tests' layout: 4 ranks, MESHMEM_SIMULATE_NODES=2 (ranks 0, 1 on one node and 2, 3
// on the other), the hierarchical NCCL barrier, kernel waits, a 2 s timeout. The Comm is made
// (the environment is set first); "" where it is, else why the test skips.
class LeaderAcrossNodes : public RealUse {
 protected:
  std::string make_two_nodes_of_two() {
    int size = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (!env_is("MESHMEM_SIMULATE_NODES", "2") || size != 4)
      return "run by gpu.leaders_across_nodes (4 ranks, MESHMEM_SIMULATE_NODES=2)";
    make_comm();
    if (comm->node_count() != 2 || comm->node_of(1) != comm->node_of(0) || comm->node_of(2) == comm->node_of(0) ||
        comm->node_of(3) != comm->node_of(2))
      return "written for ranks 0, 1 on one node and 2, 3 on another";
    comm->barrier(s0);  // a good one first: the leaders' communicator works
    if (!finishes(s0, 30)) return "the first barrier did not end";
    comm->quiet(s0);
    MPI_Barrier(MPI_COMM_WORLD);
    return "";
  }
  ScopedEnv timeout_{"MESHMEM_TIMEOUT", "2"};
  ScopedEnv wait_{"MESHMEM_STREAM_WAIT", "kernel"};
  ScopedEnv barrier_{"MESHMEM_BARRIER", "kernel"};
  ScopedEnv across_{"MESHMEM_BARRIER_ACROSS_NODES", "nccl"};
};

// Two (simulated) nodes of two ranks each; the leader of node 1 (rank 2) comes to a
// barrier(stream) only after node 0's leader gave its all-reduce among the leaders up (twice
// MESHMEM_TIMEOUT). Every rank's stream ends within the bound and every rank's next call
// reports the barrier, naming the right rank: node 0's leader the leader that did not come,
// node 0's other rank its leader (its node kernel after the all-reduce times out first, at
// one MESHMEM_TIMEOUT), node 1's other rank its late leader, and the late leader node 0's
// leader, gone by then. Run by gpu.leaders_across_nodes.
TEST_F(LeaderAcrossNodes, LateLeaderIsReportedOnEveryRank) {
  const std::string skip = make_two_nodes_of_two();
  if (!skip.empty()) GTEST_SKIP() << skip;
  const auto t0 = std::chrono::steady_clock::now();
  if (me == 2) std::this_thread::sleep_for(std::chrono::seconds(7));  // node 0's leader gives up at 4 s
  comm->barrier(s0);
  EXPECT_TRUE(finishes(s0, 40)) << "rank " << me << ": barrier(stream) with a late leader did not end";
  const std::vector<std::vector<std::string>> needles = {
      {"leader rank(s) 2 did not come"},
      {"waited for rank 0 of this node"},
      {"leader rank(s) 0 did not come", "ncclAllReduce"},
      {"waited for rank 2"}};
  try {
    comm->quiet(s0);
    ADD_FAILURE() << "rank " << me << " passed a barrier(stream) across nodes whose leaders' all-reduce failed, unaware";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Timeout) << e.what();
    const std::string m = e.what();
    EXPECT_TRUE(std::any_of(needles[me].begin(), needles[me].end(),
                            [&](const std::string& x) { return m.find(x) != std::string::npos; }))
        << "rank " << me << ": " << m;
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 40.0);
  MPI_Barrier(MPI_COMM_WORLD);
  comm.reset();  // bounded, the leaders' communicator gone
}

// The same layout; node 0's leader (rank 0) cannot enqueue its all-reduce among the leaders
// at the second barrier (MESHMEM_FAULT leaders.enqueue:fail: ncclAllReduce fails, as after
// NCCL saw a remote failure). Its barrier call raises, yet its stream runs the node kernel
// after the all-reduce (the node kernels stay paired), which lets rank 1 through at once:
// rank 1 must learn that its barrier did not wait for node 1 (it used to pass unaware). Node
// 1's leader waits for rank 0 and names it; rank 3 names its leader. At the barrier after
// it the leaders raise at once and the others report their leader at once. Run by
// gpu.leaders_across_nodes.
TEST_F(LeaderAcrossNodes, FailedLeaderIsReportedOnItsNode) {
  ScopedEnv fault("MESHMEM_FAULT", "0:leaders.enqueue:fail:hit=2");  // the first all-reduce works
  const std::string skip = make_two_nodes_of_two();
  if (!skip.empty()) GTEST_SKIP() << skip;
  if (me == 0) {
    try {
      comm->barrier(s0);
      ADD_FAILURE() << "the barrier whose all-reduce could not be enqueued returned";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("injected by MESHMEM_FAULT"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(finishes(s0, 40));
  } else {
    comm->barrier(s0);
    EXPECT_TRUE(finishes(s0, 40)) << "rank " << me << ": barrier(stream) did not end";
    const std::vector<std::string> needles = {"", "rank 0, which leads this node, gave up its all-reduce",
                                              "leader rank(s) 0 did not come", "waited for rank 2 of this node"};
    try {
      comm->quiet(s0);
      ADD_FAILURE() << "rank " << me << " passed a barrier(stream) across nodes whose leaders' all-reduce failed, unaware";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Timeout) << e.what();
      EXPECT_NE(std::string(e.what()).find(needles[me]), std::string::npos) << "rank " << me << ": " << e.what();
    }
  }
  // The next barrier: both leaders' communicators are gone, so they raise at the call and
  // never come to their node kernels; their node's other ranks are marked, so their waits
  // end at once and the error names the leader that gave up (they used to wait one timeout
  // for that leader and name its missing flag).
  MPI_Barrier(MPI_COMM_WORLD);
  if (me == 0 || me == 2) {
    try {
      comm->barrier(s0);
      ADD_FAILURE() << "rank " << me << ": a barrier after the leaders' communicator was gone returned";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("an earlier barrier(stream) across nodes failed"), std::string::npos)
          << "rank " << me << ": " << e.what();
    }
  } else {
    comm->barrier(s0);
    EXPECT_TRUE(finishes(s0, 40)) << "rank " << me << ": the barrier after a failed leader did not end";
    const std::string leader = "rank " + std::to_string(me - 1) + ", which leads this node, gave up its all-reduce";
    try {
      comm->quiet(s0);
      ADD_FAILURE() << "rank " << me << " passed a barrier(stream) across nodes after its leader gave up, unaware";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(leader), std::string::npos) << "rank " << me << ": " << e.what();
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  comm.reset();
}

// ---- another device current, a stream of another device ----

TEST_F(RealUse, EveryCallWorksWithAnotherDeviceCurrent) {
  int count = 0;
  cudaGetDeviceCount(&count);
  if (count < 2) GTEST_SKIP() << "needs two visible GPUs";
  make_comm();
  const int other = (device + 1) % count;
  DeviceBuffer src(4096);
  auto d = pattern(seed, key(0, me, right), 4096);
  CUDA_OK(upload(src.p, d.data(), 4096));
  CUDA_OK(cudaSetDevice(other));
  auto current = [] {
    int c = -1;
    cudaGetDevice(&c);
    return c;
  };
  Window win = comm->alloc(4096 + 64);
  Signals sig = comm->alloc_signals(2);
  EXPECT_EQ(current(), other) << "alloc left another device current";
  CUDA_OK(cudaSetDevice(device));
  CUDA_OK(fill_now(win.local(), kPoison, 4096 + 64));
  CUDA_OK(cudaSetDevice(other));
  comm->barrier(s0);
  comm->put_signal(win, right, 0, src.p, 4096, sig, 0, 1, SignalOp::Set, s0);
  comm->wait_until(sig, 0, Cmp::GE, 1, s0);
  comm->barrier(s0);
  EXPECT_EQ(current(), other) << "a call left another device current";
  // A kernel on the Comm's device that writes into the right neighbour through view() (a
  // mapped one; a staged one gets the word by a put, from the other device still).
  CUDA_OK(cudaSetDevice(device));
  const std::uint64_t mark = 0x1234000000ull + me;
  DeviceBuffer mark_src(sizeof(mark));  // not src: the put_signal on s0 may still read it
  if (win.peer(right) != nullptr) {
    store_into_peer<<<1, 1, 0, s0>>>(win.view(), right, 4096, mark);
    CUDA_OK(cudaGetLastError());
  } else {
    CUDA_OK(upload(mark_src.p, &mark, sizeof(mark)));
  }
  CUDA_OK(cudaSetDevice(other));
  if (win.peer(right) == nullptr) comm->put(win, right, 4096, mark_src.p, sizeof(mark), s0);
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
  CUDA_OK(cudaSetDevice(device));
  const auto got = to_host(win.local(), 4096 + 8);
  const auto want = pattern(seed, key(0, left, me), 4096);
  EXPECT_EQ(first_difference(got.data(), want.data(), 4096), -1);
  std::uint64_t word = 0;
  std::memcpy(&word, got.data() + 4096, 8);
  EXPECT_EQ(word, 0x1234000000ull + left);
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
}

TEST_F(RealUse, StreamOfAnotherDeviceIsRejected) {
  int count = 0;
  cudaGetDeviceCount(&count);
  if (count < 2) GTEST_SKIP() << "needs two visible GPUs";
  make_comm();
  const int other = (device + 1) % count;
  Window win = comm->alloc(4096);
  DeviceBuffer src(4096);
  cudaStream_t foreign = nullptr;
  CUDA_OK(cudaSetDevice(other));
  CUDA_OK(cudaStreamCreateWithFlags(&foreign, cudaStreamNonBlocking));
  CUDA_OK(cudaSetDevice(device));
  auto expect_rejected = [&](const char* what, auto&& call) {
    try {
      call();
      ADD_FAILURE() << what << " accepted a stream of device " << other;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << e.what();
      const std::string m = e.what();
      EXPECT_NE(m.find("device " + std::to_string(other)), std::string::npos) << m;
      EXPECT_NE(m.find("device " + std::to_string(device)), std::string::npos) << m;
    }
  };
  expect_rejected("put", [&] { comm->put(win, right, 0, src.p, 4096, foreign); });
  expect_rejected("barrier(stream)", [&] { comm->barrier(foreign); });
  cudaStreamDestroy(foreign);
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
}

#ifdef MESHMEM_TEST_NEW_API
// ---- native peer atomics ----

// Without native peer atomics (forced here: every pair on the GPU machines has them), a
// signal Add into another GPU over ipc is refused before anything is enqueued: neither its
// data nor its signal lands. Set still works, Add into a rank on the same GPU is a local
// atomic, and routes whose target's thread applies the Add (staged, nccl, mpi-device) take it.
TEST_F(RealUse, SignalAddWithoutNativePeerAtomicsIsRefused) {
  ScopedEnv atomics("MESHMEM_PEER_ATOMICS", "off");
  make_comm();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  const std::vector<std::string> bus = meshmem::test::gpu_bus_ids();
  ASSERT_FALSE(bus[me].empty()) << "no PCI bus id for this rank's GPU";
  auto on_my_gpu = [&](int r) { return bus[r] == bus[me]; };
  // Only the ipc route adds into the peer's GPU itself; the others (staged, nccl, mpi-device:
  // simulated nodes) apply Add with an atomic on the target's own GPU: no peer atomics.
  auto through_a_thread = [&](int r) { return comm->transport(r, Memory::Device) != TransportKind::Ipc; };
  const bool same_gpu = on_my_gpu(right) || through_a_thread(right);     // what I send: Add accepted
  const bool left_same_gpu = on_my_gpu(left) || through_a_thread(left);  // what I receive
  constexpr std::size_t kBytes = 4096;
  Window data = comm->alloc(kBytes);
  Signals sig = comm->alloc_signals(2);
  CUDA_OK(fill_now(data.local(), kPoison, kBytes));
  comm->barrier();
  DeviceBuffer src(kBytes);
  const auto d = pattern(seed, key(1, me, right), kBytes);
  CUDA_OK(upload(src.p, d.data(), kBytes));
  bool refused = false;
  try {
    comm->put_signal(data, right, 0, src.p, kBytes, sig, 0, 5, SignalOp::Add, s0);
  } catch (const Error& e) {
    refused = true;
    EXPECT_EQ(e.code(), ErrorCode::Unsupported) << e.what();
    EXPECT_NE(std::string(e.what()).find("Add"), std::string::npos) << e.what();
  }
  try {
    comm->signal(sig, right, 1, 7, SignalOp::Add, s0);
    EXPECT_TRUE(same_gpu) << "signal Add to another GPU without native peer atomics was accepted";
  } catch (const Error& e) {
    EXPECT_FALSE(same_gpu) << "signal Add to a rank on the same GPU was refused: " << e.what();
  }
  EXPECT_EQ(refused, !same_gpu) << (same_gpu ? "refused on the same GPU" : "put_signal Add to another GPU was accepted");
  comm->signal(sig, right, 1, 3, SignalOp::Set, s0);  // Set always works: it lands after the Add, if any
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
  EXPECT_EQ(sig.read(1), 3u);
  const auto got = to_host(data.local(), kBytes);
  if (left_same_gpu) {
    const auto want = pattern(seed, key(1, left, me), kBytes);
    EXPECT_EQ(first_difference(got.data(), want.data(), kBytes), -1) << "the accepted put_signal's data";
    EXPECT_EQ(sig.read(0), 5u);
  } else {
    const std::vector<unsigned char> poison(kBytes, static_cast<unsigned char>(kPoison));
    EXPECT_EQ(first_difference(got.data(), poison.data(), kBytes), -1) << "a refused put_signal wrote data";
    EXPECT_EQ(sig.read(0), 0u) << "a refused put_signal's signal landed";
  }
}

// wait_until_all on a stream and in a graph: every word must have its value.
TEST_F(GraphReplay, WaitUntilAllCoversEveryWord) {
  make_comm();
  constexpr int kWords = 5;
  Signals sig = comm->alloc_signals(static_cast<std::size_t>(kWords) * n);
  DeviceBuffer delay(sizeof(std::uint64_t));
  CUDA_OK(fill_now(delay.p, 0, delay.bytes));
  comm->barrier(s0);
  CUDA_OK(cudaStreamSynchronize(s0));
  // Each rank sets its kWords words at every rank, the late rank after a delay; every
  // rank waits for all words with one call, then resets them.
  CUDA_OK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeGlobal));
  spin_kernel<<<1, 1, 0, s0>>>(static_cast<const std::uint64_t*>(delay.p), 0);
  for (int t = 0; t < n; ++t)
    for (int w = 0; w < kWords; ++w) comm->signal(sig, t, static_cast<std::size_t>(me) * kWords + w, 1, SignalOp::Add, s0);
  comm->wait_until_all(sig, 0, static_cast<std::size_t>(kWords) * n, Cmp::EQ, 1, s0);
  for (int w = 0; w < kWords * n; ++w) comm->signal(sig, me, static_cast<std::size_t>(w), 0, SignalOp::Set, s0);
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(s0, &graph));
  cudaGraphExec_t exec = instantiate(graph);
  ASSERT_NE(exec, nullptr);
  for (int rep = 0; rep < 50; ++rep) {
    ASSERT_TRUE(replay(exec, delay, rep));
    for (int w = 0; w < kWords * n; ++w) ASSERT_EQ(sig.read(static_cast<std::size_t>(w)), 0u) << "replay " << rep;
    MPI_Barrier(MPI_COMM_WORLD);
  }
  cudaGraphExecDestroy(exec);
}
#endif

}  // namespace
