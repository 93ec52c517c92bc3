// queue_lab's shared parts: error checks, the polling and copy kernels, the primary context,
// the victim streams and VMM memory of its cases. Included once, by queue_lab.cu.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#define CK(x)                                                                               \
  do {                                                                                      \
    CUresult r_ = (x);                                                                      \
    if (r_ != CUDA_SUCCESS) {                                                               \
      const char* s_ = "?";                                                                 \
      cuGetErrorString(r_, &s_);                                                            \
      printf("RESULT FAIL %s: %s (line %d)\n", #x, s_, __LINE__);                           \
      exit(3);                                                                              \
    }                                                                                       \
  } while (0)
#define CR(x)                                                                               \
  do {                                                                                      \
    cudaError_t r_ = (x);                                                                   \
    if (r_ != cudaSuccess) {                                                                \
      printf("RESULT FAIL %s: %s (line %d)\n", #x, cudaGetErrorString(r_), __LINE__);       \
      exit(3);                                                                              \
    }                                                                                       \
  } while (0)

__global__ void spin(volatile unsigned long long* w, unsigned long long v) {
  if (w == nullptr) return;
  while (*w < v) __nanosleep(1000);
}
__global__ void copyk(const int4* s, int4* d, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) d[i] = s[i];
}
static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static CUcontext primary;
static CUdevice dev;
static void init() {
  CR(cudaSetDevice(0));
  CR(cudaFree(nullptr));
  CK(cuCtxGetCurrent(&primary));
  CK(cuDeviceGet(&dev, 0));
}

struct Victim {
  CUcontext ctx = nullptr;  // context to make current for the victim's work
  CUstream stream = nullptr;
};

static Victim make_victim(const std::string& kind) {
  Victim v;
  if (kind == "same" || kind == "hiprio") {
    int lo, hi;
    CR(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    cudaStream_t s;
    CR(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, kind == "hiprio" ? hi : 0));
    v.ctx = primary;
    v.stream = s;
  } else if (kind == "ctx") {
    CK(cuCtxCreate(&v.ctx, nullptr, 0, dev));  // becomes current
    CK(cuStreamCreate(&v.stream, CU_STREAM_NON_BLOCKING));
    CK(cuCtxSetCurrent(primary));
  } else if (kind == "green") {
    CUdevResource res;
    CK(cuDeviceGetDevResource(dev, &res, CU_DEV_RESOURCE_TYPE_SM));
    CUdevResourceDesc desc;
    CK(cuDevResourceGenerateDesc(&desc, &res, 1));
    CUgreenCtx g;
    CK(cuGreenCtxCreate(&g, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM));
    CK(cuCtxFromGreenCtx(&v.ctx, g));
    CK(cuGreenCtxStreamCreate(&v.stream, g, CU_STREAM_NON_BLOCKING, 0));
  } else {
    printf("RESULT FAIL unknown victim %s\n", kind.c_str());
    exit(2);
  }
  return v;
}

__global__ void tiny() {}
static CUdeviceptr vmm_alloc(size_t bytes) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  size_t g = 0;
  CK(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  bytes = (bytes + g - 1) / g * g;
  CUmemGenericAllocationHandle h;
  CK(cuMemCreate(&h, bytes, &prop, 0));
  CUdeviceptr p;
  CK(cuMemAddressReserve(&p, bytes, 0, 0, 0));
  CK(cuMemMap(p, bytes, 0, h, 0));
  CUmemAccessDesc a = {};
  a.location = prop.location;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CK(cuMemSetAccess(p, bytes, &a, 1));
  return p;
}
// A source of `bytes` holding a pattern and a destination of zeros, in primary-context
// memory (VMM memory with `vmm`); wrong_words() counts the destination's words that differ.
struct CopyPair {
  size_t bytes;
  void* src = nullptr;
  void* dst = nullptr;
  std::vector<unsigned> pattern;
  CopyPair(size_t b, bool vmm) : bytes(b), pattern(b / 4) {
    if (vmm) {
      src = (void*)vmm_alloc(bytes);
      dst = (void*)vmm_alloc(bytes);
    } else {
      CR(cudaMalloc(&src, bytes));
      CR(cudaMalloc(&dst, bytes));
    }
    for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = (unsigned)(i * 2654435761u + 17);
    CR(cudaMemcpy(src, pattern.data(), bytes, cudaMemcpyHostToDevice));
    CR(cudaMemset(dst, 0, bytes));
  }
  size_t wrong_words() const {  // with the primary context current
    std::vector<unsigned> out(bytes / 4);
    CR(cudaMemcpy(out.data(), dst, bytes, cudaMemcpyDeviceToHost));
    size_t bad = 0;
    for (size_t i = 0; i < out.size(); ++i) bad += out[i] != pattern[i];
    return bad;
  }
};
