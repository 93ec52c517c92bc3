// The node's staging pool (comm/src/cuda/staging_pool.hpp): every rank's region of pinned
// host memory, made on its GPU's NUMA node, is reachable from every node rank's CPU and GPU;
// a region outlives the process object that made it while others map it; make/destroy
// cycles return descriptors and GPU memory to their baseline. Also the queue in which the
// staging agent and the transfer proxies keep handed-over transfers until their sources are
// ready (ReadyQueue, event_pool.hpp). Skipped without a GPU.
#include <cuda_runtime_api.h>
#include <dirent.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>

#include <meshmem/meshmem.hpp>

#include "bootstrap.hpp"
#include "cuda/runtime/block_pool.hpp"
#include "cuda/runtime/event_pool.hpp"
#include "cuda/staged/staging_pool.hpp"
#include "cuda/proxy/transport_mpi_device.hpp"
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
    const std::string why = meshmem::test::select_gpu_on_every_rank();
    if (!why.empty()) GTEST_SKIP() << why;
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


// ---- The block pool (cuda/block_pool.hpp): meshmem's small GPU memory, given back without
// cudaFree or cudaFreeHost. Each rank on its own (no collective calls).

using detail::BlockMemory;
using detail::PooledBlock;

__global__ void wait_for_word(volatile unsigned long long* word) {
  while (*word == 0) __nanosleep(1000);
}

// A device synchronisation as the window releaser runs it: the blocks given back before it
// began are free afterwards.
void quiesce(int device) {
  const std::uint64_t mark = detail::device_quiescence_began(device);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  detail::device_quiescence_ended(device, mark);
}

// Blocks of every size class hold fresh random bytes (device blocks: through fill_block and
// back; host blocks: zeroed when taken, written by the CPU and read through the GPU), none
// overlaps another, and all are 256-byte aligned.
TEST_F(StagingPoolTest, PoolBlocksHoldTheirBytes) {
  const std::size_t sizes[] = {1, 8, 255, 256, 4097, 65536, 300000, (3u << 20) + 17};
  std::vector<PooledBlock> blocks;
  std::vector<std::vector<unsigned char>> data;
  for (BlockMemory kind : {BlockMemory::Device, BlockMemory::MappedHost})
    for (std::size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); ++i) {
      const std::size_t bytes = sizes[i];
      blocks.push_back(detail::take_block(kind, device, bytes, "test"));
      PooledBlock& b = blocks.back();
      ASSERT_TRUE(b);
      EXPECT_GE(b.size(), bytes);
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b.get()) % 256, 0u);
      data.push_back(pattern(seed, 1000 + blocks.size(), bytes));
      if (kind == BlockMemory::MappedHost) {
        const auto* p = static_cast<const unsigned char*>(b.get());
        EXPECT_EQ(std::count(p, p + bytes, 0), static_cast<std::ptrdiff_t>(bytes)) << "host block not zeroed";
        std::memcpy(b.get(), data.back().data(), bytes);
      } else {
        detail::fill_block(b, data.back().data(), bytes, "test");
      }
    }
  for (std::size_t i = 0; i < blocks.size(); ++i)
    for (std::size_t j = i + 1; j < blocks.size(); ++j) {
      const auto* a = static_cast<const char*>(blocks[i].get());
      const auto* b = static_cast<const char*>(blocks[j].get());
      EXPECT_TRUE(a + blocks[i].size() <= b || b + blocks[j].size() <= a) << "blocks " << i << " and " << j << " overlap";
    }
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    std::vector<unsigned char> back(data[i].size(), 0xAB);
    CUDA_OK(cudaMemcpy(back.data(), blocks[i].get(), back.size(), cudaMemcpyDefault));
    EXPECT_EQ(first_difference(back.data(), data[i].data(), back.size()), -1) << "block " << i;
  }
}

// A block given back is not reused, and its chunk not unmapped, before a device
// synchronisation that began after it was given back has ended; then the pool is back to
// what it held before.
TEST_F(StagingPoolTest, GivenBackBlocksWaitForADeviceSynchronisation) {
  quiesce(device);
  const std::size_t before = detail::block_pool_bytes(device);
  void* first = nullptr;
  {
    PooledBlock b = detail::take_block(BlockMemory::Device, device, 4096, "test");
    first = b.get();
  }
  EXPECT_TRUE(detail::blocks_in_quarantine(device));
  const std::uint64_t early = detail::device_quiescence_began(device);  // began before the next give-back
  {
    PooledBlock again = detail::take_block(BlockMemory::Device, device, 4096, "test");
    EXPECT_NE(again.get(), first) << "a quarantined block was handed out again";
  }
  CUDA_OK(cudaDeviceSynchronize());
  detail::device_quiescence_ended(device, early);
  EXPECT_TRUE(detail::blocks_in_quarantine(device)) << "a block given back after the synchronisation began was freed";
  quiesce(device);
  EXPECT_FALSE(detail::blocks_in_quarantine(device));
  EXPECT_EQ(detail::block_pool_bytes(device), before);
}

// 1,000 take/give-back cycles of both kinds, with a synchronisation every 10: the pool's
// chunks, the descriptors and the GPU's free memory are back where they were.
TEST_F(StagingPoolTest, PoolCyclesReturnToBaseline) {
  { PooledBlock warm = detail::take_block(BlockMemory::MappedHost, device, 64, "test"); }
  quiesce(device);
  const std::size_t pool0 = detail::block_pool_bytes(device);
  std::size_t free0 = 0, total = 0;
  CUDA_OK(cudaMemGetInfo(&free0, &total));
  const int fds0 = open_fds();
  for (int i = 0; i < 1000; ++i) {
    PooledBlock d = detail::take_block(BlockMemory::Device, device, 64 + i, "test");
    PooledBlock h = detail::take_block(BlockMemory::MappedHost, device, 4096 + i, "test");
    static_cast<volatile unsigned char*>(h.get())[i] = 1;
    if (i % 10 == 9) {
      d = PooledBlock();
      h = PooledBlock();
      quiesce(device);
    }
  }
  quiesce(device);
  std::size_t free1 = 0;
  CUDA_OK(cudaMemGetInfo(&free1, &total));
  EXPECT_EQ(detail::block_pool_bytes(device), pool0);
  EXPECT_EQ(open_fds(), fds0);
  // Other ranks sharing this GPU run the same cycles at about the same time.
  EXPECT_LE(free0 > free1 ? free0 - free1 : 0, std::size_t{8} << 20) << free0 << " -> " << free1 << " bytes free";
}

// The point of the pool: giving blocks back, their chunks unmapped at once, while a kernel of
// another stream runs returns at once, and so does another thread's launch meanwhile
// (cudaFree and cudaFreeHost would wait for the kernel and hold up the other thread's CUDA
// calls with them: studies/queue_lab).
TEST_F(StagingPoolTest, GivingBackDoesNotWaitForARunningKernel) {
  PooledBlock word = detail::take_block(BlockMemory::MappedHost, device, 8, "test");
  auto* flag = static_cast<unsigned long long*>(word.get());
  std::vector<PooledBlock> blocks;
  for (int i = 0; i < 8; ++i) {
    blocks.push_back(detail::take_block(BlockMemory::Device, device, 1 << 16, "test"));
    blocks.push_back(detail::take_block(BlockMemory::MappedHost, device, 1 << 16, "test"));
  }
  // Chunks of their own (larger than any free space): emptied and unmapped below.
  blocks.push_back(detail::take_block(BlockMemory::Device, device, 3u << 20, "test"));
  blocks.push_back(detail::take_block(BlockMemory::MappedHost, device, 3u << 20, "test"));
  const std::size_t mapped = detail::block_pool_bytes(device);
  // Releases the kernel and frees the streams however the test ends (a failed assertion
  // returns early: the kernel must not spin on for the next test to wait behind).
  struct Streams {
    unsigned long long* flag = nullptr;
    cudaStream_t busy = nullptr, other = nullptr;
    ~Streams() {
      if (flag != nullptr) __atomic_store_n(flag, 1ull, __ATOMIC_RELEASE);
      for (cudaStream_t s : {busy, other})
        if (s != nullptr) {
          cudaStreamSynchronize(s);
          cudaStreamDestroy(s);
        }
    }
  } streams;
  CUDA_OK(cudaStreamCreateWithFlags(&streams.busy, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&streams.other, cudaStreamNonBlocking));
  const cudaStream_t busy = streams.busy, other = streams.other;
  *flag = 0;
  streams.flag = flag;  // from here on the guard releases the kernel
  wait_for_word<<<1, 1, 0, busy>>>(flag);
  CUDA_OK(cudaGetLastError());
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto t0 = std::chrono::steady_clock::now();
  {
    detail::QuiescedRelease covered(device);  // as if synchronised: freed, not quarantined
    blocks.clear();
  }
  const double give_back = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LE(detail::block_pool_bytes(device) + (8u << 20), mapped) << "the large blocks' chunks were not unmapped";
  PooledBlock target = detail::take_block(BlockMemory::Device, device, 4096, "test");
  double launch = 0;
  cudaError_t launched = cudaSuccess;
  std::thread([&] {
    (void)cudaSetDevice(device);
    const auto t1 = std::chrono::steady_clock::now();
    launched = cudaMemsetAsync(target.get(), 1, 4096, other);
    launch = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  }).join();
  EXPECT_EQ(launched, cudaSuccess);
  __atomic_store_n(flag, 1ull, __ATOMIC_RELEASE);
  CUDA_OK(cudaStreamSynchronize(busy));
  CUDA_OK(cudaStreamSynchronize(other));
  EXPECT_LT(give_back, 1.0) << "giving 16 blocks back behind a running kernel took " << give_back << " s";
  EXPECT_LT(launch, 1.0) << "another thread's copy waited " << launch << " s";
  quiesce(device);
}

// Pinned slots that MPI sent from or received into stay mapped after their Comm (an MPI
// library may still hold a registration of their pages, found by address, and would use it
// for whatever is mapped there later) and serve the next Comm of the process: after each of
// two Comms whose device windows went through mpi-device (every rank a simulated node), the
// pool holds the slots' bytes once, neither none nor twice; and the puts carried every byte.
TEST_F(StagingPoolTest, MpiDeviceSlotsStayMappedForTheNextComm) {
  int n = 0, me = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  if (n < 2) GTEST_SKIP() << "needs 2 ranks or more";
  Options o = Options::from_environment();
  o.simulate_nodes = n;  // every rank a node of its own (ranks of one real node)
  o.transports = {TransportKind::MpiDevice, TransportKind::Shm, TransportKind::Mpi};
  // The wire's slots: kSlots each way (max(kSlots, peers) receiving), kChunk each.
  const std::size_t slots = detail::MpiDeviceTransport::kChunk *
                            (detail::MpiDeviceTransport::kSlots +
                             std::max<std::size_t>(detail::MpiDeviceTransport::kSlots, static_cast<std::size_t>(n - 1)));
  quiesce(device);
  const std::size_t base = detail::block_pool_bytes(device);
  std::vector<std::size_t> after;
  for (int cycle = 0; cycle < 2; ++cycle) {
    {
      Comm comm(MPI_COMM_WORLD, o);
      const int to = (me + 1) % n, from = (me + n - 1) % n;
      ASSERT_EQ(comm.transport(to, Memory::Device), TransportKind::MpiDevice);
      const std::size_t bytes = (9u << 20) + 3;  // three chunks, the last one short
      Window win = comm.alloc(bytes + 64);
      cudaStream_t s = nullptr;
      CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      CUDA_OK(fill_now(win.local(), kPoison, bytes + 64));
      const std::vector<unsigned char> mine = pattern(seed, 100 * cycle + me, bytes);
      DeviceBuffer src(bytes);
      CUDA_OK(upload(src.p, mine.data(), bytes));
      comm.barrier(s);
      comm.put(win, to, 5, src.p, bytes, s);
      comm.barrier(s);
      CUDA_OK(cudaStreamSynchronize(s));
      std::vector<unsigned char> want(bytes + 64, kPoison);
      const std::vector<unsigned char> theirs = pattern(seed, 100 * cycle + from, bytes);
      std::memcpy(want.data() + 5, theirs.data(), bytes);
      const auto got = to_host(win.local(), bytes + 64);
      EXPECT_EQ(first_difference(got.data(), want.data(), want.size()), -1) << "cycle " << cycle << ", rank " << me;
      comm.barrier(s);
      CUDA_OK(cudaStreamSynchronize(s));
      CUDA_OK(cudaStreamDestroy(s));
    }
    quiesce(device);
    after.push_back(detail::block_pool_bytes(device));
  }
  EXPECT_GE(after[0], base + slots) << "the mpi-device slots' chunks were unmapped with their Comm (" << base << " -> "
                                    << after[0] << " bytes mapped)";
  EXPECT_EQ(after[1], after[0]) << "the second Comm did not reuse the first one's slots";
}

// ReadyQueue: a transfer is taken once its source is ready and never before one of its own
// stream handed over earlier; a stream held back holds no other stream, nor transfers without
// an event, nor those of the per-thread default stream (one handle for many threads' streams:
// each is asked); take_all hands over the rest.
TEST_F(StagingPoolTest, ReadyQueueTakesEachStreamInOrderAndHoldsNoOther) {
  struct Item {
    cudaEvent_t ready;
    cudaStream_t stream;
    int id;
  };
  // Releases the held stream and frees what the test made however it ends (a failed
  // assertion returns early: the kernel must not spin on for the next test to wait behind).
  struct Owned {
    PooledBlock word;
    unsigned long long* flag = nullptr;
    cudaStream_t held = nullptr, free_stream = nullptr;
    std::vector<cudaEvent_t> events;
    ~Owned() {
      if (flag != nullptr) __atomic_store_n(flag, 1ull, __ATOMIC_RELEASE);
      if (held != nullptr) cudaStreamSynchronize(held);
      for (cudaEvent_t e : events) cudaEventDestroy(e);
      if (held != nullptr) cudaStreamDestroy(held);
      if (free_stream != nullptr) cudaStreamDestroy(free_stream);
    }
  } o;
  o.word = detail::take_block(BlockMemory::MappedHost, device, 8, "test");
  unsigned long long* flag = static_cast<unsigned long long*>(o.word.get());
  *flag = 0;
  CUDA_OK(cudaStreamCreateWithFlags(&o.held, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&o.free_stream, cudaStreamNonBlocking));
  o.events.resize(5);
  for (cudaEvent_t& e : o.events) CUDA_OK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  const std::vector<cudaEvent_t>& ev = o.events;
  // Done at once: ev[1] (handed over as the held stream's: taken before 1 only if it were
  // asked), ev[2], ev[3]; behind the kernel: ev[0], ev[4].
  CUDA_OK(cudaEventRecord(ev[1], o.free_stream));
  CUDA_OK(cudaEventRecord(ev[2], o.free_stream));
  CUDA_OK(cudaEventRecord(ev[3], cudaStreamPerThread));
  CUDA_OK(cudaStreamSynchronize(o.free_stream));
  CUDA_OK(cudaStreamSynchronize(cudaStreamPerThread));
  o.flag = flag;  // from here on the guard releases the kernel
  wait_for_word<<<1, 1, 0, o.held>>>(flag);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaEventRecord(ev[0], o.held));
  CUDA_OK(cudaEventRecord(ev[4], o.held));
  detail::ReadyQueue<Item> queue;
  queue.push(Item{ev[0], o.held, 1});
  queue.push(Item{ev[1], o.held, 2});
  queue.push(Item{ev[2], o.free_stream, 3});
  queue.push(Item{nullptr, o.held, 4});                // no event (a rung doorbell): ready
  queue.push(Item{ev[0], cudaStreamPerThread, 5});     // per-thread, not ready: holds no other
  queue.push(Item{ev[3], cudaStreamPerThread, 6});     // per-thread, ready
  queue.push(Item{ev[4], o.held, 7});
  EXPECT_EQ(queue.size(), 7u);
  std::vector<int> taken;
  auto take = [&](const Item& item, cudaError_t rc) {
    EXPECT_EQ(rc, cudaSuccess) << "transfer " << item.id;
    taken.push_back(item.id);
  };
  auto query = [](const Item& item) { return cudaEventQuery(item.ready); };
  EXPECT_TRUE(queue.take_ready(query, take));
  std::sort(taken.begin(), taken.end());
  EXPECT_EQ(taken, (std::vector<int>{3, 4, 6}));
  EXPECT_EQ(queue.size(), 4u);
  taken.clear();
  EXPECT_FALSE(queue.take_ready(query, take)) << "transfers behind the held kernel were taken before it ended";
  __atomic_store_n(flag, 1ull, __ATOMIC_RELEASE);
  CUDA_OK(cudaStreamSynchronize(o.held));
  EXPECT_TRUE(queue.take_ready(query, take));
  std::vector<int> held_order;
  for (int id : taken)
    if (id != 5) held_order.push_back(id);
  EXPECT_EQ(held_order, (std::vector<int>{1, 2, 7})) << "the held stream's own order";
  EXPECT_EQ(std::count(taken.begin(), taken.end(), 5), 1);
  EXPECT_TRUE(queue.empty());
  // What is left at the end is handed over whole.
  queue.push(Item{ev[0], o.held, 8});
  queue.push(Item{ev[3], cudaStreamPerThread, 9});
  queue.push(Item{nullptr, o.free_stream, 10});
  taken.clear();
  queue.take_all([&](const Item& item) { taken.push_back(item.id); });
  std::sort(taken.begin(), taken.end());
  EXPECT_EQ(taken, (std::vector<int>{8, 9, 10}));
  EXPECT_TRUE(queue.empty());
  EXPECT_FALSE(queue.take_ready(query, take));
}

}  // namespace
}  // namespace meshmem::test
