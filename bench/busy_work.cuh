// The "busy stream" barrier pattern shared by the device benchmarks: a kernel that keeps
// the stream busy for a fixed time, so that a barrier enqueued behind it must be met on
// the GPU (no benchmark variant can take a shortcut for idle streams).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace bench {

constexpr unsigned kBusyNs = 20000;  // long enough to outlast every host-side barrier call

__global__ void busy_kernel(unsigned ns) {
  std::uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

inline cudaError_t launch_busy(cudaStream_t s) {
  busy_kernel<<<1, 32, 0, s>>>(kBusyNs);
  return cudaGetLastError();
}

}  // namespace bench
