// DeviceWindow, the fixture and helpers of the device-window suite (test_device_window.cu and
// device_window_*.cu, compiled as one translation unit): the foundation's checks on GPU memory
// (fresh random data, poisoned destinations, every byte checked). Skipped without a GPU.
#pragma once
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

