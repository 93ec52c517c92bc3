// RealUse, native peer atomics: a signal Add without them is refused before anything is enqueued.
#include "real_use.hpp"

namespace real_use {
namespace {

// ---- native peer atomics ----

// Without native peer atomics (forced here: every pair on the GPU machines has them), a
// signal Add into another GPU over ipc is refused before anything is enqueued: neither its
// data nor its signal lands. Set still works, Add into a rank on the same GPU is a local
// atomic, and routes whose target's thread applies the Add (staged, nccl, mpi-device) take it.
TEST_F(RealUse, SignalAddWithoutNativePeerAtomicsIsRefused) {
  ScopedEnv atomics("MESHMEM_IPC_PEER_ATOMICS", "off");
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


}  // namespace
}  // namespace real_use
