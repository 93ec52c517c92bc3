// alloc_lab: where the time of mapping node peers' VMM allocations goes (the study behind
// comm.alloc's import path). Every rank creates 1 GiB, exports a POSIX fd, and maps every
// peer's allocation: call by call, one peer after another, then all peers from threads at
// once, then into one reserved range with one access call.
//   mpirun -np 4 alloc_lab
#include <cuda.h>
#include <cuda_runtime.h>
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <meshmem/ipc/cuda_driver.hpp>
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

CUmemAccessDesc access_for(int device) {
  CUmemAccessDesc a{};
  a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a.location.id = device;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int size = 0, g_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  bench::check_rank() = g_rank;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  {
    const int device = meshmem::select_local_device(MPI_COMM_WORLD);
    cudaFree(nullptr);
    const auto& d = meshmem::ipc::cuda_driver();
    const std::size_t bytes = std::size_t(1) << 30;
    auto t0 = Clock::now();
    meshmem::ipc::VmmAllocation mine = meshmem::ipc::VmmAllocation::create(bytes, device);
    const double create_ms = ms_since(t0);
    meshmem::ipc::UniqueFd fd = mine.export_fd();
    Peer me{getpid(), fd.get()};
    std::vector<Peer> all(size);
    MPI_Allgather(&me, sizeof(Peer), MPI_BYTE, all.data(), sizeof(Peer), MPI_BYTE, MPI_COMM_WORLD);
    const CUmemAccessDesc access = access_for(device);
    auto import_handle = [&](int r) {
      meshmem::ipc::UniqueFd pfd = meshmem::ipc::fetch_fd(all[r].pid, all[r].fd);
      CUmemGenericAllocationHandle h = 0;
      CU(d.cuMemImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<std::intptr_t>(pfd.get())),
                                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
      return h;
    };

    // 1. One peer after another, call by call.
    double t_fetch = 0, t_import = 0, t_reserve = 0, t_map = 0, t_access = 0, t_unmap = 0;
    MPI_Barrier(MPI_COMM_WORLD);
    auto total0 = Clock::now();
    std::vector<CUdeviceptr> ptrs;
    for (int r = 0; r < size; ++r) {
      if (r == g_rank) continue;
      t0 = Clock::now();
      meshmem::ipc::UniqueFd pfd = meshmem::ipc::fetch_fd(all[r].pid, all[r].fd);
      t_fetch += ms_since(t0);
      t0 = Clock::now();
      CUmemGenericAllocationHandle h = 0;
      CU(d.cuMemImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<std::intptr_t>(pfd.get())),
                                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
      t_import += ms_since(t0);
      t0 = Clock::now();
      CUdeviceptr p = 0;
      CU(d.cuMemAddressReserve(&p, bytes, 0, 0, 0));
      t_reserve += ms_since(t0);
      t0 = Clock::now();
      CU(d.cuMemMap(p, bytes, 0, h, 0));
      t_map += ms_since(t0);
      t0 = Clock::now();
      CU(d.cuMemSetAccess(p, bytes, &access, 1));
      t_access += ms_since(t0);
      CU(d.cuMemRelease(h));
      ptrs.push_back(p);
    }
    const double sequential = ms_since(total0);
    t0 = Clock::now();
    for (CUdeviceptr p : ptrs) {
      CU(d.cuMemUnmap(p, bytes));
      CU(d.cuMemAddressFree(p, bytes));
    }
    t_unmap = ms_since(t0);
    ptrs.clear();

    // 2. All peers at once, a thread each.
    MPI_Barrier(MPI_COMM_WORLD);
    total0 = Clock::now();
    std::vector<std::thread> threads;
    std::vector<CUdeviceptr> tptr(size, 0);
    for (int r = 0; r < size; ++r) {
      if (r == g_rank) continue;
      threads.emplace_back([&, r] {
        cudaSetDevice(device);  // the primary context, current in this thread too
        meshmem::ipc::UniqueFd pfd = meshmem::ipc::fetch_fd(all[r].pid, all[r].fd);
        CUmemGenericAllocationHandle h = 0;
        CU(d.cuMemImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<std::intptr_t>(pfd.get())),
                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
        CUdeviceptr p = 0;
        CU(d.cuMemAddressReserve(&p, bytes, 0, 0, 0));
        CU(d.cuMemMap(p, bytes, 0, h, 0));
        CU(d.cuMemSetAccess(p, bytes, &access, 1));
        CU(d.cuMemRelease(h));
        tptr[r] = p;
      });
    }
    for (auto& t : threads) t.join();
    const double threaded = ms_since(total0);
    for (CUdeviceptr p : tptr)
      if (p) {
        CU(d.cuMemUnmap(p, bytes));
        CU(d.cuMemAddressFree(p, bytes));
      }

    // 3. One reserved range for every peer, one access call.
    MPI_Barrier(MPI_COMM_WORLD);
    total0 = Clock::now();
    CUdeviceptr base = 0;
    CU(d.cuMemAddressReserve(&base, bytes * (size - 1), 0, 0, 0));
    int k = 0;
    for (int r = 0; r < size; ++r) {
      if (r == g_rank) continue;
      const CUmemGenericAllocationHandle h = import_handle(r);
      CU(d.cuMemMap(base + bytes * k++, bytes, 0, h, 0));
      CU(d.cuMemRelease(h));
    }
    CU(d.cuMemSetAccess(base, bytes * (size - 1), &access, 1));
    const double one_range = ms_since(total0);
    CU(d.cuMemUnmap(base, bytes * (size - 1)));
    CU(d.cuMemAddressFree(base, bytes * (size - 1)));

    // 4. One peer after another, each range reserved with a large alignment (lets the
    // driver use large pages for the peer mappings, if it does).
    auto aligned = [&](std::size_t alignment) {
      MPI_Barrier(MPI_COMM_WORLD);
      const auto start = Clock::now();
      std::vector<CUdeviceptr> ps;
      for (int r = 0; r < size; ++r) {
        if (r == g_rank) continue;
        const CUmemGenericAllocationHandle h = import_handle(r);
        CUdeviceptr p = 0;
        CU(d.cuMemAddressReserve(&p, bytes, alignment, 0, 0));
        CU(d.cuMemMap(p, bytes, 0, h, 0));
        CU(d.cuMemSetAccess(p, bytes, &access, 1));
        CU(d.cuMemRelease(h));
        ps.push_back(p);
      }
      const double t = ms_since(start);
      for (CUdeviceptr p : ps) {
        CU(d.cuMemUnmap(p, bytes));
        CU(d.cuMemAddressFree(p, bytes));
      }
      return t;
    };
    const double a512 = aligned(std::size_t(512) << 20);
    const double a1g = aligned(std::size_t(1) << 30);
    const double again = aligned(0);

    double mine_v[13] = {create_ms, t_fetch, t_import, t_reserve, t_map, t_access, t_unmap, sequential, threaded, one_range, a512, a1g, again};
    std::vector<double> every(static_cast<std::size_t>(13) * size);
    MPI_Gather(mine_v, 13, MPI_DOUBLE, every.data(), 13, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    if (g_rank == 0) {
      std::printf("# alloc_lab: %d ranks, 1 GiB each; ms per rank (all peers together)\n", size);
      std::printf("%-5s %8s %8s %8s %8s %8s %8s %8s | %10s %10s %10s %10s %10s %10s\n", "#rank", "create", "fetchfd", "import", "reserve",
                  "map", "access", "unmap", "sequential", "threads", "one-range", "align512M", "align1G", "again");
      for (int r = 0; r < size; ++r) {
        const double* v = &every[static_cast<std::size_t>(r) * 13];
        std::printf("%-5d %8.2f %8.2f %8.2f %8.2f %8.2f %8.2f %8.2f | %10.2f %10.2f %10.2f %10.2f %10.2f %10.2f\n", r, v[0], v[1], v[2], v[3],
                    v[4], v[5], v[6], v[7], v[8], v[9], v[10], v[11], v[12]);
      }
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
  MPI_Finalize();
  return 0;
}
