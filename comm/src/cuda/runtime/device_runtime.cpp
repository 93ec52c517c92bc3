#include "cuda/runtime/device_runtime.hpp"

#include <algorithm>
#include <atomic>

#include "backoff.hpp"
#include "log.hpp"
#include "topology.hpp"
#include "cuda/barrier/stream_barrier.hpp"
#include "cuda/halo/device_halo_plan.hpp"
#include "cuda/runtime/device_window.hpp"
#include "cuda/runtime/gpu_queues.hpp"
#include "cuda/runtime/kernels.hpp"
#include "cuda/runtime/module_loading.hpp"
#include "cuda/runtime/stream_ops.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

CudaDeviceRuntime::CudaDeviceRuntime(const CommContext& ctx, int device)
    : rank_(ctx.topo.rank),
      size_(ctx.topo.size),
      timeout_(ctx.options.timeout),
      halo_sends_at_once_(halo_sends_at_once(ctx.options)),
      setup_stream_("meshmem::Comm (device setup)"),
      live_(std::in_place, device),
      releaser_(device, ctx.options.timeout),
      gpu_(ctx, device) {}

std::string CudaDeviceRuntime::describe() const { return gpu_.describe(halo_sends_at_once_ ? "" : ", halo sends serial"); }

void CudaDeviceRuntime::note_own_stream_route(const std::string& route) {
  // Once per process each: every Comm would say the same.
  static std::atomic<bool> said_queues{false}, said_loading{false};
  const std::string queues = few_gpu_queues_warning(rank_, route);
  if (!queues.empty() && !said_queues.exchange(true)) log(LogLevel::Warn, queues);
  const std::string loading = lazy_loading_warning(rank_, route);
  if (!loading.empty() && !said_loading.exchange(true)) log(LogLevel::Warn, loading);
}

void CudaDeviceRuntime::create_local(WindowState& state, const std::string& what) {
  create_device_part(state, gpu_.device(), gpu_.granularity(), setup_stream_.get(), what);
  state.peer.assign(static_cast<std::size_t>(size_), nullptr);
  state.peer[static_cast<std::size_t>(rank_)] = state.local;
}

void CudaDeviceRuntime::publish(WindowState& state, const std::string& what) { publish_peer_table(state, what); }

DeviceEntry CudaDeviceRuntime::enter(Stream stream, bool capture, const char* call) {
  DeviceEntry entry;
  cudaError_t rc = cudaGetDevice(&entry.previous);
  if (rc != cudaSuccess) ipc::check_cuda(rc, "cudaGetDevice", where(call));
  if (entry.previous != gpu_.device()) {
    rc = cudaSetDevice(gpu_.device());
    if (rc != cudaSuccess) ipc::check_cuda(rc, "cudaSetDevice", where(call));
  }
  try {
    // Messages are built only on failure: this runs before every stream operation.
    gpu_.faults().raise_if_set([&] { return where(call); });
    // cudaStreamPerThread is the calling thread's stream of the device current at the call.
    if (stream == cudaStreamPerThread && entry.previous != gpu_.device())
      throw Error(ErrorCode::InvalidArgument,
                  where(call) + ": cudaStreamPerThread names the per-thread stream of the current device, " +
                      std::to_string(entry.previous) + ", but this Comm works on device " + std::to_string(gpu_.device()) +
                      " (the device current when the Comm was made); make device " + std::to_string(gpu_.device()) +
                      " current, or pass a stream of it");
    // The legacy default stream cannot be captured; the per-thread one can.
    if (stream != nullptr && stream != cudaStreamLegacy) {
      if (stream != cudaStreamPerThread) {
        CUcontext owner = nullptr;
        const CUresult got = ipc::cuda_driver().cuStreamGetCtx(stream, &owner);
        if (got != CUDA_SUCCESS) ipc::check_cu(got, "cuStreamGetCtx", where(call));
        if (owner != gpu_.context())
          throw Error(ErrorCode::InvalidArgument,
                      where(call) + ": the stream belongs to " + device_of(owner) + ", but this Comm works on device " +
                          std::to_string(gpu_.device()) + " (the device current when the Comm was made); pass a stream of device " +
                          std::to_string(gpu_.device()));
      }
      if (capture) {
        cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
        rc = cudaStreamIsCapturing(stream, &status);
        if (rc != cudaSuccess) ipc::check_cuda(rc, "cudaStreamIsCapturing", where(call));
        if (status == cudaStreamCaptureStatusInvalidated)
          throw Error(ErrorCode::InvalidArgument, where(call) + ": the stream's graph capture was invalidated by an earlier error");
        entry.capturing = status == cudaStreamCaptureStatusActive;
      }
    }
  } catch (...) {
    leave(entry);
    throw;
  }
  return entry;
}

// Only for the message of a refused stream.
std::string CudaDeviceRuntime::device_of(CUcontext context) {
  const ipc::CudaDriver& d = ipc::cuda_driver();
  CUdevice dev = -1;
  if (d.cuCtxPushCurrent(context) != CUDA_SUCCESS) return "another CUDA context";
  const CUresult rc = d.cuCtxGetDevice(&dev);
  CUcontext popped = nullptr;
  (void)d.cuCtxPopCurrent(&popped);
  if (rc != CUDA_SUCCESS) return "another CUDA context";
  // A primary context of device dev (cudaSetDevice's) or a context the application made.
  return "device " + std::to_string(static_cast<int>(dev));
}

void CudaDeviceRuntime::leave(const DeviceEntry& entry) noexcept {
  if (entry.previous >= 0 && entry.previous != gpu_.device()) (void)cudaSetDevice(entry.previous);
}

void CudaDeviceRuntime::wait_until(const WindowState& sig, std::size_t index, std::size_t count, Cmp cmp,
                                   std::uint64_t value, std::optional<std::uint64_t> then, Stream stream,
                                   const char* call) {
  auto* words = static_cast<std::uint64_t*>(sig.local) + index;
  // The stream's front end waits for GE / EQ (and GT as GE value+1) with
  // MESHMEM_STREAM_WAIT=memop (no timeout then); otherwise a polling kernel that gives up
  // after MESHMEM_TIMEOUT.
  const bool memop = !gpu_.waits_with_kernel() && (cmp == Cmp::GE || cmp == Cmp::EQ || (cmp == Cmp::GT && value != UINT64_MAX));
  if (!memop) {
    const cudaError_t k = cuda::launch_wait(words, count, cmp, value, then.has_value(), then.value_or(0), sig.id, index,
                                            gpu_.wait_limit(), stream, gpu_.early_launch());
    if (k != cudaSuccess) ipc::check_cuda(k, "wait kernel launch", where(call));
    return;
  }
  std::vector<CUstreamBatchMemOpParams> ops;
  ops.reserve(then ? 2 * count : count);
  for (std::size_t i = 0; i < count; ++i)
    ops.push_back(stream_wait_op(words + i, cmp == Cmp::GT ? value + 1 : value,
                                 (cmp == Cmp::EQ ? CU_STREAM_WAIT_VALUE_EQ : CU_STREAM_WAIT_VALUE_GEQ) | gpu_.wait_flags()));
  for (std::size_t i = 0; then && i < count; ++i) ops.push_back(stream_write_op(words + i, *then));  // after every wait
  run_stream_batch(ops, stream, call, rank_);
}

std::uint64_t CudaDeviceRuntime::read_word(const WindowState& sig, std::size_t index) {
  const char* call = "Signals::read";
  std::uint64_t value = 0;
  ipc::check_cuda(cudaMemcpyAsync(&value, static_cast<const std::uint64_t*>(sig.local) + index, sizeof(value),
                                  cudaMemcpyDeviceToHost, setup_stream_.get()),
                  "cudaMemcpyAsync", where(call));
  ipc::check_cuda(cudaStreamSynchronize(setup_stream_.get()), "cudaStreamSynchronize", where(call));
  return value;
}

void CudaDeviceRuntime::write_words(const WindowState& sig, std::size_t index, std::size_t count, std::uint64_t value,
                                    const char* call) {
  const std::vector<std::uint64_t> values(count, value);
  ipc::check_cuda(cudaMemcpyAsync(static_cast<std::uint64_t*>(sig.local) + index, values.data(), count * sizeof(value),
                                  cudaMemcpyHostToDevice, setup_stream_.get()),
                  "cudaMemcpyAsync", where(call));
  ipc::check_cuda(cudaStreamSynchronize(setup_stream_.get()), "cudaStreamSynchronize", where(call));
}

std::unique_ptr<DeviceHaloPlan> CudaDeviceRuntime::make_halo_plan(const DeviceHaloSpec& spec) {
  return make_device_halo_plan(spec, gpu_, halo_sends_at_once_);
}

void CudaDeviceRuntime::retire(WindowState& state, const char* call) {
  const std::chrono::milliseconds overdue = releaser_.take_overdue();  // before this free's own
  const WindowReleaser::Handed handed = releaser_.hand_over(state, where(call));
  if (handed.then == WindowReleaser::Then::CaptureRefused)
    throw Error(ErrorCode::Unsupported,
                where(call) + ": a graph capture is open on GPU " + std::to_string(gpu_.device()) +
                    " (CUDA refused the context event cuCtxRecordEvent and invalidated that capture; free windows "
                    "outside graph captures); the window is freed, and its memory is released after the capture, at the next "
                    "free, an allocation that needs it, or ~Comm" +
                    (overdue.count() > 0 ? "; work issued before an earlier free has not finished after " +
                                               describe_timeout(overdue) + " either"
                                         : std::string()));
  if (handed.then == WindowReleaser::Then::Wait && !releaser_.wait({handed.ticket}, timeout_)) {
    releaser_.give_up({handed.ticket});
    throw Error(ErrorCode::Timeout,
                where(call) + ": work issued on this GPU before the free has not finished (or a graph capture on this GPU is still open) after " + describe_timeout(timeout_) +
                    " (a stream waiting for a signal or a barrier that never comes?); the window's memory is released "
                    "once that work ends");
  }
  if (overdue.count() > 0)
    throw Error(ErrorCode::Timeout,
                where(call) + ": work issued on this GPU before an earlier free has not finished after " +
                    describe_timeout(overdue) +
                    " (a stream waiting for a signal or a barrier that never comes?); this window is freed, and the "
                    "memory of both is released once that work ends");
}

void CudaDeviceRuntime::retire_all(const std::vector<WindowState*>& states, const char* call) noexcept {
  // No DeviceScope: a fault it would raise must not keep the releases from their wait.
  CurrentDevice on(gpu_.device());
  try {
    for (WindowState* s : states) (void)releaser_.hand_over(*s, where(call));
  } catch (const std::exception& e) {
    log(LogLevel::Error, where(call) + ": " + e.what());
  }
  // Windows freed during a capture: behind an event now, or, with a capture still open, a
  // device synchronisation on the thread once it has ended (not waited for).
  try {
    if (!releaser_.release_refused(where(call))) releaser_.synchronise_refused();
  } catch (const std::exception& e) {
    log(LogLevel::Error, where(call) + ": " + e.what());
  }
  // After a free's wait for the device timed out, another would time out too: the thread
  // releases the memory once the work ends.
  if (releaser_.gave_up()) return;
  // The Comm's transports stop next: every release, the earlier frees' too, waits for the
  // device's work before that, in one bounded wait.
  try {
    const std::vector<std::uint64_t> pending = releaser_.all_pending();
    if (!releaser_.wait(pending, timeout_)) {
      releaser_.give_up(pending);
      log(LogLevel::Error, where(call) + ": work issued on this GPU has not finished after " + describe_timeout(timeout_) +
                               "; its windows' memory is released once that work ends");
    }
  } catch (const std::exception& e) {
    log(LogLevel::Error, where(call) + ": " + e.what());
  }
}

void CudaDeviceRuntime::make_room(std::size_t bytes, const char* call) {
  if (!releaser_.pending()) return;
  std::size_t free_bytes = 0, total = 0;
  {
    CurrentDevice on(gpu_.device());
    if (cudaMemGetInfo(&free_bytes, &total) != cudaSuccess) {
      (void)cudaGetLastError();
      return;  // the allocation reports what is wrong
    }
  }
  if (free_bytes >= bytes) return;
  (void)releaser_.release_refused(where(call));  // windows freed during a capture: behind an event now
  // wait() takes 0 for no bound: a timeout of 1 ms still waits a little, not for ever.
  const auto most = timeout_.count() == 0 ? std::chrono::milliseconds(std::chrono::hours(1))
                                          : std::max(timeout_ / 2, std::chrono::milliseconds(1));
  if (!releaser_.wait(releaser_.all_pending(), most))
    log(LogLevel::Warn, where(call) + ": " + std::to_string(bytes) + " bytes do not fit in the " +
                            std::to_string(free_bytes) + " free on this GPU, and windows freed earlier still wait for "
                            "work issued before their free; allocating anyway");
}

std::unique_ptr<StreamBarrier> CudaDeviceRuntime::make_barrier(const CommContext& ctx, const BarrierContext& bctx) {
  return make_stream_barrier(ctx, bctx, gpu_);
}

GpuDevice* gpu_device_of(DeviceRuntime* runtime) {
  return runtime == nullptr ? nullptr : &static_cast<CudaDeviceRuntime*>(runtime)->gpu();
}

}  // namespace meshmem::detail
