// staging_memory_lab: the GPU memory that pinned staging memory costs, per GPU, when every
// process of a node must reach the node's staging bytes: meshmem's shared pool (each rank makes
// its share as VMM host-NUMA memory with 2 MiB pages and maps every rank's share) against each
// process pinning the same bytes itself with cudaHostRegister (4 KiB pages). GPU memory is
// read with cudaMemGetInfo before and after, every rank having finished its step (ranks that
// share a GPU all count on that GPU).
//   mpirun -np 4 staging_memory_lab [--bytes N]   (N: node total, K/M/G suffixes, default 4G)
#include <cuda.h>
#include <cuda_runtime.h>
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <meshmem/ipc/pidfd.hpp>
#include <meshmem/ipc/vmm.hpp>
#include <meshmem/meshmem.hpp>
#include <string>
#include <thread>
#include <vector>

#include "bench_check.hpp"

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

struct Peer {
  pid_t pid;
  int fd;
};

// Free GPU memory once every rank has reached this point (and the driver had a moment).
std::size_t free_after_everyone() {
  CK(cudaDeviceSynchronize());
  MPI_Barrier(MPI_COMM_WORLD);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  std::size_t free = 0, total = 0;
  CK(cudaMemGetInfo(&free, &total));
  MPI_Barrier(MPI_COMM_WORLD);
  return free;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int size = 0, rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  bench::check_rank() = rank;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::size_t node_bytes = std::size_t(4) << 30;
  for (int i = 1; i < argc; ++i) {
    const bool known = std::strcmp(argv[i], "--bytes") == 0 && i + 1 < argc;
    if (!known || !bench::parse_bytes(argv[++i], &node_bytes)) {
      if (rank == 0)
        std::fprintf(stderr, "staging_memory_lab: bad argument '%s' (usage: --bytes N, N in bytes or with K/M/G)\n",
                     argv[i]);
      MPI_Finalize();
      return 2;
    }
  }
  {
    const int device = meshmem::select_local_device(MPI_COMM_WORLD);
    CK(cudaFree(nullptr));
    const int numa = meshmem::ipc::host_numa_node_of(device);
    if (numa < 0) {
      if (rank == 0) std::printf("device %d cannot allocate VMM host-NUMA memory: nothing to measure\n", device);
      MPI_Finalize();
      return 0;
    }
    const std::size_t granule = meshmem::ipc::host_numa_granularity(numa);
    const std::size_t share = meshmem::ipc::vmm_round(node_bytes / size, granule);
    const std::size_t mapped = share * size;  // what each process reaches
    char bus[32] = {};
    CK(cudaDeviceGetPCIBusId(bus, sizeof(bus), device));
    { auto warm = meshmem::ipc::SharedHostMemory::create(granule, numa, {device}); }  // driver state, not counted

    // 1. meshmem's pool: one share per rank, every share mapped by every rank.
    std::size_t free0 = free_after_everyone();
    auto t0 = Clock::now();
    std::vector<meshmem::ipc::SharedHostMemory> shares(size);
    shares[rank] = meshmem::ipc::SharedHostMemory::create(share, numa, {device});
    meshmem::ipc::UniqueFd fd = shares[rank].export_fd();
    Peer me{getpid(), fd.get()};
    std::vector<Peer> all(size);
    MPI_Allgather(&me, sizeof(Peer), MPI_BYTE, all.data(), sizeof(Peer), MPI_BYTE, MPI_COMM_WORLD);
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      meshmem::ipc::UniqueFd pfd = meshmem::ipc::fetch_fd(all[r].pid, all[r].fd);
      shares[r] = meshmem::ipc::SharedHostMemory::import(pfd.get(), share, {device});
    }
    const double pool_ms = ms_since(t0);
    std::memset(shares[rank].data(), 1, share);
    const std::size_t free1 = free_after_everyone();
    shares.clear();
    MPI_Barrier(MPI_COMM_WORLD);

    // 2. Every process pins all the node's staging bytes itself (pageable memory, 4 KiB pages).
    const std::size_t free2 = free_after_everyone();
    void* p = nullptr;
    if (posix_memalign(&p, 4096, mapped) != 0) bench::fail("posix_memalign", "no memory", __FILE__, __LINE__);
    std::memset(p, 1, mapped);
    t0 = Clock::now();
    CK(cudaHostRegister(p, mapped, cudaHostRegisterDefault));
    const double register_ms = ms_since(t0);
    const std::size_t free3 = free_after_everyone();
    CK(cudaHostUnregister(p));
    std::free(p);

    struct Row {
      char bus[32];
      double pool_mib, register_mib, pool_ms, register_ms;
    } row{};
    std::memcpy(row.bus, bus, sizeof(bus));
    row.pool_mib = (static_cast<double>(free0) - static_cast<double>(free1)) / (1 << 20);
    row.register_mib = (static_cast<double>(free2) - static_cast<double>(free3)) / (1 << 20);
    row.pool_ms = pool_ms;
    row.register_ms = register_ms;
    std::vector<Row> rows(size);
    MPI_Gather(&row, sizeof(Row), MPI_BYTE, rows.data(), sizeof(Row), MPI_BYTE, 0, MPI_COMM_WORLD);
    if (rank == 0) {
      std::printf("# staging_memory_lab: %d ranks, node staging %zu MiB (%zu MiB per rank), %zu KiB host-NUMA pages\n",
                  size, mapped >> 20, share >> 20, granule >> 10);
      std::printf("# GPU memory used on the rank's GPU while every rank reaches all %zu MiB (all ranks on that GPU counted)\n",
                  mapped >> 20);
      std::printf("# %-4s %-14s %22s %22s %10s %12s\n", "rank", "gpu", "shared-pool(MiB)", "hostregister-4k(MiB)",
                  "pool(ms)", "register(ms)");
      std::printf("# pinned host memory: the shared pool pins %zu MiB once for the node; cudaHostRegister in every process "
                  "pins %zu MiB (%d x)\n", mapped >> 20, (mapped >> 20) * static_cast<std::size_t>(size), size);
      for (int r = 0; r < size; ++r)
        std::printf("  %-4d %-14s %22.1f %22.1f %10.1f %12.1f\n", r, rows[r].bus, rows[r].pool_mib, rows[r].register_mib,
                    rows[r].pool_ms, rows[r].register_ms);
    }
  }
  MPI_Finalize();
  return 0;
}
