// Device windows between ranks of a node: the foundation's checks on GPU memory (fresh
// random data, poisoned destinations, every byte checked), through copy kernels and the
// copy engine, stream-ordered signals under stress, the stream barrier 10,000 times in
// both variants, kernels that write into peers through the device API, and alloc/free
// cycles back to the baseline of GPU memory and descriptors. Skipped without a GPU.
#include <cuda_runtime_api.h>
#include <dirent.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <regex>
#include <string>
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

// Picks this rank's GPU before any Comm exists: node-local rank modulo the GPUs visible.
bool select_device(std::string* why) {
  *why = meshmem::test::select_gpu_on_every_rank();
  return why->empty();
}

Options options_from_env() { return Options::from_environment(); }

class DeviceWindow : public meshmem::test::MpiTest {
 protected:
  void SetUp() override {
    std::string why;
    if (!select_device(&why)) GTEST_SKIP() << "no usable GPU: " << why;
    comm = std::make_unique<Comm>(MPI_COMM_WORLD, options());
    me = comm->rank();
    n = comm->size();
    // Placements where some pair may have no device route (nodes simulated on too few GPUs):
    // skipped on every rank together, with the first pair that has none.
    if (std::getenv("MESHMEM_TEST_EVERY_PAIR_ROUTED") != nullptr) {
      int missing = -1;
      for (int r = 0; r < n && missing < 0; ++r)
        if (comm->transport(r, Memory::Device) == TransportKind::None) missing = r;
      int any = missing >= 0 ? 1 : 0;
      MPI_Allreduce(MPI_IN_PLACE, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
      if (any) GTEST_SKIP() << "some pair has no device route here (rank " << me << " -> " << missing << ": "
                            << (missing >= 0 ? comm->unreachable_reason(missing, Memory::Device) : "another rank's") << ")";
    }
    seed = meshmem::test::shared_seed();
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream) cudaStreamDestroy(stream);
    comm.reset();
    MpiTest::TearDown();
  }
  virtual Options options() { return options_from_env(); }
  // GraphOfPutSignalAndGetReplays*: a graph of put_signal and get captured on `stream`.
  void graph_of_put_signal_and_get_replays(cudaStream_t stream);

  std::unique_ptr<Comm> comm;
  int me = 0;
  int n = 1;
  std::uint64_t seed = 0;
  cudaStream_t stream = nullptr;
};

std::uint64_t key(std::size_t size, int from, int to, int tag = 0) {
  return (static_cast<std::uint64_t>(size) << 24) ^ (static_cast<std::uint64_t>(from) << 12) ^
         static_cast<std::uint64_t>(to) ^ (static_cast<std::uint64_t>(tag) << 56);
}

const std::size_t kSizes[] = {1, 7, 8, 13, 4096, 4099, 65536 + 17, (1u << 20) + 5, 64u << 20};
constexpr std::size_t kGuard = 64;

std::size_t slot_offset(int s, std::size_t size) {
  return static_cast<std::size_t>(s) * (size + 2 * kGuard + 8) + kGuard + static_cast<std::size_t>(s * 3 + 1) % 8;
}
std::size_t slots_bytes(int n, std::size_t size) { return static_cast<std::size_t>(n) * (size + 2 * kGuard + 8); }

// Every rank puts into every rank's window (64 MiB: ring only) from `source` memory;
// checks every byte of its own window, poison included.
void put_every_pair(Comm& comm, cudaStream_t stream, std::uint64_t seed, bool pageable_source) {
  const int me = comm.rank(), n = comm.size();
  for (std::size_t size : kSizes) {
    const bool ring = size > (8u << 20);
    Window win = comm.alloc(slots_bytes(n, size));
    CUDA_OK(cudaMemsetAsync(win.local(), kPoison, slots_bytes(n, size), stream));
    comm.barrier(stream);
    std::vector<std::vector<unsigned char>> host_src;
    std::vector<std::unique_ptr<DeviceBuffer>> dev_src;
    for (int t = 0; t < n; ++t) {
      if (ring && t != (me + 1) % n) continue;
      host_src.push_back(pattern(seed, key(size, me, t), size));
      const void* src = host_src.back().data();
      if (!pageable_source) {
        dev_src.push_back(std::make_unique<DeviceBuffer>(size));
        upload(dev_src.back()->p, src, size);
        src = dev_src.back()->p;
      }
      comm.put(win, t, slot_offset(me, size), src, size, stream);
    }
    comm.barrier(stream);
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<unsigned char> img(slots_bytes(n, size), kPoison);
    for (int s = 0; s < n; ++s) {
      if (ring && s != (me + n - 1) % n) continue;
      auto d = pattern(seed, key(size, s, me), size);
      std::memcpy(img.data() + slot_offset(s, size), d.data(), size);
    }
    auto got = to_host(win.local(), img.size());
    EXPECT_EQ(first_difference(got.data(), img.data(), img.size()), -1)
        << "put of " << size << " bytes (" << (pageable_source ? "pageable" : "device") << " source) into rank " << me;
    comm.barrier(stream);
    CUDA_OK(cudaStreamSynchronize(stream));
  }
}

}  // namespace

// The route the settings ask for. Another (real or simulated) node: `nccl` where allowed,
// except for two ranks on one GPU of one machine when the user set NCCL_HOSTID (the entry
// says so with MESHMEM_TEST_USER_NCCL_HOSTID: meshmem sets NCCL_HOSTID itself otherwise,
// one per simulated node, so the test cannot read it from its environment), else none. This
// node: `staged` where MESHMEM_TRANSPORTS puts it first, or for a pair of different GPUs
// under MESHMEM_IPC_PEER_ACCESS=off; else ipc (every GPU machine here has peer access).
// Collective (every rank calls it for the same r).
TransportKind expected_route(const Comm& comm, int me, int r) {
  const char* order = std::getenv("MESHMEM_TRANSPORTS");
  const std::vector<std::string> hosts = meshmem::test::host_names();
  const std::vector<std::string> bus = meshmem::test::gpu_bus_ids();
  if (comm.node_of(r) != comm.node()) {
    // nccl, then mpi-device, in MESHMEM_TRANSPORTS' order (both by default, nccl first).
    const char* nccl = order == nullptr ? "nccl" : std::strstr(order, "nccl");
    const char* mpi = order == nullptr ? nullptr : std::strstr(order, "mpi-device");
    const bool one_gpu = hosts[me] == hosts[r] && bus[me] == bus[r];
    const bool nccl_reaches = nccl != nullptr && !(one_gpu && std::getenv("MESHMEM_TEST_USER_NCCL_HOSTID") != nullptr);
    const bool mpi_reaches = order == nullptr || mpi != nullptr;
    if (nccl_reaches && (order == nullptr || mpi == nullptr || nccl < mpi)) return TransportKind::Nccl;
    return mpi_reaches ? TransportKind::MpiDevice : TransportKind::None;
  }
  if (order != nullptr && std::strncmp(order, "staged", 6) == 0) return TransportKind::Staged;
  const char* access = std::getenv("MESHMEM_IPC_PEER_ACCESS");
  if (access == nullptr || std::strcmp(access, "off") != 0) return TransportKind::Ipc;
  if (bus[me].empty()) return TransportKind::None;
  return bus[me] == bus[r] ? TransportKind::Ipc : TransportKind::Staged;
}

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

namespace {
// Reads what the left neighbour wrote for iteration `it`; counts mismatches.
__global__ void check_iteration(const std::uint64_t* slot, std::uint64_t want, unsigned* errors) {
  if (*reinterpret_cast<const volatile std::uint64_t*>(slot) != want) atomicAdd(errors, 1u);
}
}  // namespace

// 10,000 rounds (500 in the fast tier) of: put my round number into the right neighbour,
// barrier(stream), check that the left neighbour's round number is there. A barrier that lets
// any rank through early shows up as a stale value. Rank 0 prints the time per barrier and the
// barrier's variant (run_entries.sh's barrier probe compares them): where ranks share a GPU,
// a variant that polls in a kernel waits for the time slices of every other rank's context.
TEST_F(DeviceWindow, BarrierTenThousandRounds) {
  const int rounds = meshmem::test::rounds(10000, 500);
  Window win = comm->alloc(64);
  DeviceBuffer values(static_cast<std::size_t>(rounds) * sizeof(std::uint64_t));
  std::vector<std::uint64_t> host(static_cast<std::size_t>(rounds));
  for (int i = 0; i < rounds; ++i) host[i] = (static_cast<std::uint64_t>(me) << 32) | static_cast<std::uint64_t>(i + 1);
  upload(values.p, host.data(), values.bytes);
  DeviceBuffer errors(sizeof(unsigned));
  CUDA_OK(fill_now(errors.p, 0, sizeof(unsigned)));
  const int left = (me + n - 1) % n;
  comm->barrier(stream);
  CUDA_OK(cudaStreamSynchronize(stream));
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < rounds; ++i) {
    comm->put(win, (me + 1) % n, 0, static_cast<std::uint64_t*>(values.p) + i, sizeof(std::uint64_t), stream);
    comm->barrier(stream);
    check_iteration<<<1, 1, 0, stream>>>(static_cast<const std::uint64_t*>(win.local()),
                                         (static_cast<std::uint64_t>(left) << 32) | static_cast<std::uint64_t>(i + 1),
                                         static_cast<unsigned*>(errors.p));
    comm->barrier(stream);  // nobody overwrites before the check ran
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (me == 0) {
    std::string variant = comm->device_info();
    const std::size_t at = variant.find("barrier(stream)");
    variant = at == std::string::npos ? "?" : variant.substr(at, variant.find('\n', at) - at);
    std::printf("[ barrier timing ] %d ranks, %d rounds, %.2f s, %.1f us per barrier; %s\n", n, rounds, seconds,
                seconds * 1e6 / (2.0 * rounds), variant.c_str());
    std::fflush(stdout);
  }
  unsigned bad = 0;
  CUDA_OK(cudaMemcpy(&bad, errors.p, sizeof(bad), cudaMemcpyDeviceToHost));
  EXPECT_EQ(bad, 0u) << "rounds in which the barrier let a stale value through";
}

namespace {
// Waits `ns` on the GPU, then stores `value` into a peer's window: a put that lands late.
__global__ void late_store(std::uint64_t* dst, std::uint64_t value, unsigned ns) {
  std::uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
  *reinterpret_cast<volatile std::uint64_t*>(dst) = value;
}
}  // namespace

// The barrier with some ranks' streams busy (a store into the right neighbour still waiting
// on the GPU) and others idle (their store done and synchronised): every rank must see its
// left neighbour's store after the barrier, whichever state either was in. Rounds where all
// streams are idle and all are busy are included.
TEST_F(DeviceWindow, BarrierOrdersBusyAndIdleStreams) {
  Window win = comm->alloc(64);
  // A mapped neighbour gets the late store itself; an unmapped (staged) one a put of a word
  // that the late store wrote here.
  auto* right_word = static_cast<std::uint64_t*>(win.peer((me + 1) % n));
  DeviceBuffer outgoing(sizeof(std::uint64_t));
  DeviceBuffer errors(sizeof(unsigned));
  CUDA_OK(fill_now(errors.p, 0, sizeof(unsigned)));
  const int left = (me + n - 1) % n;
  std::mt19937_64 gen(seed);  // the same draws on every rank
  comm->barrier(stream);
  int busy_rounds = 0, idle_rounds = 0;
  const int rounds = meshmem::test::rounds(600, 150);  // 150 in the fast tier
  for (int i = 0; i < rounds; ++i) {
    const std::uint64_t draw = gen();
    const int pattern = static_cast<int>(draw % 4);  // 0: all idle, 1: all busy, else mixed
    const bool busy = pattern == 1 || (pattern >= 2 && ((draw >> 8) + me) % 2 == 0);
    const unsigned ns = busy ? 5000 + static_cast<unsigned>((draw >> 16) % 40000) : 0;
    late_store<<<1, 1, 0, stream>>>(right_word ? right_word : static_cast<std::uint64_t*>(outgoing.p),
                                    (static_cast<std::uint64_t>(me) << 32) | (i + 1), ns);
    CUDA_OK(cudaGetLastError());
    if (right_word == nullptr) comm->put(win, (me + 1) % n, 0, outgoing.p, sizeof(std::uint64_t), stream);
    if (!busy) CUDA_OK(cudaStreamSynchronize(stream));
    (busy ? busy_rounds : idle_rounds)++;
    comm->barrier(stream);
    check_iteration<<<1, 1, 0, stream>>>(static_cast<const std::uint64_t*>(win.local()),
                                         (static_cast<std::uint64_t>(left) << 32) | (i + 1),
                                         static_cast<unsigned*>(errors.p));
    comm->barrier(stream);  // nobody overwrites before the check ran
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  unsigned bad = 0;
  CUDA_OK(cudaMemcpy(&bad, errors.p, sizeof(bad), cudaMemcpyDeviceToHost));
  EXPECT_EQ(bad, 0u) << "rounds in which a rank read its left neighbour's word before the store landed ("
                     << busy_rounds << " busy, " << idle_rounds << " idle rounds on this rank)";
}

// Across (simulated) nodes the barrier is hierarchical (node kernel, the node leaders' NCCL
// all-reduce, node kernel) or goes through a proxy thread: the host must not wait for the
// GPU, and every rank must see its left neighbour's late store after the barrier. The stores
// go through host memory that all ranks of the machine share (an MPI shared window
// registered with CUDA), since device windows do not span nodes.
TEST_F(DeviceWindow, BarrierAcrossNodesOrdersAndDoesNotBlockHost) {
  if (comm->node_count() == 1) GTEST_SKIP() << "needs ranks on several (real or simulated) nodes";
  MPI_Comm machine;
  ASSERT_EQ(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &machine), MPI_SUCCESS);
  int machine_size = 0;
  MPI_Comm_size(machine, &machine_size);
  if (machine_size != n) {
    MPI_Comm_free(&machine);
    GTEST_SKIP() << "needs every rank on this machine (the check goes through shared host memory)";
  }
  {
    // The variant MESHMEM_BARRIER_ACROSS_NODES asks for; `auto` takes the hierarchical one
    // where every pair across nodes is nccl, every node pair ipc, and no GPU is shared.
    int hierarchical_expected = 1;
    for (int r = 0; r < n; ++r)
      if (r != me)
        hierarchical_expected &= comm->transport(r, Memory::Device) ==
                                 (comm->node_of(r) == comm->node_of(me) ? TransportKind::Ipc : TransportKind::Nccl);
    int dev = 0;
    CUDA_OK(cudaGetDevice(&dev));
    char bus[32] = {};
    CUDA_OK(cudaDeviceGetPCIBusId(bus, sizeof(bus), dev));
    std::vector<char> buses(sizeof(bus) * static_cast<std::size_t>(n));
    MPI_Allgather(bus, sizeof(bus), MPI_CHAR, buses.data(), sizeof(bus), MPI_CHAR, machine);
    for (int r = 0; r < n; ++r)
      if (r != me && std::strncmp(bus, buses.data() + r * sizeof(bus), sizeof(bus)) == 0) hierarchical_expected = 0;
    MPI_Allreduce(MPI_IN_PLACE, &hierarchical_expected, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    const char* asked_env = std::getenv("MESHMEM_BARRIER_ACROSS_NODES");
    const std::string asked = asked_env ? asked_env : "auto";
    const std::string info = comm->device_info();
    if (me == 0) std::printf("[ info     ] %s\n", info.c_str());
    const bool hierarchical = info.find("barrier(stream) hierarchical") != std::string::npos;
    if (asked == "nccl") EXPECT_TRUE(hierarchical) << info;
    if (asked == "auto") EXPECT_EQ(hierarchical, hierarchical_expected == 1) << info;
    if (asked == "proxy") EXPECT_FALSE(hierarchical) << info;
  }
  MPI_Win win;
  std::uint64_t* base = nullptr;
  const MPI_Aint bytes = me == 0 ? 4096 : 0;
  ASSERT_EQ(MPI_Win_allocate_shared(bytes, 8, MPI_INFO_NULL, machine, &base, &win), MPI_SUCCESS);
  MPI_Aint got = 0;
  int unit = 0;
  ASSERT_EQ(MPI_Win_shared_query(win, 0, &got, &unit, &base), MPI_SUCCESS);
  if (me == 0) std::memset(base, 0, 4096);
  MPI_Barrier(machine);
  CUDA_OK(cudaHostRegister(base, 4096, cudaHostRegisterMapped | cudaHostRegisterPortable));
  std::uint64_t* slots = nullptr;
  CUDA_OK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&slots), base, 0));
  DeviceBuffer errors(sizeof(unsigned));
  CUDA_OK(fill_now(errors.p, 0, sizeof(unsigned)));
  const int left = (me + n - 1) % n, right = (me + 1) % n;
  comm->barrier(stream);

  // The host does not wait: behind 200 ms of GPU work, barrier(stream) returns at once.
  late_store<<<1, 1, 0, stream>>>(slots + 64, 0, 200u * 1000u * 1000u);
  const auto t0 = std::chrono::steady_clock::now();
  comm->barrier(stream);
  const double host_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(host_ms, 50.0) << "barrier(stream) across nodes blocked the host behind 200 ms of GPU work";
  CUDA_OK(cudaStreamSynchronize(stream));

  std::mt19937_64 gen(seed);
  for (int i = 0; i < 300; ++i) {
    const std::uint64_t draw = gen();
    const int pattern = static_cast<int>(draw % 4);  // 0: all idle, 1: all busy, else mixed
    const bool busy = pattern == 1 || (pattern >= 2 && ((draw >> 8) + me) % 2 == 0);
    const unsigned ns = busy ? 5000 + static_cast<unsigned>((draw >> 16) % 40000) : 0;
    late_store<<<1, 1, 0, stream>>>(slots + right, (static_cast<std::uint64_t>(me) << 32) | (i + 1), ns);
    CUDA_OK(cudaGetLastError());
    if (!busy) CUDA_OK(cudaStreamSynchronize(stream));
    comm->barrier(stream);
    check_iteration<<<1, 1, 0, stream>>>(slots + me, (static_cast<std::uint64_t>(left) << 32) | (i + 1),
                                         static_cast<unsigned*>(errors.p));
    comm->barrier(stream);
  }
  // One node busy for 20 ms, the others idle: a barrier whose node parts pass without the
  // nodes meeting lets the idle nodes read before the busy node's stores (on a GPU shared
  // by the ranks, the short random delays above can hide that behind the time slices).
  for (int i = 300; i < 300 + 2 * comm->node_count(); ++i) {
    const bool busy = comm->node_of(me) == i % comm->node_count();
    late_store<<<1, 1, 0, stream>>>(slots + right, (static_cast<std::uint64_t>(me) << 32) | (i + 1),
                                    busy ? 20u * 1000u * 1000u : 0u);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(busy ? cudaSuccess : cudaStreamSynchronize(stream));
    comm->barrier(stream);
    check_iteration<<<1, 1, 0, stream>>>(slots + me, (static_cast<std::uint64_t>(left) << 32) | (i + 1),
                                         static_cast<unsigned*>(errors.p));
    comm->barrier(stream);
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  unsigned bad = 0;
  CUDA_OK(cudaMemcpy(&bad, errors.p, sizeof(bad), cudaMemcpyDeviceToHost));
  EXPECT_EQ(bad, 0u) << "rounds in which a rank read its left neighbour's word before the store landed";
  CUDA_OK(cudaHostUnregister(base));
  MPI_Win_free(&win);
  MPI_Comm_free(&machine);
}

namespace {
// Device API: every block writes its slice to the right neighbour and signals once.
__global__ void ring_kernel(device::WindowView win, device::SignalsView sig, const unsigned char* src,
                            std::size_t bytes, std::uint64_t value) {
  const int right = (win.rank + 1) % win.size;
  const std::size_t per = (bytes + gridDim.x - 1) / gridDim.x;
  const std::size_t begin = per * blockIdx.x;
  const std::size_t len = begin >= bytes ? 0 : (begin + per > bytes ? bytes - begin : per);
  device::put_signal_block(win, right, begin, src + begin, len, sig, 0, value, SignalOp::Add);
}
__global__ void wait_kernel(device::SignalsView sig, std::uint64_t value) {
  if (threadIdx.x == 0) device::wait_until(sig, 0, Cmp::GE, value);
}
}  // namespace

TEST_F(DeviceWindow, KernelsWriteIntoPeersThroughDeviceApi) {
  const std::size_t bytes = (3u << 20) + 11;
  const unsigned blocks = 24;
  Window win = comm->alloc(bytes);
  const std::string unmapped = meshmem::test::unmapped_peer(*comm, win);
  if (!unmapped.empty()) GTEST_SKIP() << unmapped;
  Signals sig = comm->alloc_signals(1);
  const int right = (me + 1) % n, left = (me + n - 1) % n;
  auto data = pattern(seed, key(bytes, me, right, 3), bytes);
  DeviceBuffer src(bytes);
  upload(src.p, data.data(), bytes);
  CUDA_OK(fill_now(win.local(), kPoison, bytes));
  comm->barrier(stream);
  ring_kernel<<<blocks, 256, 0, stream>>>(win.view(), sig.view(), static_cast<unsigned char*>(src.p), bytes, 1);
  wait_kernel<<<1, 32, 0, stream>>>(sig.view(), blocks);  // one Add per block
  CUDA_OK(cudaStreamSynchronize(stream));
  auto got = to_host(win.local(), bytes);
  auto want = pattern(seed, key(bytes, left, me, 3), bytes);
  EXPECT_EQ(first_difference(got.data(), want.data(), bytes), -1);
  comm->barrier(stream);
  CUDA_OK(cudaStreamSynchronize(stream));
}

namespace {
// One block per (destination offset, source offset, length): device::copy_block between
// pointers of every relative alignment within 16 bytes.
__host__ __device__ constexpr std::size_t copy_len(unsigned block) {
  return block % 4 == 0 ? 1 : block % 4 == 1 ? 15 : block % 4 == 2 ? 33 : 4099;
}
constexpr std::size_t kCopyRegion = 4099 + 64;  // room for both offsets and guard bytes
__global__ void copy_block_kernel(unsigned char* dst, const unsigned char* src) {
  const unsigned b = blockIdx.x;
  const std::size_t len = copy_len(b), so = (b / 4) % 16, doff = b / 64;
  device::copy_block(dst + b * kCopyRegion + 16 + doff, src + b * kCopyRegion + so, len);
}
}  // namespace

// The device API's block copy moves every byte, and only those, whatever the two pointers'
// alignments (a row 8 bytes into a 16-byte line, odd offsets), with the whole block.
TEST_F(DeviceWindow, BlockCopyMovesEveryByteAtEveryRelativeAlignment) {
  const unsigned blocks = 16 * 16 * 4;
  const std::size_t bytes = blocks * kCopyRegion;
  const auto data = pattern(seed, key(bytes, me, me, 11), bytes);
  DeviceBuffer src(bytes), dst(bytes);
  upload(src.p, data.data(), bytes);
  CUDA_OK(fill_now(dst.p, kPoison, bytes));
  copy_block_kernel<<<blocks, 256, 0, stream>>>(static_cast<unsigned char*>(dst.p), static_cast<const unsigned char*>(src.p));
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaStreamSynchronize(stream));
  const auto got = to_host(dst.p, bytes);
  for (unsigned b = 0; b < blocks; ++b) {
    const std::size_t len = copy_len(b), so = (b / 4) % 16, doff = b / 64;
    std::vector<unsigned char> want(kCopyRegion, static_cast<unsigned char>(kPoison));
    std::memcpy(want.data() + 16 + doff, data.data() + b * kCopyRegion + so, len);
    ASSERT_EQ(first_difference(got.data() + b * kCopyRegion, want.data(), kCopyRegion), -1)
        << "block " << b << ": " << len << " bytes from source offset " << so << " to destination offset " << doff;
  }
}

TEST_F(DeviceWindow, AllocFreeCyclesReturnToBaseline) {
  { Window warm = comm->alloc(64u << 20); }
  CUDA_OK(cudaDeviceSynchronize());
  MPI_Barrier(MPI_COMM_WORLD);
  std::size_t free0 = 0, total = 0;
  CUDA_OK(cudaMemGetInfo(&free0, &total));
  const int fds0 = meshmem::test::count_fds();
  for (int cycle = 0; cycle < 20; ++cycle) {
    Window win = comm->alloc((64u << 20) + static_cast<std::size_t>(cycle));
    Signals sig = comm->alloc_signals(8);
    const std::uint64_t v = static_cast<std::uint64_t>(cycle);
    comm->put_signal(win, (me + 1) % n, 0, &v, sizeof(v), sig, 0, 1, SignalOp::Set, stream);
    comm->barrier(stream);
    CUDA_OK(cudaStreamSynchronize(stream));
    if (cycle % 2) win.free();
  }
  CUDA_OK(cudaDeviceSynchronize());
  MPI_Barrier(MPI_COMM_WORLD);  // every rank released its mappings of the others' memory
  std::size_t free1 = 0;
  CUDA_OK(cudaMemGetInfo(&free1, &total));
  EXPECT_EQ(meshmem::test::count_fds(), fds0);
  // Several ranks may share this GPU: allow for their allocator slack, not for a leak
  // (20 cycles of 64 MiB would be 1.25 GiB).
  EXPECT_LE(free0 > free1 ? free0 - free1 : 0, std::size_t{32} << 20) << "GPU memory not returned";
}

TEST_F(DeviceWindow, BadArguments) {
  Window win = comm->alloc(1000);
  Signals sig = comm->alloc_signals(2);
  const std::uint64_t v = 1;
  EXPECT_THROW(comm->put(win, n, 0, &v, 8, stream), Error);
  EXPECT_THROW(comm->put(win, 0, 996, &v, 8, stream), Error);
  EXPECT_THROW(comm->put_signal(win, 0, 0, &v, 8, sig, 2, 1, SignalOp::Set, stream), Error);
  EXPECT_THROW(comm->wait_until(sig, 5, Cmp::GE, 1, stream), Error);
  Window host = comm->alloc(64, Memory::Host);
  EXPECT_THROW(comm->put_signal(host, 0, 0, &v, 8, sig, 0, 1, SignalOp::Set), Error);  // kinds differ
  EXPECT_THROW((void)host.view(), Error);
  comm->barrier(stream);
  CUDA_OK(cudaStreamSynchronize(stream));
}

// HaloExchange on device windows: 2D blocks with strided columns, stream-ordered, several
// rounds, every cell checked.
#include "halo_grid.hpp"

// MESHMEM_HALO_SENDS reaches the device runtime (the halo_sends entries run the halo cases
// with each value): device_info says `serial` where it is set, and only there (`concurrent`
// is the default).
TEST_F(DeviceWindow, HaloExchangeSendsAsTheKnobSays) {
  const char* knob = std::getenv("MESHMEM_HALO_SENDS");
  const bool serial = knob != nullptr && std::strcmp(knob, "serial") == 0;
  EXPECT_EQ(comm->device_info().find("halo sends serial") != std::string::npos, serial)
      << "rank " << me << ", MESHMEM_HALO_SENDS=" << (knob ? knob : "(unset)") << ": " << comm->device_info();
}

TEST_F(DeviceWindow, HaloBlockDecompositionWithColumns) {
  meshmem::test::BlockGrid g(n, me, 301, 157);
  Window win = comm->alloc(g.bytes());
  HaloExchange halo = comm->make_halo(win, g.regions());
  const double poison = -7.25;
  const std::size_t cells = (g.ny + 2) * (g.nx + 2);
  for (int round = 0; round < 5; ++round) {
    std::vector<double> mine(cells, poison);
    for (std::size_t y = 1; y <= g.ny; ++y)
      for (std::size_t x = 1; x <= g.nx; ++x) mine[y * (g.nx + 2) + x] = meshmem::test::cell(seed, me, round, y, x);
    upload(win.local(), mine.data(), cells * sizeof(double));
    comm->barrier(stream);
    halo.exchange(stream);
    CUDA_OK(cudaStreamSynchronize(stream));
    auto got = to_host(win.local(), cells * sizeof(double));
    const auto want = meshmem::test::expected_grid(g, seed, me, round, poison);
    EXPECT_EQ(first_difference(got.data(), want.data(), cells * sizeof(double)), -1) << "round " << round << ", rank " << me;
    comm->barrier(stream);
    CUDA_OK(cudaStreamSynchronize(stream));
  }
}

// Columns: strided regions (unaligned offsets, different pitches here and there) to both ring
// neighbours, fresh data every round, the whole window poisoned first and every byte checked.
// Between nodes (nccl) the rows go packed, as one transfer unpacked at the target.
TEST_F(DeviceWindow, StridedHaloRegionsEveryByte) {
  constexpr std::size_t kWidth = 24, kHeight = 157, kSrcPitch = 1000, kDstPitch = 1240;
  constexpr std::size_t kToRight = 5;                                   // rows sent right
  constexpr std::size_t kToLeft = kToRight + kSrcPitch * kHeight + 3;   // other rows, sent left
  constexpr std::size_t kFromLeft = kToLeft + kSrcPitch * kHeight + 11;     // the left neighbour's land here
  constexpr std::size_t kFromRight = kFromLeft + kDstPitch * kHeight + 13;  // the right one's here
  const std::size_t bytes = kFromRight + kDstPitch * kHeight + 64;
  const int right = (me + 1) % n, left = (me + n - 1) % n;
  Window win = comm->alloc(bytes);
  HaloExchange halo = comm->make_halo(win, {{right, kToRight, kFromLeft, kWidth, kHeight, kSrcPitch, kDstPitch},
                                            {left, kToLeft, kFromRight, kWidth, kHeight, kSrcPitch, kDstPitch}});
  for (int round = 0; round < 4; ++round) {
    // Different rows each way, so that two ranks that are both neighbours cannot swap them.
    const auto rows_of = [&](int rank, int way) { return pattern(seed, key(round, rank, way, 7), kWidth * kHeight); };
    const auto place = [&](std::vector<unsigned char>& image, std::size_t at, std::size_t pitch, int rank, int way) {
      const auto rows = rows_of(rank, way);
      for (std::size_t y = 0; y < kHeight; ++y) std::memcpy(image.data() + at + y * pitch, rows.data() + y * kWidth, kWidth);
    };
    std::vector<unsigned char> image(bytes, kPoison);
    place(image, kToRight, kSrcPitch, me, 0);
    place(image, kToLeft, kSrcPitch, me, 1);
    upload(win.local(), image.data(), bytes);
    comm->barrier(stream);
    halo.exchange(stream);
    CUDA_OK(cudaStreamSynchronize(stream));
    place(image, kFromLeft, kDstPitch, left, 0);
    place(image, kFromRight, kDstPitch, right, 1);
    const auto got = to_host(win.local(), bytes);
    EXPECT_EQ(first_difference(got.data(), image.data(), bytes), -1)
        << "round " << round << ", rank " << me << " (left " << left << " through "
        << to_string(comm->transport(left, Memory::Device)) << ", right " << right << " through "
        << to_string(comm->transport(right, Memory::Device)) << ")";
    comm->barrier(stream);
    CUDA_OK(cudaStreamSynchronize(stream));
  }
}

// A put_signal (Add) to the right neighbour and a get from it, captured once into a CUDA graph
// and replayed with fresh data every time: each route's transfers (ipc, staged, nccl across
// nodes) are correct on every replay. Destinations poisoned first, every byte checked, the
// signal counting the replays.
void DeviceWindow::graph_of_put_signal_and_get_replays(cudaStream_t s) {
  constexpr std::size_t kBytes = 65536 + 13, kGetFrom = kBytes + 8, kWindow = 2 * kBytes + 16;
  constexpr int kReplays = 20;
  const int right = (me + 1) % n, left = (me + n - 1) % n;
  Window win = comm->alloc(kWindow);
  Signals sig = comm->alloc_signals(static_cast<std::size_t>(n));
  DeviceBuffer src(kBytes), got(kBytes);
  CUDA_OK(cudaMemset(sig.local(), 0, static_cast<std::size_t>(n) * sizeof(std::uint64_t)));
  comm->barrier(s);
  CUDA_OK(cudaStreamSynchronize(s));
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  comm->put_signal(win, right, 0, src.p, kBytes, sig, static_cast<std::size_t>(me), 1, SignalOp::Add, s);
  comm->get(got.p, win, right, kGetFrom, kBytes, s);
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphDestroy(graph));  // the instantiation keeps what the capture made
  int bad = 0;
  for (int rep = 0; rep < kReplays; ++rep) {
    const auto put_data = [&](int rank) { return pattern(seed, key(rep, rank, 0, 3), kBytes); };
    const auto get_data = [&](int rank) { return pattern(seed, key(rep, rank, 0, 4), kBytes); };
    std::vector<unsigned char> image(kWindow, kPoison);
    const auto serve = get_data(me);
    std::memcpy(image.data() + kGetFrom, serve.data(), kBytes);
    upload(win.local(), image.data(), kWindow);
    const auto mine = put_data(me);
    upload(src.p, mine.data(), kBytes);
    CUDA_OK(cudaMemset(got.p, kPoison, kBytes));
    CUDA_OK(cudaDeviceSynchronize());
    MPI_Barrier(MPI_COMM_WORLD);  // every source and window of this replay is in place
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    MPI_Barrier(MPI_COMM_WORLD);  // every put of this replay is at its target
    const auto from_left = put_data(left);
    std::memcpy(image.data(), from_left.data(), kBytes);
    const auto window_now = to_host(win.local(), kWindow);
    const auto fetched = to_host(got.p, kBytes);
    const auto want = get_data(right);
    const std::uint64_t count = sig.read(static_cast<std::size_t>(left));
    if ((first_difference(window_now.data(), image.data(), kWindow) >= 0 ||
         first_difference(fetched.data(), want.data(), kBytes) >= 0 || count != static_cast<std::uint64_t>(rep + 1)) &&
        ++bad <= 3)
      ADD_FAILURE() << "replay " << rep << " on rank " << me << ": window first differs at "
                    << first_difference(window_now.data(), image.data(), kWindow) << ", get at "
                    << first_difference(fetched.data(), want.data(), kBytes) << ", signal " << count << " (want "
                    << rep + 1 << "); routes: left " << to_string(comm->transport(left, Memory::Device)) << ", right "
                    << to_string(comm->transport(right, Memory::Device));
    MPI_Barrier(MPI_COMM_WORLD);
  }
  EXPECT_EQ(bad, 0);
  CUDA_OK(cudaGraphExecDestroy(exec));
}

TEST_F(DeviceWindow, GraphOfPutSignalAndGetReplays) { graph_of_put_signal_and_get_replays(stream); }
// The per-thread default stream can be captured too (the legacy one cannot). (These calls
// passed there before meshmem saw such a capture; HaloExchange did not: see
// GraphReplay.HaloExchangeCapturedOnThePerThreadStreamReplays.)
TEST_F(DeviceWindow, GraphOfPutSignalAndGetReplaysOnThePerThreadStream) {
  graph_of_put_signal_and_get_replays(cudaStreamPerThread);
}

// A halo neighbour on another (real or simulated) node has no device route yet: the plan is
// refused on every rank with Error(Unsupported) naming the pair and each transport's reason
// (an early version accepted it, and complete() then stored signals through a null peer pointer).
TEST_F(DeviceWindow, HaloAcrossNodesRefusesUnreachableNeighbour) {
  if (comm->node_count() == 1) GTEST_SKIP() << "needs ranks on several (real or simulated) nodes";
  Window win = comm->alloc(4096);
  const int right = (me + 1) % n, left = (me + n - 1) % n;
  // Whether to skip is decided alike on every rank (make_halo is collective): the lowest rank
  // with an unreachable neighbour reports its first such region (its right neighbour where
  // that is unreachable, else its left one). Only a rank's own routes are known to it.
  const bool right_none = comm->transport(right, Memory::Device) == TransportKind::None;
  const bool left_none = comm->transport(left, Memory::Device) == TransportKind::None;
  const int mine = right_none || left_none ? me : n;
  int reporter = n;
  MPI_Allreduce(&mine, &reporter, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (reporter == n) GTEST_SKIP() << "every halo neighbour is reached (nccl between the nodes' GPUs)";
  int unreached = right_none ? right : left;
  MPI_Bcast(&unreached, 1, MPI_INT, reporter, MPI_COMM_WORLD);
  try {
    HaloExchange halo = comm->make_halo(win, {{right, 0, 2048, 8}, {left, 8, 3072, 8}});
    ADD_FAILURE() << "make_halo accepted a neighbour that no transport reaches";
    return;  // complete() would store through a null peer pointer
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Unsupported) << e.what();
    for (const std::string& p : std::vector<std::string>{"comm.make_halo on rank " + std::to_string(reporter), "no transport reaches device window",
                                "of rank " + std::to_string(unreached), "ipc: rank " + std::to_string(unreached)})
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "'" << p << "' not in: " << e.what();
  }
  // The Comm stays usable.
  comm->barrier(stream);
  CUDA_OK(cudaStreamSynchronize(stream));
}

// A rank late to the nccl transport's connect by more than the timeout (delayed after the
// NCCL ids are exchanged, before it makes its NCCL communicators): the others' NCCL
// initialisation gives up within MESHMEM_TIMEOUT and their constructors raise, naming the
// late rank, instead of waiting inside NCCL until it comes; the late rank raises too.
TEST_F(DeviceWindow, NcclConnectWithALatePeerIsBounded) {
  int every_rank_uses_nccl = 0;
  for (int r = 0; r < n; ++r) every_rank_uses_nccl |= comm->transport(r, Memory::Device) == TransportKind::Nccl;
  MPI_Allreduce(MPI_IN_PLACE, &every_rank_uses_nccl, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!every_rank_uses_nccl) GTEST_SKIP() << "needs every rank to reach some rank through nccl";
  const int late = n - 1;
  constexpr double kTimeout = 3, kLate = 12;
  Options o = options_from_env();
  o.timeout = std::chrono::milliseconds(static_cast<int>(kTimeout * 1000));
  o.set("MESHMEM_FAULT", std::to_string(late) + ":nccl.connect:delay=" + std::to_string(static_cast<int>(kLate * 1000)));
  const auto t0 = std::chrono::steady_clock::now();
  std::string message;
  ErrorCode code = ErrorCode::Internal;
  try {
    Comm late_comm(MPI_COMM_WORLD, o);
    ADD_FAILURE() << "rank " << me << ": the Comm was made although rank " << late << " came "
                  << kLate << " s late with a " << kTimeout << " s timeout";
  } catch (const Error& e) {
    message = e.what();
    code = e.code();
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (me != late) {
    EXPECT_EQ(code, ErrorCode::Timeout) << message;
    EXPECT_GE(took, kTimeout - 0.5) << "rank " << me << " gave up before the timeout: " << message;
    EXPECT_LT(took, kLate - 1) << "rank " << me << " waited for the late rank: " << message;
    // A rank that connects with the late one over NCCL names it (alone, or in the list of its
    // group); a node peer of the late rank waits for ranks that wait for it, and names those.
    const std::string name = std::to_string(late);
    const bool named = message.find("rank " + name) != std::string::npos ||
                       std::regex_search(message, std::regex("rank\\(s\\) ([0-9]+, )*" + name + "\\b"));
    if (comm->transport(late, Memory::Device) == TransportKind::Nccl)
      EXPECT_TRUE(named) << "rank " << me << " did not name the late rank " << late << ": " << message;
    else
      EXPECT_NE(message.find("holds up all"), std::string::npos) << message;
  }
  std::printf("rank %d: the constructor ended after %.1f s: %s\n", me, took, message.empty() ? "made" : message.c_str());
  // Every rank is back (the late one last) before the next case.
  MPI_Barrier(MPI_COMM_WORLD);
}

// Every pair without a device route says why, transport by transport.
TEST_F(DeviceWindow, RoutesAcrossNodesNameEveryReason) {
  if (comm->node_count() == 1) GTEST_SKIP() << "needs ranks on several (real or simulated) nodes";
  for (int r = 0; r < n; ++r) {
    const std::string why = comm->unreachable_reason(r, Memory::Device);
    const TransportKind want = expected_route(*comm, me, r);
    if (comm->node_of(r) == comm->node() || want != TransportKind::None) {
      EXPECT_EQ(comm->transport(r, Memory::Device), want) << "rank " << me << " -> " << r;
      EXPECT_TRUE(why.empty()) << why;
    } else {
      EXPECT_EQ(comm->transport(r, Memory::Device), TransportKind::None);
      EXPECT_NE(why.find("nccl: "), std::string::npos) << why;
      EXPECT_NE(why.find("ipc: rank " + std::to_string(r) + " is on node"), std::string::npos) << why;
      EXPECT_NE(why.find("shm: host windows only"), std::string::npos) << why;
      EXPECT_NE(why.find("mpi: host windows only"), std::string::npos) << why;
    }
  }
}
