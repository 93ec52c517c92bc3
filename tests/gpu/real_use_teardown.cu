// RealUse, teardown and late peers: Signals::read, free and ~Comm behind waits that cannot
// complete, device waits, barriers and halo exchanges whose peer never comes, proxies and
// agents that stop (the transfer ends in the timeout, nothing lands after it), and node
// leaders late or failed across simulated nodes.
#include "real_use.hpp"

namespace real_use {
namespace {

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

// (Freeing behind work still running on the GPU: real_use_free.cu.)

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
    std::optional<ScopedEnv> transports, channels, agents_only;
    if (staged) {
      transports.emplace("MESHMEM_TRANSPORTS", "staged,shm,mpi");
      channels.emplace("MESHMEM_STAGED_CHANNELS", "always");  // through rank 1's agent
      agents_only.emplace("MESHMEM_STAGED_STREAM_PATH", "off");
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

// A small staged put's stream fills its slot (MESHMEM_STAGED_STREAM_FILL) once the slot's
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
  ScopedEnv fill("MESHMEM_STAGED_STREAM_FILL", "on");
  ScopedEnv channels("MESHMEM_STAGED_CHANNELS", "always");  // through rank 1's agent
  ScopedEnv agents_only("MESHMEM_STAGED_STREAM_PATH", "off");
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
  ScopedEnv fill("MESHMEM_STAGED_STREAM_FILL", "on");
  ScopedEnv channels("MESHMEM_STAGED_CHANNELS", "always");
  ScopedEnv agents_only("MESHMEM_STAGED_STREAM_PATH", "off");
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


}  // namespace
}  // namespace real_use
