// RealUse, several streams: barriers and halo exchanges on two alternating streams (every
// barrier variant), and meshmem's early-launched kernels ordered after the previous kernel.
#include "real_use.hpp"

namespace real_use {
namespace {

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
  ScopedEnv fused("MESHMEM_IPC_FUSED_SIGNAL_MAX", "8388608");  // both copies on the SMs
  ScopedEnv sm("MESHMEM_IPC_SM_COPY_MAX", "8388608");
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


}  // namespace
}  // namespace real_use
