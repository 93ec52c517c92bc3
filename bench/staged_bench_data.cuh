// staged_bench's data check: a pseudo-random byte pattern made and compared on the GPU, every
// byte (shared by the put/get table and the put_signal ping-pong).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "bench_check.hpp"

namespace staged_data {

constexpr unsigned char kPoison = 0xEE;
constexpr std::size_t kGuard = 4 << 10;  // bytes past the destination that must stay untouched

static __device__ __forceinline__ unsigned char pattern_byte(unsigned long long seed, std::size_t i) {
  unsigned long long z = seed + static_cast<unsigned long long>(i >> 3) * 0x9E3779B97F4A7C15ull;  // splitmix64
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<unsigned char>(z >> ((i & 7) * 8));
}

static __global__ void fill_pattern(unsigned char* p, std::size_t n, unsigned long long seed) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    p[i] = pattern_byte(seed, i);
}

// out[0] += bytes of p[0, n) that differ from the pattern (constant < 0) or from `constant`;
// out[1] = min(out[1], the first such index).
static __global__ void count_mismatches(const unsigned char* p, std::size_t n, unsigned long long seed, int constant,
                                 unsigned long long* out) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  unsigned long long count = 0, first = ~0ull;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const unsigned char want = constant < 0 ? pattern_byte(seed, i) : static_cast<unsigned char>(constant);
    if (p[i] != want) {
      if (count == 0) first = i;
      ++count;
    }
  }
  if (count != 0) {
    atomicAdd(&out[0], count);
    atomicMin(&out[1], first);
  }
}

constexpr int kBlocks = 1024, kThreads = 256;

static inline void fill(void* p, std::size_t n, unsigned long long seed, cudaStream_t s) {
  fill_pattern<<<kBlocks, kThreads, 0, s>>>(static_cast<unsigned char*>(p), n, seed);
  CK(cudaGetLastError());
  CK(cudaStreamSynchronize(s));
}

struct Mismatch {
  unsigned long long count = 0, first = ~0ull;
};

// Compares p[0, n) (a buffer of the current GPU) with the pattern (constant < 0) or a byte.
static inline Mismatch compare(const void* p, std::size_t n, unsigned long long seed, int constant, unsigned long long* counters,
                 cudaStream_t s) {
  Mismatch m;
  CK(cudaMemcpyAsync(counters, &m, sizeof(m), cudaMemcpyHostToDevice, s));
  count_mismatches<<<kBlocks, kThreads, 0, s>>>(static_cast<const unsigned char*>(p), n, seed, constant, counters);
  CK(cudaGetLastError());
  CK(cudaMemcpyAsync(&m, counters, sizeof(m), cudaMemcpyDeviceToHost, s));
  CK(cudaStreamSynchronize(s));
  return m;
}

}  // namespace staged_data
