// cross_host_bench: device windows between two ranks on different nodes (separate hosts made by
// launch/meshmem-hosts, real nodes, or MESHMEM_SIMULATE_NODES), rank 0 -> rank 1, against the
// baselines of the same run:
//   cross_host_put      meshmem-nccl (the nccl transport), meshmem-mpi (the mpi-device
//                       transport: NCCL left out), nccl (raw ncclSend / ncclRecv, the same
//                       sizes, one transfer after another on one stream)
//   cross_host_barrier  meshmem-nccl (barrier(stream) + stream sync across nodes, hierarchical:
//                       the node leaders' NCCL all-reduce, MESHMEM_BARRIER_ACROSS_NODES=nccl
//                       unless set), meshmem-mpi (the same where the routes are mpi-device: the
//                       proxy thread's meeting over MPI), nccl (an all-reduce of one word +
//                       sync); size 1: idle (one at a time), size 200: 200 back to back, then
//                       one sync (latency per barrier)
// Latency = time per transfer with one in flight (a meshmem put's stream passes it once the
// data is at the target); bandwidth = size / that time. Prints OSU-style tables and a summary
// of ratios; --csv appends rows in the bench/results format.
//   mpirun -np 2 cross_host_bench [--csv FILE] [--commit C] [--machine M] [--date D]
//                                 [--max-bytes N] [--quick]
#include <cuda_runtime_api.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <meshmem/meshmem.hpp>
#include <string>
#include <vector>

#include <nccl.h>

#include "bench_check.hpp"
#include "results_csv.hpp"

namespace {

#define NK(call)                                                                                    \
  do {                                                                                              \
    const ncclResult_t rc_ = (call);                                                                \
    if (rc_ != ncclSuccess) bench::fail(#call, ncclGetErrorString(rc_), __FILE__, __LINE__);         \
  } while (0)

int g_rank = 0;
std::vector<bench::ResultRow> g_rows;

void record(const char* benchmark, const char* variant, long long size, double us, double gbps) {
  g_rows.push_back(bench::ResultRow{benchmark, variant, 2, size, us, gbps});
  if (g_rank == 0)
    std::printf("  %-18s %-13s %12lld %14.2f %16.3f\n", benchmark, variant, size, us, gbps < 0 ? 0.0 : gbps);
}

int iterations_for(std::size_t bytes, bool quick) {
  const double budget = quick ? 1e8 : 1e9;  // bytes per measurement
  return static_cast<int>(std::min(quick ? 100.0 : 500.0, std::max(5.0, budget / static_cast<double>(bytes))));
}

// Wall time per iteration of `body` (both ranks start together; each ends with its stream).
template <class F>
double per_op_us(cudaStream_t s, int iters, F&& body) {
  body(0);  // warm-up (first use of a size)
  CK(cudaStreamSynchronize(s));
  MK(MPI_Barrier(MPI_COMM_WORLD));
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) body(i);
  CK(cudaStreamSynchronize(s));
  double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
  MK(MPI_Allreduce(MPI_IN_PLACE, &us, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
  return us;
}

// meshmem puts rank 0 -> rank 1 through `comm` (whose route is checked by the caller).
void meshmem_puts(meshmem::Comm& comm, const char* variant, const std::vector<std::size_t>& sizes, cudaStream_t s,
                  bool quick) {
  const std::size_t largest = sizes.back();
  meshmem::Window win = comm.alloc(largest);
  void* src = nullptr;
  CK(cudaMalloc(&src, largest));
  CK(cudaMemset(src, 0x5a, largest));
  for (std::size_t size : sizes) {
    const int iters = iterations_for(size, quick);
    const double us = per_op_us(s, iters, [&](int) {
      if (g_rank == 0) comm.put(win, 1, 0, src, size, s);
    });
    record("cross_host_put", variant, static_cast<long long>(size), us, static_cast<double>(size) / us / 1e3);
  }
  // Every byte of the last put arrived (the window is rank 1's).
  comm.barrier();
  if (g_rank == 1) {
    std::vector<unsigned char> got(largest);
    CK(cudaMemcpy(got.data(), win.local(), largest, cudaMemcpyDeviceToHost));
    if (std::count(got.begin(), got.end(), 0x5a) != static_cast<long>(largest))
      bench::fail(variant, "the window does not hold the bytes put into it", __FILE__, __LINE__);
  }
  CK(cudaFree(src));
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MK(MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided));
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  bench::check_rank() = g_rank;
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  bench::RunInfo info;
  std::size_t max_bytes = std::size_t{256} << 20;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (info.parse(argc, argv, i)) continue;
    const std::string a = argv[i];
    if (a == "--max-bytes" && i + 1 < argc) {
      if (!bench::parse_bytes(argv[++i], &max_bytes)) {
        if (g_rank == 0) std::fprintf(stderr, "cross_host_bench: bad value for --max-bytes: '%s' (bytes, or K/M/G)\n", argv[i]);
        MPI_Abort(MPI_COMM_WORLD, 2);
      }
    } else if (a == "--quick") {
      quick = true;
    } else {
      if (g_rank == 0) std::fprintf(stderr, "cross_host_bench: unknown argument %s\n", argv[i]);
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
  }
  if (size != 2) bench::fail("cross_host_bench", "runs on exactly 2 ranks", __FILE__, __LINE__);
  std::vector<std::size_t> sizes;
  for (std::size_t b = 8; b <= max_bytes; b *= (b < (std::size_t{1} << 20) ? 8 : 4)) sizes.push_back(b);
  cudaStream_t s = nullptr;
  {
    // meshmem-nccl's barrier is the hierarchical one (the leaders' NCCL all-reduce) even where
    // the ranks share a GPU, where `auto` would take the proxy's (meshmem-mpi's row).
    meshmem::Options hierarchical = meshmem::Options::from_environment();
    if (std::getenv("MESHMEM_BARRIER_ACROSS_NODES") == nullptr) hierarchical.set("MESHMEM_BARRIER_ACROSS_NODES", "nccl");
    meshmem::Comm nccl_comm(MPI_COMM_WORLD, hierarchical);
    meshmem::Options mpi_only = meshmem::Options::from_environment();
    mpi_only.set("MESHMEM_TRANSPORTS", "ipc,staged,mpi-device,shm,mpi");
    meshmem::Comm mpi_comm(MPI_COMM_WORLD, mpi_only);
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const meshmem::TransportKind a = nccl_comm.transport(1 - g_rank, meshmem::Memory::Device);
    const meshmem::TransportKind b = mpi_comm.transport(1 - g_rank, meshmem::Memory::Device);
    if (a != meshmem::TransportKind::Nccl || b != meshmem::TransportKind::MpiDevice)
      bench::fail("cross_host_bench", std::string("the ranks must be on different nodes; routes: ") +
                                          meshmem::to_string(a) + ", " + meshmem::to_string(b),
                  __FILE__, __LINE__);
    // Raw NCCL between the same two processes (after meshmem's Comm: under simulated nodes
    // meshmem has set this process's NCCL_HOSTID, so two ranks may share a GPU).
    ncclUniqueId id;
    if (g_rank == 0) NK(ncclGetUniqueId(&id));
    MK(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD));
    ncclComm_t nc = nullptr;
    NK(ncclCommInitRank(&nc, 2, id, g_rank));
    if (g_rank == 0) {
      int dev = 0;
      CK(cudaGetDevice(&dev));
      std::printf("# meshmem cross_host_bench: 2 ranks, nodes %d and %d (%s), GPU %d on rank 0\n", nccl_comm.node_of(0),
                  nccl_comm.node_of(1), std::getenv("MESHMEM_SIMULATE_NODES") ? "simulated" : "real or separate hosts",
                  dev);
      std::printf("# nccl route: %s\n# mpi-device route: %s\n", nccl_comm.device_info().c_str(),
                  mpi_comm.device_info().c_str());
      std::printf("# sizes %zu .. %zu bytes, one transfer in flight; %s\n", sizes.front(), sizes.back(),
                  quick ? "--quick" : "full");
      std::printf("# %-18s %-13s %12s %14s %16s\n", "benchmark", "variant", "size", "latency(us)", "bandwidth(GB/s)");
    }
    meshmem_puts(nccl_comm, "meshmem-nccl", sizes, s, quick);
    meshmem_puts(mpi_comm, "meshmem-mpi", sizes, s, quick);
    {
      void* buf = nullptr;
      CK(cudaMalloc(&buf, sizes.back()));
      for (std::size_t bytes : sizes) {
        const double us = per_op_us(s, iterations_for(bytes, quick), [&](int) {
          if (g_rank == 0)
            NK(ncclSend(buf, bytes, ncclChar, 1, nc, s));
          else
            NK(ncclRecv(buf, bytes, ncclChar, 0, nc, s));
        });
        record("cross_host_put", "nccl", static_cast<long long>(bytes), us, static_cast<double>(bytes) / us / 1e3);
      }
      CK(cudaFree(buf));
    }
    {
      std::uint64_t* word = nullptr;
      CK(cudaMalloc(&word, sizeof(std::uint64_t)));
      CK(cudaMemset(word, 0, sizeof(std::uint64_t)));
      const int idle_iters = quick ? 50 : 200;
      // Idle: one barrier, its sync, then the next.
      double idle = per_op_us(s, idle_iters, [&](int) {
        nccl_comm.barrier(s);
        CK(cudaStreamSynchronize(s));
      });
      record("cross_host_barrier", "meshmem-nccl", 1, idle, -1);
      idle = per_op_us(s, idle_iters, [&](int) {
        NK(ncclAllReduce(word, word, 1, ncclUint64, ncclSum, nc, s));
        CK(cudaStreamSynchronize(s));
      });
      record("cross_host_barrier", "nccl", 1, idle, -1);
      idle = per_op_us(s, idle_iters, [&](int) {
        mpi_comm.barrier(s);
        CK(cudaStreamSynchronize(s));
      });
      record("cross_host_barrier", "meshmem-mpi", 1, idle, -1);
      // 200 back to back, one sync.
      const double burst = per_op_us(s, 200, [&](int) { nccl_comm.barrier(s); });
      record("cross_host_barrier", "meshmem-nccl", 200, burst, -1);
      const double mburst = per_op_us(s, 200, [&](int) { mpi_comm.barrier(s); });
      record("cross_host_barrier", "meshmem-mpi", 200, mburst, -1);
      const double nburst = per_op_us(s, 200, [&](int) { NK(ncclAllReduce(word, word, 1, ncclUint64, ncclSum, nc, s)); });
      record("cross_host_barrier", "nccl", 200, nburst, -1);
      CK(cudaFree(word));
    }
    NK(ncclCommDestroy(nc));
    if (g_rank == 0) {
      std::printf("\n# summary (ratios within this run)\n");
      std::map<std::pair<std::string, long long>, std::map<std::string, const bench::ResultRow*>> by;
      for (const auto& r : g_rows) by[{r.benchmark, r.size_bytes}][r.variant] = &r;
      for (const auto& [key, v] : by) {
        const auto n = v.find("nccl");
        if (n == v.end()) continue;
        for (const char* m : {"meshmem-nccl", "meshmem-mpi"}) {
          const auto it = v.find(m);
          if (it == v.end()) continue;
          if (key.first == "cross_host_put")
            std::printf("  %-18s %12lld  %-13s / nccl bandwidth %6.2f x\n", key.first.c_str(), key.second, m,
                        it->second->bandwidth_gbps / n->second->bandwidth_gbps);
          else
            std::printf("  %-18s %12lld  %-13s / nccl time      %6.2f x\n", key.first.c_str(), key.second, m,
                        it->second->latency_us / n->second->latency_us);
        }
      }
      if (!info.csv.empty())
        bench::write_results_csv(info.csv, bench::CsvMode::Append, info.date, info.commit, info.machine, g_rows,
                                 "cross_host_bench");
    }
    CK(cudaStreamDestroy(s));
  }
  MPI_Finalize();
  return 0;
}
