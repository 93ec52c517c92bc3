// Small types shared by the host API and device code; no MPI, no CUDA headers.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MESHMEM_HOST_DEVICE __host__ __device__
#else
#define MESHMEM_HOST_DEVICE
#endif

// The CUDA stream type, declared without CUDA headers: cudaStream_t and CUstream are both
// `CUstream_st*`, so a meshmem::Stream is passed where either is expected.
struct CUstream_st;

namespace meshmem {

using Stream = CUstream_st*;

enum class Memory {
  Device,  // GPU memory of this rank's current device
  Host,    // host memory; works with no GPU
};

enum class SignalOp { Set, Add };
enum class Cmp { EQ, NE, GT, GE, LT, LE };

// `v cmp x`, the test of wait_until on the host and on the device.
MESHMEM_HOST_DEVICE constexpr bool compare(std::uint64_t v, Cmp cmp, std::uint64_t x) {
  switch (cmp) {
    case Cmp::EQ: return v == x;
    case Cmp::NE: return v != x;
    case Cmp::GT: return v > x;
    case Cmp::GE: return v >= x;
    case Cmp::LT: return v < x;
    case Cmp::LE: return v <= x;
  }
  return false;
}

}  // namespace meshmem
