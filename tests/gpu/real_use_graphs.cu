// RealUse, CUDA graphs: captured puts, barriers, halo exchanges and signal waits replayed with a
// late rank in every replay, two instantiations replayed at once, replays after the Comm is
// gone, the limit of hierarchical barriers in one graph.
#include "real_use.hpp"

namespace real_use {

// No anonymous namespace here: GraphReplay's members are defined in real_use.

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

// put_signal + wait_until in a graph: the values are those of the capture on every replay,
// so the receiver resets its word after the wait (docs/semantics.md "CUDA graphs").
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
// wait for the host nodes (from about 32 in a chain, studies/queue_lab chain) while holding a
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

}  // namespace real_use
