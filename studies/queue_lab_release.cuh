// queue_lab blocking / contention / capture: which releasing calls wait for a running
// kernel, which calls of other threads wait behind them, and what they do to an open graph
// capture. Included once, by queue_lab.cu.
#pragma once
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
