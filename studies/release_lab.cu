// release_lab: can a window's memory be released once the GPU's work before its free has
// ended, without the free waiting for that work and without a device synchronisation (issue
// 55, item 4)? One process, one GPU, CUDA only (no meshmem). Each case prints a RESULT line:
//   ctx-event-behind-wait        cuCtxRecordEvent while another stream waits (a kernel spinning
//                                on a host word the host sets after --hold-ms): the call's time,
//                                the event not ready at once, ready once the wait ends
//   ctx-event-ignores-later-work the event recorded on an idle GPU, then a --hold-ms kernel: ready
//                                at once (work after the record does not count)
//   unmap-behind-wait            cuMemUnmap + cuMemRelease + cuMemAddressFree of an unused VMM
//                                allocation while another stream waits: does it wait too?
//   ctx-event-vs-capture-<mode>  another thread holds a capture open (global / relaxed mode)
//                                while this one calls cuCtxRecordEvent: its result, and whether
//                                that capture survives
//   event-query-vs-capture       another thread holds a global-mode capture while a thread in
//                                relaxed mode polls an event: does the capture survive?
//   unmap-vs-capture             the same around an unmap of an unused VMM allocation
// Every wait ends: a spinning kernel gives up after 5 s, a held capture after --hold-ms.
//   release_lab [--hold-ms 300] [--device 0]
#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "bench_check.hpp"
#include "busy_work.cuh"

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// Spins until *flag is set or 5 s went by (so that nothing here can hang).
__global__ void wait_for_flag(volatile int* flag) {
  unsigned long long start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    if (*flag != 0) return;
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < 5000000000ull);
}

struct Lab {
  int device = 0;
  int hold_ms = 300;
  CUcontext ctx = nullptr;
  int* flag_host = nullptr;
  int* flag_dev = nullptr;
  cudaStream_t waiting = nullptr, other = nullptr;
};

// A wait that the host ends after hold_ms: the kernel on lab.waiting, the host's release on
// a thread. Returns the thread, to join.
std::thread hold_a_stream(Lab& lab) {
  __atomic_store_n(lab.flag_host, 0, __ATOMIC_SEQ_CST);
  wait_for_flag<<<1, 1, 0, lab.waiting>>>(lab.flag_dev);
  CK(cudaGetLastError());
  return std::thread([&lab] {
    std::this_thread::sleep_for(std::chrono::milliseconds(lab.hold_ms));
    __atomic_store_n(lab.flag_host, 1, __ATOMIC_SEQ_CST);
  });
}

// An unused VMM allocation of 2 MiB on the lab's GPU: its address, size and handle.
struct Vmm {
  CUdeviceptr ptr = 0;
  std::size_t bytes = 0;
  CUmemGenericAllocationHandle handle = 0;
};
Vmm make_vmm(const Lab& lab) {
  Vmm v;
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = lab.device;
  CU(cuMemGetAllocationGranularity(&v.bytes, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  CU(cuMemCreate(&v.handle, v.bytes, &prop, 0));
  CU(cuMemAddressReserve(&v.ptr, v.bytes, 0, 0, 0));
  CU(cuMemMap(v.ptr, v.bytes, 0, v.handle, 0));
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CU(cuMemSetAccess(v.ptr, v.bytes, &access, 1));
  return v;
}
CUresult drop_vmm(const Vmm& v) {
  CUresult rc = cuMemUnmap(v.ptr, v.bytes);
  if (rc == CUDA_SUCCESS) rc = cuMemRelease(v.handle);
  if (rc == CUDA_SUCCESS) rc = cuMemAddressFree(v.ptr, v.bytes);
  return rc;
}

// Polls until the event is ready (or 6 s went by); the ms it took, -1 if it never was.
double ms_until_ready(CUevent ev) {
  const auto t0 = Clock::now();
  for (;;) {
    const CUresult rc = cuEventQuery(ev);
    if (rc == CUDA_SUCCESS) return ms_since(t0);
    if (rc != CUDA_ERROR_NOT_READY || ms_since(t0) > 6000) return -1;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

const char* name_of(CUresult rc) {
  const char* s = nullptr;
  return cuGetErrorName(rc, &s) == CUDA_SUCCESS && s != nullptr ? s : "?";
}

void ctx_event_behind_wait(Lab& lab) {
  CUevent ev = nullptr;
  CU(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  std::thread release = hold_a_stream(lab);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the kernel is spinning
  const auto t0 = Clock::now();
  const CUresult rc = cuCtxRecordEvent(lab.ctx, ev);
  const double record_ms = ms_since(t0);
  const CUresult at_once = cuEventQuery(ev);
  const double ready_ms = ms_until_ready(ev);
  release.join();
  CK(cudaStreamSynchronize(lab.waiting));
  std::printf("RESULT ctx-event-behind-wait          record %s in %.3f ms; at once %s; ready after %.1f ms (the wait held %d ms)\n",
              name_of(rc), record_ms, name_of(at_once), ready_ms, lab.hold_ms);
  CU(cuEventDestroy(ev));
}

void ctx_event_ignores_later_work(Lab& lab) {
  CUevent ev = nullptr;
  CU(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  CK(cudaDeviceSynchronize());
  const CUresult rc = cuCtxRecordEvent(lab.ctx, ev);
  bench::busy_kernel<<<1, 1, 0, lab.other>>>(static_cast<unsigned>(lab.hold_ms) * 1000000u);  // <= 3 s fits
  CK(cudaGetLastError());
  const double ready_ms = ms_until_ready(ev);
  CK(cudaStreamSynchronize(lab.other));
  std::printf("RESULT ctx-event-ignores-later-work   record %s; ready after %.3f ms with a %d ms kernel launched after it\n",
              name_of(rc), ready_ms, lab.hold_ms);
  CU(cuEventDestroy(ev));
}

void unmap_behind_wait(Lab& lab) {
  const Vmm v = make_vmm(lab);
  std::thread release = hold_a_stream(lab);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const auto t0 = Clock::now();
  const CUresult rc = drop_vmm(v);
  const double ms = ms_since(t0);
  release.join();
  CK(cudaStreamSynchronize(lab.waiting));
  std::printf("RESULT unmap-behind-wait              unmap+release+free %s in %.3f ms (the wait held %d ms): %s\n", name_of(rc),
              ms, lab.hold_ms, ms > 0.5 * lab.hold_ms ? "WAITS for the other stream" : "does not wait");
}

// Another thread begins a capture in `mode` on its own stream (a kernel in it), signals
// `begun`, holds it for hold_ms, and ends it; `ended` is EndCapture's result.
struct HeldCapture {
  std::atomic<bool> begun{false};
  cudaError_t begin_rc = cudaErrorUnknown, end_rc = cudaErrorUnknown;
  std::thread thread;
  HeldCapture(Lab& lab, cudaStreamCaptureMode mode) {
    thread = std::thread([this, &lab, mode] {
      (void)cudaSetDevice(lab.device);
      cudaStream_t s = nullptr;
      if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
        begun = true;
        return;
      }
      begin_rc = cudaStreamBeginCapture(s, mode);
      if (begin_rc == cudaSuccess) bench::busy_kernel<<<1, 1, 0, s>>>(1000);
      begun = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(lab.hold_ms));
      cudaGraph_t g = nullptr;
      if (begin_rc == cudaSuccess) end_rc = cudaStreamEndCapture(s, &g);
      if (g != nullptr) (void)cudaGraphDestroy(g);
      (void)cudaGetLastError();
      (void)cudaStreamDestroy(s);
    });
    while (!begun) std::this_thread::yield();
  }
  std::string finish() {
    thread.join();
    if (begin_rc != cudaSuccess) return std::string("capture not begun: ") + cudaGetErrorName(begin_rc);
    return end_rc == cudaSuccess ? "the capture survived" : std::string("the capture ended with ") + cudaGetErrorName(end_rc);
  }
};

void ctx_event_vs_capture(Lab& lab, cudaStreamCaptureMode mode, const char* label) {
  CUevent ev = nullptr;
  CU(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  HeldCapture held(lab, mode);
  const CUresult rc = cuCtxRecordEvent(lab.ctx, ev);
  const std::string outcome = held.finish();
  std::printf("RESULT ctx-event-vs-capture-%-8s  record %s; %s\n", label, name_of(rc), outcome.c_str());
  (void)cudaGetLastError();
  CU(cuEventDestroy(ev));
}

void event_query_vs_capture(Lab& lab) {
  CUevent ev = nullptr;
  CU(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  CU(cuCtxRecordEvent(lab.ctx, ev));
  HeldCapture held(lab, cudaStreamCaptureModeGlobal);
  CUresult rc = CUDA_ERROR_UNKNOWN;
  std::thread poller([&] {
    cudaStreamCaptureMode relaxed = cudaStreamCaptureModeRelaxed;
    (void)cudaThreadExchangeStreamCaptureMode(&relaxed);
    (void)cuCtxSetCurrent(lab.ctx);
    rc = cuEventQuery(ev);
  });
  poller.join();
  const std::string outcome = held.finish();
  std::printf("RESULT event-query-vs-capture         query (relaxed thread) %s; %s\n", name_of(rc), outcome.c_str());
  CU(cuEventDestroy(ev));
}

void unmap_vs_capture(Lab& lab) {
  const Vmm v = make_vmm(lab);
  HeldCapture held(lab, cudaStreamCaptureModeGlobal);
  CUresult rc = CUDA_ERROR_UNKNOWN;
  std::thread dropper([&] {
    cudaStreamCaptureMode relaxed = cudaStreamCaptureModeRelaxed;
    (void)cudaThreadExchangeStreamCaptureMode(&relaxed);
    (void)cuCtxSetCurrent(lab.ctx);
    rc = drop_vmm(v);
  });
  dropper.join();
  const std::string outcome = held.finish();
  std::printf("RESULT unmap-vs-capture               unmap+release+free (relaxed thread) %s; %s\n", name_of(rc),
              outcome.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  Lab lab;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has = i + 1 < argc;
    if (a == "--hold-ms" && has) lab.hold_ms = std::atoi(argv[++i]);
    else if (a == "--device" && has) lab.device = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: release_lab [--hold-ms 300] [--device 0]\n");
      return 2;
    }
  }
  if (lab.hold_ms < 50 || lab.hold_ms > 3000) {
    std::fprintf(stderr, "release_lab: --hold-ms from 50 to 3000\n");
    return 2;
  }
  CK(cudaSetDevice(lab.device));
  CK(cudaFree(nullptr));
  CU(cuCtxGetCurrent(&lab.ctx));
  CK(cudaHostAlloc(&lab.flag_host, sizeof(int), cudaHostAllocMapped));
  CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&lab.flag_dev), lab.flag_host, 0));
  CK(cudaStreamCreateWithFlags(&lab.waiting, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&lab.other, cudaStreamNonBlocking));
  bench::busy_kernel<<<1, 1, 0, lab.other>>>(1000);  // the module loaded before any case
  CK(cudaDeviceSynchronize());
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, lab.device));
  int driver = 0;
  CK(cudaDriverGetVersion(&driver));
  std::printf("# release_lab: GPU %d (%s), driver API %d, hold %d ms\n", lab.device, prop.name, driver, lab.hold_ms);
  ctx_event_behind_wait(lab);
  ctx_event_ignores_later_work(lab);
  unmap_behind_wait(lab);
  ctx_event_vs_capture(lab, cudaStreamCaptureModeGlobal, "global");
  ctx_event_vs_capture(lab, cudaStreamCaptureModeRelaxed, "relaxed");
  event_query_vs_capture(lab);
  unmap_vs_capture(lab);
  CK(cudaDeviceSynchronize());
  CK(cudaStreamDestroy(lab.waiting));
  CK(cudaStreamDestroy(lab.other));
  CK(cudaFreeHost(lab.flag_host));
  return 0;
}
