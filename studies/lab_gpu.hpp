// What the one-GPU labs (driver_call_lab, fill_lab) share: GPU 0 made current, and a stream
// write of a pinned word as the staging agent enqueues it. The labs price raw driver calls and
// do not include the library's internal headers.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "bench_check.hpp"

namespace bench {

// Makes GPU 0 current and fills `prop`; false (and says so) where there is no GPU.
inline bool use_gpu0(const char* lab, cudaDeviceProp* prop) {
  int ngpu = 0;
  if (cudaGetDeviceCount(&ngpu) != cudaSuccess || ngpu < 1) {
    std::printf("# %s: no GPU; nothing measured\n", lab);
    return false;
  }
  CK(cudaSetDevice(0));
  CK(cudaGetDeviceProperties(prop, 0));
  return true;
}

inline CUstreamBatchMemOpParams write_op(std::uint64_t* word, std::uint64_t value) {
  CUstreamBatchMemOpParams op{};
  op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
  op.writeValue.address = reinterpret_cast<CUdeviceptr>(word);
  op.writeValue.value64 = value;
  op.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  return op;
}

}  // namespace bench
