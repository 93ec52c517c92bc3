// Device windows between ranks of a node: routes and mappings, puts from every source through
// copy kernels and the copy engine, gets of every size, and stream-ordered signals under
// stress. The suite's other subjects are device_window_*.cu (barriers, kernels and alloc/free,
// halos and nodes), compiled with this file as one translation unit (CMakeLists.txt).
#include "device_window.hpp"

TEST_F(DeviceWindow, RoutesAndMappings) {
  Window win = comm->alloc(4096);
  EXPECT_EQ(win.memory(), Memory::Device);
  for (int r = 0; r < n; ++r) {
    const TransportKind want = expected_route(*comm, me, r);
    EXPECT_EQ(comm->transport(r, Memory::Device), want) << "rank " << me << " -> " << r;
    if (want == TransportKind::Ipc || r == me)  // this rank's own part is always mapped
      EXPECT_NE(win.peer(r), nullptr) << "rank " << me << " -> " << r;
    else
      EXPECT_EQ(win.peer(r), nullptr) << "rank " << me << " -> " << r << ": a staged or nccl peer is not mapped";
  }
  EXPECT_EQ(default_memory(), Memory::Device);
  int device = -1;
  cudaGetDevice(&device);
  if (me == 0) std::printf("rank 0 on device %d, fd passing %s\n", device, to_string(comm->fd_passing()));
}

// Where another rank of the Comm uses this rank's GPU (same UUID: one physical GPU, whatever
// node, container or simulated node it is seen from), the stream waits are stream memory
// operations by default: a polling kernel would hold the time-sliced GPU from the rank it
// waits for. Elsewhere they are kernels.
TEST_F(DeviceWindow, StreamWaitsAvoidKernelsWhereAnyRankSharesTheGpu) {
  const char* knob = std::getenv("MESHMEM_STREAM_WAIT");
  if (knob != nullptr && *knob != '\0' && std::strcmp(knob, "auto") != 0)
    GTEST_SKIP() << "MESHMEM_STREAM_WAIT=" << knob << " chooses";
  int device = -1;
  CUDA_OK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  CUDA_OK(cudaGetDeviceProperties(&prop, device));
  std::vector<char> uuids(static_cast<std::size_t>(n) * sizeof(prop.uuid.bytes));
  ASSERT_EQ(MPI_Allgather(prop.uuid.bytes, sizeof(prop.uuid.bytes), MPI_BYTE, uuids.data(), sizeof(prop.uuid.bytes),
                          MPI_BYTE, MPI_COMM_WORLD),
            MPI_SUCCESS);
  bool shared = false;
  for (int r = 0; r < n; ++r)
    shared = shared || (r != me && std::memcmp(uuids.data() + r * sizeof(prop.uuid.bytes), prop.uuid.bytes,
                                               sizeof(prop.uuid.bytes)) == 0);
  const std::string info = comm->device_info();
  EXPECT_NE(info.find(shared ? "stream waits memop" : "stream waits kernel"), std::string::npos)
      << "rank " << me << (shared ? " shares its GPU with another rank" : " has its GPU to itself") << ": " << info;
}

// A Comm of one rank (MPI_COMM_SELF) under whatever this entry forces: its stream barrier
// needs no peer and no NCCL. Under MESHMEM_TRANSPORTS=mpi (no device route, not even to
// itself) such a Comm chose the node leaders' NCCL all-reduce without an NCCL library and
// crashed in its constructor (gpu.one_rank_comm_mpi_only; found by the Python suite's split
// communicator on 1 x H200). Every byte of a host put to itself is checked, and of a device
// put where it has a device route.
TEST_F(DeviceWindow, AOneRankCommOfEveryRankBarriersAndPutsToItself) {
  Comm self(MPI_COMM_SELF, options());
  ASSERT_EQ(self.size(), 1);
  for (int round = 0; round < 3; ++round) self.barrier(stream);
  CUDA_OK(cudaStreamSynchronize(stream));
  EXPECT_NE(self.device_info().find("barrier(stream) none needed (one rank)"), std::string::npos) << self.device_info();
  const std::size_t bytes = 4099;
  const auto data = pattern(seed, key(bytes, me, 0, 7), bytes);
  {
    Window host = self.alloc(bytes, Memory::Host);
    std::memset(host.local(), kPoison, bytes);
    self.put(host, 0, 0, data.data(), bytes);
    self.quiet();
    EXPECT_EQ(first_difference(host.local(), data.data(), bytes), -1) << "host put to itself on rank " << me;
  }
  if (self.transport(0, Memory::Device) != TransportKind::None) {
    Window dev = self.alloc(bytes);
    CUDA_OK(cudaMemsetAsync(dev.local(), kPoison, bytes, stream));
    DeviceBuffer src(bytes);
    CUDA_OK(upload(src.p, data.data(), bytes));
    self.put(dev, 0, 0, src.p, bytes, stream);
    self.barrier(stream);
    CUDA_OK(cudaStreamSynchronize(stream));
    const auto got = to_host(dev.local(), bytes);
    EXPECT_EQ(first_difference(got.data(), data.data(), bytes), -1) << "device put to itself on rank " << me;
  } else {
    EXPECT_FALSE(self.unreachable_reason(0, Memory::Device).empty());
  }
  comm->barrier(stream);
  CUDA_OK(cudaStreamSynchronize(stream));
}

TEST_F(DeviceWindow, PutEveryPairDeviceSource) { put_every_pair(*comm, stream, seed, false); }
TEST_F(DeviceWindow, PutEveryPairPageableSource) { put_every_pair(*comm, stream, seed, true); }

class DeviceWindowCopyEngine : public DeviceWindow {
  Options options() override { Options o = options_from_env(); o.set("MESHMEM_IPC_SM_COPY_MAX", "0"); return o; }
};
TEST_F(DeviceWindowCopyEngine, PutEveryPairAlwaysCopyEngine) { put_every_pair(*comm, stream, seed, false); }

class DeviceWindowSm : public DeviceWindow {
  Options options() override { Options o = options_from_env(); o.set("MESHMEM_IPC_SM_COPY_MAX", "1099511627776"); return o; }
};
TEST_F(DeviceWindowSm, PutEveryPairAlwaysCopyKernel) { put_every_pair(*comm, stream, seed, false); }

TEST_F(DeviceWindow, GetEveryPairEverySize) {
  for (std::size_t size : kSizes) {
    const std::size_t bytes = size + 2 * kGuard + 16;
    Window win = comm->alloc(bytes);
    auto mine = pattern(seed, key(size, me, 0, 1), bytes);
    upload(win.local(), mine.data(), bytes);
    comm->barrier(stream);
    for (int t = 0; t < n; ++t) {
      if (size > (8u << 20) && t != (me + 1) % n) continue;
      const std::size_t off = kGuard + static_cast<std::size_t>(t * 5 + me + 1) % 16;
      DeviceBuffer dst(size + 2 * kGuard);
      CUDA_OK(cudaMemsetAsync(dst.p, kPoison, size + 2 * kGuard, stream));
      comm->get(static_cast<char*>(dst.p) + kGuard, win, t, off, size, stream);
      CUDA_OK(cudaStreamSynchronize(stream));
      auto got = to_host(dst.p, size + 2 * kGuard);
      auto theirs = pattern(seed, key(size, t, 0, 1), bytes);
      EXPECT_EQ(first_difference(got.data() + kGuard, theirs.data() + off, size), -1) << "get " << size << " from " << t;
      EXPECT_EQ(meshmem::test::first_not(got.data(), kPoison, kGuard), -1);
      EXPECT_EQ(meshmem::test::first_not(got.data() + kGuard + size, kPoison, kGuard), -1);
    }
    comm->barrier(stream);
    CUDA_OK(cudaStreamSynchronize(stream));
  }
}

// A get into plain (pageable) host memory, from every peer: the routes that cannot write
// there themselves go through a device bounce buffer, whose copy out must come after the
// transfer and before the buffer is freed (the mpi-device wire lands its bytes later, from
// its proxy thread). Poisoned guards on both sides; every byte checked.
TEST_F(DeviceWindow, GetIntoPageableMemoryEveryPair) {
  for (std::size_t size : {std::size_t{13}, std::size_t{4099}, (std::size_t{1} << 20) + 5, std::size_t{9} << 20}) {
    const std::size_t bytes = size + 2 * kGuard + 16;
    Window win = comm->alloc(bytes);
    auto mine = pattern(seed, key(size, me, 0, 3), bytes);
    upload(win.local(), mine.data(), bytes);
    comm->barrier(stream);
    for (int t = 0; t < n; ++t) {
      const std::size_t off = kGuard + static_cast<std::size_t>(t * 3 + me + 5) % 16;
      std::vector<unsigned char> dst(size + 2 * kGuard, kPoison);
      comm->get(dst.data() + kGuard, win, t, off, size, stream);
      CUDA_OK(cudaStreamSynchronize(stream));
      auto theirs = pattern(seed, key(size, t, 0, 3), bytes);
      EXPECT_EQ(first_difference(dst.data() + kGuard, theirs.data() + off, size), -1) << "get " << size << " from " << t;
      EXPECT_EQ(meshmem::test::first_not(dst.data(), kPoison, kGuard), -1);
      EXPECT_EQ(meshmem::test::first_not(dst.data() + kGuard + size, kPoison, kGuard), -1);
    }
    comm->barrier(stream);
    CUDA_OK(cudaStreamSynchronize(stream));
  }
}

// Signal ordering under stress, all on the stream: each iteration waits for the right
// neighbour's ack, puts with a signal, waits for the left neighbour's signal and snapshots
// the window right then (stream order), then acks. Every snapshot is checked afterwards.
TEST_F(DeviceWindow, PutSignalRingDataVisibleWithSignal) {
  const std::size_t sizes[] = {8, 1000, 4099, 70000, (1u << 20) + 3};  // fused kernel and copy engine + write
  const int iterations = 200;
  const std::size_t max = (1u << 20) + 3;
  Window win = comm->alloc(max);
  Signals sig = comm->alloc_signals(2);
  const int right = (me + 1) % n, left = (me + n - 1) % n;
  DeviceBuffer src(max * iterations / 20 + max);  // a fresh source region per iteration (reused every 20)
  std::vector<std::vector<unsigned char>> sent;
  for (int it = 0; it < 20; ++it) {
    sent.push_back(pattern(seed, key(sizes[it % 5], me, right, it), sizes[it % 5]));
  }
  unsigned char* snap = nullptr;
  CUDA_OK(cudaMallocHost(&snap, max * iterations / 5 + 16));
  std::vector<std::size_t> snap_off(iterations);
  std::size_t snap_used = 0;
  std::vector<std::size_t> src_off(20);
  std::size_t used = 0;
  for (int k = 0; k < 20; ++k) {
    src_off[k] = used;
    upload(static_cast<char*>(src.p) + used, sent[k].data(), sent[k].size());
    used += sent[k].size();
  }
  for (int it = 0; it < iterations; ++it) {
    const std::size_t size = sizes[it % 5];
    comm->wait_until(sig, 1, Cmp::GE, static_cast<std::uint64_t>(it), stream);
    comm->put_signal(win, right, 0, static_cast<char*>(src.p) + src_off[it % 20], size, sig, 0,
                     static_cast<std::uint64_t>(it + 1), SignalOp::Set, stream);
    comm->wait_until(sig, 0, Cmp::GE, static_cast<std::uint64_t>(it + 1), stream);
    if (size < 100000 || it % 10 == 0) {
      snap_off[it] = snap_used;
      CUDA_OK(cudaMemcpyAsync(snap + snap_used, win.local(), size, cudaMemcpyDeviceToHost, stream));
      snap_used += size;
    } else {
      snap_off[it] = SIZE_MAX;
    }
    comm->signal(sig, left, 1, static_cast<std::uint64_t>(it + 1), SignalOp::Set, stream);
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  int bad = 0;
  for (int it = 0; it < iterations; ++it) {
    if (snap_off[it] == SIZE_MAX) continue;
    const std::size_t size = sizes[it % 5];
    auto want = pattern(seed, key(size, left, me, it % 20), size);
    if (first_difference(snap + snap_off[it], want.data(), size) != -1 && bad++ < 5)
      ADD_FAILURE() << "iteration " << it << " (" << size << " bytes): data not complete when its signal was seen";
  }
  cudaFreeHost(snap);
  comm->barrier(stream);
  CUDA_OK(cudaStreamSynchronize(stream));
}

TEST_F(DeviceWindow, SignalAddAndEveryComparison) {
  Signals sig = comm->alloc_signals(4);
  const int rounds = 10;
  for (int k = 0; k < rounds; ++k)
    for (int t = 0; t < n; ++t) comm->signal(sig, t, 2, static_cast<std::uint64_t>(me + 1), SignalOp::Add, stream);
  const std::uint64_t total = static_cast<std::uint64_t>(rounds) * n * (n + 1) / 2;
  comm->wait_until(sig, 2, Cmp::EQ, total, stream);
  comm->wait_until(sig, 2, Cmp::GE, total, stream);
  comm->wait_until(sig, 2, Cmp::GT, total - 1, stream);
  comm->wait_until(sig, 2, Cmp::NE, total + 1, stream);  // kernel-polled comparisons
  comm->wait_until(sig, 2, Cmp::LE, total, stream);
  comm->wait_until(sig, 2, Cmp::LT, total + 1, stream);
  CUDA_OK(cudaStreamSynchronize(stream));
  std::uint64_t words[4];
  CUDA_OK(cudaMemcpy(words, sig.local(), sizeof(words), cudaMemcpyDeviceToHost));
  EXPECT_EQ(words[2], total);
  EXPECT_EQ(words[0], 0u);
  EXPECT_EQ(words[1], 0u);
  EXPECT_EQ(words[3], 0u);
  comm->barrier(stream);
  CUDA_OK(cudaStreamSynchronize(stream));
}

