// RealUse, devices: every call with another device current, a stream of another device.
#include "real_use.hpp"

namespace real_use {
namespace {

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


}  // namespace
}  // namespace real_use
