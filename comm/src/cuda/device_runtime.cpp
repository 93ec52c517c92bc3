#define MESHMEM_DEFINING_GPU_PART
#include "device_runtime.hpp"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>

#include "../bootstrap.hpp"
#include "../gpu_part.hpp"
#include "../backoff.hpp"
#include "../knobs.hpp"
#include "../log.hpp"
#include "../topology.hpp"
#include "device_window.hpp"
#include "device_runtime_knobs.hpp"
#include "gpu_queues.hpp"
#include "halo_watch.hpp"
#include "kernels.hpp"
#include "module_loading.hpp"
#include "meshmem/ipc/cuda_driver.hpp"
#include "stream_barrier.hpp"

namespace meshmem::detail {

namespace {

// MESHMEM_STREAM_WAIT, MESHMEM_HALO_SENDS and MESHMEM_EARLY_LAUNCH: device_runtime_knobs.hpp.

// The copies and the neighbours' signals in one kernel; the waits for this rank's halos in
// the same kernel, except where ranks share the GPU (MESHMEM_STREAM_WAIT memop) and the
// exchange is not captured: there a waiting kernel holds the time-sliced GPU from the
// neighbour it waits for (2.25 ms per exchange of the Jacobi example, against 0.26 ms for its
// put_signal + wait_until variant, 2 ranks on 1 x H100), so the stream waits with
// cuStreamWaitValue64 for the exchange number, which the host then knows, and a HaloWatch
// keeps the time limit. The kernel counts every exchange, graph replays too, which the host
// does not see: once the plan has been captured, the waits stay in the kernel.
class KernelHaloPlan final : public DeviceHaloPlan {
 public:
  KernelHaloPlan(const DeviceHaloSpec& spec, const CudaDeviceRuntime& device)
      : rank_(device.rank()), limit_(device.wait_limit()), early_(device.early_launch()), sequence_("halo exchange plan") {
    const std::string what = "halo exchange plan on rank " + std::to_string(rank_);
    if (!device.waits_with_kernel() && !spec.waits.empty()) {
      for (const std::uint64_t* word : spec.waits)
        memop_waits_.push_back(stream_wait_op(word, 0, CU_STREAM_WAIT_VALUE_GEQ | device.wait_flags()));
      watch_.emplace(device.device(), device.timeout(), limit_.fault, spec.signals_window,
                     std::vector<const std::uint64_t*>(spec.waits.begin(), spec.waits.end()), spec.wait_ranks,
                     "halo exchange on rank " + std::to_string(rank_));
    }
    std::vector<cuda::Copy2D> table;
    for (const DeviceCopy& c : spec.copies) {
      table.push_back({static_cast<char*>(c.dst), static_cast<const char*>(c.src), c.width, c.height, c.src_pitch, c.dst_pitch});
      largest_ = std::max<std::uint64_t>(largest_, c.width * c.height);
    }
    count_ = static_cast<int>(table.size());
    table_ = device_array(table_memory_, table, what);
    sync_.stores = device_array(stores_, spec.stores, what);
    sync_.waits = device_array(waits_, spec.waits, what);
    sync_.wait_ranks = device_array(wait_ranks_, spec.wait_ranks, what);
    sync_.nstores = static_cast<int>(spec.stores.size());
    sync_.nwaits = static_cast<int>(spec.waits.size());
    sync_.window = spec.signals_window;
    // The exchange number and the count of finished copy blocks: zero, on the device.
    std::uint64_t* p = device_array(counters_, std::vector<std::uint64_t>(2, 0), what);
    sync_.epoch = p;
    sync_.arrived = reinterpret_cast<unsigned*>(p + 1);
    // The lanes are made with the plan, not at an exchange, which may be under a capture.
    if (device.halo_sends_at_once() && spec.transport_neighbours > 1) {
      fork_.emplace(what + " (fork of its lanes)");
      for (std::size_t k = 1; k < spec.transport_neighbours; ++k)
        lanes_.push_back(std::make_unique<Lane>(what + " (lane " + std::to_string(k) + ")"));
    }
  }
  void begin(Stream stream, bool capturing, const char* call) override {
    if (!broken_.empty())
      throw Error(ErrorCode::Internal, std::string(call) + " on rank " + std::to_string(rank_) + ": an earlier exchange failed " +
                                           "part-way (" + broken_ + "), so its waits may be unwatched and the "
                                           "exchange numbers may disagree: make a new halo exchange; nothing was enqueued");
    if (watch_) {
      const std::string released = watch_->released();
      if (!released.empty())
        throw Error(ErrorCode::Timeout, std::string(call) + " on rank " + std::to_string(rank_) + ": " + released +
                                            "; its signal words were written by the watch, not by the late "
                                            "neighbour, so this halo exchange is failed: make a new one once every "
                                            "rank is back; nothing was enqueued");
    }
    sequence_.before(stream, capturing, call, rank_);
  }
  void run(Stream stream, bool copy, bool capturing, const char* call) override {
    if (capturing) captured_ = true;
    const bool memop = watch_ && !captured_;
    cuda::HaloSync sync = sync_;
    if (memop) sync.nwaits = 0;
    const cudaError_t rc = cuda::launch_halo(copy ? table_ : nullptr, copy ? count_ : 0, largest_, sync, limit_, stream,
                                             early_);
    if (rc != cudaSuccess) ipc::check_cuda(rc, "halo exchange kernel launch", std::string(call) + " on rank " + std::to_string(rank_));
    const std::uint64_t epoch = ++exchanges_;  // the kernel's number for this exchange (while not captured)
    if (memop) {
      // The kernel is enqueued: whatever fails now, the next exchange is still ordered after it.
      try {
        const auto s = static_cast<cudaStream_t>(stream);
        watch_->began(s);
        for (auto& op : memop_waits_) op.waitValue.value64 = epoch;
        run_stream_batch(memop_waits_, stream, call, rank_);
        watch_->enqueued(s, epoch);
      } catch (const std::exception& e) {
        broken_ = e.what();
        sequence_.after(stream, capturing, call, rank_);
        throw;
      }
    }
    sequence_.after(stream, capturing, call, rank_);
  }
  std::uint64_t next_exchange(bool capturing) const override { return capturing || captured_ ? 0 : exchanges_ + 1; }
  void fail(const std::string& why) override { broken_ = why; }
  Stream lane(Stream stream, std::size_t k, const char* call) override {
    if (lanes_.empty()) return stream;
    // Messages are built only on a failure: an exchange runs every iteration.
    const auto where = [&] { return std::string(call) + " on rank " + std::to_string(rank_); };
    if (k > lanes_.size())
      throw Error(ErrorCode::Internal, where() + ": lane " + std::to_string(k) + " of a halo plan with " +
                                           std::to_string(lanes_.size()) + " lanes besides the caller's stream");
    if (k == 0) {
      // The exchange's fork, before anything of lane 0 is enqueued: every lane starts after
      // the caller's work before the exchange, not after lane 0's.
      const auto s = static_cast<cudaStream_t>(stream);
      fork_capture_ = capture_of(s, where);
      const cudaError_t rc = cudaEventRecord(fork_->get(), s);
      if (rc != cudaSuccess) ipc::check_cuda(rc, "cudaEventRecord (fork of the halo lanes)", where());
      return stream;
    }
    Lane& lane = *lanes_[k - 1];
    // A lane stays in a capture it joined until that capture ends. While it is in another one
    // than the caller's stream (the plan captured twice at once, or an uncaptured exchange
    // during such a capture), waiting for the fork would fail or break that capture: this
    // neighbour goes on the caller's stream then, after the others, as under `serial`.
    if (const unsigned long long held = capture_of(lane.stream.get(), where); held != 0 && held != fork_capture_)
      return stream;
    const cudaError_t rc = cudaStreamWaitEvent(lane.stream.get(), fork_->get(), 0);
    if (rc != cudaSuccess) ipc::check_cuda(rc, "cudaStreamWaitEvent (halo lane)", where());
    lane.used = true;
    return lane.stream.get();
  }
  void join(Stream stream, const char* call) override {
    const auto s = static_cast<cudaStream_t>(stream);
    std::string failed;
    for (std::size_t k = 0; k < lanes_.size(); ++k) {
      Lane& lane = *lanes_[k];
      if (!lane.used) continue;
      lane.used = false;
      cudaError_t rc = cudaEventRecord(lane.end.get(), lane.stream.get());
      if (rc == cudaSuccess) rc = cudaStreamWaitEvent(s, lane.end.get(), 0);
      if (rc != cudaSuccess && failed.empty())
        failed = "joining halo lane " + std::to_string(k + 1) + ": " + cudaGetErrorName(rc) + " (" + cudaGetErrorString(rc) + ")";
    }
    if (!failed.empty())
      throw Error(ErrorCode::Cuda, std::string(call) + " on rank " + std::to_string(rank_) + ": " + failed);
  }

 private:
  // A stream of the plan's own for one transport neighbour's transfers, and the event that
  // marks its end for the caller's stream.
  struct Lane {
    explicit Lane(const std::string& what) : stream(what), end(what + " (its end)") {}
    OwnedStream stream;
    OwnedEvent end;
    bool used = false;  // since the last join
  };
  // The id of the capture `s` is in; ~0 for one that was invalidated, 0 for none.
  template <class Where>
  static unsigned long long capture_of(cudaStream_t s, const Where& where) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    const cudaError_t rc = cudaStreamGetCaptureInfo(s, &status, &id);
    if (rc != cudaSuccess) ipc::check_cuda(rc, "cudaStreamGetCaptureInfo (halo lanes)", where());
    if (status == cudaStreamCaptureStatusNone) return 0;
    return status == cudaStreamCaptureStatusActive ? id : ~0ull;
  }

  int rank_;
  cuda::WaitLimit limit_;
  bool early_;
  StreamSequence sequence_;
  PooledBlock table_memory_, stores_, waits_, wait_ranks_, counters_;
  const cuda::Copy2D* table_ = nullptr;
  int count_ = 0;
  std::uint64_t largest_ = 0;
  cuda::HaloSync sync_{};
  std::uint64_t exchanges_ = 0;
  bool captured_ = false;
  std::string broken_;  // why an exchange failed part-way (begin refuses then)
  std::vector<CUstreamBatchMemOpParams> memop_waits_;  // where the waits are stream operations
  std::optional<HaloWatch> watch_;                     // with them
  std::optional<OwnedEvent> fork_;                     // where there are lanes
  std::vector<std::unique_ptr<Lane>> lanes_;
  unsigned long long fork_capture_ = 0;                // capture_of the caller's stream at the fork
};

}  // namespace

CUstreamBatchMemOpParams stream_write_op(std::uint64_t* address, std::uint64_t value) {
  CUstreamBatchMemOpParams op{};
  op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
  op.writeValue.address = reinterpret_cast<CUdeviceptr>(address);
  op.writeValue.value64 = value;
  return op;
}

CUstreamBatchMemOpParams stream_wait_op(const std::uint64_t* address, std::uint64_t value, unsigned flags) {
  CUstreamBatchMemOpParams op{};
  op.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
  op.waitValue.address = reinterpret_cast<CUdeviceptr>(address);
  op.waitValue.value64 = value;
  op.waitValue.flags = flags;
  return op;
}

void run_stream_batch(std::vector<CUstreamBatchMemOpParams>& ops, Stream stream, const char* call, int rank) {
  // The driver takes fewer than 256 operations a call (cuda.h); the parts stay in order on
  // the stream.
  constexpr std::size_t kMostOps = 255;
  for (std::size_t i = 0; i < ops.size(); i += kMostOps) {
    const unsigned count = static_cast<unsigned>(std::min<std::size_t>(kMostOps, ops.size() - i));
    const CUresult rc = ipc::cuda_driver().cuStreamBatchMemOp(stream, count, ops.data() + i, 0);
    if (rc != CUDA_SUCCESS) ipc::check_cu(rc, "cuStreamBatchMemOp", std::string(call) + " on rank " + std::to_string(rank));
  }
}

// One rank's GPU: its PCI bus id (where node peers look for each other's GPU) and its UUID
// (one physical GPU, or MIG instance, whatever machine or container it is seen from).
struct GpuId {
  char bus[32];
  unsigned char uuid[16];
};
struct GpuIds {
  std::vector<std::string> bus;
  std::vector<std::string> uuid;
};
// Collective: every rank's GpuId, by rank.
static GpuIds gather_gpu_ids(const CommContext& ctx, const GpuId& mine, const std::string& what) {
  std::vector<GpuId> all(static_cast<std::size_t>(ctx.topo.size));
  ctx.boot.allgather(&mine, all.data(), sizeof(GpuId), what);
  GpuIds ids;
  for (const GpuId& i : all) {
    ids.bus.emplace_back(i.bus, strnlen(i.bus, sizeof(i.bus)));
    ids.uuid.emplace_back(reinterpret_cast<const char*>(i.uuid), sizeof(i.uuid));
  }
  return ids;
}

CurrentDevice::CurrentDevice(int device) {
  (void)cudaGetDevice(&previous_);
  if (previous_ != device) (void)cudaSetDevice(device);
}

CurrentDevice::~CurrentDevice() {
  int now = -1;
  (void)cudaGetDevice(&now);
  if (previous_ >= 0 && now != previous_) (void)cudaSetDevice(previous_);
}

bool stream_ends_by(cudaStream_t stream, const Deadline& deadline, const char* call, const std::string& what) {
  Backoff backoff;
  cudaError_t q;
  while ((q = cudaStreamQuery(stream)) == cudaErrorNotReady && !deadline.expired()) backoff.pause();
  if (q == cudaErrorNotReady) return false;
  ipc::check_cuda(q, call, what);
  return true;
}

OwnedStream::OwnedStream(const std::string& what) {
  ipc::check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", what);
}

OwnedStream::~OwnedStream() {
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}

OwnedEvent::OwnedEvent(const std::string& what) {
  ipc::check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags", what);
}

OwnedEvent::~OwnedEvent() {
  if (event_ != nullptr) (void)cudaEventDestroy(event_);
}

CudaDeviceRuntime::CudaDeviceRuntime(const CommContext& ctx, int device)
    : rank_(ctx.topo.rank),
      size_(ctx.topo.size),
      device_(device),
      timeout_(ctx.options.timeout),
      setup_stream_("meshmem::Comm (device setup)"),
      live_(std::in_place, device),
      releaser_(device, ctx.options.timeout),
      fault_(device, ctx.options.timeout, "meshmem::Comm (device setup)") {
  const std::string what = "meshmem::Comm (device setup)";
  GpuId gpu{};
  agreed_step(ctx.boot, what, [&] {
    ipc::check_cuda(cudaSetDevice(device_), "cudaSetDevice", what);
    ipc::check_cuda(cudaFree(nullptr), "cudaFree(nullptr) (context creation)", what);
    ipc::check_cu(ipc::cuda_driver().cuCtxGetCurrent(&context_), "cuCtxGetCurrent", what);
    ipc::check_cuda(cuda::preload_kernels(), "cudaFuncGetAttributes (loading meshmem's kernels)", what);
    // Only reported (device_info, warnings): a failure leaves the mode unknown, not the Comm.
    CUmoduleLoadingMode loading = CU_MODULE_EAGER_LOADING;
    const CUresult loading_rc = ipc::cuda_driver().cuModuleGetLoadingMode(&loading);
    note_module_loading(loading_rc != CUDA_SUCCESS ? LoadingMode::Unknown
                        : loading == CU_MODULE_LAZY_LOADING ? LoadingMode::Lazy
                                                            : LoadingMode::Eager);
    if (loading_rc != CUDA_SUCCESS)
      log(LogLevel::Warn, what + ": cuModuleGetLoadingMode failed (CUresult " + std::to_string(int(loading_rc)) +
                              "): the module loading mode is not known");
    static std::atomic<bool> told_mode{false};
    if (module_loading_request().set_by_meshmem && !told_mode.exchange(true))
      log(LogLevel::Info, describe_module_loading() + " (MESHMEM_MODULE_LOADING=keep leaves CUDA's default)");
    cudaDeviceProp prop{};
    ipc::check_cuda(cudaGetDeviceProperties(&prop, device_), "cudaGetDeviceProperties", what);
    ipc::check_cuda(cudaDeviceGetPCIBusId(gpu.bus, sizeof(gpu.bus), device_), "cudaDeviceGetPCIBusId", what);
    std::memcpy(gpu.uuid, prop.uuid.bytes, sizeof(gpu.uuid));
    description_ = "device " + std::to_string(device_) + " (" + prop.name + ", " + gpu.bus + ")";
    early_launch_ = kEarlyLaunch.get(ctx.options) == EarlyLaunch::Auto && prop.major >= 9 && cuda::early_launch_compiled();
    halo_sends_at_once_ = kHaloSends.get(ctx.options) == HaloSends::Concurrent;
    granularity_ = ipc::vmm_granularity(device_);
    CUdevice dev = 0;
    ipc::check_cu(ipc::cuda_driver().cuDeviceGet(&dev, device_), "cuDeviceGet", what);
    int flush = 0;
    ipc::check_cu(ipc::cuda_driver().cuDeviceGetAttribute(&flush, CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES, dev),
                  "cuDeviceGetAttribute", what);
    wait_flags_ = flush ? CU_STREAM_WAIT_VALUE_FLUSH : 0;
  });
  // Granularities are powers of two: the largest is a multiple of all, so every rank
  // rounds a window to the same size.
  granularity_ = ctx.boot.allreduce_max(granularity_, what);
  // Which node peers share this rank's GPU (same PCI bus id): the node barrier's choice.
  // Which ranks of the Comm do, by UUID (one physical GPU whatever machine or container it is
  // seen from): polling kernels would hold a time-sliced GPU from the very ranks they wait
  // for, so the stream waits and the cross-node barrier avoid them then; by bus id alone, two
  // containers (or simulated nodes) on one GPU waited with kernels.
  GpuIds ids = gather_gpu_ids(ctx, gpu, what);
  bus_ids_ = std::move(ids.bus);
  for (int r : ctx.topo.node_ranks) shared_gpu_ = shared_gpu_ || (r != ctx.topo.rank && bus_ids_[r] == bus_ids_[ctx.topo.rank]);
  for (int r = 0; r < ctx.topo.size; ++r)
    shared_in_comm_ = shared_in_comm_ || (r != ctx.topo.rank && ids.uuid[r] == ids.uuid[ctx.topo.rank]);
  any_shared_ = ctx.boot.allreduce_max(shared_gpu_ ? 1 : 0, what) != 0;
  const StreamWait wait = kStreamWait.get(ctx.options);
  wait_kernel_ = wait == StreamWait::Kernel || (wait == StreamWait::Auto && !shared_in_comm_);
  description_ += std::string(", stream waits ") + (wait_kernel_ ? "kernel" : "memop") +
                  (shared_in_comm_ ? " (GPU shared with other ranks)" : "") + (early_launch_ ? ", early launch" : "") +
                  (halo_sends_at_once_ ? "" : ", halo sends serial") + ", " + describe_gpu_queues() + ", " + describe_module_loading();
}

void CudaDeviceRuntime::note_own_stream_route(const std::string& route) {
  // Once per process each: every Comm would say the same.
  static std::atomic<bool> said_queues{false}, said_loading{false};
  const std::string queues = few_gpu_queues_warning(rank_, route);
  if (!queues.empty() && !said_queues.exchange(true)) log(LogLevel::Warn, queues);
  const std::string loading = lazy_loading_warning(rank_, route);
  if (!loading.empty() && !said_loading.exchange(true)) log(LogLevel::Warn, loading);
}

void CudaDeviceRuntime::create_local(WindowState& state, const std::string& what) {
  create_device_part(state, device_, granularity_, setup_stream_.get(), what);
  state.peer.assign(static_cast<std::size_t>(size_), nullptr);
  state.peer[static_cast<std::size_t>(rank_)] = state.local;
}

void CudaDeviceRuntime::publish(WindowState& state, const std::string& what) { publish_peer_table(state, what); }

DeviceEntry CudaDeviceRuntime::enter(Stream stream, bool capture, const char* call) {
  DeviceEntry entry;
  cudaError_t rc = cudaGetDevice(&entry.previous);
  if (rc != cudaSuccess) ipc::check_cuda(rc, "cudaGetDevice", where(call));
  if (entry.previous != device_) {
    rc = cudaSetDevice(device_);
    if (rc != cudaSuccess) ipc::check_cuda(rc, "cudaSetDevice", where(call));
  }
  try {
    // Messages are built only on failure: this runs before every stream operation.
    fault_.raise_if_set([&] { return where(call); });
    // cudaStreamPerThread is the calling thread's stream of the device current at the call.
    if (stream == cudaStreamPerThread && entry.previous != device_)
      throw Error(ErrorCode::InvalidArgument,
                  where(call) + ": cudaStreamPerThread names the per-thread stream of the current device, " +
                      std::to_string(entry.previous) + ", but this Comm works on device " + std::to_string(device_) +
                      " (the device current when the Comm was made); make device " + std::to_string(device_) +
                      " current, or pass a stream of it");
    // The legacy default stream cannot be captured; the per-thread one can.
    if (stream != nullptr && stream != cudaStreamLegacy) {
      if (stream != cudaStreamPerThread) {
        CUcontext owner = nullptr;
        const CUresult got = ipc::cuda_driver().cuStreamGetCtx(stream, &owner);
        if (got != CUDA_SUCCESS) ipc::check_cu(got, "cuStreamGetCtx", where(call));
        if (owner != context_)
          throw Error(ErrorCode::InvalidArgument,
                      where(call) + ": the stream belongs to " + device_of(owner) + ", but this Comm works on device " +
                          std::to_string(device_) + " (the device current when the Comm was made); pass a stream of device " +
                          std::to_string(device_));
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
  if (entry.previous >= 0 && entry.previous != device_) (void)cudaSetDevice(entry.previous);
}

void CudaDeviceRuntime::wait_until(const WindowState& sig, std::size_t index, std::size_t count, Cmp cmp,
                                   std::uint64_t value, std::optional<std::uint64_t> then, Stream stream,
                                   const char* call) {
  auto* words = static_cast<std::uint64_t*>(sig.local) + index;
  // The stream's front end waits for GE / EQ (and GT as GE value+1) with
  // MESHMEM_STREAM_WAIT=memop (no timeout then); otherwise a polling kernel that gives up
  // after MESHMEM_TIMEOUT.
  const bool memop = !wait_kernel_ && (cmp == Cmp::GE || cmp == Cmp::EQ || (cmp == Cmp::GT && value != UINT64_MAX));
  if (!memop) {
    const cudaError_t k = cuda::launch_wait(words, count, cmp, value, then.has_value(), then.value_or(0), sig.id, index,
                                            fault_.limit(), stream, early_launch_);
    if (k != cudaSuccess) ipc::check_cuda(k, "wait kernel launch", where(call));
    return;
  }
  std::vector<CUstreamBatchMemOpParams> ops;
  ops.reserve(then ? 2 * count : count);
  for (std::size_t i = 0; i < count; ++i)
    ops.push_back(stream_wait_op(words + i, cmp == Cmp::GT ? value + 1 : value,
                                 (cmp == Cmp::EQ ? CU_STREAM_WAIT_VALUE_EQ : CU_STREAM_WAIT_VALUE_GEQ) | wait_flags_));
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
  return std::make_unique<KernelHaloPlan>(spec, *this);
}

void CudaDeviceRuntime::retire(WindowState& state, const char* call) {
  const std::uint64_t ticket = releaser_.submit(state);
  if (!releaser_.wait(ticket, timeout_))
    throw Error(ErrorCode::Timeout,
                where(call) + ": work issued on this GPU before the free has not finished (or a graph capture on this GPU is still open) after " + describe_timeout(timeout_) +
                    " (a stream waiting for a signal or a barrier that never comes?); the window's memory is released "
                    "once that work ends");
}

void CudaDeviceRuntime::retire_all(const std::vector<WindowState*>& states, const char* call) noexcept {
  try {
    std::uint64_t ticket = 0;
    for (WindowState* s : states) ticket = releaser_.submit(*s);
    if (ticket != 0 && !releaser_.wait(ticket, timeout_))
      log(LogLevel::Error, where(call) + ": work issued on this GPU has not finished after " + describe_timeout(timeout_) +
                               "; its windows' memory is released once that work ends");
  } catch (const std::exception& e) {
    log(LogLevel::Error, where(call) + ": " + e.what());
  }
}

std::unique_ptr<StreamBarrier> CudaDeviceRuntime::make_barrier(const CommContext& ctx, const BarrierContext& bctx) {
  return make_stream_barrier(ctx, bctx, *this);
}

// ---- the GPU part's entry points (gpu_part.hpp) ----

bool gpu_available(std::string* why) {
  auto fail = [&](const std::string& text) {
    if (why) *why = text;
    return false;
  };
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess) {
    (void)cudaGetLastError();
    return fail(std::string("no usable CUDA device: cudaGetDeviceCount: ") + cudaGetErrorString(rc) +
                (rc == cudaErrorInsufficientDriver ? " (no NVIDIA driver is loaded, or it is older than CUDA " +
                                                         std::to_string(CUDART_VERSION / 1000) + ")"
                                                   : ""));
  }
  if (count == 0) return fail("no CUDA device is visible");
  try {
    const auto& drv = ipc::cuda_driver();
    int device = 0;
    ipc::check_cuda(cudaGetDevice(&device), "cudaGetDevice", "device check");
    CUdevice dev = 0;
    ipc::check_cu(drv.cuDeviceGet(&dev, device), "cuDeviceGet", "device check");
    int vmm = 0, fd = 0;
    ipc::check_cu(drv.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev), "cuDeviceGetAttribute", "device check");
    ipc::check_cu(drv.cuDeviceGetAttribute(&fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev), "cuDeviceGetAttribute", "device check");
    if (!vmm) return fail("device " + std::to_string(device) + " does not support CUDA virtual memory management");
    if (!fd) return fail("device " + std::to_string(device) + " cannot export memory as POSIX file descriptors");
  } catch (const Error& e) {
    return fail(e.what());
  }
  return true;
}

int gpu_set_device_modulo(int ordinal) {
  if (!gpu_available(nullptr)) return -1;
  int count = 0;
  ipc::check_cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount", "select_local_device");
  const int device = ordinal % count;
  ipc::check_cuda(cudaSetDevice(device), "cudaSetDevice", "select_local_device");
  return device;
}

std::unique_ptr<DeviceRuntime> gpu_start_device_runtime(const CommContext& ctx, std::string* why) {
  const std::string what = "meshmem::Comm (device check)";
  std::string mine_why;
  const bool ok = gpu_available(&mine_why);
  int device = -1;
  if (ok) (void)cudaGetDevice(&device);
  // Device windows exist on all ranks or on none: the first rank that cannot says why.
  const std::int32_t flag = ok ? 1 : 0;
  std::vector<std::int32_t> all(static_cast<std::size_t>(ctx.topo.size));
  ctx.boot.allgather(&flag, all.data(), sizeof(flag), what);
  const auto first = std::find(all.begin(), all.end(), 0);
  if (first != all.end()) {
    const int speaker = static_cast<int>(first - all.begin());
    std::uint64_t len = ctx.topo.rank == speaker ? mine_why.size() : 0;
    ctx.boot.broadcast(&len, sizeof(len), speaker, what);
    std::string text(len, '\0');
    if (ctx.topo.rank == speaker) text = mine_why;
    if (len > 0) ctx.boot.broadcast(text.data(), len, speaker, what);
    *why = "rank " + std::to_string(speaker) + ": " + text;
    return nullptr;
  }
  finish_earlier_nccl_destroys(ctx.options.timeout, "meshmem::Comm on rank " + std::to_string(ctx.topo.rank));
  return std::make_unique<CudaDeviceRuntime>(ctx, device);
}

void CudaDeviceRuntime::wait_for_ticket(std::uint64_t* done, std::uint64_t ticket, int peer, cudaStream_t stream,
                                        bool owner_ends_it, const std::string& what, std::uint64_t* ready,
                                        std::uint64_t until, bool give_up) const {
  if (until == 0) until = ticket;
  if (wait_kernel_ || !owner_ends_it) {
    const cudaError_t k = cuda::launch_ticket_wait(ready, done, ticket, cuda::FaultKind::Transfer, peer, wait_limit(),
                                                   stream, early_launch_, until, give_up);
    if (k != cudaSuccess) ipc::check_cuda(k, "transfer wait kernel launch", what);
    return;
  }
  if (ready == nullptr) {
    ipc::check_cu(ipc::cuda_driver().cuStreamWaitValue64(stream, reinterpret_cast<CUdeviceptr>(done), until,
                                                         CU_STREAM_WAIT_VALUE_GEQ | wait_flags_),
                  "cuStreamWaitValue64 (transfer wait)", what);
    return;
  }
  // The write comes after the stream's earlier work (a stream write fences what came before it).
  std::vector<CUstreamBatchMemOpParams> ops{stream_write_op(ready, ticket),
                                            stream_wait_op(done, until, CU_STREAM_WAIT_VALUE_GEQ | wait_flags_)};
  run_stream_batch(ops, stream, "cuStreamBatchMemOp (transfer ready and wait)", rank_);
}

}  // namespace meshmem::detail
