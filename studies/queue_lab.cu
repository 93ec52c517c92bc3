// queue_lab: the study behind cuda/gpu_queues.hpp. Does a stream that waits hold back the
// work of another stream of the same process, and does a second context escape it?
//   queue_lab all            every case below, each in a child process (a held-back case can
//                            leave its process stuck: the child is killed after 15 s)
//   queue_lab queue BLOCKER VICTIM WORK
//     BLOCKER: memop (cuStreamWaitValue64 on a pinned word), kernel (a polling kernel), and
//              either followed by a tiny kernel on the same stream (memop+tail, kernel+tail),
//              on N streams (N = CUDA_DEVICE_MAX_CONNECTIONS, or BLOCKERS=N)
//     VICTIM:  a stream made before the blockers: same (primary context), hiprio (greatest
//              priority), green (a green context of all SMs), ctx (a context of cuCtxCreate)
//     WORK:    copy (64 MiB device to device; VMM=1: VMM memory) or kernel (a copy kernel), or
//              what a staged transfer enqueues: memop-write (a stream write of a pinned word),
//              h2h8 / h2d8 / d2h8 (8-byte copies, pinned host memory), d2h / h2d / d2d (4 MiB
//              with pinned host memory, or within the GPU), h2d-batch / h2d8-batch / d2d-batch
//              (cudaMemcpyBatchAsync, cudaMemcpyFlagPreferOverlapWithCompute)
//     -> "ran in X ms" or "HELD BACK" (not done after 2 s; then the blockers are released)
//   queue_lab access green|ctx   a kernel of that context copies primary-context memory
//   queue_lab cost               device memory a green context and a cuCtxCreate context take
//   queue_lab nccl primary|green|ctx   a one-rank NCCL send/recv with that context current
//   queue_lab blocking       which releasing calls (cudaFree, ...) wait for a running kernel
//   queue_lab contention HOLDER   while another thread is inside HOLDER (devsync, free,
//                            freehost, streamsync, eventsync), held there by a running kernel,
//                            which calls of this thread wait too
//   queue_lab capture CAPTURE SYNCER CALL   this thread captures a kernel on a stream of
//                            its own in mode CAPTURE (global, thread, relaxed); meanwhile
//                            another thread in mode SYNCER calls CALL (devsync, ctxsync,
//                            streamsync and eventsync of a stream of its own, unmap of a VMM
//                            chunk, free): that call's result, the capture's end, and whether
//                            the graph then replays
//   queue_lab order          is an 8-byte pinned-to-pinned cudaMemcpyAsync stream-ordered?
//   queue_lab chain BRANCHES STEPS ROUNDS WORK   does cudaGraphLaunch return before the graph
//                            runs, and can another thread enqueue meanwhile? A graph of
//                            BRANCHES branches of STEPS steps each: a host node hands the step to
//                            an "agent" thread (as meshmem's captured hand-off does), then a
//                            polling kernel waits for the agent's word. WORK is what the agent
//                            does for a step: host (stores the word, no CUDA call), memop
//                            (cuStreamWriteValue64 on its stream), kernel (a kernel writes it),
//                            copy / d2h / h2d (a 4 KiB device-to-device / to pinned host / from
//                            pinned host copy, then the memop), event (an event recorded, waited
//                            for on the stream and queried, then the memop). Prints the longest
//                            cudaGraphLaunch call and the agent's longest CUDA call; a launch
//                            still inside after 3 s is released from the host (DEADLOCK).
//                            CHAIN_HOST=all|first|none: where the host nodes are (see the code);
//                            doorbell: no host node, a kernel writes the step into a word the
//                            agent polls.
//   queue_lab graph MODE BRANCHES N [probe]   N rounds of a graph captured from BRANCHES
//                            streams (fork and join): a host node hands a round number to this
//                            thread (as meshmem's captured hand-off does), then each branch
//                            waits for a pinned word (polling kernel, a tiny kernel behind it);
//                            this thread copies 4 KiB on an "agent" stream made first and sets
//                            the word after the copy. MODE new: instantiated each round; reuse:
//                            once. A round not done after 1 s is STALLED: a fresh stream then
//                            sets the word (does it escape?), else the host does. probe: before
//                            each round's copy an event on the agent stream must complete within
//                            2 ms, else the agent moves to a fresh stream (the mitigation tried).
// No meshmem: the lab is about CUDA. Results: bench/results/*-queue-lab-*.txt.
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

static int queue_test(const std::string& blocker, const std::string& victim_kind, const std::string& op) {
  init();
  const char* env = getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  int conns = env ? atoi(env) : 8;
  if (getenv("BLOCKERS")) conns = atoi(getenv("BLOCKERS"));
  const bool vmm = getenv("VMM") != nullptr;
  // Load the kernels first: a first launch under lazy loading waits for the device.
  copyk<<<1, 1>>>(nullptr, nullptr, 0);
  spin<<<1, 1>>>(nullptr, 0);
  tiny<<<1, 1>>>();
  CR(cudaDeviceSynchronize());
  unsigned long long* word = nullptr;
  CR(cudaHostAlloc((void**)&word, 8, cudaHostAllocMapped));
  *word = 0;
  unsigned long long* dword = nullptr;
  CR(cudaHostGetDevicePointer((void**)&dword, word, 0));
  const size_t bytes = 64 << 20;
  const CopyPair pair(bytes, vmm);
  void* src = pair.src;
  void* dst = pair.dst;
  // The victim exists before the blockers, as meshmem's proxy streams exist before a user's
  // later waits; the blockers fill every connection.
  Victim v = make_victim(victim_kind);
  if (v.ctx != primary) {  // load the victim's kernel in its context too
    CK(cuCtxSetCurrent(v.ctx));
    copyk<<<1, 1, 0, (cudaStream_t)v.stream>>>(nullptr, nullptr, 0);
    CK(cuStreamSynchronize(v.stream));
    CK(cuCtxSetCurrent(primary));
  }
  std::vector<cudaStream_t> blockers(conns);
  for (auto& s : blockers) {
    CR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    if (blocker.rfind("memop", 0) == 0)
      CK(cuStreamWaitValue64((CUstream)s, (CUdeviceptr)dword, 1, CU_STREAM_WAIT_VALUE_GEQ));
    else
      spin<<<1, 1, 0, s>>>(dword, 1);
    if (blocker == "kernel+tail" || blocker == "memop+tail") tiny<<<1, 1, 0, s>>>();
    CR(cudaGetLastError());
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CK(cuCtxSetCurrent(v.ctx));
  CUevent done;
  CK(cuEventCreate(&done, CU_EVENT_DISABLE_TIMING));
  double t0 = now();
  static void* pinned_chunk = nullptr;
  if (pinned_chunk == nullptr) CR(cudaHostAlloc(&pinned_chunk, 4 << 20, 0));
  // Small host-side cells for the word-sized ops (pinned): what a transfer's end writes.
  static unsigned long long* cells = nullptr;
  if (cells == nullptr) {
    CR(cudaHostAlloc((void**)&cells, 4096, cudaHostAllocMapped));
    cells[0] = 7;
    cells[1] = 0;
  }
  const double call0 = now();
  if (op == "copy") {
    CK(cuMemcpyAsync((CUdeviceptr)dst, (CUdeviceptr)src, bytes, v.stream));
  } else if (op == "memop-write") {  // a stream memory operation writing a pinned word
    CK(cuStreamWriteValue64(v.stream, (CUdeviceptr)(cells + 1), 7, CU_STREAM_WRITE_VALUE_DEFAULT));
  } else if (op == "h2h8") {  // 8 bytes pinned to pinned
    CR(cudaMemcpyAsync(cells + 1, cells, 8, cudaMemcpyHostToHost, (cudaStream_t)v.stream));
  } else if (op == "h2d8") {
    CR(cudaMemcpyAsync(dst, cells, 8, cudaMemcpyHostToDevice, (cudaStream_t)v.stream));
  } else if (op == "d2h8") {
    CR(cudaMemcpyAsync(cells + 1, src, 8, cudaMemcpyDeviceToHost, (cudaStream_t)v.stream));
  } else if (op == "d2h" || op == "h2d" || op == "d2d" || op == "h2d-batch" || op == "h2d8-batch" ||
             op == "d2d-batch") {
    // 4 MiB (a staging chunk) between this GPU and pinned host memory, or within the GPU;
    // -batch: cudaMemcpyBatchAsync with cudaMemcpyFlagPreferOverlapWithCompute.
    void* chunk = pinned_chunk;
    void* d = op.rfind("d2h", 0) == 0 ? chunk : dst;
    const void* from = op.rfind("h2d", 0) == 0 ? (op == "h2d8-batch" ? (const void*)cells : chunk) : src;
    const size_t n = op == "h2d8-batch" ? 8 : size_t(4) << 20;
    if (op.find("-batch") != std::string::npos) {
      cudaMemcpyAttributes attr{};
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
      size_t idx = 0;
      void* dsts[1] = {d};
      const void* srcs[1] = {from};
      size_t sizes[1] = {n};
      CR(cudaMemcpyBatchAsync(dsts, srcs, sizes, 1, &attr, &idx, 1, (cudaStream_t)v.stream));
    } else {
      CR(cudaMemcpyAsync(d, from, n, cudaMemcpyDefault, (cudaStream_t)v.stream));
    }
  } else {
    copyk<<<264, 512, 0, (cudaStream_t)v.stream>>>((const int4*)src, (int4*)dst, bytes / 16);
    CR(cudaGetLastError());
  }
  const double call_ms = (now() - call0) * 1e3;
  CK(cuEventRecord(done, v.stream));
  bool finished = false;
  double t_end = 0;
  while (now() - t0 < 2.0) {
    CUresult q = cuEventQuery(done);
    if (q == CUDA_SUCCESS) {
      finished = true;
      t_end = now();
      break;
    }
    if (q != CUDA_ERROR_NOT_READY) CK(q);
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  *word = 1;  // release the blockers
  CK(cuEventSynchronize(done));
  CK(cuCtxSetCurrent(primary));
  CR(cudaDeviceSynchronize());
  const bool copied = op == "copy" || op == "kernel";
  printf("RESULT queue connections=%s%s blockers=%d blocker=%s victim=%s op=%s: %s%s, the call took %.3f ms%s\n",
         env ? env : "(unset)", vmm ? " vmm" : "", conns, blocker.c_str(), victim_kind.c_str(), op.c_str(),
         finished ? "ran in " : "HELD BACK (not done after 2 s)",
         finished ? (std::to_string((t_end - t0) * 1e3) + " ms").c_str() : "", call_ms,
         copied ? (", wrong words " + std::to_string(pair.wrong_words())).c_str() : "");
  return finished && (!copied || pair.wrong_words() == 0) ? 0 : 1;
}

// A kernel of the other context reads primary cudaMalloc memory and writes primary memory.
static int access_test(const std::string& kind) {
  init();
  const size_t bytes = 16 << 20;
  const CopyPair pair(bytes, false);
  void* src = pair.src;
  void* dst = pair.dst;
  Victim v = make_victim(kind);
  CK(cuCtxSetCurrent(v.ctx));
  copyk<<<132, 512, 0, (cudaStream_t)v.stream>>>((const int4*)src, (int4*)dst, bytes / 16);
  cudaError_t le = cudaGetLastError();
  CUresult sr = cuStreamSynchronize(v.stream);
  const char* s = "ok";
  if (sr != CUDA_SUCCESS) cuGetErrorString(sr, &s);
  CK(cuCtxSetCurrent(primary));
  const size_t bad = pair.wrong_words();
  printf("RESULT access %s: launch %s, sync %s, wrong words %zu of %zu\n", kind.c_str(), cudaGetErrorString(le), s,
         bad, bytes / 4);
  // Copy bandwidth in that context between primary buffers, vs the primary context.
  for (int pass = 0; pass < 2; ++pass) {
    CUcontext c = pass == 0 ? primary : v.ctx;
    CUstream st = nullptr;
    CK(cuCtxSetCurrent(c));
    if (pass == 1) st = v.stream; else CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
    CK(cuMemcpyAsync((CUdeviceptr)dst, (CUdeviceptr)src, bytes, st));
    CK(cuStreamSynchronize(st));
    double t0 = now();
    for (int i = 0; i < 20; ++i) CK(cuMemcpyAsync((CUdeviceptr)dst, (CUdeviceptr)src, bytes, st));
    CK(cuStreamSynchronize(st));
    double t = (now() - t0) / 20;
    printf("RESULT copy-bw %s in %s: %.1f GB/s\n", kind.c_str(), pass == 0 ? "primary" : kind.c_str(), bytes / t / 1e9);
  }
  return bad == 0 && sr == CUDA_SUCCESS ? 0 : 1;
}

// Device memory (MiB) that a context of `kind` takes once a kernel ran in it (kept alive).
static double context_cost_mib(const char* kind) {
  size_t before, after, total;
  CR(cudaMemGetInfo(&before, &total));
  Victim v = make_victim(kind);
  CK(cuCtxSetCurrent(v.ctx));
  spin<<<1, 1, 0, (cudaStream_t)v.stream>>>(nullptr, 0);  // its resources come into being
  CK(cuStreamSynchronize(v.stream));
  CK(cuCtxSetCurrent(primary));
  CR(cudaMemGetInfo(&after, &total));
  return (double)(before - after) / (1 << 20);
}

static int cost_test() {
  init();
  const double green = context_cost_mib("green");
  const double ctx = context_cost_mib("ctx");
  printf("RESULT cost: green context %.1f MiB, cuCtxCreate context %.1f MiB of device memory\n", green, ctx);
  return 0;
}

// A one-rank NCCL communicator made with `kind` current: send to self from primary memory.
typedef int ncclResult_t_;
struct ncclUniqueId_ { char internal[128]; };
static int nccl_test(const std::string& kind) {
  init();
  void* lib = dlopen("libnccl.so.2", RTLD_NOW);
  if (!lib) {
    printf("RESULT nccl %s: cannot load libnccl.so.2 (%s)\n", kind.c_str(), dlerror());
    return 1;
  }
  auto getid = (ncclResult_t_(*)(ncclUniqueId_*))dlsym(lib, "ncclGetUniqueId");
  auto init_rank = (ncclResult_t_(*)(void**, int, ncclUniqueId_, int))dlsym(lib, "ncclCommInitRank");
  auto send = (ncclResult_t_(*)(const void*, size_t, int, int, void*, cudaStream_t))dlsym(lib, "ncclSend");
  auto recv = (ncclResult_t_(*)(void*, size_t, int, int, void*, cudaStream_t))dlsym(lib, "ncclRecv");
  auto gs = (ncclResult_t_(*)())dlsym(lib, "ncclGroupStart");
  auto ge = (ncclResult_t_(*)())dlsym(lib, "ncclGroupEnd");
  auto err = (const char* (*)(ncclResult_t_))dlsym(lib, "ncclGetErrorString");
  const size_t bytes = 8 << 20;
  const CopyPair pair(bytes, false);
  Victim v;
  if (kind == "primary") {
    v.ctx = primary;
    CK(cuStreamCreate(&v.stream, CU_STREAM_NON_BLOCKING));
  } else {
    v = make_victim(kind);
  }
  CK(cuCtxSetCurrent(v.ctx));
  ncclUniqueId_ id;
  void* comm = nullptr;
  int r = getid(&id);
  if (r == 0) r = init_rank(&comm, 1, id, 0);
  if (r != 0) {
    printf("RESULT nccl %s: init failed: %s\n", kind.c_str(), err(r));
    return 1;
  }
  gs();
  send(pair.src, bytes, /*ncclInt8*/ 0, 0, comm, (cudaStream_t)v.stream);
  recv(pair.dst, bytes, 0, 0, comm, (cudaStream_t)v.stream);
  r = ge();
  CUresult sr = cuStreamSynchronize(v.stream);
  const char* s = "ok";
  if (sr != CUDA_SUCCESS) cuGetErrorString(sr, &s);
  CK(cuCtxSetCurrent(primary));
  const size_t bad = pair.wrong_words();
  printf("RESULT nccl %s: group %s, sync %s, wrong words %zu\n", kind.c_str(), err(r), s, bad);
  return bad == 0 ? 0 : 1;
}

// Which releasing calls wait for a kernel that runs on another (non-blocking) stream: each
// call's host time while a polling kernel runs for 3 s (a call that waits takes about that).
static int blocking_test() {
  init();
  unsigned long long* word = nullptr;
  CR(cudaHostAlloc((void**)&word, 8, cudaHostAllocMapped));
  unsigned long long* dword = nullptr;
  CR(cudaHostGetDevicePointer((void**)&dword, word, 0));
  spin<<<1, 1>>>(nullptr, 0);
  CR(cudaDeviceSynchronize());
  cudaStream_t busy;
  CR(cudaStreamCreateWithFlags(&busy, cudaStreamNonBlocking));
  auto timed = [&](const char* name, auto&& prepare, auto&& call) {
    prepare();
    CR(cudaDeviceSynchronize());
    *word = 0;
    spin<<<1, 1, 0, busy>>>(dword, 1);
    std::thread release([&] {
      std::this_thread::sleep_for(std::chrono::seconds(3));
      __atomic_store_n(word, 1ull, __ATOMIC_RELEASE);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const double t0 = now();
    call();
    const double t = now() - t0;
    __atomic_store_n(word, 1ull, __ATOMIC_RELEASE);
    release.join();
    CR(cudaStreamSynchronize(busy));
    printf("RESULT blocking %-34s %8.3f ms%s\n", name, t * 1e3, t > 1.0 ? "  WAITS for the kernel" : "");
  };
  void* d = nullptr;
  void* h = nullptr;
  cudaEvent_t e = nullptr;
  cudaStream_t s = nullptr;
  CUdeviceptr v = 0;
  timed("cudaFree", [&] { CR(cudaMalloc(&d, 1 << 20)); }, [&] { CR(cudaFree(d)); });
  timed("cudaFreeAsync (own stream) + nothing", [&] { CR(cudaMalloc(&d, 1 << 20)); CR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); },
        [&] { CR(cudaFreeAsync(d, s)); });
  CR(cudaStreamDestroy(s));
  timed("cudaFreeHost", [&] { CR(cudaHostAlloc(&h, 1 << 20, cudaHostAllocMapped)); }, [&] { CR(cudaFreeHost(h)); });
  timed("cudaHostUnregister", [&] { h = malloc(1 << 20); CR(cudaHostRegister(h, 1 << 20, 0)); },
        [&] { CR(cudaHostUnregister(h)); });
  free(h);
  timed("cudaEventDestroy", [&] { CR(cudaEventCreate(&e)); }, [&] { CR(cudaEventDestroy(e)); });
  timed("cudaStreamDestroy", [&] { CR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); },
        [&] { CR(cudaStreamDestroy(s)); });
  timed("cuMemUnmap + cuMemAddressFree (VMM)", [&] { v = vmm_alloc(2 << 20); }, [&] {
    CK(cuMemUnmap(v, 2 << 20));
    CK(cuMemAddressFree(v, 2 << 20));
  });
  // What a teardown could use instead, and the allocations.
  CUmemGenericAllocationHandle vh = 0;
  auto vmm_make = [&](CUmemLocationType where, bool through_fd) {
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = where;
    prop.location.id = 0;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CK(cuMemCreate(&vh, 2 << 20, &prop, 0));
    if (through_fd) {
      int fd = -1;
      CK(cuMemExportToShareableHandle(&fd, vh, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
      CUmemGenericAllocationHandle imported = 0;
      CK(cuMemImportFromShareableHandle(&imported, (void*)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
      close(fd);
      CK(cuMemRelease(vh));
      vh = imported;
    }
    CK(cuMemAddressReserve(&v, 2 << 20, 0, 0, 0));
    CK(cuMemMap(v, 2 << 20, 0, vh, 0));
    CUmemAccessDesc a = {};
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = 0;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CK(cuMemSetAccess(v, 2 << 20, &a, 1));
  };
  auto vmm_drop = [&] {
    CK(cuMemUnmap(v, 2 << 20));
    CK(cuMemRelease(vh));
    CK(cuMemAddressFree(v, 2 << 20));
  };
  timed("VMM device: unmap+release+free", [&] { vmm_make(CU_MEM_LOCATION_TYPE_DEVICE, false); }, vmm_drop);
  timed("VMM device via fd: unmap+release", [&] { vmm_make(CU_MEM_LOCATION_TYPE_DEVICE, true); }, vmm_drop);
  timed("VMM host NUMA: unmap+release+free", [&] { vmm_make(CU_MEM_LOCATION_TYPE_HOST_NUMA, false); }, vmm_drop);
  timed("cudaEventDestroy (interprocess)",
        [&] { CR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventInterprocess)); },
        [&] { CR(cudaEventDestroy(e)); });
  timed("cudaFreeAsync (pool) + own sync", [&] {
    CR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CR(cudaMallocAsync(&d, 1 << 20, s));
    CR(cudaStreamSynchronize(s));
  }, [&] { CR(cudaFreeAsync(d, s)); CR(cudaStreamSynchronize(s)); });
  timed("cudaMallocAsync (pool) + own sync", [&] {}, [&] { CR(cudaMallocAsync(&d, 1 << 20, s)); CR(cudaStreamSynchronize(s)); });
  CR(cudaFreeAsync(d, s));
  CR(cudaStreamSynchronize(s));
  timed("cudaStreamSynchronize (own idle stream)", [&] {}, [&] { CR(cudaStreamSynchronize(s)); });
  CR(cudaStreamDestroy(s));
  timed("cudaHostAlloc", [&] {}, [&] { CR(cudaHostAlloc(&h, 1 << 20, cudaHostAllocMapped)); });
  CR(cudaFreeHost(h));
  timed("cudaHostRegister", [&] { h = malloc(1 << 20); }, [&] { CR(cudaHostRegister(h, 1 << 20, 0)); });
  CR(cudaHostUnregister(h));
  free(h);
  timed("cudaDeviceSynchronize (control: must wait)", [&] {}, [&] { CR(cudaDeviceSynchronize()); });
  timed("cudaMalloc", [&] {}, [&] { CR(cudaMalloc(&d, 1 << 20)); });
  CR(cudaFree(d));
  timed("cudaMemset (legacy stream)", [&] { CR(cudaMalloc(&d, 1 << 20)); }, [&] { CR(cudaMemset(d, 0, 1 << 20)); });
  CR(cudaFree(d));
  return 0;
}

// 2 MiB of device memory through VMM: reserved, created, mapped, readable and writable.
static void map_device_chunk(CUdeviceptr* v, CUmemGenericAllocationHandle* vh) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  CK(cuMemCreate(vh, 2 << 20, &prop, 0));
  CK(cuMemAddressReserve(v, 2 << 20, 0, 0, 0));
  CK(cuMemMap(*v, 2 << 20, 0, *vh, 0));
  CUmemAccessDesc acc = {};
  acc.location = prop.location;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CK(cuMemSetAccess(*v, 2 << 20, &acc, 1));
}

// A kernel polls a pinned word on a stream of its own for 1.5 s; a second thread enters
// `holder` (which waits for that kernel), and this thread times each call: "WAITS" when it
// returned only after the kernel ended. A call that waits only here takes a lock that the
// holder keeps while it waits.
static int contention_test(const std::string& holder) {
  init();
  unsigned long long* word = nullptr;
  CR(cudaHostAlloc((void**)&word, 8, cudaHostAllocMapped));
  unsigned long long* dword = nullptr;
  CR(cudaHostGetDevicePointer((void**)&dword, word, 0));
  cudaStream_t busy, own;
  CR(cudaStreamCreateWithFlags(&busy, cudaStreamNonBlocking));
  CR(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
  void* a = nullptr;
  void* b = nullptr;
  CR(cudaMalloc(&a, 1 << 20));
  CR(cudaMalloc(&b, 1 << 20));
  auto timed = [&](const char* name, auto&& prepare, auto&& call) {
    void* held_device = nullptr;
    void* held_host = nullptr;
    cudaEvent_t busy_done = nullptr;
    prepare();
    if (holder == "free") CR(cudaMalloc(&held_device, 1 << 20));
    if (holder == "freehost") CR(cudaHostAlloc(&held_host, 1 << 20, 0));
    if (holder == "eventsync") CR(cudaEventCreateWithFlags(&busy_done, cudaEventDisableTiming));
    CR(cudaDeviceSynchronize());
    *word = 0;
    spin<<<1, 1, 0, busy>>>(dword, 1);
    if (busy_done != nullptr) CR(cudaEventRecord(busy_done, busy));
    std::thread hold([&] {
      cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
      CR(cudaThreadExchangeStreamCaptureMode(&mode));
      if (holder == "devsync") CR(cudaDeviceSynchronize());
      if (holder == "free") CR(cudaFree(held_device));
      if (holder == "freehost") CR(cudaFreeHost(held_host));
      if (holder == "streamsync") CR(cudaStreamSynchronize(busy));
      if (holder == "eventsync") CR(cudaEventSynchronize(busy_done));
    });
    std::thread release([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      __atomic_store_n(word, 1ull, __ATOMIC_RELEASE);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the holder is inside
    const double t0 = now();
    call();
    const double t = now() - t0;
    release.join();
    hold.join();
    CR(cudaStreamSynchronize(busy));
    if (busy_done != nullptr) CR(cudaEventDestroy(busy_done));
    printf("RESULT contention %-10s %-36s %8.3f ms%s\n", holder.c_str(), name, t * 1e3,
           t > 0.7 ? "  WAITS" : "");
  };
  cudaEvent_t e = nullptr;
  cudaStream_t s = nullptr;
  void* d = nullptr;
  void* h = nullptr;
  CUdeviceptr v = 0;
  CUmemGenericAllocationHandle vh = 0;
  timed("cudaEventDestroy (never recorded)", [&] { CR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)); },
        [&] { CR(cudaEventDestroy(e)); });
  timed("cudaEventDestroy (recorded, done)", [&] {
    CR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CR(cudaEventRecord(e, own));
  }, [&] { CR(cudaEventDestroy(e)); });
  timed("cudaEventCreate", [&] {}, [&] { CR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)); });
  CR(cudaEventDestroy(e));
  timed("cudaStreamDestroy", [&] { CR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); },
        [&] { CR(cudaStreamDestroy(s)); });
  timed("cudaStreamCreate", [&] {}, [&] { CR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); });
  CR(cudaStreamDestroy(s));
  CR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  timed("cudaEventRecord (own stream)", [&] {}, [&] { CR(cudaEventRecord(e, own)); });
  timed("cudaEventQuery (done)", [&] {}, [&] { CR(cudaEventQuery(e)); });
  timed("kernel launch (own stream)", [&] {}, [&] { tiny<<<1, 1, 0, own>>>(); CR(cudaGetLastError()); });
  timed("cudaMemcpyAsync D2D (own stream)", [&] {}, [&] { CR(cudaMemcpyAsync(b, a, 1 << 20, cudaMemcpyDeviceToDevice, own)); });
  timed("cudaStreamSynchronize (own, idle)", [&] {}, [&] { CR(cudaStreamSynchronize(own)); });
  timed("cudaStreamQuery (own, idle)", [&] {}, [&] { (void)cudaStreamQuery(own); });
  timed("cudaMallocAsync+cudaFreeAsync (own)", [&] {}, [&] {
    CR(cudaMallocAsync(&d, 4096, own));
    CR(cudaFreeAsync(d, own));
  });
  timed("cudaMalloc", [&] {}, [&] { CR(cudaMalloc(&d, 1 << 20)); });
  CR(cudaFree(d));
  timed("cudaHostAlloc", [&] {}, [&] { CR(cudaHostAlloc(&h, 1 << 20, 0)); });
  CR(cudaFreeHost(h));
  timed("VMM device: unmap+release+free", [&] { map_device_chunk(&v, &vh); }, [&] {
    CK(cuMemUnmap(v, 2 << 20));
    CK(cuMemRelease(vh));
    CK(cuMemAddressFree(v, 2 << 20));
  });
  timed("cuStreamWaitValue64 (own, met)", [&] {}, [&] {
    CK(cuStreamWaitValue64((CUstream)own, (CUdeviceptr)dword, 0, CU_STREAM_WAIT_VALUE_GEQ));
  });
  CR(cudaStreamSynchronize(own));
  CR(cudaEventDestroy(e));
  return 0;
}

static cudaStreamCaptureMode capture_mode(const std::string& m) {
  if (m == "global") return cudaStreamCaptureModeGlobal;
  if (m == "thread") return cudaStreamCaptureModeThreadLocal;
  return cudaStreamCaptureModeRelaxed;
}

// What a thread of a library (a releaser's device synchronisation, a pool's unmap) does to a
// capture another thread of the program has open, and what it is told.
static int capture_test(const std::string& capture, const std::string& syncer, const std::string& call) {
  init();
  cudaStream_t cap, own;
  CR(cudaStreamCreateWithFlags(&cap, cudaStreamNonBlocking));
  CR(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
  cudaEvent_t ev;
  CR(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  void* freed = nullptr;
  CR(cudaMalloc(&freed, 1 << 20));
  CUdeviceptr v = 0;
  CUmemGenericAllocationHandle vh = 0;
  map_device_chunk(&v, &vh);
  tiny<<<1, 1, 0, own>>>();  // the own stream has done work
  CR(cudaDeviceSynchronize());
  CR(cudaStreamBeginCapture(cap, capture_mode(capture)));
  tiny<<<1, 1, 0, cap>>>();
  std::string result = "?";
  std::thread other([&] {
    cudaStreamCaptureMode mode = capture_mode(syncer);
    cudaThreadExchangeStreamCaptureMode(&mode);
    cudaError_t rc = cudaSuccess;
    CUresult cu = CUDA_SUCCESS;
    if (call == "devsync") rc = cudaDeviceSynchronize();
    if (call == "ctxsync") cu = cuCtxSynchronize();
    if (call == "streamsync") rc = cudaStreamSynchronize(own);
    if (call == "eventsync") {
      rc = cudaEventRecord(ev, own);
      if (rc == cudaSuccess) rc = cudaEventSynchronize(ev);
    }
    if (call == "unmap") {
      cu = cuMemUnmap(v, 2 << 20);
      if (cu == CUDA_SUCCESS) cu = cuMemRelease(vh);
      if (cu == CUDA_SUCCESS) cu = cuMemAddressFree(v, 2 << 20);
    }
    if (call == "free") rc = cudaFree(freed);
    const char* s = "no error";
    if (cu != CUDA_SUCCESS) cuGetErrorName(cu, &s);
    result = rc != cudaSuccess ? cudaGetErrorName(rc) : s;
    (void)cudaGetLastError();
  });
  other.join();
  tiny<<<1, 1, 0, cap>>>();
  const cudaError_t launched = cudaGetLastError();
  cudaGraph_t g = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(cap, &g);
  std::string replay = "no graph";
  if (ended == cudaSuccess && g != nullptr) {
    cudaGraphExec_t x = nullptr;
    cudaError_t rc = cudaGraphInstantiate(&x, g, 0);
    if (rc == cudaSuccess) rc = cudaGraphLaunch(x, cap);
    if (rc == cudaSuccess) rc = cudaStreamSynchronize(cap);
    replay = rc == cudaSuccess ? "replays" : cudaGetErrorName(rc);
  }
  (void)cudaGetLastError();
  printf("RESULT capture %-7s syncer %-7s %-10s -> %-36s later launch into capture: %-28s end: %-32s %s\n",
         capture.c_str(), syncer.c_str(), call.c_str(), result.c_str(), cudaGetErrorName(launched),
         cudaGetErrorName(ended), replay.c_str());
  return 0;
}

// Graph rounds against a copy of another stream (see the header).
__global__ void spin_to(volatile unsigned long long* w, volatile unsigned long long* target) {
  if (w == nullptr) return;
  while (*w < *target) __nanosleep(1000);
}
static std::atomic<unsigned long long> handed{0};
static unsigned long long* host_target = nullptr;
static void CUDART_CB hand_over(void*) {
  const unsigned long long v = handed.load() + 1;
  *host_target = v;
  handed.store(v);
}
static bool wait_query(cudaStream_t s, double seconds) {
  const double t0 = now();
  while (now() - t0 < seconds) {
    const cudaError_t q = cudaStreamQuery(s);
    if (q == cudaSuccess) return true;
    if (q != cudaErrorNotReady) CR(q);
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return false;
}
static int graph_test(const std::string& mode, int branches, int rounds, bool probe) {
  init();
  spin_to<<<1, 1>>>(nullptr, nullptr);
  (void)cudaGetLastError();
  tiny<<<1, 1>>>();
  CR(cudaDeviceSynchronize());
  cudaStream_t agent;
  CR(cudaStreamCreateWithFlags(&agent, cudaStreamNonBlocking));  // first, as meshmem's agent's
  unsigned long long *word = nullptr, *dword = nullptr, *dtarget = nullptr;
  CR(cudaHostAlloc((void**)&word, 8, cudaHostAllocMapped));
  CR(cudaHostAlloc((void**)&host_target, 8, cudaHostAllocMapped));
  *word = 0;
  *host_target = ~0ull;
  CR(cudaHostGetDevicePointer((void**)&dword, word, 0));
  CR(cudaHostGetDevicePointer((void**)&dtarget, host_target, 0));
  void *src = nullptr, *dst = nullptr;
  CR(cudaMalloc(&src, 4096));
  CR(cudaMalloc(&dst, 4096));
  std::vector<cudaStream_t> streams(static_cast<size_t>(branches));
  for (auto& st : streams) CR(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t fork, probe_ev;
  CR(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CR(cudaEventCreateWithFlags(&probe_ev, cudaEventDisableTiming));
  std::vector<cudaEvent_t> joins(static_cast<size_t>(branches));
  for (auto& e : joins) CR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  cudaGraphExec_t exec = nullptr;
  int stalls = 0, escaped = 0, moved = 0, made = 1;
  std::string where;
  for (int round = 1; round <= rounds; ++round) {
    if (exec == nullptr || mode == "new") {
      if (exec != nullptr) CR(cudaGraphExecDestroy(exec));
      cudaStream_t s = streams[0];
      CR(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      CR(cudaLaunchHostFunc(s, hand_over, nullptr));
      CR(cudaEventRecord(fork, s));
      for (int b = 1; b < branches; ++b) CR(cudaStreamWaitEvent(streams[b], fork, 0));
      for (int b = 0; b < branches; ++b) {
        spin_to<<<1, 1, 0, streams[b]>>>(dword, dtarget);
        tiny<<<1, 1, 0, streams[b]>>>();
      }
      for (int b = 1; b < branches; ++b) {
        CR(cudaEventRecord(joins[b], streams[b]));
        CR(cudaStreamWaitEvent(s, joins[b], 0));
      }
      cudaGraph_t g = nullptr;
      CR(cudaStreamEndCapture(s, &g));
      CR(cudaGraphInstantiate(&exec, g, 0));
      CR(cudaGraphDestroy(g));
    }
    CR(cudaGraphLaunch(exec, streams[0]));
    const double t0 = now();
    while (handed.load() < (unsigned long long)round) {
      if (now() - t0 > 5) {
        printf("RESULT FAIL round %d: the host node did not run within 5 s\n", round);
        return 3;
      }
      std::this_thread::yield();
    }
    if (probe) {
      CR(cudaEventRecord(probe_ev, agent));
      const double p0 = now();
      cudaError_t q = cudaErrorNotReady;
      while (now() - p0 < 2e-3 && (q = cudaEventQuery(probe_ev)) == cudaErrorNotReady) {
      }
      if (q == cudaErrorNotReady) {  // its queue is held: leave the stream (its probe runs later) for a fresh one
        CR(cudaStreamCreateWithFlags(&agent, cudaStreamNonBlocking));
        ++moved;
        ++made;
      } else if (q != cudaSuccess) {
        CR(q);
      }
    }
    CR(cudaMemcpyAsync(dst, src, 4096, cudaMemcpyDeviceToDevice, agent));
    CK(cuStreamWriteValue64((CUstream)agent, (CUdeviceptr)dword, (cuuint64_t)round, CU_STREAM_WRITE_VALUE_DEFAULT));
    if (!wait_query(streams[0], 1.0)) {
      ++stalls;
      where += " " + std::to_string(round);
      cudaStream_t fresh;
      CR(cudaStreamCreateWithFlags(&fresh, cudaStreamNonBlocking));
      ++made;
      CK(cuStreamWriteValue64((CUstream)fresh, (CUdeviceptr)dword, (cuuint64_t)round, CU_STREAM_WRITE_VALUE_DEFAULT));
      if (wait_query(streams[0], 0.5)) {
        ++escaped;
        where += "(fresh escaped)";
      } else {
        *(volatile unsigned long long*)word = (unsigned long long)round;
        where += "(host released)";
        if (!wait_query(streams[0], 2.0)) {
          printf("RESULT FAIL round %d: not done even after the host set the word\n", round);
          return 3;
        }
      }
    }
  }
  CR(cudaDeviceSynchronize());
  const char* env = getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  printf("RESULT graph connections=%s mode=%s branches=%d rounds=%d probe=%s: %d STALLED%s, %d escaped to a fresh "
         "stream, agent moved %d times, streams made by this thread %d\n",
         env ? env : "(unset)", mode.c_str(), branches, rounds, probe ? "on" : "off", stalls, where.c_str(), escaped,
         moved, made + branches);
  return 0;
}

__global__ void spin_step(volatile unsigned long long* word, const volatile unsigned long long* base,
                          unsigned long long step, unsigned long long* gave_up) {
  const unsigned long long target = *base + step;
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  while (*word < target) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 > 10000000000ull) {  // 10 s: the lab never hangs for good
      atomicAdd(gave_up, 1ull);
      return;
    }
    __nanosleep(500);
  }
}
// The hand-off without a host node: the step's number, this round's, into a word the agent polls.
__global__ void ring_step(unsigned long long* door, const volatile unsigned long long* base, unsigned long long step) {
  *(volatile unsigned long long*)door = *base + step;
  __threadfence_system();
}
__global__ void set_word(unsigned long long* w, unsigned long long v) {
  *(volatile unsigned long long*)w = v;
  __threadfence_system();
}
namespace chain {
struct Step {
  int branch;
  unsigned long long step;
};
std::mutex m;
std::condition_variable cv;
std::deque<Step> asked;
bool stop = false;
void CUDART_CB hand(void* p) {
  std::lock_guard<std::mutex> lock(m);
  asked.push_back(*static_cast<Step*>(p));
  cv.notify_one();
}
}  // namespace chain
static int chain_test(int branches, int steps, int rounds, const std::string& work) {
  init();
  // CHAIN_HOST=all (a host node before every step), first (before each branch's first step
  // only: the agent then releases all its steps at once, 20 ms later), none (no host node:
  // the agent releases every branch 20 ms after the launch call returned).
  const std::string host_nodes = getenv("CHAIN_HOST") ? getenv("CHAIN_HOST") : "all";
  unsigned long long *words = nullptr, *dwords = nullptr, *base = nullptr, *dbase = nullptr, *gave = nullptr;
  CR(cudaHostAlloc((void**)&words, 8 * branches, cudaHostAllocMapped));
  CR(cudaHostAlloc((void**)&base, 8, cudaHostAllocMapped));
  CR(cudaHostGetDevicePointer((void**)&dwords, words, 0));
  CR(cudaHostGetDevicePointer((void**)&dbase, base, 0));
  unsigned long long *doors = nullptr, *ddoors = nullptr;
  CR(cudaHostAlloc((void**)&doors, 8 * branches, cudaHostAllocMapped));
  CR(cudaHostGetDevicePointer((void**)&ddoors, doors, 0));
  for (int b = 0; b < branches; ++b) doors[b] = 0;
  CR(cudaMallocManaged((void**)&gave, 8));
  *gave = 0;
  for (int b = 0; b < branches; ++b) words[b] = 0;
  *base = 0;
  void *src = nullptr, *dst = nullptr;
  CR(cudaMalloc(&src, 4096));
  CR(cudaMalloc(&dst, 4096));
  set_word<<<1, 1>>>(dst == nullptr ? nullptr : (unsigned long long*)dst, 0);  // loaded before any graph runs
  spin_step<<<1, 1>>>(dwords, dbase, 0, gave);
  CR(cudaDeviceSynchronize());
  cudaStream_t agent;
  CR(cudaStreamCreateWithFlags(&agent, cudaStreamNonBlocking));
  void* pinned = nullptr;
  CR(cudaHostAlloc(&pinned, 4096, cudaHostAllocDefault));
  cudaEvent_t agent_event;
  CR(cudaEventCreateWithFlags(&agent_event, cudaEventDisableTiming));
  std::vector<cudaStream_t> streams(static_cast<size_t>(branches));
  for (auto& st : streams) CR(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t fork;
  CR(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  std::vector<cudaEvent_t> joins(static_cast<size_t>(branches));
  for (auto& e : joins) CR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  std::vector<chain::Step> payload(static_cast<size_t>(branches * steps));
  cudaStream_t s = streams[0];
  CR(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  CR(cudaEventRecord(fork, s));
  for (int b = 1; b < branches; ++b) CR(cudaStreamWaitEvent(streams[b], fork, 0));
  for (int k = 0; k < steps; ++k)
    for (int b = 0; b < branches; ++b) {
      chain::Step& p = payload[static_cast<size_t>(b * steps + k)];
      p = chain::Step{b, static_cast<unsigned long long>(k + 1)};
      if (host_nodes == "all" || (host_nodes == "first" && k == 0)) CR(cudaLaunchHostFunc(streams[b], chain::hand, &p));
      if (host_nodes == "doorbell") ring_step<<<1, 1, 0, streams[b]>>>(ddoors + b, dbase, p.step);
      spin_step<<<1, 1, 0, streams[b]>>>(dwords + b, dbase, p.step, gave);
    }
  for (int b = 1; b < branches; ++b) {
    CR(cudaEventRecord(joins[b], streams[b]));
    CR(cudaStreamWaitEvent(s, joins[b], 0));
  }
  cudaGraph_t g = nullptr;
  CR(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t exec = nullptr;
  CR(cudaGraphInstantiate(&exec, g, 0));
  CR(cudaGraphDestroy(g));
  std::atomic<double> longest_call{0};
  std::thread agent_thread([&] {
    for (;;) {
      chain::Step st;
      if (host_nodes == "doorbell") {  // polls the doorbells (no host node, no CUDA call)
        static std::vector<unsigned long long> seen(static_cast<size_t>(branches), 0);
        bool found = false;
        while (!found) {
          {
            std::lock_guard<std::mutex> lock(chain::m);
            if (chain::stop) return;
          }
          for (int b = 0; b < branches && !found; ++b) {
            const unsigned long long d = *(volatile unsigned long long*)(doors + b);
            if (d > seen[static_cast<size_t>(b)]) {
              seen[static_cast<size_t>(b)] = d;
              st = chain::Step{b, d - *(volatile unsigned long long*)base};
              found = true;
            }
          }
          if (!found) std::this_thread::yield();
        }
      } else {
        std::unique_lock<std::mutex> lock(chain::m);
        chain::cv.wait(lock, [] { return chain::stop || !chain::asked.empty(); });
        if (chain::stop) return;
        st = chain::asked.front();
        chain::asked.pop_front();
      }
      unsigned long long v = *(volatile unsigned long long*)base + st.step;
      if (host_nodes == "first" || host_nodes == "none") {  // release the whole branch, a while after its hand-over
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        v = *(volatile unsigned long long*)base + static_cast<unsigned long long>(steps);
      }
      const double t0 = now();
      if (work == "host") {
        *(volatile unsigned long long*)(words + st.branch) = v;
      } else if (work == "kernel") {
        set_word<<<1, 1, 0, agent>>>(dwords + st.branch, v);
        CR(cudaGetLastError());
      } else {
        if (work == "copy") CR(cudaMemcpyAsync(dst, src, 4096, cudaMemcpyDeviceToDevice, agent));
        if (work == "d2h") CR(cudaMemcpyAsync(pinned, src, 4096, cudaMemcpyDeviceToHost, agent));
        if (work == "h2d") CR(cudaMemcpyAsync(dst, pinned, 4096, cudaMemcpyHostToDevice, agent));
        if (work == "event") {
          CR(cudaEventRecord(agent_event, agent));
          CR(cudaStreamWaitEvent(agent, agent_event, 0));
          (void)cudaEventQuery(agent_event);
        }
        CK(cuStreamWriteValue64((CUstream)agent, (CUdeviceptr)(dwords + st.branch), (cuuint64_t)v,
                                CU_STREAM_WRITE_VALUE_DEFAULT));
      }
      const double took = now() - t0;
      if (took > longest_call.load()) longest_call.store(took);
    }
  });
  double longest_launch = 0, longest_round = 0;
  int deadlocks = 0, stalls = 0;
  for (int round = 1; round <= rounds; ++round) {
    *(volatile unsigned long long*)base = static_cast<unsigned long long>(round) * 1000000ull;
    std::atomic<bool> launched{false};
    std::atomic<bool> released{false};
    std::thread watchdog([&] {
      const double w0 = now();
      while (!launched.load() && now() - w0 < 3.0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (launched.load()) return;
      released.store(true);  // still inside cudaGraphLaunch: release every step from the host
      for (int b = 0; b < branches; ++b) *(volatile unsigned long long*)(words + b) = ~0ull >> 1;
    });
    const double t0 = now();
    CR(cudaGraphLaunch(exec, s));
    const double took = now() - t0;
    launched.store(true);
    if (host_nodes == "none") {  // no hand-over: the agent is asked for every branch now
      std::lock_guard<std::mutex> lock(chain::m);
      for (int b = 0; b < branches; ++b) chain::asked.push_back(chain::Step{b, 1});
      chain::cv.notify_one();
    }
    watchdog.join();
    longest_launch = std::max(longest_launch, took);
    if (released.load()) ++deadlocks;
    if (!wait_query(s, 15.0)) {
      ++stalls;
      for (int b = 0; b < branches; ++b) *(volatile unsigned long long*)(words + b) = ~0ull >> 1;
      if (!wait_query(s, 15.0)) {
        printf("RESULT FAIL round %d: not done even after the host set the words\n", round);
        return 3;
      }
    }
    longest_round = std::max(longest_round, now() - t0);
    if (released.load()) {  // the words are far ahead now: start the next round past them
      CR(cudaStreamSynchronize(agent));
      for (int b = 0; b < branches; ++b) words[b] = 0;
    }
  }
  {
    std::lock_guard<std::mutex> lock(chain::m);
    chain::stop = true;
  }
  chain::cv.notify_one();
  agent_thread.join();
  CR(cudaDeviceSynchronize());
  const char* env = getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  printf("RESULT chain connections=%s host-nodes=%s branches=%d steps=%d rounds=%d work=%s: longest cudaGraphLaunch %.3f ms, "
         "longest round %.1f ms, agent's longest call %.3f ms, %d DEADLOCK (launch still inside after 3 s), %d "
         "stalled, %llu spins gave up\n",
         env ? env : "(unset)", host_nodes.c_str(), branches, steps, rounds, work.c_str(), longest_launch * 1e3, longest_round * 1e3,
         longest_call.load() * 1e3, deadlocks, stalls, *gave);
  return 0;
}

// Is an 8-byte pinned-to-pinned cudaMemcpyAsync stream-ordered (done by the GPU after the
// stream's earlier work), or done by the calling thread at once? Behind a 200 ms kernel.
static int order_test() {
  init();
  spin<<<1, 1>>>(nullptr, 0);
  CR(cudaDeviceSynchronize());
  cudaStream_t s;
  CR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  unsigned long long* cells = nullptr;
  CR(cudaHostAlloc((void**)&cells, 64, cudaHostAllocMapped));
  unsigned long long* dcells = nullptr;
  CR(cudaHostGetDevicePointer((void**)&dcells, cells, 0));
  cells[0] = 0;  // the spin's release word
  cells[1] = 42;
  cells[2] = 0;
  spin<<<1, 1, 0, s>>>(dcells, 1);
  // Released after 3 s from another thread, in case the copy's call waits for the kernel.
  std::thread release([cells] {
    std::this_thread::sleep_for(std::chrono::seconds(3));
    *(volatile unsigned long long*)cells = 1;
  });
  const double c0 = now();
  CR(cudaMemcpyAsync(cells + 2, cells + 1, 8, cudaMemcpyHostToHost, s));
  const double call_s = now() - c0;
  const volatile unsigned long long* out = cells + 2;
  const unsigned long long right_after = *out;
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const unsigned long long while_held = *out;
  release.join();
  CR(cudaStreamSynchronize(s));
  const unsigned long long after = *out;
  printf("RESULT order h2h8 behind a kernel that waits 3 s: the call took %.3f s; the word right after the call %llu, "
         "200 ms later %llu, after the kernel %llu\n",
         call_s, right_after, while_held, after);
  return 0;
}

// Runs `args` of this program in a child with `env` added; kills it after `limit_s`.
static void run_case(const char* self, const std::vector<std::string>& env, const std::vector<std::string>& args,
                     int limit_s = 15) {
  fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    for (const auto& e : env) putenv(const_cast<char*>(e.c_str()));
    std::vector<char*> argv{const_cast<char*>(self)};
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(self, argv.data());
    _exit(127);
  }
  int status = 0;
  for (int i = 0; i < limit_s * 100; ++i) {
    if (waitpid(pid, &status, WNOHANG) == pid) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  std::string line;
  for (const auto& e : env) line += e + " ";
  for (const auto& a : args) line += a + " ";
  printf("RESULT %s: process stuck after %d s (killed): HELD BACK\n", line.c_str(), limit_s);
}

static int all(const char* self) {
  const std::vector<std::string> c8{"CUDA_DEVICE_MAX_CONNECTIONS=8"};
  for (const char* work : {"copy", "kernel"})
    for (const char* blocker : {"memop", "memop+tail", "kernel", "kernel+tail"})
      for (const char* victim : {"same", "hiprio", "green", "ctx"}) run_case(self, c8, {"queue", blocker, victim, work});
  for (const char* victim : {"same", "green", "ctx"})
    run_case(self, {"CUDA_DEVICE_MAX_CONNECTIONS=8", "VMM=1"}, {"queue", "memop", victim, "copy"});
  for (const char* victim : {"same", "ctx"})
    run_case(self, {"CUDA_DEVICE_MAX_CONNECTIONS=1"}, {"queue", "memop", victim, "copy"});
  for (const char* blocker : {"memop+tail", "kernel+tail"})
    run_case(self, {"CUDA_DEVICE_MAX_CONNECTIONS=8", "BLOCKERS=1"}, {"queue", blocker, "same", "copy"});
  for (const char* blocker : {"memop+tail", "kernel+tail"})
    run_case(self, {"CUDA_DEVICE_MAX_CONNECTIONS=32"}, {"queue", blocker, "same", "copy"});
  for (const char* blocker : {"memop+tail", "kernel+tail"})
    run_case(self, {"CUDA_DEVICE_MAX_CONNECTIONS=32", "BLOCKERS=8"}, {"queue", blocker, "same", "copy"});
  run_case(self, {}, {"access", "green"});
  run_case(self, {}, {"access", "ctx"});
  run_case(self, {}, {"cost"});
  run_case(self, {}, {"blocking"}, 120);
  for (const char* holder : {"devsync", "free", "freehost", "streamsync", "eventsync"})
    run_case(self, {}, {"contention", holder}, 120);
  for (const char* k : {"primary", "green", "ctx"}) run_case(self, {}, {"nccl", k});
  for (const char* capture : {"global", "thread", "relaxed"})
    for (const char* syncer : {"global", "thread", "relaxed"})
      for (const char* call : {"devsync", "ctxsync", "streamsync", "eventsync", "unmap", "free"})
        run_case(self, {}, {"capture", capture, syncer, call}, 20);
  return 0;
}

int main(int argc, char** argv) {
  std::string what = argc > 1 ? argv[1] : "";
  if (what == "all") return all(argv[0]);
  if (what == "queue" && argc == 5) return queue_test(argv[2], argv[3], argv[4]);
  if (what == "access" && argc == 3) return access_test(argv[2]);
  if (what == "cost") return cost_test();
  if (what == "blocking") return blocking_test();
  if (what == "contention" && argc == 3) return contention_test(argv[2]);
  if (what == "nccl" && argc == 3) return nccl_test(argv[2]);
  if (what == "capture" && argc == 5) return capture_test(argv[2], argv[3], argv[4]);
  if (what == "order") return order_test();
  if (what == "chain" && argc == 6) return chain_test(atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), argv[5]);
  if (what == "graph" && (argc == 5 || argc == 6))
    return graph_test(argv[2], atoi(argv[3]), atoi(argv[4]), argc == 6 && std::string(argv[5]) == "probe");
  printf("usage: queue_lab all | queue BLOCKER VICTIM WORK | access green|ctx | cost | blocking | contention HOLDER | nccl primary|green|ctx | capture MODE MODE CALL | graph new|reuse BRANCHES N [probe] | chain BRANCHES STEPS ROUNDS host|memop|kernel|copy|d2h|h2d|event\n");
  return 2;
}
