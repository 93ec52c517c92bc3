// The staged transport, forced (MESHMEM_TRANSPORTS=staged,shm,mpi) where peer access works:
// put / put_signal / get / signal Add through the node's pinned staging pool, 1 B .. 1 GiB at
// unaligned offsets, fresh random data, poisoned destinations, every byte checked; a put
// returns before its data moved (several streams: staged_streams.cu); captured graphs replay
// with fresh data; window and Comm cycles come back to their baseline.
// Skipped without a GPU.
#include <cuda_runtime_api.h>
#include <dirent.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>

#include <meshmem/meshmem.hpp>

#include "gpu_test.hpp"
#include "mpi_test.hpp"
#include "staged_test.hpp"

using namespace meshmem;
using meshmem::test::DeviceBuffer;
using meshmem::test::first_difference;
using meshmem::test::kPoison;
using meshmem::test::pattern;

namespace {

// Each size: every rank put_signals fresh data at an unaligned offset into its right
// neighbour's poisoned window; the neighbour's stream waits for the signal and checks every
// byte (and that nothing around the range was touched); then every rank gets that range
// back from its right neighbour into a poisoned buffer.
TEST_F(Staged, PutSignalAndGetEverySize) {
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  EXPECT_EQ(comm->transport(right, Memory::Device), TransportKind::Staged);
  const std::size_t sizes[] = {1, 7, 4096 + 3, (4u << 20) + 5, (40u << 20) + 13, (std::size_t(1) << 30) + 3};
  const std::size_t offset = 77;
  const std::size_t largest = sizes[sizeof(sizes) / sizeof(sizes[0]) - 1];
  const std::size_t guard = 64;
  Window win = comm->alloc(offset + largest + guard);
  Signals sig = comm->alloc_signals(1);
  DeviceBuffer src(largest), back(largest);
  std::uint64_t round = 0;
  for (std::size_t size : sizes) {
    ++round;
    const auto mine = pattern(seed, key(size, me, 0), size);
    CUDA_OK(cudaMemcpy(src.p, mine.data(), size, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(win.local(), kPoison, offset + size + guard));
    CUDA_OK(cudaMemset(back.p, kPoison, size));
    CUDA_OK(cudaDeviceSynchronize());
    comm->barrier();
    comm->put_signal(win, right, offset, src.p, size, sig, 0, round, SignalOp::Set, s);
    comm->wait_until(sig, 0, Cmp::GE, round, s);
    CUDA_OK(cudaStreamSynchronize(s));
    std::vector<unsigned char> got(offset + size + guard);
    CUDA_OK(cudaMemcpy(got.data(), win.local(), got.size(), cudaMemcpyDeviceToHost));
    const auto want = pattern(seed, key(size, left, 0), size);
    EXPECT_EQ(first_difference(got.data() + offset, want.data(), size), -1) << size << " bytes from rank " << left;
    std::vector<unsigned char> poison(offset, kPoison);
    EXPECT_EQ(first_difference(got.data(), poison.data(), offset), -1) << "bytes before the put's range, " << size;
    EXPECT_EQ(first_difference(got.data() + offset + size, poison.data(), guard), -1) << "bytes after the put's range, " << size;
    comm->barrier();
    // Right's window holds what this rank put there.
    comm->get(back.p, win, right, offset, size, s);
    CUDA_OK(cudaStreamSynchronize(s));
    std::vector<unsigned char> fetched(size);
    CUDA_OK(cudaMemcpy(fetched.data(), back.p, size, cudaMemcpyDeviceToHost));
    EXPECT_EQ(first_difference(fetched.data(), mine.data(), size), -1) << "get of " << size << " bytes from rank " << right;
    comm->barrier();  // the left neighbour's get from this window is done before the next round poisons it
  }
  comm->barrier();
}

// Several put_signals back to back on one stream, each overwriting the same range with new
// data: the signal of each lands after its own data, never ahead (the receiver checks the
// data of every signal value it sees at once, on the GPU: a kernel compares and counts).
// Round `round`'s bytes from rank `from` (0 where the sender does not matter): the receiver
// checks them on the GPU once their signal is seen, counting the wrong ones.
__global__ void check_round(const unsigned char* data, std::size_t bytes, std::uint64_t round, int from, unsigned* bad) {
  // The caller's stream waited for the signal >= round: the data is that round's or a later one's
  // only if the sender ran ahead, which it cannot (it waits for our ack).
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < bytes; i += gridDim.x * blockDim.x)
    if (data[i] != static_cast<unsigned char>(round * 13 + i * 7 + from * 101)) atomicAdd(bad, 1u);
}
__global__ void fill_round(unsigned char* data, std::size_t bytes, std::uint64_t round, int from) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < bytes; i += gridDim.x * blockDim.x)
    data[i] = static_cast<unsigned char>(round * 13 + i * 7 + from * 101);
}

TEST_F(Staged, SignalNeverAheadOfItsData) {
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  constexpr std::size_t kBytes = (9u << 20) + 11;  // three chunks with the default 4 MiB
  constexpr int kRounds = 30;
  Window win = comm->alloc(kBytes);
  Signals sig = comm->alloc_signals(2);  // 0: data from the left, 1: ack from the right
  DeviceBuffer src(kBytes), bad_buf(sizeof(unsigned));
  ASSERT_NE(src.p, nullptr);  // its first real use is a kernel's: a null one would fault there
  auto* const bad = static_cast<unsigned*>(bad_buf.p);
  CUDA_OK(cudaMemset(bad, 0, sizeof(unsigned)));
  // Load this test's kernels before any wait is in flight: under CUDA's lazy loading a first
  // launch may synchronise the context behind a polling wait (see kernels.hpp, preload_kernels).
  fill_round<<<1, 32, 0, s>>>(static_cast<unsigned char*>(src.p), 0, 0, 0);
  check_round<<<1, 32, 0, s>>>(static_cast<const unsigned char*>(win.local()), 0, 0, 0, bad);
  CUDA_OK(cudaDeviceSynchronize());
  comm->barrier();
  for (std::uint64_t r = 1; r <= kRounds; ++r) {
    if (r > 1) comm->wait_until(sig, 1, Cmp::GE, r - 1, s);  // right checked the last round
    fill_round<<<64, 256, 0, s>>>(static_cast<unsigned char*>(src.p), kBytes, r, 0);
    comm->put_signal(win, right, 0, src.p, kBytes, sig, 0, r, SignalOp::Set, s);
    comm->wait_until(sig, 0, Cmp::GE, r, s);
    check_round<<<64, 256, 0, s>>>(static_cast<const unsigned char*>(win.local()), kBytes, r, 0, bad);
    comm->signal(sig, left, 1, r, SignalOp::Set, s);
  }
  CUDA_OK(cudaStreamSynchronize(s));
  unsigned h = 0;
  CUDA_OK(cudaMemcpy(&h, bad, sizeof(h), cudaMemcpyDeviceToHost));
  EXPECT_EQ(h, 0u) << "bytes seen before their data landed, over " << kRounds << " rounds";
  comm->barrier();
}

// Both neighbours put_signal into this rank in every round at about the same time, so its
// agent often takes both descriptors in one look at its channels and enqueues their copies and
// stream writes together (one copy batch, one batch of writes): each signal still lands after
// its own data. Sizes cycle through one small chunk, one large chunk and two chunks (a chunk
// that more follow has its consumed count written after the copy by the host); the large last
// chunks take long enough to copy that a signal enqueued ahead of them would be seen with a
// GPU per rank (where two ranks time-share one GPU, a build that wrote the batch's signals
// before its copies still passed: the copy ends while the other rank holds the GPU). The
// receiver's stream waits for both signals of the round and a kernel checks both regions;
// with two ranks both puts go to the one peer (two descriptors of one writer in a look).

TEST_F(Staged, SignalsFromBothNeighboursAtOnceNeverAheadOfTheirData) {
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  // One chunk, one chunk, two chunks with the default 4 MiB.
  const std::size_t sizes[] = {(40u << 10) + 3, (3u << 20) + 5, (7u << 20) + 4099};
  const std::size_t largest = sizes[2];
  constexpr int kRounds = 40;
  Window win = comm->alloc(2 * largest);  // [0]: from the left, [1]: from the right
  Signals sig = comm->alloc_signals(4);   // 0 / 1: data from the left / right; 2 / 3: acks from the right / left
  DeviceBuffer src_buf(largest), bad_buf(sizeof(unsigned));
  ASSERT_NE(src_buf.p, nullptr);  // its first real use is a kernel's: a null one would fault there
  auto* const src = static_cast<unsigned char*>(src_buf.p);
  auto* const bad = static_cast<unsigned*>(bad_buf.p);
  CUDA_OK(cudaMemset(bad, 0, sizeof(unsigned)));
  auto* region = static_cast<unsigned char*>(win.local());
  CUDA_OK(cudaMemset(region, kPoison, 2 * largest));
  fill_round<<<1, 32, 0, s>>>(src, 0, 0, 0);  // loaded before any wait is in flight (see SignalNeverAheadOfItsData)
  check_round<<<1, 32, 0, s>>>(region, 0, 0, 0, bad);
  CUDA_OK(cudaDeviceSynchronize());
  comm->barrier();
  for (std::uint64_t r = 1; r <= kRounds; ++r) {
    const std::size_t bytes = sizes[r % 3];
    if (r > 1) {  // both neighbours checked the last round
      comm->wait_until(sig, 2, Cmp::GE, r - 1, s);
      comm->wait_until(sig, 3, Cmp::GE, r - 1, s);
    }
    fill_round<<<64, 256, 0, s>>>(src, bytes, r, me);
    comm->put_signal(win, right, 0, src, bytes, sig, 0, r, SignalOp::Set, s);
    comm->put_signal(win, left, largest, src, bytes, sig, 1, r, SignalOp::Set, s);
    comm->wait_until(sig, 0, Cmp::GE, r, s);
    comm->wait_until(sig, 1, Cmp::GE, r, s);
    check_round<<<64, 256, 0, s>>>(region, bytes, r, left, bad);
    check_round<<<64, 256, 0, s>>>(region + largest, bytes, r, right, bad);
    comm->signal(sig, left, 2, r, SignalOp::Set, s);
    comm->signal(sig, right, 3, r, SignalOp::Set, s);
  }
  CUDA_OK(cudaStreamSynchronize(s));
  unsigned h = 0;
  CUDA_OK(cudaMemcpy(&h, bad, sizeof(h), cudaMemcpyDeviceToHost));
  EXPECT_EQ(h, 0u) << "bytes seen before their data landed, over " << kRounds << " rounds from ranks " << left << " and "
                   << right;
  comm->barrier();
}

// The copies of incoming chunks fail on the target (MESHMEM_FAULT 1:staged.copy_in:fail, the
// first and second time rank 1's agent enqueues such copies): rank 0's put_signal with Set,
// then one with Add, are refused there. Nothing lands in the poisoned window, neither signal
// is raised, rank 0's stream still moves on and its next quiet names rank 1 and the transfer;
// a third put_signal lands whole with its signal.
TEST_F(Staged, ChunksWhoseCopyFailsAreRefusedWithoutTheirSignal) {
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  // The fault point is the channel reader's (the target's agent copying chunks in). With one
  // agent (MESHMEM_STAGED_CHANNELS=when-hidden; the suite's entries never hide the peer's GPU
  // there) the initiator's agent makes both copies and rank 1's copies nothing.
  if (const char* channels = std::getenv("MESHMEM_STAGED_CHANNELS");
      channels != nullptr && std::string(channels) == "when-hidden")
    GTEST_SKIP() << "one agent carries the transfers (MESHMEM_STAGED_CHANNELS=when-hidden): no channel reader copies "
                    "in, where this case injects its fault";
  comm.reset();
  comm = std::make_unique<Comm>(MPI_COMM_WORLD, staged_options("MESHMEM_FAULT", "1:staged.copy_in:fail,1:staged.copy_in:fail:hit=2"));
  constexpr std::size_t kBytes = (1u << 20) + 3, kAt = 5, kSpan = kBytes + 64;
  Window win = comm->alloc(kSpan);
  Signals sig = comm->alloc_signals(2);
  DeviceBuffer src(kBytes);
  const auto mine = pattern(seed, key(kBytes, me, 7), kBytes);
  CUDA_OK(cudaMemcpy(src.p, mine.data(), kBytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(win.local(), kPoison, kSpan));
  CUDA_OK(cudaDeviceSynchronize());
  comm->barrier();
  auto refused = [&](const char* which) {
    CUDA_OK(cudaStreamSynchronize(s));  // rank 1 still writes the done word: the stream moves on
    std::string error;
    try {
      comm->quiet(s);
    } catch (const Error& e) {
      error = e.what();
    }
    EXPECT_NE(error.find("rank 1 could not carry out 1 staged transfer(s)"), std::string::npos)
        << which << ": " << (error.empty() ? std::string("no error") : error);
  };
  if (me == 0) {
    comm->put_signal(win, 1, kAt, src.p, kBytes, sig, 0, 7, SignalOp::Set, s);
    refused("put_signal Set");
    comm->put_signal(win, 1, kAt, src.p, kBytes, sig, 1, 1, SignalOp::Add, s);
    refused("put_signal Add");
  }
  comm->barrier();
  std::vector<unsigned char> got(kSpan), want(kSpan, kPoison);
  if (me == 1) {
    EXPECT_EQ(sig.read(0), 0u) << "a refused put_signal's Set landed";
    EXPECT_EQ(sig.read(1), 0u) << "a refused put_signal's Add landed";
    CUDA_OK(cudaMemcpy(got.data(), win.local(), kSpan, cudaMemcpyDeviceToHost));
    EXPECT_EQ(first_difference(got.data(), want.data(), kSpan), -1) << "a refused transfer wrote into the window";
  }
  comm->barrier();
  if (me == 0) {
    comm->put_signal(win, 1, kAt, src.p, kBytes, sig, 0, 9, SignalOp::Set, s);
    comm->quiet(s);
    CUDA_OK(cudaStreamSynchronize(s));
  }
  if (me == 1) {
    comm->wait_until(sig, 0, Cmp::GE, 9, s);
    CUDA_OK(cudaStreamSynchronize(s));
    CUDA_OK(cudaMemcpy(got.data(), win.local(), kSpan, cudaMemcpyDeviceToHost));
    const auto sent = pattern(seed, key(kBytes, 0, 7), kBytes);
    std::memcpy(want.data() + kAt, sent.data(), kBytes);
    EXPECT_EQ(first_difference(got.data(), want.data(), kSpan), -1) << "the put after the refused ones";
  }
  comm->barrier();
}

TEST_F(Staged, SignalAddFromEveryRankCountsEveryUpdate) {
  Signals sig = comm->alloc_signals(1);
  constexpr int kAdds = 50;
  comm->barrier();
  for (int i = 0; i < kAdds; ++i)
    for (int t = 0; t < n; ++t) comm->signal(sig, t, 0, 1, SignalOp::Add, s);
  CUDA_OK(cudaStreamSynchronize(s));
  comm->barrier();
  EXPECT_EQ(sig.read(0), static_cast<std::uint64_t>(kAdds) * n);
  comm->barrier();
}

// The host returns from a 1 GiB put long before the data moved (the agent enqueues the
// chunks); the stream is still busy then. Timed with a wide margin (the issue's target, 20 us,
// is measured by the benchmark).
TEST_F(Staged, PutReturnsBeforeItsDataMoved) {
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  const std::size_t bytes = std::size_t(1) << 30;
  Window win = comm->alloc(bytes);
  DeviceBuffer src(bytes);
  CUDA_OK(cudaMemset(src.p, 1, bytes));
  CUDA_OK(cudaDeviceSynchronize());
  comm->put(win, right, 0, src.p, 4096, s);  // warm-up: events, lanes
  CUDA_OK(cudaStreamSynchronize(s));
  comm->barrier();
  const auto t0 = std::chrono::steady_clock::now();
  comm->put(win, right, 0, src.p, bytes, s);
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  const cudaError_t busy = cudaStreamQuery(s);
  EXPECT_LT(us, 2000.0) << "a staged put of 1 GiB held the host";
  EXPECT_EQ(busy, cudaErrorNotReady) << "the stream had finished the 1 GiB put when the call returned";
  CUDA_OK(cudaStreamSynchronize(s));
  comm->barrier();
}

// MESHMEM_STAGED_COMPLETION=source: a put's stream goes on once its source is in the staging
// pool; quiet(stream), barrier(stream), a get from the same rank and the host barrier wait for
// its landing.
class StagedSourceCompletion : public Staged {
 protected:
  void SetUp() override {
    Staged::SetUp();
    if (IsSkipped()) return;
    comm.reset();
    comm = std::make_unique<Comm>(MPI_COMM_WORLD, options());
  }
  // Through the channel (source completion's route) also where the environment picks the
  // one-agent path.
  virtual Options options() {
    Options o = staged_options("MESHMEM_STAGED_COMPLETION", "source");
    o.set("MESHMEM_STAGED_CHANNELS", "always");
    return o;
  }
};

__global__ void scribble(unsigned char* p, std::size_t n, unsigned char v) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = v;
}

// The source may be reused once the put's stream passed it: a kernel overwrites it right
// after the put on the same stream, then quiet(stream); the target holds the put's bytes,
// not the overwrite (every size: one chunk, a remainder under 32 KiB, several chunks).
TEST_F(StagedSourceCompletion, SourceReusedOnceTheStreamPassedThePutAndQuietLandsIt) {
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  const std::size_t sizes[] = {5, 4096 + 3, (4u << 20) + 5, (40u << 20) + 13};
  const std::size_t offset = 77, guard = 64, largest = sizes[3];
  Window win = comm->alloc(offset + largest + guard);
  DeviceBuffer src(largest);
  for (std::size_t size : sizes) {
    const auto mine = pattern(seed, key(size, me, 20), size);
    CUDA_OK(cudaMemcpy(src.p, mine.data(), size, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(win.local(), kPoison, offset + size + guard));
    CUDA_OK(cudaDeviceSynchronize());
    comm->barrier();
    comm->put(win, right, offset, src.p, size, s);
    scribble<<<64, 256, 0, s>>>(static_cast<unsigned char*>(src.p), size, 0x5A);
    CUDA_OK(cudaGetLastError());
    comm->quiet(s);
    CUDA_OK(cudaStreamSynchronize(s));
    comm->barrier();
    std::vector<unsigned char> got(offset + size + guard);
    CUDA_OK(cudaMemcpy(got.data(), win.local(), got.size(), cudaMemcpyDeviceToHost));
    const auto want = pattern(seed, key(size, left, 20), size);
    EXPECT_EQ(first_difference(got.data() + offset, want.data(), size), -1) << size << " bytes from rank " << left;
    const std::vector<unsigned char> poison(offset, kPoison);
    EXPECT_EQ(first_difference(got.data(), poison.data(), offset), -1) << "bytes before the range, " << size;
    EXPECT_EQ(first_difference(got.data() + offset + size, poison.data(), guard), -1) << "bytes after the range, " << size;
    comm->barrier();
  }
}

// A get right after a put to the same rank on the same stream reads the put's bytes (the get
// waits for the put's landing), and barrier(stream) lands the stream's puts before it passes.
TEST_F(StagedSourceCompletion, AGetAfterAPutAndABarrierOnTheStreamSeeTheLandedBytes) {
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  const std::size_t size = (40u << 20) + 13, offset = 5;
  Window win = comm->alloc(offset + size);
  DeviceBuffer src(size), back(size);
  for (int round = 0; round < 3; ++round) {
    const auto mine = pattern(seed, key(size, me, 30 + round), size);
    CUDA_OK(cudaMemcpy(src.p, mine.data(), size, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(back.p, kPoison, size));
    CUDA_OK(cudaMemset(win.local(), kPoison, offset + size));
    CUDA_OK(cudaDeviceSynchronize());
    comm->barrier();
    comm->put(win, right, offset, src.p, size, s);
    comm->get(back.p, win, right, offset, size, s);
    CUDA_OK(cudaStreamSynchronize(s));
    std::vector<unsigned char> fetched(size);
    CUDA_OK(cudaMemcpy(fetched.data(), back.p, size, cudaMemcpyDeviceToHost));
    EXPECT_EQ(first_difference(fetched.data(), mine.data(), size), -1) << "get after put, round " << round;
    comm->barrier();
    // Again, now landed by barrier(stream) alone: the left neighbour's bytes are here once this
    // rank's barrier passed.
    CUDA_OK(cudaMemset(win.local(), kPoison, offset + size));
    CUDA_OK(cudaDeviceSynchronize());
    comm->barrier();
    comm->put(win, right, offset, src.p, size, s);
    comm->barrier(s);
    CUDA_OK(cudaStreamSynchronize(s));
    std::vector<unsigned char> got(size);
    CUDA_OK(cudaMemcpy(got.data(), static_cast<char*>(win.local()) + offset, size, cudaMemcpyDeviceToHost));
    const auto want = pattern(seed, key(size, left, 30 + round), size);
    EXPECT_EQ(first_difference(got.data(), want.data(), size), -1) << "after barrier(stream), round " << round;
    comm->barrier();
  }
}

// With rank 1's agent stopped for 3 s as it takes rank 0's put: the put's stream goes on at
// once (its source is in the pool), quiet(stream) waits until rank 1 landed it, and the host
// barrier (rank 0's puts land first) lets rank 1 see the bytes.
class StagedSourceCompletionStalledReader : public StagedSourceCompletion {
 protected:
  Options options() override {
    Options o = StagedSourceCompletion::options();
    o.set("MESHMEM_FAULT", "1:staged.carry:stop=3000");
    return o;
  }
};

TEST_F(StagedSourceCompletionStalledReader, TheStreamPassesBeforeTheLandingAndQuietWaitsForIt) {
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  const std::size_t size = (8u << 20) + 7;
  Window win = comm->alloc(size);
  DeviceBuffer src(size);
  const auto mine = pattern(seed, key(size, me, 40), size);
  CUDA_OK(cudaMemcpy(src.p, mine.data(), size, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(win.local(), kPoison, size));
  CUDA_OK(cudaDeviceSynchronize());
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t0 = std::chrono::steady_clock::now();
  auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  if (me == 0) {
    comm->put(win, 1, 0, src.p, size, s);
    CUDA_OK(cudaStreamSynchronize(s));
    const double passed = seconds();
    EXPECT_LT(passed, 1.5) << "the put's stream waited for the stopped reader (target completion?)";
    comm->quiet(s);
    CUDA_OK(cudaStreamSynchronize(s));
    const double landed = seconds();
    EXPECT_GT(landed, 2.0) << "quiet(stream) did not wait for the stopped reader";
    EXPECT_LT(landed, 20.0);
  }
  comm->barrier();  // rank 0's puts landed before it arrives
  if (me == 1) {
    std::vector<unsigned char> got(size);
    CUDA_OK(cudaMemcpy(got.data(), win.local(), size, cudaMemcpyDeviceToHost));
    const auto want = pattern(seed, key(size, 0, 40), size);
    EXPECT_EQ(first_difference(got.data(), want.data(), size), -1) << "rank 0's put after the barrier";
  }
  comm->barrier();
}

// A put_signal (Add) and barrier(stream) captured once into a CUDA graph (global capture
// mode, as applications capture), replayed with fresh data each time: every replay moves
// that replay's bytes and adds once more.
TEST_F(Staged, CapturedPutSignalReplaysWithFreshData) {
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  constexpr std::size_t kBytes = (9u << 20) + 11, kOffset = 13;
  constexpr int kReplays = 6;
  Window win = comm->alloc(kOffset + kBytes);
  Signals sig = comm->alloc_signals(1);
  DeviceBuffer src(kBytes);
  ASSERT_NE(src.p, nullptr);  // captured before its first CUDA call
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  comm->put_signal(win, right, kOffset, src.p, kBytes, sig, 0, 1, SignalOp::Add, s);
  comm->barrier(s);
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphDestroy(graph));  // the exec keeps what the replays need
  for (int r = 1; r <= kReplays; ++r) {
    const auto mine = pattern(seed, key(kBytes, me, 10 + r), kBytes);
    CUDA_OK(cudaMemcpy(src.p, mine.data(), kBytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(win.local(), kPoison, kOffset + kBytes));
    CUDA_OK(cudaDeviceSynchronize());
    comm->barrier();
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    std::vector<unsigned char> got(kOffset + kBytes);
    CUDA_OK(cudaMemcpy(got.data(), win.local(), got.size(), cudaMemcpyDeviceToHost));
    const auto want = pattern(seed, key(kBytes, left, 10 + r), kBytes);
    EXPECT_EQ(first_difference(got.data() + kOffset, want.data(), kBytes), -1) << "replay " << r;
    const std::vector<unsigned char> poison(kOffset, kPoison);
    EXPECT_EQ(first_difference(got.data(), poison.data(), kOffset), -1) << "bytes before the range, replay " << r;
    EXPECT_EQ(sig.read(0), static_cast<std::uint64_t>(r)) << "signal Adds after replay " << r;
    comm->barrier();
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  comm->barrier();
}

// A graph of many captured staged puts in a chain on one stream (each after the previous
// one's end). A host node per transfer made cudaGraphLaunch wait for the host nodes (from
// about 32 in a chain, studies/queue_lab chain) while holding a lock that the agent's copies
// wait for: every replay stalled until MESHMEM_TIMEOUT. The launch must return at once, and
// every replay deliver fresh data and every signal.
TEST_F(Staged, AGraphOfManyChainedTransfersLaunchesAtOnceAndReplays) {
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  constexpr std::size_t kPieces = 96, kPiece = 4099, kOffset = 13, kBytes = kPieces * kPiece;
  constexpr int kReplays = 4;
  Window win = comm->alloc(kOffset + kBytes);
  Signals sig = comm->alloc_signals(1);
  DeviceBuffer src(kBytes);
  ASSERT_NE(src.p, nullptr);  // captured before its first CUDA call
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (std::size_t i = 0; i < kPieces; ++i)
    comm->put_signal(win, right, kOffset + i * kPiece, src.c() + i * kPiece, kPiece, sig, 0, 1, SignalOp::Add, s);
  comm->barrier(s);
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphDestroy(graph));
  for (int r = 1; r <= kReplays; ++r) {
    const auto mine = pattern(seed, key(kBytes, me, 40 + r), kBytes);
    CUDA_OK(cudaMemcpy(src.p, mine.data(), kBytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(win.local(), kPoison, kOffset + kBytes));
    CUDA_OK(cudaDeviceSynchronize());
    comm->barrier();
    const auto t0 = std::chrono::steady_clock::now();
    CUDA_OK(cudaGraphLaunch(exec, s));
    const double launch_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // Generous: a launch of this graph takes about a millisecond; the stall lasted MESHMEM_TIMEOUT.
    EXPECT_LT(launch_s, 2.0) << "cudaGraphLaunch of " << kPieces << " chained staged puts, replay " << r;
    CUDA_OK(cudaStreamSynchronize(s));
    EXPECT_NO_THROW(comm->quiet(s)) << "replay " << r;
    std::vector<unsigned char> got(kOffset + kBytes);
    CUDA_OK(cudaMemcpy(got.data(), win.local(), got.size(), cudaMemcpyDeviceToHost));
    const auto want = pattern(seed, key(kBytes, left, 40 + r), kBytes);
    EXPECT_EQ(first_difference(got.data() + kOffset, want.data(), kBytes), -1) << "replay " << r;
    const std::vector<unsigned char> poison(kOffset, kPoison);
    EXPECT_EQ(first_difference(got.data(), poison.data(), kOffset), -1) << "bytes before the range, replay " << r;
    EXPECT_EQ(sig.read(0), static_cast<std::uint64_t>(r) * kPieces) << "signal Adds after replay " << r;
    comm->barrier();
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  comm->barrier();
}

// HaloExchange::complete() (halos written by kernels) is refused on every rank when some
// pair of the exchange is staged, including ranks with no staged neighbour of their own
// (before, only the senders refused and their neighbours' waits ran into the timeout); the
// exchange stays usable: exchange() then moves every region.
TEST_F(Staged, HaloCompleteIsRefusedOnEveryRankWhereSomePairIsStaged) {
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  constexpr std::size_t kBytes = 4096 + 7;
  Window win = comm->alloc(2 * kBytes);
  std::vector<HaloRegion> sends;
  if (me < 2) sends.push_back(HaloRegion{1 - me, 0, kBytes, kBytes, 1, 0, 0});  // ranks 0 and 1 only
  HaloExchange halo = comm->make_halo(win, sends);
  const auto mine = pattern(seed, key(kBytes, me, 50), kBytes);
  CUDA_OK(cudaMemcpy(win.local(), mine.data(), kBytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(static_cast<char*>(win.local()) + kBytes, kPoison, kBytes));
  CUDA_OK(cudaDeviceSynchronize());
  comm->barrier();
  try {
    halo.complete(s);
    ADD_FAILURE() << "complete() was accepted on rank " << me;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Unsupported) << e.what();
    EXPECT_NE(std::string(e.what()).find("exchange()"), std::string::npos) << e.what();
  }
  EXPECT_EQ(halo.exchanges(), 0u);
  halo.exchange(s);
  CUDA_OK(cudaStreamSynchronize(s));
  comm->barrier();
  if (me < 2) {
    std::vector<unsigned char> got(kBytes);
    CUDA_OK(cudaMemcpy(got.data(), static_cast<char*>(win.local()) + kBytes, kBytes, cudaMemcpyDeviceToHost));
    const auto want = pattern(seed, key(kBytes, 1 - me, 50), kBytes);
    EXPECT_EQ(first_difference(got.data(), want.data(), kBytes), -1) << "the halo from rank " << 1 - me;
  }
  comm->barrier();
}

int open_fds() {
  int count = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d) != nullptr) ++count;
    closedir(d);
  }
  return count;
}

// 1,000 window alloc/free cycles (each attaches the peers' parts for the staged route; every
// tenth moves data) and 20 Comm lifetimes (each makes and drops the node's pool): open
// descriptors and free GPU memory come back to where they were.
// Every rank puts to both neighbours at once and then gets from one, with chunks of 16 KiB:
// thousands of chunks per transfer in both directions of every pair. Through the channel
// (the default, MESHMEM_STAGED_CHANNELS=always, or isolation) the agents carry each other's chunks while
// they wait for their own slots; nothing may stall, and every byte arrives.
TEST_F(Staged, BothWaysWithThousandsOfChunksEachNothingStalls) {
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  comm.reset();
  Comm c(MPI_COMM_WORLD, staged_options("MESHMEM_STAGED_CHUNK", "16384"));
  const std::size_t bytes = (std::size_t(64) << 20) + 4099;  // 4,097 chunks
  Window win = c.alloc(2 * bytes);
  Signals sig = c.alloc_signals(2);
  cudaStream_t s2 = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  DeviceBuffer to_right(bytes), to_left(bytes), back(bytes);
  const auto mine_right = pattern(seed, key(bytes, me, 3), bytes);
  const auto mine_left = pattern(seed, key(bytes, me, 4), bytes);
  CUDA_OK(cudaMemcpy(to_right.p, mine_right.data(), bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(to_left.p, mine_left.data(), bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(win.local(), kPoison, 2 * bytes));
  CUDA_OK(cudaMemset(back.p, kPoison, bytes));
  CUDA_OK(cudaDeviceSynchronize());
  c.barrier();
  // Into the right neighbour's first half (signal 0), the left neighbour's second half (signal 1).
  c.put_signal(win, right, 0, to_right.p, bytes, sig, 0, 1, SignalOp::Set, s);
  c.put_signal(win, left, bytes, to_left.p, bytes, sig, 1, 1, SignalOp::Set, s2);
  c.wait_until(sig, 0, Cmp::GE, 1, s);
  c.wait_until(sig, 1, Cmp::GE, 1, s);
  CUDA_OK(cudaStreamSynchronize(s));
  CUDA_OK(cudaStreamSynchronize(s2));
  std::vector<unsigned char> got(2 * bytes);
  CUDA_OK(cudaMemcpy(got.data(), win.local(), got.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(first_difference(got.data(), pattern(seed, key(bytes, left, 3), bytes).data(), bytes), -1)
      << "the first half, from rank " << left;
  EXPECT_EQ(first_difference(got.data() + bytes, pattern(seed, key(bytes, right, 4), bytes).data(), bytes), -1)
      << "the second half, from rank " << right;
  c.barrier();
  // Both directions again, as gets: this rank's put to the right comes back from there.
  c.get(back.p, win, right, 0, bytes, s);
  CUDA_OK(cudaStreamSynchronize(s));
  std::vector<unsigned char> fetched(bytes);
  CUDA_OK(cudaMemcpy(fetched.data(), back.p, bytes, cudaMemcpyDeviceToHost));
  EXPECT_EQ(first_difference(fetched.data(), mine_right.data(), bytes), -1) << "get from rank " << right;
  c.barrier();
  cudaStreamDestroy(s2);
}

// Peer access that the driver grants but that drops or corrupts writes: the write-and-verify
// check at Comm creation (MESHMEM_IPC_PEER_VERIFY_CORRUPT=on makes every rank's check writes wrong,
// as such a path would) leaves ipc out for every peer, says why, and staged carries the data.
// With the check on, peers are reached by ipc wherever the mapping works (one GPU per rank
// with peer access: the GPU machines).
TEST_F(Staged, PeerAccessThatFailsWriteAndVerifyGoesThroughStaged) {
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  comm.reset();
  {
    Options o = Options::from_environment();
    o.set("MESHMEM_TRANSPORTS", "ipc,staged,shm,mpi");
    o.set("MESHMEM_IPC_PEER_VERIFY", "on");
    Comm c(MPI_COMM_WORLD, o);
    EXPECT_EQ(c.transport(right, Memory::Device), TransportKind::Ipc) << "with the check passing";
  }
  Options o = Options::from_environment();
  o.set("MESHMEM_TRANSPORTS", "ipc,staged,shm,mpi");
  o.set("MESHMEM_IPC_PEER_VERIFY_CORRUPT", "on");
  Comm c(MPI_COMM_WORLD, o);
  ASSERT_EQ(c.transport(right, Memory::Device), TransportKind::Staged);
  const std::string why = c.skipped_reason(right, Memory::Device);
  EXPECT_NE(why.find("granted but broken"), std::string::npos) << why;
  const std::size_t bytes = (std::size_t(3) << 20) + 11;
  Window win = c.alloc(bytes);
  DeviceBuffer src(bytes);
  const auto mine = pattern(seed, key(bytes, me, 5), bytes);
  CUDA_OK(cudaMemcpy(src.p, mine.data(), bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(win.local(), kPoison, bytes));
  CUDA_OK(cudaDeviceSynchronize());
  c.barrier();
  c.put(win, right, 0, src.p, bytes, s);
  c.quiet(s);
  CUDA_OK(cudaStreamSynchronize(s));
  c.barrier();
  std::vector<unsigned char> got(bytes);
  CUDA_OK(cudaMemcpy(got.data(), win.local(), bytes, cudaMemcpyDeviceToHost));
  EXPECT_EQ(first_difference(got.data(), pattern(seed, key(bytes, left, 5), bytes).data(), bytes), -1)
      << "from rank " << left;
  c.barrier();
}

TEST_F(Staged, AllocFreeAndCommCyclesReturnToBaseline) {
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  DeviceBuffer src(1u << 20);
  CUDA_OK(cudaMemset(src.p, 3, 1u << 20));
  {  // warm-up: the first window brings lasting state (events, lanes)
    Window w = comm->alloc(1u << 20);
    comm->put(w, right, 0, src.p, 1u << 20, s);
    CUDA_OK(cudaStreamSynchronize(s));
    comm->barrier();
  }
  CUDA_OK(cudaDeviceSynchronize());
  comm->barrier();
  std::size_t free0 = 0, total = 0;
  CUDA_OK(cudaMemGetInfo(&free0, &total));
  const int fds0 = open_fds();
  for (int i = 0; i < 1000; ++i) {
    Window w = comm->alloc((1u << 20) + static_cast<std::size_t>(i % 7) * 4096);
    if (i % 10 == 0) {
      comm->put(w, right, 0, src.p, 1u << 20, s);
      CUDA_OK(cudaStreamSynchronize(s));
      comm->barrier();
    }
  }
  comm->barrier();
  CUDA_OK(cudaDeviceSynchronize());
  std::size_t free1 = 0;
  CUDA_OK(cudaMemGetInfo(&free1, &total));
  EXPECT_EQ(open_fds(), fds0) << "descriptors after 1,000 window cycles";
  EXPECT_LE(free0 - std::min(free0, free1), std::size_t(4) << 20) << "GPU memory lost over 1,000 window cycles";
  comm.reset();
  CUDA_OK(cudaDeviceSynchronize());
  // cudaMemGetInfo counts the whole GPU: where ranks share it, every rank's Comm is gone first
  // (4 ranks on 1 x H200 saw 6 MiB "lost": the other ranks' last Comm of the loop not yet freed).
  MPI_Barrier(MPI_COMM_WORLD);
  const int fds_no_comm = open_fds();
  std::size_t free_no_comm = 0;
  CUDA_OK(cudaMemGetInfo(&free_no_comm, &total));
  for (int i = 0; i < 20; ++i) {
    Comm c(MPI_COMM_WORLD, staged_options());
    Window w = c.alloc(1u << 20);
    c.put(w, (c.rank() + 1) % c.size(), 0, src.p, 1u << 20, s);
    CUDA_OK(cudaStreamSynchronize(s));
    c.barrier();
  }
  CUDA_OK(cudaDeviceSynchronize());
  MPI_Barrier(MPI_COMM_WORLD);
  std::size_t free2 = 0;
  CUDA_OK(cudaMemGetInfo(&free2, &total));
  EXPECT_EQ(open_fds(), fds_no_comm) << "descriptors after 20 Comms with a staging pool";
  EXPECT_LE(free_no_comm - std::min(free_no_comm, free2), std::size_t(4) << 20) << "GPU memory lost over 20 Comms";
}

}  // namespace
