#define MESHMEM_DEFINING_GPU_PART
#include "device_runtime.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "../bootstrap.hpp"
#include "../gpu_part.hpp"
#include "../knobs.hpp"
#include "../topology.hpp"
#include "device_window.hpp"
#include "kernels.hpp"
#include "meshmem/ipc/cuda_driver.hpp"
#include "stream_barrier.hpp"

namespace meshmem::detail {

namespace {

enum class StreamWait { Auto, Memop, Kernel };
constexpr std::pair<const char*, StreamWait> kStreamWaits[] = {
    {"auto", StreamWait::Auto}, {"memop", StreamWait::Memop}, {"kernel", StreamWait::Kernel}};
StreamWait parse_stream_wait(const char* n, const std::string& raw) { return parse_choice(n, raw, kStreamWaits); }
std::string print_stream_wait(const StreamWait& w) { return choice_name(w, kStreamWaits); }

const TuningKnob<StreamWait> kStreamWait{
    "device", "MESHMEM_STREAM_WAIT", StreamWait::Auto, parse_stream_wait, print_stream_wait,
    "device `wait_until`: `memop` (cuStreamWaitValue64, holds no SM), `kernel` (polling kernel, about 2x lower "
    "put_signal latency); `auto` = `kernel` unless this rank's GPU is shared (a polling kernel would hold a "
    "time-sliced GPU from the ranks it waits for)"};

class KernelCopyPlan final : public DeviceCopyPlan {
 public:
  KernelCopyPlan(const std::vector<DeviceCopy>& copies, int rank) : count_(static_cast<int>(copies.size())), rank_(rank) {
    std::vector<cuda::Copy2D> table;
    for (const DeviceCopy& c : copies) {
      table.push_back({static_cast<char*>(c.dst), static_cast<const char*>(c.src), c.width, c.height, c.src_pitch, c.dst_pitch});
      largest_ = std::max<std::uint64_t>(largest_, c.width * c.height);
    }
    if (table.empty()) return;
    void* p = nullptr;
    const std::string what = "halo copy plan on rank " + std::to_string(rank_);
    ipc::check_cuda(cudaMalloc(&p, table.size() * sizeof(cuda::Copy2D)), "cudaMalloc", what);
    table_.reset(p);
    ipc::check_cuda(cudaMemcpy(p, table.data(), table.size() * sizeof(cuda::Copy2D), cudaMemcpyHostToDevice), "cudaMemcpy", what);
  }
  void run(Stream stream) override {
    const cudaError_t rc = cuda::launch_copies(static_cast<const cuda::Copy2D*>(table_.get()), count_, largest_, stream);
    if (rc != cudaSuccess) ipc::check_cuda(rc, "halo copy kernel launch", "HaloExchange::exchange on rank " + std::to_string(rank_));
  }

 private:
  DevicePtr table_;
  int count_;
  int rank_;
  std::uint64_t largest_ = 0;
};

}  // namespace

void run_stream_batch(std::vector<CUstreamBatchMemOpParams>& ops, Stream stream, const char* call, int rank) {
  // The driver takes at most 256 operations a call; the parts stay in order on the stream.
  for (std::size_t i = 0; i < ops.size(); i += 256) {
    const unsigned count = static_cast<unsigned>(std::min<std::size_t>(256, ops.size() - i));
    const CUresult rc = ipc::cuda_driver().cuStreamBatchMemOp(stream, count, ops.data() + i, 0);
    if (rc != CUDA_SUCCESS) ipc::check_cu(rc, "cuStreamBatchMemOp", std::string(call) + " on rank " + std::to_string(rank));
  }
}

OwnedStream::OwnedStream(const std::string& what) {
  ipc::check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", what);
}

OwnedStream::~OwnedStream() {
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}

CudaDeviceRuntime::CudaDeviceRuntime(const CommContext& ctx, int device)
    : rank_(ctx.topo.rank), size_(ctx.topo.size), device_(device), setup_stream_("meshmem::Comm (device setup)") {
  const std::string what = "meshmem::Comm (device setup)";
  std::string bus_id;
  agreed_step(ctx.boot, what, [&] {
    ipc::check_cuda(cudaSetDevice(device_), "cudaSetDevice", what);
    cudaDeviceProp prop{};
    ipc::check_cuda(cudaGetDeviceProperties(&prop, device_), "cudaGetDeviceProperties", what);
    char bus[32] = {};
    ipc::check_cuda(cudaDeviceGetPCIBusId(bus, sizeof(bus), device_), "cudaDeviceGetPCIBusId", what);
    description_ = "device " + std::to_string(device_) + " (" + prop.name + ", " + bus + ")";
    bus_id = bus;
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
  // Which node peers share this rank's GPU (same PCI bus id): polling kernels would hold a
  // time-sliced GPU from the very ranks they wait for, so the Auto choices avoid them then.
  struct BusId {
    char text[32];
  } mine{};
  std::snprintf(mine.text, sizeof(mine.text), "%s", bus_id.c_str());
  std::vector<BusId> all(static_cast<std::size_t>(ctx.topo.size));
  ctx.boot.allgather(&mine, all.data(), sizeof(BusId), what);
  for (int r : ctx.topo.node_ranks)
    shared_gpu_ = shared_gpu_ || (r != ctx.topo.rank && std::strncmp(all[r].text, mine.text, sizeof(mine.text)) == 0);
  any_shared_ = ctx.boot.allreduce_max(shared_gpu_ ? 1 : 0, what) != 0;
  const StreamWait wait = kStreamWait.get(ctx.options);
  wait_kernel_ = wait == StreamWait::Kernel || (wait == StreamWait::Auto && !shared_gpu_);
  description_ += std::string(", stream waits ") + (wait_kernel_ ? "kernel" : "memop") +
                  (shared_gpu_ ? " (GPU shared with other ranks)" : "");
}

void CudaDeviceRuntime::create_local(WindowState& state, const std::string& what) {
  create_device_part(state, device_, granularity_, setup_stream_.get(), what);
  state.peer.assign(static_cast<std::size_t>(size_), nullptr);
  state.peer[static_cast<std::size_t>(rank_)] = state.local;
}

void CudaDeviceRuntime::publish(WindowState& state, const std::string& what) { publish_peer_table(state, what); }

void CudaDeviceRuntime::wait_until(const WindowState& sig, std::size_t index, Cmp cmp, std::uint64_t value,
                                   Stream stream) {
  auto* word = static_cast<std::uint64_t*>(sig.local) + index;
  const auto addr = reinterpret_cast<CUdeviceptr>(word);
  // The stream's front end waits for GE / EQ (and GT as GE value+1); the other comparisons
  // (and MESHMEM_STREAM_WAIT=kernel) use a polling kernel.
  const bool memop = !wait_kernel_;
  CUresult rc = CUDA_SUCCESS;
  if (memop && (cmp == Cmp::GE || (cmp == Cmp::GT && value != UINT64_MAX))) {
    rc = ipc::cuda_driver().cuStreamWaitValue64(stream, addr, cmp == Cmp::GT ? value + 1 : value,
                                                CU_STREAM_WAIT_VALUE_GEQ | wait_flags_);
  } else if (memop && cmp == Cmp::EQ) {
    rc = ipc::cuda_driver().cuStreamWaitValue64(stream, addr, value, CU_STREAM_WAIT_VALUE_EQ | wait_flags_);
  } else {
    const cudaError_t k = cuda::launch_wait(word, cmp, value, stream);
    if (k != cudaSuccess) ipc::check_cuda(k, "wait kernel launch", where("comm.wait_until"));
  }
  if (rc != CUDA_SUCCESS) ipc::check_cu(rc, "cuStreamWaitValue64", where("comm.wait_until"));
}

void CudaDeviceRuntime::store_and_wait(const std::vector<std::uint64_t*>& stores,
                                       const std::vector<const std::uint64_t*>& waits, std::uint64_t value,
                                       Stream stream, const char* call) {
  std::vector<CUstreamBatchMemOpParams> ops;
  ops.reserve(stores.size() + waits.size());
  for (std::uint64_t* word : stores) {
    CUstreamBatchMemOpParams op{};
    op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
    op.writeValue.address = reinterpret_cast<CUdeviceptr>(word);
    op.writeValue.value64 = value;
    op.writeValue.flags = 0;  // memory barrier first: the puts before it land first
    ops.push_back(op);
  }
  for (const std::uint64_t* word : waits) {
    CUstreamBatchMemOpParams op{};
    op.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
    op.waitValue.address = reinterpret_cast<CUdeviceptr>(word);
    op.waitValue.value64 = value;
    op.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ | wait_flags_;
    ops.push_back(op);
  }
  if (!ops.empty()) run_stream_batch(ops, stream, call, rank_);
}

std::unique_ptr<DeviceCopyPlan> CudaDeviceRuntime::make_copy_plan(const std::vector<DeviceCopy>& copies) {
  return std::make_unique<KernelCopyPlan>(copies, rank_);
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
  return std::make_unique<CudaDeviceRuntime>(ctx, device);
}

}  // namespace meshmem::detail
