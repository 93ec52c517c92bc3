// Small types shared by the host API and device code; no MPI, no CUDA headers.
#pragma once

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

}  // namespace meshmem
