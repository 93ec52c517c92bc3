// pipeline_lab: the study behind the staged transport's chunk size (MESHMEM_STAGED_CHUNK)
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
// With --sm B, the same through the SMs (B blocks of 512 threads per kernel, 16-byte loads and
// stores through the mapped pinned memory; no copy engine):
//   sm-d2h, sm-h2d   one kernel copying S (GPU 0 to host, host to GPU 1)
//   sm-both          both at once
//   sm-pipe          a kernel on GPU 0 copies chunk i into slot i mod K, a kernel on GPU 1 copies it
//                    out, both at once: block b of each moves the b-th share of every chunk and
//                    hands it over through a pair of pinned counters of its own (ready, freed), so
//                    no block waits for another block of its kernel. The chunk is the hand-over size.
// With --lanes N the chunked cases spread their chunks over N streams per GPU (chunk i on stream
// i mod N): whether a copy's start-up and drain overlap the copy before it on another stream.
// With --transfers T (2 or more) two more rows per chunk size: T transfers of S back to back,
// as staged_bench's back-to-back puts on one stream,
//   pipe-serial      each transfer's first copy waits for the previous transfer's last one: the
//                    stream of a staged put waits for the put's end at its target (docs/semantics.md,
//                    completion: a put is complete at its target once its stream passed it)
//   pipe-overlap     each transfer's first copy waits only for a free slot: what the stream
//                    could do if it waited only until the put's source was read (the pipeline's
//                    fill and drain paid once for all T)
// (bytes column: S x T; the reference is T x min(d2h, h2d)).
// The time is from the end of the spin kernel to the end of the last copy (both on GPU 0's
// clock; GPU 0 waits for GPU 1's last event). A row whose enqueueing outran the spin says so.
// With --one-gpu GPU 0 plays both sides (its device-to-host and host-to-device copy engines over
// its one full-duplex link): a proxy where only one GPU is lent, not the figure of two GPUs.
//   pipeline_lab [--sizes 64M,256M] [--chunks 512K,1M,2M,4M,8M] [--slots 4] [--lanes 1] [--reps 5]
//                [--transfers T] [--one-gpu] [--sm B [--sm-chunks 256K,512K,1M,2M]]
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

__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// Copies n 16-byte words from src to dst with this block's threads, four loads in flight per
// thread. Loads bypass the caches (__ldcv): a slot is written again by the other GPU.
__device__ void block_copy(uint4* dst, const uint4* src, std::size_t n) {
  const std::size_t step = blockDim.x;
  for (std::size_t k = threadIdx.x; k < n; k += 4 * step) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (k + u * step < n) v[u] = __ldcv(src + k + u * step);
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (k + u * step < n) dst[k + u * step] = v[u];
  }
}

__device__ std::size_t smaller(std::size_t a, std::size_t b) { return a < b ? a : b; }

// Block b's share of a range of n words: [*first, *first + *count).
__device__ void share(std::size_t n, std::size_t* first, std::size_t* count) {
  const std::size_t per = (n + gridDim.x - 1) / gridDim.x;
  *first = smaller(n, blockIdx.x * per);
  *count = smaller(n - *first, per);
}

__global__ void sm_copy(uint4* dst, const uint4* src, std::size_t n) {
  std::size_t first = 0, count = 0;
  share(n, &first, &count);
  block_copy(dst + first, src + first, count);
}

__device__ void wait_at_least(const volatile unsigned long long* word, unsigned long long value) {
  if (threadIdx.x == 0) {
    while (*word < value) {
    }
    __threadfence_system();
  }
  __syncthreads();
}

__device__ void publish(volatile unsigned long long* word, unsigned long long value) {
  __threadfence_system();  // this thread's copies are out
  __syncthreads();         // and every thread's
  if (threadIdx.x == 0) *word = value;
}

// sm-pipe's two halves: n words in chunks of `chunk` words through `slots` slots.
__global__ void sm_produce(uint4* slots, const uint4* src, std::size_t n, std::size_t chunk, int nslots,
                           unsigned long long* ready, const unsigned long long* freed) {
  const std::size_t chunks = (n + chunk - 1) / chunk;
  for (std::size_t i = 0; i < chunks; ++i) {
    const std::size_t len = smaller(chunk, n - i * chunk);
    std::size_t first = 0, count = 0;
    share(len, &first, &count);
    if (i >= static_cast<std::size_t>(nslots)) wait_at_least(freed + blockIdx.x, i - nslots + 1);
    block_copy(slots + (i % nslots) * chunk + first, src + i * chunk + first, count);
    publish(ready + blockIdx.x, i + 1);
  }
}

__global__ void sm_consume(uint4* dst, const uint4* slots, std::size_t n, std::size_t chunk, int nslots,
                           const unsigned long long* ready, unsigned long long* freed) {
  const std::size_t chunks = (n + chunk - 1) / chunk;
  for (std::size_t i = 0; i < chunks; ++i) {
    const std::size_t len = smaller(chunk, n - i * chunk);
    std::size_t first = 0, count = 0;
    share(len, &first, &count);
    wait_at_least(ready + blockIdx.x, i + 1);
    block_copy(dst + i * chunk + first, slots + (i % nslots) * chunk + first, count);
    publish(freed + blockIdx.x, i + 1);
  }
}

struct Gpu {
  int device = 0;
  std::vector<cudaStream_t> streams;  // streams[0] also carries the whole copies and the timing
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
  Lab(std::size_t max_bytes, std::size_t max_chunk, int slots, int lanes, int transfers, bool one_gpu)
      : slots_(slots), lanes_(lanes), transfers_(transfers) {
    for (int d = 0; d < 2; ++d) {
      gpu_[d].device = one_gpu ? 0 : d;
      on(d);
      gpu_[d].streams.resize(static_cast<std::size_t>(lanes));
      for (cudaStream_t& st : gpu_[d].streams) CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
      CK(cudaMalloc(&gpu_[d].buf, max_bytes));
      CK(cudaMemset(gpu_[d].buf, d + 1, max_bytes));
    }
    on(0);
    CK(cudaMallocHost(&host_, max_bytes));   // whole-copy references
    CK(cudaMallocHost(&host2_, max_bytes));  // both-ways: the h2d half's source
    CK(cudaMallocHost(&slots_mem_, max_chunk * static_cast<std::size_t>(slots)));
    CK(cudaMallocHost(&words_, 4096));
    CK(cudaMallocHost(&flags_, 2 * kMaxBlocks * sizeof(unsigned long long)));
    int rate_khz = 0;
    CK(cudaDeviceGetAttribute(&rate_khz, cudaDevAttrClockRate, 0));
    spin_cycles_ = static_cast<long long>(rate_khz) * 5;  // 5 ms
    // Per slot: its copy in is done (GPU 0's stream), its copy out is done (GPU 1's).
    copied_.resize(slots);
    freed_.resize(slots);
    for (int d = 0; d < 2; ++d) {
      on(d);
      for (cudaEvent_t& e : d == 0 ? copied_ : freed_) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      joins_[d].resize(static_cast<std::size_t>(lanes));
      for (cudaEvent_t& e : joins_[d]) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    on(1);
    CK(cudaEventCreateWithFlags(&landed_, cudaEventDisableTiming));
    on(0);
    CK(cudaEventCreate(&t0_));
    CK(cudaEventCreate(&t1_));
  }

  // Best time in microseconds of `reps` runs of `enqueue` (which enqueues on both streams),
  // and whether the host's enqueueing outran the spin in some run.
  template <class F>
  double best(int reps, F enqueue, bool* outran) {
    double best_us = 1e30;
    for (int rep = 0; rep < reps; ++rep) {
      on(0);
      spin<<<1, 1, 0, stream(0, 0)>>>(spin_cycles_);
      CK(cudaGetLastError());
      CK(cudaEventRecord(t0_, stream(0, 0)));
      for (int d = 0; d < 2; ++d) {
        on(d);
        for (cudaStream_t st : gpu_[d].streams)
          if (st != stream(0, 0)) CK(cudaStreamWaitEvent(st, t0_, 0));
      }
      const auto h0 = std::chrono::steady_clock::now();
      enqueue();
      const double host_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - h0).count();
      // Every stream of both GPUs joins GPU 0's first stream, which records the end.
      for (int d = 0; d < 2; ++d) {
        on(d);
        for (int l = 0; l < lanes_; ++l) CK(cudaEventRecord(joins_[d][l], stream(d, l)));
      }
      on(0);
      for (int d = 0; d < 2; ++d)
        for (int l = 0; l < lanes_; ++l)
          if (d != 0 || l != 0) CK(cudaStreamWaitEvent(stream(0, 0), joins_[d][l], 0));
      CK(cudaEventRecord(t1_, stream(0, 0)));
      CK(cudaEventSynchronize(t1_));
      if (host_ms > 4.5) *outran = true;
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, t0_, t1_));
      best_us = std::min(best_us, 1e3 * ms);
    }
    return best_us;
  }

  // Makes side d's GPU current (0: the source, 1: the target; the same GPU under --one-gpu).
  void on(int d) const { CK(cudaSetDevice(gpu_[d].device)); }

  // Chunk i's stream on GPU d.
  cudaStream_t stream(int d, std::size_t i) const {
    return gpu_[d].streams[i % static_cast<std::size_t>(lanes_)];
  }
  void d2h(char* dst, const char* src, std::size_t n, std::size_t i = 0) {
    on(0);
    CK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, stream(0, i)));
  }
  void h2d(char* dst, const char* src, std::size_t n, std::size_t i = 0) {
    on(1);
    CK(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, stream(1, i)));
  }
  void memop(int d, int word, std::uint64_t value, std::size_t i) {
    on(d);
    CU(cuStreamWriteValue64(reinterpret_cast<CUstream>(stream(d, i)), reinterpret_cast<CUdeviceptr>(words_ + word),
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

  // The SM cases: B blocks per kernel, hand-over sizes `chunks`.
  void run_sm(std::size_t S, const std::vector<std::size_t>& chunks, int blocks, int reps) {
    bool outran = false;
    const double t_d2h = best(reps, [&] { d2h(host_, gpu_[0].buf, S); }, &outran);
    const double t_h2d = best(reps, [&] { h2d(gpu_[1].buf, host2_, S); }, &outran);
    const double t_min = std::max(t_d2h, t_h2d);
    auto row = [&](const char* name, std::size_t chunk, double us) {
      std::printf("%-14s %10zu %10zu %12.1f %10.2f %12.3f\n", name, S, chunk, us, S / us / 1e3, t_min / us);
    };
    const std::size_t n = S / 16;
    auto sm_d2h = [&] {
      on(0);
      sm_copy<<<blocks, 512, 0, stream(0, 0)>>>(reinterpret_cast<uint4*>(host_), reinterpret_cast<const uint4*>(gpu_[0].buf), n);
      CK(cudaGetLastError());
    };
    auto sm_h2d = [&] {
      on(1);
      sm_copy<<<blocks, 512, 0, stream(1, 0)>>>(reinterpret_cast<uint4*>(gpu_[1].buf), reinterpret_cast<const uint4*>(host2_), n);
      CK(cudaGetLastError());
    };
    row("sm-d2h", S, best(reps, sm_d2h, &outran));
    row("sm-h2d", S, best(reps, sm_h2d, &outran));
    row("sm-both", S, best(reps, [&] { sm_d2h(); sm_h2d(); }, &outran));
    for (std::size_t C : chunks) {
      // Counters start at 0 each run (the previous run ended; this one's kernels wait for the spin).
      row("sm-pipe", C, best(reps, [&] {
            std::fill(flags_, flags_ + 2 * kMaxBlocks, 0ull);
            on(0);
            sm_produce<<<blocks, 512, 0, stream(0, 0)>>>(reinterpret_cast<uint4*>(slots_mem_), reinterpret_cast<const uint4*>(gpu_[0].buf),
                                                         n, C / 16, slots_, flags_, flags_ + kMaxBlocks);
            CK(cudaGetLastError());
            on(1);
            sm_consume<<<blocks, 512, 0, stream(1, 0)>>>(reinterpret_cast<uint4*>(gpu_[1].buf), reinterpret_cast<const uint4*>(slots_mem_),
                                                         n, C / 16, slots_, flags_, flags_ + kMaxBlocks);
            CK(cudaGetLastError());
          }, &outran));
      // Every byte arrived (GPU 1's buffer against GPU 0's).
      std::vector<char> a(S), b(S);
      CK(cudaMemcpy(a.data(), gpu_[0].buf, S, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(b.data(), gpu_[1].buf, S, cudaMemcpyDeviceToHost));
      if (a != b) std::printf("# sm-pipe chunk %zu: GPU 1's copy differs from GPU 0's source\n", C);
    }
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
              d2h(slots_mem_ + (i % slots_) * C, gpu_[0].buf + i * C, piece(i), i);
              if (with_memop) memop(0, 0, i + 1, i);
            }
          }, &outran), t_min);
    }
    if (transfers_ > 1) {
      const std::size_t T = static_cast<std::size_t>(transfers_);
      auto big_row = [&](const char* name, double us) {
        std::printf("%-14s %10zu %10zu %12.1f %10.2f %12.3f\n", name, S * T, C, us, S * T / us / 1e3, T * t_min / us);
      };
      for (int serial = 1; serial >= 0; --serial) {
        big_row(serial ? "pipe-serial" : "pipe-overlap", best(reps, [&] {
                  for (std::size_t t = 0; t < T; ++t)
                    for (std::size_t i = 0; i < n; ++i) {
                      const std::size_t g = t * n + i;  // slots are reused across transfers
                      const std::size_t s = g % slots_;
                      char* slot = slots_mem_ + s * C;
                      on(0);
                      if (serial && t > 0 && i < static_cast<std::size_t>(lanes_))  // each lane's first of the transfer
                        CK(cudaStreamWaitEvent(stream(0, g), landed_, 0));
                      if (g >= static_cast<std::size_t>(slots_)) CK(cudaStreamWaitEvent(stream(0, g), freed_[s], 0));
                      d2h(slot, gpu_[0].buf + i * C, piece(i), g);
                      CK(cudaEventRecord(copied_[s], stream(0, g)));
                      on(1);
                      CK(cudaStreamWaitEvent(stream(1, g), copied_[s], 0));
                      h2d(gpu_[1].buf + i * C, slot, piece(i), g);
                      CK(cudaEventRecord(freed_[s], stream(1, g)));
                      if (i + 1 == n) CK(cudaEventRecord(landed_, stream(1, g)));
                    }
                }, &outran));
      }
    }
    for (int with_memop = 0; with_memop < 2; ++with_memop) {
      row(with_memop ? "pipe+memop" : "pipe", C, best(reps, [&] {
            for (std::size_t i = 0; i < n; ++i) {
              const std::size_t s = i % slots_;
              char* slot = slots_mem_ + s * C;
              on(0);
              if (i >= static_cast<std::size_t>(slots_)) CK(cudaStreamWaitEvent(stream(0, i), freed_[s], 0));
              d2h(slot, gpu_[0].buf + i * C, piece(i), i);
              if (with_memop) memop(0, 0, i + 1, i);
              CK(cudaEventRecord(copied_[s], stream(0, i)));
              on(1);
              CK(cudaStreamWaitEvent(stream(1, i), copied_[s], 0));
              h2d(gpu_[1].buf + i * C, slot, piece(i), i);
              if (with_memop) memop(1, 8, i + 1, i);
              CK(cudaEventRecord(freed_[s], stream(1, i)));
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
  static constexpr int kMaxBlocks = 1024;
  unsigned long long* flags_ = nullptr;  // sm-pipe: ready[kMaxBlocks], then freed[kMaxBlocks]
  int slots_;
  int lanes_;
  int transfers_;
  cudaEvent_t landed_ = nullptr;  // --transfers: recorded after a transfer's last host-to-device copy
  long long spin_cycles_ = 0;
  std::vector<cudaEvent_t> copied_, freed_;
  std::vector<cudaEvent_t> joins_[2];  // per GPU and stream: its last work, for the end's join
  cudaEvent_t t0_ = nullptr, t1_ = nullptr;
};

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::size_t> sizes = parse_list("64M,256M"), chunks = parse_list("512K,1M,2M,4M,8M");
  int slots = 4, lanes = 1, reps = 5, sm_blocks = 0, transfers = 1;
  bool one_gpu = false;
  std::vector<std::size_t> sm_chunks = parse_list("256K,512K,1M,2M");
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has = i + 1 < argc;
    if (a == "--sizes" && has) sizes = parse_list(argv[++i]);
    else if (a == "--chunks" && has) chunks = parse_list(argv[++i]);
    else if (a == "--slots" && has) slots = std::atoi(argv[++i]);
    else if (a == "--lanes" && has) lanes = std::atoi(argv[++i]);
    else if (a == "--sm" && has) sm_blocks = std::atoi(argv[++i]);
    else if (a == "--sm-chunks" && has) sm_chunks = parse_list(argv[++i]);
    else if (a == "--reps" && has) reps = std::atoi(argv[++i]);
    else if (a == "--transfers" && has) transfers = std::atoi(argv[++i]);
    else if (a == "--one-gpu") one_gpu = true;
    else {
      std::fprintf(stderr, "usage: pipeline_lab [--sizes 64M,256M] [--chunks 512K,1M,2M,4M,8M] [--slots 4] [--lanes 1] [--reps 5] [--transfers T] [--one-gpu] [--sm B [--sm-chunks 256K,512K,1M,2M]]\n");
      return 2;
    }
  }
  int ngpu = 0;
  if (cudaGetDeviceCount(&ngpu) != cudaSuccess || ngpu < (one_gpu ? 1 : 2)) {
    std::printf("# pipeline_lab: needs %d GPU(s) in this process (has %d); nothing measured\n", one_gpu ? 1 : 2, ngpu);
    return 0;
  }
  if (slots < 2 || lanes < 1 || sm_blocks < 0 || sm_blocks > 1024 || transfers < 1 || transfers > 64) {
    std::fprintf(stderr, "pipeline_lab: --slots needs 2 or more, --lanes 1 or more, --sm 1 .. 1024, --transfers 1 .. 64\n");
    return 2;
  }
  for (std::size_t v : sizes)
    if (sm_blocks > 0 && v % 16 != 0) {
      std::fprintf(stderr, "pipeline_lab: --sm needs sizes in whole 16-byte words\n");
      return 2;
    }
  for (std::size_t v : sm_chunks)
    if (sm_blocks > 0 && (v % 16 != 0 || v > *std::max_element(chunks.begin(), chunks.end()))) {
      std::fprintf(stderr, "pipeline_lab: --sm-chunks must be whole 16-byte words, at most the largest of --chunks\n");
      return 2;
    }
  Lab lab(*std::max_element(sizes.begin(), sizes.end()), *std::max_element(chunks.begin(), chunks.end()), slots, lanes,
          transfers, one_gpu);
  std::printf("# pipeline_lab: GPU 0 -> pinned host -> GPU %d, %d slots, %d stream(s) per GPU, best of %d; ratio = time of min(d2h, h2d) / time\n",
              one_gpu ? 0 : 1, slots, lanes, reps);
  std::printf("%-14s %10s %10s %12s %10s %12s\n", "# case", "bytes", "chunk", "time (us)", "GB/s", "x min(d,h)");
  if (sm_blocks > 0) {
    std::printf("# SM copies: %d blocks of 512 threads per kernel; chunk = the hand-over size (sm-pipe)\n", sm_blocks);
    for (std::size_t S : sizes) lab.run_sm(S, sm_chunks, sm_blocks, reps);
    return 0;
  }
  for (std::size_t S : sizes) lab.run(S, chunks, reps);
  return 0;
}
