// copy_lab: the study behind meshmem's SM copy kernel. Rank 0 writes into rank 1's device
// window (push) or reads from it (pull) with the copy engine and with grid-stride copy
// kernels of several shapes (blocks, threads, 16-byte loads in flight per thread).
//   mpirun -np 2 copy_lab [--csv FILE --commit C --machine M --date D]
#include <cuda_runtime.h>
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <meshmem/meshmem.hpp>
#include <string>
#include <vector>

#include "bench_check.hpp"
#include "results_csv.hpp"

namespace {


// Each thread keeps `U` 16-byte loads in flight before it stores them.
template <int U>
__global__ void copy_unrolled(uint4* __restrict__ dst, const uint4* __restrict__ src, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (U - 1) * stride < n; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = __ldg(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) dst[i + u * stride] = v[u];
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

// meshmem's kernel as it stands: a contiguous slice per block (about 16 KiB), 512 threads.
__global__ void copy_sliced(uint4* dst, const uint4* src, std::size_t n) {
  const std::size_t per = (n + gridDim.x - 1) / gridDim.x;
  const std::size_t begin = per * blockIdx.x;
  const std::size_t end = begin + per < n ? begin + per : n;
  for (std::size_t i = begin + threadIdx.x; i < end; i += blockDim.x) dst[i] = src[i];
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  bench::RunInfo run;
  for (int i = 1; i < argc; ++i) run.parse(argc, argv, i);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  bench::check_rank() = rank;
  {
    meshmem::select_local_device(MPI_COMM_WORLD);
    meshmem::Comm comm(MPI_COMM_WORLD);
    const std::size_t max_bytes = std::size_t(1) << 30;
    meshmem::Window win = comm.alloc(max_bytes, meshmem::Memory::Device);
    std::vector<bench::ResultRow> rows;
    if (rank == 0) {
      int dev = 0;
      cudaDeviceProp prop{};
      CK(cudaGetDevice(&dev));
      CK(cudaGetDeviceProperties(&prop, dev));
      const int sms = prop.multiProcessorCount;
      void* local = nullptr;
      CK(cudaMalloc(&local, max_bytes));
      CK(cudaMemset(local, 1, max_bytes));
      cudaStream_t s;
      CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      cudaEvent_t a, b;
      CK(cudaEventCreate(&a));
      CK(cudaEventCreate(&b));
      void* remote = win.peer(1);
      std::printf("# copy_lab: rank 0 -> rank 1, %s, %d SMs; GB/s = 1e9 bytes/s, best of 5\n", comm.device_info().c_str(), sms);
      std::printf("%-34s %10s %12s\n", "# variant", "bytes", "GB/s");
      auto time = [&](const std::string& name, std::size_t bytes, auto&& launch) {
        for (int w = 0; w < 2; ++w) launch();
        float best = 1e30f;
        for (int rep = 0; rep < 5; ++rep) {
          CK(cudaEventRecord(a, s));
          launch();
          CK(cudaEventRecord(b, s));
          CK(cudaEventSynchronize(b));
          float ms = 0;
          CK(cudaEventElapsedTime(&ms, a, b));
          best = std::min(best, ms);
        }
        const double gbps = bytes / (best * 1e-3) / 1e9;
        std::printf("%-34s %10zu %12.1f\n", name.c_str(), bytes, gbps);
        std::fflush(stdout);
        rows.push_back({"copy_lab", name, 2, static_cast<long long>(bytes), best * 1e3, gbps});
      };
      for (std::size_t bytes : {std::size_t(64) << 20, std::size_t(1) << 30}) {
        const std::size_t n = bytes / 16;
        time("ce-push", bytes, [&] { CK(cudaMemcpyAsync(remote, local, bytes, cudaMemcpyDeviceToDevice, s)); });
        time("ce-pull", bytes, [&] { CK(cudaMemcpyAsync(local, remote, bytes, cudaMemcpyDeviceToDevice, s)); });
        // Two engines at once: halves on two streams, and copy engine + kernel side by side.
        cudaStream_t s2;
        cudaEvent_t fork, join;
        CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
        CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
        CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
        auto split = [&](std::size_t first, auto&& second) {
          CK(cudaEventRecord(fork, s));
          CK(cudaStreamWaitEvent(s2, fork, 0));
          CK(cudaMemcpyAsync(remote, local, first, cudaMemcpyDeviceToDevice, s));
          second(first);
          CK(cudaEventRecord(join, s2));
          CK(cudaStreamWaitEvent(s, join, 0));
        };
        time("ce-push 2 streams", bytes, [&] {
          split(bytes / 2, [&](std::size_t off) {
            CK(cudaMemcpyAsync(static_cast<char*>(remote) + off, static_cast<char*>(local) + off, bytes - off,
                               cudaMemcpyDeviceToDevice, s2));
          });
        });
        for (int pct : {5, 10, 20, 30}) {
          const std::size_t ce_bytes = bytes / 100 * (100 - pct) / 4096 * 4096;
          time("ce+kernel push, kernel " + std::to_string(pct) + "%", bytes, [&] {
            split(ce_bytes, [&](std::size_t off) {
              copy_unrolled<4><<<static_cast<unsigned>(sms), 512, 0, s2>>>(
                  reinterpret_cast<uint4*>(static_cast<char*>(remote) + off),
                  reinterpret_cast<const uint4*>(static_cast<char*>(local) + off), (bytes - off) / 16);
            });
          });
        }
        CK(cudaStreamSynchronize(s2));
        CK(cudaStreamDestroy(s2));
        CK(cudaEventDestroy(fork));
        CK(cudaEventDestroy(join));
        time("sliced-push (meshmem now)", bytes, [&] {
          copy_sliced<<<static_cast<unsigned>(std::min<std::size_t>(1024, (bytes + 16383) / 16384)), 512, 0, s>>>(
              static_cast<uint4*>(remote), static_cast<const uint4*>(local), n);
        });
        for (int per_sm : {1, 4})
          for (int threads : {512}) {
            if (per_sm * threads > 2048) continue;
            const unsigned grid = static_cast<unsigned>(sms * per_sm);
            auto* d = static_cast<uint4*>(remote);
            auto* sr = static_cast<const uint4*>(local);
            const std::string shape = "x" + std::to_string(per_sm) + "/SM t" + std::to_string(threads);
            time("push u1 " + shape, bytes, [&] { copy_unrolled<1><<<grid, threads, 0, s>>>(d, sr, n); });
            time("push u4 " + shape, bytes, [&] { copy_unrolled<4><<<grid, threads, 0, s>>>(d, sr, n); });
            time("push u8 " + shape, bytes, [&] { copy_unrolled<8><<<grid, threads, 0, s>>>(d, sr, n); });
            time("pull u4 " + shape, bytes, [&] {
              copy_unrolled<4><<<grid, threads, 0, s>>>(static_cast<uint4*>(local), static_cast<const uint4*>(remote), n);
            });
          }
        CK(cudaGetLastError());
      }
      CK(cudaStreamSynchronize(s));
      CK(cudaEventDestroy(a));
      CK(cudaEventDestroy(b));
      CK(cudaStreamDestroy(s));
      CK(cudaFree(local));
      if (!run.csv.empty())
        bench::write_results_csv(run.csv, bench::CsvMode::Append, run.date, run.commit, run.machine, rows, "copy_lab");
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
  MPI_Finalize();
  return 0;
}
