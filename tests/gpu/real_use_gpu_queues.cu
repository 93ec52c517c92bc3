// RealUse, GPU queues: streams that wait while meshmem's own streams move the data, a kernel
// first launched during a transfer, and a transfer held behind the caller's wait on the one
// GPU queue of a process (gpu.staged_held_lane).
#include "real_use.hpp"

namespace real_use {
namespace {

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


}  // namespace
}  // namespace real_use
