// The node's staging pool (comm/src/cuda/staging_pool.hpp): every rank's region of pinned
// host memory, made on its GPU's NUMA node, is reachable from every node rank's CPU and GPU;
// a region outlives the process object that made it while others map it; make/destroy
// cycles return descriptors and GPU memory to their baseline. Skipped without a GPU.
#include <cuda_runtime_api.h>
#include <dirent.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>

#include <meshmem/meshmem.hpp>

#include "bootstrap.hpp"
#include "cuda/staging_pool.hpp"
#include "fd_exchange.hpp"
#include "gpu_test.hpp"
#include "mpi_test.hpp"
#include "topology.hpp"

namespace meshmem::test {
namespace {

using detail::Bootstrap;
using detail::FdExchange;
using detail::StagingPool;
using detail::Topology;

constexpr std::size_t kRegion = (4u << 20) + 4096;  // rounds up to 6 MiB with 2 MiB pages

struct Ranks {
  Bootstrap boot;
  Topology topo;
  FdExchange fds;
  Ranks()
      : boot(MPI_COMM_WORLD, std::chrono::milliseconds(60000)),
        topo(Topology::discover(boot, Options::from_environment().simulate_nodes)),
        fds(boot, topo, Options::from_environment().fd_passing) {}
};

int open_fds() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') ++n;
    closedir(d);
  }
  return n;
}

class StagingPoolTest : public MpiTest {
 protected:
  void SetUp() override {
    std::string why;
    if (!gpu_available(&why) || select_local_device(MPI_COMM_WORLD) < 0) GTEST_SKIP() << "no usable GPU: " << why;
    cudaGetDevice(&device);
    seed = shared_seed();
  }
  std::unique_ptr<StagingPool> make(Ranks& s) {
    return std::make_unique<StagingPool>(s.boot, s.topo, s.fds, kRegion, device, std::vector<int>{device}, "test pool");
  }
  int device = -1;
  std::uint64_t seed = 0;
};

// Each rank fills its region from the CPU; every node rank reads every region from the CPU
// and through its GPU (a copy engine reading host memory). Then each GPU writes into its
// right node neighbour's region and the owner checks it from the CPU.
TEST_F(StagingPoolTest, EveryRegionReachesEveryCpuAndGpuOfTheNode) {
  Ranks s;
  auto pool = make(s);
  const Topology& t = s.topo;
  ASSERT_GE(pool->region_bytes(), kRegion);
  EXPECT_EQ(pool->region_bytes() % (2u << 20), 0u) << pool->describe();
  const std::size_t bytes = pool->region_bytes();
  auto fill = pattern(seed, 100 + t.rank, bytes);
  std::memcpy(pool->region(t.rank), fill.data(), bytes);
  MPI_Barrier(MPI_COMM_WORLD);
  void* dev = nullptr;
  CUDA_OK(cudaMalloc(&dev, bytes));
  std::vector<unsigned char> got(bytes);
  for (int r : t.node_ranks) {
    const auto want = pattern(seed, 100 + r, bytes);
    EXPECT_EQ(first_difference(static_cast<const unsigned char*>(pool->region(r)), want.data(), bytes), -1)
        << "rank " << r << "'s region read by the CPU of rank " << t.rank;
    std::memset(got.data(), kPoison, bytes);
    CUDA_OK(cudaMemset(dev, kPoison, bytes));
    CUDA_OK(cudaMemcpy(dev, pool->region(r), bytes, cudaMemcpyDefault));
    CUDA_OK(cudaMemcpy(got.data(), dev, bytes, cudaMemcpyDeviceToHost));
    EXPECT_EQ(first_difference(got.data(), want.data(), bytes), -1)
        << "rank " << r << "'s region read through the GPU of rank " << t.rank;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  // GPU writes into the right node neighbour's region.
  const auto& nr = t.node_ranks;
  const std::size_t at = static_cast<std::size_t>(std::find(nr.begin(), nr.end(), t.rank) - nr.begin());
  const int right = nr[(at + 1) % nr.size()];
  const int left = nr[(at + nr.size() - 1) % nr.size()];
  const auto mine = pattern(seed, 200 + t.rank, bytes);
  CUDA_OK(cudaMemcpy(dev, mine.data(), bytes, cudaMemcpyHostToDevice));
  MPI_Barrier(MPI_COMM_WORLD);  // everyone has read its regions
  CUDA_OK(cudaMemcpy(pool->region(right), dev, bytes, cudaMemcpyDefault));
  CUDA_OK(cudaDeviceSynchronize());
  MPI_Barrier(MPI_COMM_WORLD);
  const auto want = pattern(seed, 200 + left, bytes);
  EXPECT_EQ(first_difference(static_cast<const unsigned char*>(pool->region(t.rank)), want.data(), bytes), -1)
      << "rank " << left << "'s GPU write into rank " << t.rank << "'s region";
  cudaFree(dev);
  MPI_Barrier(MPI_COMM_WORLD);
}

// The lowest node rank lets go of its pool (its own region included) first; the others
// still read that region intact afterwards: no process has to stay alive for the others.
TEST_F(StagingPoolTest, RegionOutlivesTheProcessObjectThatMadeIt) {
  Ranks s;
  auto pool = make(s);
  const Topology& t = s.topo;
  const int maker = t.node_ranks.front();
  const std::size_t bytes = pool->region_bytes();
  if (t.rank == maker) {
    const auto fill = pattern(seed, 300, bytes);
    std::memcpy(pool->region(t.rank), fill.data(), bytes);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (t.rank == maker) pool.reset();
  MPI_Barrier(MPI_COMM_WORLD);
  if (t.rank != maker) {
    const auto want = pattern(seed, 300, bytes);
    EXPECT_EQ(first_difference(static_cast<const unsigned char*>(pool->region(maker)), want.data(), bytes), -1)
        << "rank " << maker << "'s region after rank " << maker << " let go of it";
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// 200 make/destroy cycles: descriptors and free GPU memory back to where they were after the
// first cycle (which sets up the driver's own state).
TEST_F(StagingPoolTest, CyclesReturnToBaseline) {
  Ranks s;
  make(s).reset();
  CUDA_OK(cudaDeviceSynchronize());
  std::size_t free0 = 0, total = 0;
  CUDA_OK(cudaMemGetInfo(&free0, &total));
  const int fds0 = open_fds();
  for (int i = 0; i < 200; ++i) {
    auto pool = make(s);
    static_cast<volatile unsigned char*>(pool->region(s.topo.rank))[i] = static_cast<unsigned char>(i);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  std::size_t free1 = 0;
  CUDA_OK(cudaMemGetInfo(&free1, &total));
  EXPECT_EQ(open_fds(), fds0) << "descriptors after 200 cycles";
  // Other ranks sharing this GPU free theirs at about the same time: allow one granule each.
  EXPECT_LE(free0 > free1 ? free0 - free1 : 0, static_cast<std::size_t>(s.topo.node_ranks.size()) * (2u << 20))
      << "GPU memory after 200 cycles: " << free0 << " -> " << free1 << " bytes free";
}

}  // namespace
}  // namespace meshmem::test
