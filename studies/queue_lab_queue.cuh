// queue_lab queue / access / cost / nccl: does a waiting stream hold back another stream's
// work, and what a second context costs and can do. Included once, by queue_lab.cu.
#pragma once
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
