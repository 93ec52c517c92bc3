// The staged transport with several streams: a put behind a long kernel holds no other stream,
// a stream waiting for a peer holds no other stream's transfer (large, and small ones past the
// stream path's slots), an eager put behind a graph launch, many small transfers on four
// streams each in order, stream-filled and agent puts on more streams than fill slots, small
// transfers while another thread captures a graph in global mode.
// Skipped without a GPU.
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

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

__global__ void spin_for(unsigned long long ns) {
  unsigned long long start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

// The driver's own staged peer copy stalls copies on other streams; a staged put must not:
// a long kernel on stream A, then a 64 MiB staged put on A; a 64 MiB copy on stream B, issued
// after both, finishes long before the kernel does. The put's call returns at once too.
TEST_F(Staged, PutBehindALongKernelDoesNotDelayAnotherStream) {
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  constexpr std::size_t kBytes = 64u << 20;
  constexpr double kKernelMs = 400;
  Window win = comm->alloc(kBytes);
  DeviceBuffer src(kBytes), b_src(kBytes), b_dst(kBytes);
  ASSERT_NE(b_src.p, nullptr);  // first used once the timed put is in flight
  ASSERT_NE(b_dst.p, nullptr);
  const auto data = pattern(seed, key(kBytes, me, 20), kBytes);
  CUDA_OK(cudaMemcpy(src.p, data.data(), kBytes, cudaMemcpyHostToDevice));
  cudaStream_t b = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  cudaEvent_t b_done = nullptr;
  CUDA_OK(cudaEventCreate(&b_done));
  spin_for<<<1, 1, 0, b>>>(0);  // loaded before any wait is in flight
  CUDA_OK(cudaMemsetAsync(win.local(), kPoison, kBytes, b));
  CUDA_OK(cudaDeviceSynchronize());
  comm->barrier();
  const auto t0 = std::chrono::steady_clock::now();
  spin_for<<<1, 1, 0, s>>>(static_cast<unsigned long long>(kKernelMs * 1e6));
  const auto t1 = std::chrono::steady_clock::now();
  comm->put(win, right, 0, src.p, kBytes, s);
  const auto t2 = std::chrono::steady_clock::now();
  CUDA_OK(cudaMemcpyAsync(b_dst.p, b_src.p, kBytes, cudaMemcpyDeviceToDevice, b));
  CUDA_OK(cudaEventRecord(b_done, b));
  CUDA_OK(cudaEventSynchronize(b_done));
  const double b_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const double put_us = std::chrono::duration<double, std::micro>(t2 - t1).count();
  const bool a_busy = cudaStreamQuery(s) == cudaErrorNotReady;
  CUDA_OK(cudaStreamSynchronize(s));
  const double a_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[rank %d] put call %.1f us; stream B's 64 MiB copy done after %.1f ms; stream A (%.0f ms kernel + put) after %.1f ms\n",
              me, put_us, b_ms, kKernelMs, a_ms);
  EXPECT_LT(b_ms, kKernelMs / 4) << "the copy on stream B waited for stream A's kernel or put";
  EXPECT_TRUE(a_busy) << "stream A was idle when stream B's copy finished";
  EXPECT_LT(put_us, 2000.0) << "the put's call held the host";
  comm->barrier();
  std::vector<unsigned char> got(kBytes);
  CUDA_OK(cudaMemcpy(got.data(), win.local(), kBytes, cudaMemcpyDeviceToHost));
  const auto want = pattern(seed, key(kBytes, left, 20), kBytes);
  EXPECT_EQ(first_difference(got.data(), want.data(), kBytes), -1);
  comm->barrier();
  cudaEventDestroy(b_done);
  cudaStreamDestroy(b);
}

// Rank 0 first enqueues on stream B a wait for rank 1's signal and `puts` puts of `bytes` behind
// it, then on stream A a put_signal that rank 1 waits for before it sends that signal; every byte
// of A's and B's ranges checked at rank 1, and the bytes before them still poisoned.
void waiting_stream_holds_no_other(Comm& comm, int me, std::uint64_t seed, cudaStream_t s, std::size_t bytes,
                                   std::size_t puts, std::size_t offset, int kind) {
  const std::size_t total = offset + (puts + 1) * bytes;
  Window win = comm.alloc(total);
  Signals sig = comm.alloc_signals(2);  // 0: rank 1 -> rank 0, go on; 1: rank 0 -> rank 1, A's data
  DeviceBuffer a_src(bytes), b_src(puts * bytes);
  const auto a_data = pattern(seed, key(bytes, me, kind), bytes);
  const auto b_data = pattern(seed, key(bytes, me, kind + 1), puts * bytes);
  CUDA_OK(cudaMemcpy(a_src.p, a_data.data(), bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(b_src.p, b_data.data(), puts * bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(win.local(), kPoison, total));
  cudaStream_t b = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  CUDA_OK(cudaDeviceSynchronize());
  comm.barrier();
  if (me == 0) {
    comm.wait_until(sig, 0, Cmp::GE, 1, b);
    for (std::size_t i = 0; i < puts; ++i)
      comm.put(win, 1, offset + (i + 1) * bytes, static_cast<const char*>(b_src.p) + i * bytes, bytes, b);
    comm.put_signal(win, 1, offset, a_src.p, bytes, sig, 1, 1, SignalOp::Set, s);
  } else if (me == 1) {
    comm.wait_until(sig, 1, Cmp::GE, 1, s);
    comm.signal(sig, 0, 0, 1, SignalOp::Set, s);
  }
  CUDA_OK(cudaStreamSynchronize(s));
  CUDA_OK(cudaStreamSynchronize(b));
  comm.barrier();
  if (me == 1) {
    std::vector<unsigned char> got(total);
    CUDA_OK(cudaMemcpy(got.data(), win.local(), total, cudaMemcpyDeviceToHost));
    const auto want_a = pattern(seed, key(bytes, 0, kind), bytes);
    const auto want_b = pattern(seed, key(bytes, 0, kind + 1), puts * bytes);
    EXPECT_EQ(first_difference(got.data() + offset, want_a.data(), bytes), -1) << "stream A's put_signal";
    EXPECT_EQ(first_difference(got.data() + offset + bytes, want_b.data(), puts * bytes), -1) << "stream B's puts";
    const std::vector<unsigned char> poison(offset, kPoison);
    EXPECT_EQ(first_difference(got.data(), poison.data(), offset), -1) << "bytes before the range";
  }
  comm.barrier();
  cudaStreamDestroy(b);
}

// A transfer whose stream waits for a peer holds no other stream's transfer back (the agent
// starts transfers as their sources become ready, not in call order): one put on B. Enqueued in
// call order (before this was fixed) the put on B held A's put_signal: both ranks stalled until
// MESHMEM_TIMEOUT.
TEST_F(Staged, AStreamWaitingForAPeerHoldsNoOtherStreamsTransfer) {
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  waiting_stream_holds_no_other(*comm, me, seed, s, (5u << 20) + 3, 1, 11, 30);
}

// The same with small transfers and more of them on the waiting stream than there are slots
// of the stream path (MESHMEM_STAGED_STREAM_PATH, 16): B's puts, behind its wait, hold slots
// (and, between two GPUs, B's lane) until rank 1 signals; A's put_signal must not wait for any
// of them. With the agents (the path off) it is the case above at a small size.
TEST_F(Staged, AStreamWaitingForAPeerHoldsNoOtherStreamsSmallTransfers) {
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  waiting_stream_holds_no_other(*comm, me, seed, s, 4096 + 3, 20, 5, 32);
}

// An eager put issued on a stream behind a graph launch whose graph holds a staged
// put_signal: the graph's transfer is handed over only when the stream reaches it (after a
// long kernel), after the eager put was; both land. Enqueued in call order (before this was
// fixed) the eager put waited for the graph, whose transfer waited behind the eager put.
TEST_F(Staged, EagerPutBehindAGraphLaunchOnOneStream) {
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  constexpr std::size_t kBytes = (3u << 20) + 5;
  Window win = comm->alloc(2 * kBytes);
  Signals sig = comm->alloc_signals(1);
  DeviceBuffer g_src(kBytes), e_src(kBytes);
  const auto g_data = pattern(seed, key(kBytes, me, 40), kBytes);
  const auto e_data = pattern(seed, key(kBytes, me, 41), kBytes);
  CUDA_OK(cudaMemcpy(g_src.p, g_data.data(), kBytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(e_src.p, e_data.data(), kBytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(win.local(), kPoison, 2 * kBytes));
  spin_for<<<1, 1, 0, s>>>(0);  // loaded before any wait is in flight
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  comm->put_signal(win, right, 0, g_src.p, kBytes, sig, 0, 1, SignalOp::Add, s);
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaDeviceSynchronize());
  comm->barrier();
  spin_for<<<1, 1, 0, s>>>(200ull * 1000 * 1000);  // the graph's host node runs after the eager put's call
  CUDA_OK(cudaGraphLaunch(exec, s));
  comm->put(win, right, kBytes, e_src.p, kBytes, s);
  CUDA_OK(cudaStreamSynchronize(s));
  comm->barrier();
  std::vector<unsigned char> got(2 * kBytes);
  CUDA_OK(cudaMemcpy(got.data(), win.local(), got.size(), cudaMemcpyDeviceToHost));
  const auto want_g = pattern(seed, key(kBytes, left, 40), kBytes);
  const auto want_e = pattern(seed, key(kBytes, left, 41), kBytes);
  EXPECT_EQ(first_difference(got.data(), want_g.data(), kBytes), -1) << "the graph's put_signal";
  EXPECT_EQ(first_difference(got.data() + kBytes, want_e.data(), kBytes), -1) << "the eager put behind the graph";
  EXPECT_EQ(sig.read(0), 1u);
  comm->barrier();
  CUDA_OK(cudaGraphExecDestroy(exec));
}

// Many small transfers on several streams at once, each stream's later put overwriting its
// earlier one's range: done words are lent and taken back all the time (a word reused while
// an older wait still reads it must not move backwards); the last value of every range lands.
TEST_F(Staged, ManySmallTransfersOnFourStreamsEachKeepTheirOrder) {
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  constexpr int kStreams = 4, kRounds = 200;
  constexpr std::size_t kBytes = 4096 + 9;
  Window win = comm->alloc(kStreams * kBytes);
  DeviceBuffer src(std::size_t(kRounds) * kStreams * kBytes);
  std::vector<unsigned char> all(std::size_t(kRounds) * kStreams * kBytes);
  for (int r = 0; r < kRounds; ++r)
    for (int k = 0; k < kStreams; ++k) {
      const auto p = pattern(seed, key(kBytes, me, 1000 + r * kStreams + k), kBytes);
      std::memcpy(all.data() + (std::size_t(r) * kStreams + k) * kBytes, p.data(), kBytes);
    }
  CUDA_OK(cudaMemcpy(src.p, all.data(), all.size(), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(win.local(), kPoison, kStreams * kBytes));
  cudaStream_t streams[kStreams];
  for (auto& st : streams) CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  CUDA_OK(cudaDeviceSynchronize());
  comm->barrier();
  for (int r = 0; r < kRounds; ++r)
    for (int k = 0; k < kStreams; ++k)
      comm->put(win, right, k * kBytes, src.c() + (std::size_t(r) * kStreams + k) * kBytes, kBytes, streams[k]);
  for (auto& st : streams) CUDA_OK(cudaStreamSynchronize(st));
  comm->barrier();
  std::vector<unsigned char> got(kStreams * kBytes);
  CUDA_OK(cudaMemcpy(got.data(), win.local(), got.size(), cudaMemcpyDeviceToHost));
  for (int k = 0; k < kStreams; ++k) {
    const auto want = pattern(seed, key(kBytes, left, 1000 + (kRounds - 1) * kStreams + k), kBytes);
    EXPECT_EQ(first_difference(got.data() + k * kBytes, want.data(), kBytes), -1) << "stream " << k << "'s last put";
  }
  comm->barrier();
  for (auto& st : streams) cudaStreamDestroy(st);
}

// Puts of at most 64 KiB from a rank's GPU go into a small slot by a kernel on the caller's
// stream (MESHMEM_STAGED_STREAM_FILL=on), 16 slots, one per stream; the streams beyond
// (their slots' puts still running), larger puts and odd sources, through the agent's copy. 20
// streams, sizes on both sides of the limit, sources 4, 8 or 16 bytes into a line or odd,
// unaligned destinations, each put to a range of its own: every byte lands, and the poisoned
// bytes between the ranges stay.
TEST_F(Staged, StreamFilledAndAgentPutsOnMoreStreamsThanFillSlotsLandWhole) {
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  // On also where ranks share a GPU (auto: off there).
  comm.reset();
  comm = std::make_unique<Comm>(MPI_COMM_WORLD, staged_options("MESHMEM_STAGED_STREAM_FILL", "on"));
  constexpr int kStreams = 20, kRounds = 6;
  constexpr std::size_t kSizes[] = {1, 4096 + 3, 65536, 65537, 777, 65536 - 5};
  constexpr std::size_t kGap = 15, kSpan = 65537 + kGap;  // each put's range, a multiple of 16
  const std::size_t total = std::size_t(kStreams) * kRounds * kSpan;
  Window win = comm->alloc(total + 64);
  DeviceBuffer src(total + 64);
  std::vector<unsigned char> all(total + 64);
  auto place = [&](int k, int r) { return (std::size_t(k) * kRounds + r) * kSpan; };
  // Sources 4, 8 or 16 bytes into a line (filled by the kernel), or odd (the agent's copy), by
  // round and stream: every stream wants a fill slot in some rounds, so 20 compete for 16.
  auto source = [&](int k, int r) {
    const int a = (k + r) % 4;
    return place(k, r) + std::size_t(a == 3 ? 3 : 4 << a) % 16;
  };
  for (int k = 0; k < kStreams; ++k)
    for (int r = 0; r < kRounds; ++r) {
      const std::size_t bytes = kSizes[(k + r) % 6];
      const auto p = pattern(seed, key(bytes, me, 5000 + k * kRounds + r), bytes);
      std::memcpy(all.data() + source(k, r), p.data(), bytes);
    }
  CUDA_OK(cudaMemcpy(src.p, all.data(), all.size(), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(win.local(), kPoison, total + 64));
  cudaStream_t streams[kStreams];
  for (auto& st : streams) CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  CUDA_OK(cudaDeviceSynchronize());
  comm->barrier();
  for (int r = 0; r < kRounds; ++r)
    for (int k = 0; k < kStreams; ++k)
      comm->put(win, right, place(k, r) + 5, src.c() + source(k, r), kSizes[(k + r) % 6], streams[k]);
  for (auto& st : streams) CUDA_OK(cudaStreamSynchronize(st));
  comm->quiet(s);
  comm->barrier();
  std::vector<unsigned char> got(total + 64);
  CUDA_OK(cudaMemcpy(got.data(), win.local(), got.size(), cudaMemcpyDeviceToHost));
  int bad = 0;
  std::vector<unsigned char> want(total + 64, kPoison);
  for (int k = 0; k < kStreams; ++k)
    for (int r = 0; r < kRounds; ++r) {
      const std::size_t bytes = kSizes[(k + r) % 6];
      const auto p = pattern(seed, key(bytes, left, 5000 + k * kRounds + r), bytes);
      std::memcpy(want.data() + place(k, r) + 5, p.data(), bytes);
    }
  for (int k = 0; k < kStreams && bad < 5; ++k)
    for (int r = 0; r < kRounds && bad < 5; ++r) {
      const std::size_t at = place(k, r);
      const long d = first_difference(got.data() + at, want.data() + at, kSpan);
      if (d >= 0) {
        ++bad;
        ADD_FAILURE() << "stream " << k << " round " << r << " (" << kSizes[(k + r) % 6] << " bytes at +5): first wrong "
                      << "byte at +" << d;
      }
    }
  EXPECT_EQ(first_difference(got.data() + total, want.data() + total, 64), -1) << "the tail past the last range";
  comm->barrier();
  for (auto& st : streams) cudaStreamDestroy(st);
}

// Small puts and a get on this thread while another thread of the process captures a graph in
// global mode (the default of cudaStreamBeginCapture and of PyTorch's graphs): none of the
// transfers' CUDA calls may count as unsafe there (a pointer or event query would fail and
// invalidate that capture). The other thread's graph instantiates and replays; every
// transfer lands. A warm-up transfer on the stream first: its lanes and slots exist before.
TEST_F(Staged, SmallTransfersWhileAnotherThreadCapturesInGlobalMode) {
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  constexpr std::size_t kBytes = 4096 + 5, kPuts = 24, kMarks = 256;
  Window win = comm->alloc(kPuts * kBytes);
  DeviceBuffer src(kPuts * kBytes), back(kBytes), marks(kMarks);
  const auto mine = pattern(seed, key(kBytes, me, 60), kPuts * kBytes);
  CUDA_OK(cudaMemcpy(src.p, mine.data(), mine.size(), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(back.p, kPoison, kBytes));
  CUDA_OK(cudaMemset(marks.p, 0, kMarks));
  int device = -1;
  CUDA_OK(cudaGetDevice(&device));
  cudaStream_t cs = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
  comm->put(win, right, 0, src.p, kBytes, s);  // the warm-up
  CUDA_OK(cudaStreamSynchronize(s));
  comm->barrier();
  CUDA_OK(cudaMemset(win.local(), kPoison, kPuts * kBytes));
  CUDA_OK(cudaDeviceSynchronize());
  comm->barrier();

  std::atomic<int> phase{0};  // 1: the capture has begun; 2: this thread's transfers are enqueued
  cudaError_t begun = cudaErrorUnknown, filled = cudaErrorUnknown, ended = cudaErrorUnknown;
  cudaGraph_t graph = nullptr;
  std::thread capturer([&] {
    begun = cudaSetDevice(device);
    if (begun == cudaSuccess) begun = cudaStreamBeginCapture(cs, cudaStreamCaptureModeGlobal);
    if (begun == cudaSuccess) filled = cudaMemsetAsync(marks.p, 0x7e, kMarks, cs);
    phase.store(1);
    while (phase.load() < 2) std::this_thread::yield();
    if (begun == cudaSuccess) ended = cudaStreamEndCapture(cs, &graph);
  });
  while (phase.load() < 1) std::this_thread::yield();
  std::string failure;
  try {
    for (std::size_t i = 0; i < kPuts; ++i) comm->put(win, right, i * kBytes, src.c() + i * kBytes, kBytes, s);
    comm->get(back.p, win, right, 0, kBytes, s);
  } catch (const std::exception& e) {
    failure = e.what();
  }
  phase.store(2);
  capturer.join();
  EXPECT_EQ(failure, "") << "a transfer while another thread captured";
  ASSERT_EQ(begun, cudaSuccess) << cudaGetErrorString(begun);
  EXPECT_EQ(filled, cudaSuccess) << cudaGetErrorString(filled);
  EXPECT_EQ(ended, cudaSuccess) << "the other thread's capture ended with " << cudaGetErrorString(ended)
                                << ": a transfer's CUDA call here counted as unsafe and invalidated it";
  (void)cudaGetLastError();
  CUDA_OK(cudaStreamSynchronize(s));
  comm->barrier();
  std::vector<unsigned char> got(kPuts * kBytes), got_back(kBytes);
  CUDA_OK(cudaMemcpy(got.data(), win.local(), got.size(), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(got_back.data(), back.p, kBytes, cudaMemcpyDeviceToHost));
  const auto want = pattern(seed, key(kBytes, left, 60), kPuts * kBytes);
  EXPECT_EQ(first_difference(got.data(), want.data(), got.size()), -1) << "the puts from rank " << left;
  EXPECT_EQ(first_difference(got_back.data(), mine.data(), kBytes), -1) << "the get of what this rank put";
  if (graph != nullptr) {
    cudaGraphExec_t exec = nullptr;
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_OK(cudaGraphLaunch(exec, cs));
    CUDA_OK(cudaStreamSynchronize(cs));
    std::vector<unsigned char> m(kMarks);
    CUDA_OK(cudaMemcpy(m.data(), marks.p, kMarks, cudaMemcpyDeviceToHost));
    const std::vector<unsigned char> want_marks(kMarks, 0x7e);
    EXPECT_EQ(first_difference(m.data(), want_marks.data(), kMarks), -1) << "the other thread's graph's memset";
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
  }
  CUDA_OK(cudaStreamDestroy(cs));
  comm->barrier();
}

}  // namespace
