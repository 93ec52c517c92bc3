// pipeline_lab: the study behind the staged transport's chunk size (MESHMEM_STAGING_CHUNK)
// and the steps it enqueues per chunk. One process, GPUs 0 and 1 (peer access never enabled),
// pinned host memory (cudaMallocHost). A host-staged copy of S bytes from GPU 0 to GPU 1, cut
// into chunks of C bytes through K slots. Everything is enqueued up front behind a spin kernel,
// with GPU-side dependencies only, so each row is the floor a host-driven pipeline can reach:
//   d2h, h2d         one copy of S (GPU 0 to host, host to GPU 1): the references
//   both-ways        both at once, each on its own GPU and buffer
//   d2h-cut          S/C device-to-host copies back to back on one stream
//   d2h-cut+memop    ... each followed by a stream write of a pinned word (a channel's posted count)
//   pipe             device-to-host into slot i on GPU 0, host-to-device from it on GPU 1 (events), K slots
//   pipe+memop       the same, with a stream write after every copy on both GPUs (posted, consumed)
// The time is from the end of the spin kernel to the end of the last copy (both on GPU 0's
// clock; GPU 0 waits for GPU 1's last event). A row whose enqueueing outran the spin says so.
//   pipeline_lab [--sizes 64M,256M] [--chunks 512K,1M,2M,4M,8M] [--slots 4] [--reps 5]
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "bench_check.hpp"

namespace {

#define LK(x)                                                                                         \
  do {                                                                                                \
    const auto rc_ = (x);                                                                             \
    if (static_cast<int>(rc_) != 0) {                                                                 \
      std::fprintf(stderr, "%s failed: %d (%s:%d)\n", #x, static_cast<int>(rc_), __FILE__, __LINE__); \
      std::exit(1);                                                                                   \
    }                                                                                                 \
  } while (0)

__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

struct Gpu {
  int device = 0;
  cudaStream_t stream = nullptr;
  char* buf = nullptr;
};

std::vector<std::size_t> parse_list(const std::string& text) {
  std::vector<std::size_t> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    std::size_t v = 0;
    if (!bench::parse_bytes(item, &v)) {
      std::fprintf(stderr, "pipeline_lab: '%s' is not a byte count (4096, 64K, 4M, 1G)\n", item.c_str());
      std::exit(2);
    }
    out.push_back(v);
  }
  return out;
}

class Lab {
 public:
  Lab(std::size_t max_bytes, std::size_t max_chunk, int slots) : slots_(slots) {
    for (int d = 0; d < 2; ++d) {
      gpu_[d].device = d;
      LK(cudaSetDevice(d));
      LK(cudaStreamCreateWithFlags(&gpu_[d].stream, cudaStreamNonBlocking));
      LK(cudaMalloc(&gpu_[d].buf, max_bytes));
      LK(cudaMemset(gpu_[d].buf, d + 1, max_bytes));
    }
    LK(cudaSetDevice(0));
    LK(cudaMallocHost(&host_, max_bytes));   // whole-copy references
    LK(cudaMallocHost(&host2_, max_bytes));  // both-ways: the h2d half's source
    LK(cudaMallocHost(&slots_mem_, max_chunk * static_cast<std::size_t>(slots)));
    LK(cudaMallocHost(&words_, 4096));
    int rate_khz = 0;
    LK(cudaDeviceGetAttribute(&rate_khz, cudaDevAttrClockRate, 0));
    spin_cycles_ = static_cast<long long>(rate_khz) * 5;  // 5 ms
    // Per slot: its copy in is done (GPU 0's stream), its copy out is done (GPU 1's).
    copied_.resize(slots);
    freed_.resize(slots);
    for (int d = 0; d < 2; ++d) {
      LK(cudaSetDevice(d));
      for (cudaEvent_t& e : d == 0 ? copied_ : freed_) LK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      LK(cudaEventCreateWithFlags(&last_[d], cudaEventDisableTiming));
    }
    LK(cudaSetDevice(0));
    LK(cudaEventCreate(&t0_));
    LK(cudaEventCreate(&t1_));
  }

  // Best time in microseconds of `reps` runs of `enqueue` (which enqueues on both streams),
  // and whether the host's enqueueing outran the spin in some run.
  template <class F>
  double best(int reps, F enqueue, bool* outran) {
    double best_us = 1e30;
    for (int rep = 0; rep < reps; ++rep) {
      LK(cudaSetDevice(0));
      spin<<<1, 1, 0, gpu_[0].stream>>>(spin_cycles_);
      LK(cudaGetLastError());
      LK(cudaEventRecord(t0_, gpu_[0].stream));
      LK(cudaSetDevice(1));
      LK(cudaStreamWaitEvent(gpu_[1].stream, t0_, 0));
      const auto h0 = std::chrono::steady_clock::now();
      enqueue();
      const double host_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - h0).count();
      LK(cudaSetDevice(1));
      LK(cudaEventRecord(last_[1], gpu_[1].stream));
      LK(cudaSetDevice(0));
      LK(cudaStreamWaitEvent(gpu_[0].stream, last_[1], 0));
      LK(cudaEventRecord(t1_, gpu_[0].stream));
      LK(cudaEventSynchronize(t1_));
      if (host_ms > 4.5) *outran = true;
      float ms = 0;
      LK(cudaEventElapsedTime(&ms, t0_, t1_));
      best_us = std::min(best_us, 1e3 * ms);
    }
    return best_us;
  }

  void d2h(char* dst, const char* src, std::size_t n) {
    LK(cudaSetDevice(0));
    LK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, gpu_[0].stream));
  }
  void h2d(char* dst, const char* src, std::size_t n) {
    LK(cudaSetDevice(1));
    LK(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, gpu_[1].stream));
  }
  void memop(int d, int word, std::uint64_t value) {
    LK(cudaSetDevice(d));
    LK(cuStreamWriteValue64(reinterpret_cast<CUstream>(gpu_[d].stream), reinterpret_cast<CUdeviceptr>(words_ + word),
                            value, CU_STREAM_WRITE_VALUE_DEFAULT));
  }

  void run(std::size_t S, const std::vector<std::size_t>& chunks, int reps) {
    bool outran = false;
    auto row = [&](const char* name, std::size_t chunk, double us, double ref_us) {
      std::printf("%-14s %10zu %10zu %12.1f %10.2f %12.3f\n", name, S, chunk, us, S / us / 1e3, ref_us / us);
    };
    const double t_d2h = best(reps, [&] { d2h(host_, gpu_[0].buf, S); }, &outran);
    const double t_h2d = best(reps, [&] { h2d(gpu_[1].buf, host2_, S); }, &outran);
    const double t_min = std::max(t_d2h, t_h2d);  // the slower one: min(d2h, h2d) in GB/s
    row("d2h", S, t_d2h, t_min);
    row("h2d", S, t_h2d, t_min);
    row("both-ways", S, best(reps, [&] {
          d2h(host_, gpu_[0].buf, S);
          h2d(gpu_[1].buf, host2_, S);
        }, &outran), t_min);
    for (std::size_t C : chunks) run_chunked(S, C, reps, t_min, row, &outran);
    if (outran) std::printf("# (S %zu): the host's enqueueing outran the 5 ms spin in some run: those rows include host time\n", S);
  }

  template <class Row>
  void run_chunked(std::size_t S, std::size_t C, int reps, double t_min, Row& row, bool* outran_flag) {
    bool& outran = *outran_flag;
    const std::size_t n = (S + C - 1) / C;
    auto piece = [&](std::size_t i) { return std::min(C, S - i * C); };
    for (int with_memop = 0; with_memop < 2; ++with_memop) {
      row(with_memop ? "d2h-cut+memop" : "d2h-cut", C, best(reps, [&] {
            for (std::size_t i = 0; i < n; ++i) {
              d2h(slots_mem_ + (i % slots_) * C, gpu_[0].buf + i * C, piece(i));
              if (with_memop) memop(0, 0, i + 1);
            }
          }, &outran), t_min);
    }
    for (int with_memop = 0; with_memop < 2; ++with_memop) {
      row(with_memop ? "pipe+memop" : "pipe", C, best(reps, [&] {
            for (std::size_t i = 0; i < n; ++i) {
              const std::size_t s = i % slots_;
              char* slot = slots_mem_ + s * C;
              LK(cudaSetDevice(0));
              if (i >= static_cast<std::size_t>(slots_)) LK(cudaStreamWaitEvent(gpu_[0].stream, freed_[s], 0));
              d2h(slot, gpu_[0].buf + i * C, piece(i));
              if (with_memop) memop(0, 0, i + 1);
              LK(cudaEventRecord(copied_[s], gpu_[0].stream));
              LK(cudaSetDevice(1));
              LK(cudaStreamWaitEvent(gpu_[1].stream, copied_[s], 0));
              h2d(gpu_[1].buf + i * C, slot, piece(i));
              if (with_memop) memop(1, 8, i + 1);
              LK(cudaEventRecord(freed_[s], gpu_[1].stream));
            }
          }, &outran), t_min);
    }
  }

 private:
  Gpu gpu_[2];
  char* host_ = nullptr;
  char* host2_ = nullptr;
  char* slots_mem_ = nullptr;
  std::uint64_t* words_ = nullptr;
  int slots_;
  long long spin_cycles_ = 0;
  std::vector<cudaEvent_t> copied_, freed_;
  cudaEvent_t last_[2]{}, t0_ = nullptr, t1_ = nullptr;
};

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::size_t> sizes = parse_list("64M,256M"), chunks = parse_list("512K,1M,2M,4M,8M");
  int slots = 4, reps = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has = i + 1 < argc;
    if (a == "--sizes" && has) sizes = parse_list(argv[++i]);
    else if (a == "--chunks" && has) chunks = parse_list(argv[++i]);
    else if (a == "--slots" && has) slots = std::atoi(argv[++i]);
    else if (a == "--reps" && has) reps = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: pipeline_lab [--sizes 64M,256M] [--chunks 512K,1M,2M,4M,8M] [--slots 4] [--reps 5]\n");
      return 2;
    }
  }
  int ngpu = 0;
  if (cudaGetDeviceCount(&ngpu) != cudaSuccess || ngpu < 2) {
    std::printf("# pipeline_lab: needs 2 GPUs in this process (has %d); nothing measured\n", ngpu);
    return 0;
  }
  if (slots < 2) {
    std::fprintf(stderr, "pipeline_lab: --slots needs 2 or more\n");
    return 2;
  }
  Lab lab(*std::max_element(sizes.begin(), sizes.end()), *std::max_element(chunks.begin(), chunks.end()), slots);
  std::printf("# pipeline_lab: GPU 0 -> pinned host -> GPU 1, %d slots, best of %d; ratio = time of min(d2h, h2d) / time\n", slots, reps);
  std::printf("%-14s %10s %10s %12s %10s %12s\n", "# case", "bytes", "chunk", "time (us)", "GB/s", "x min(d,h)");
  for (std::size_t S : sizes) lab.run(S, chunks, reps);
  return 0;
}
