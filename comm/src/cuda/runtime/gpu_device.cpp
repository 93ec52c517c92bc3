#include "cuda/runtime/gpu_device.hpp"

#include <atomic>
#include <cstring>
#include <utility>

#include "bootstrap.hpp"
#include "knobs.hpp"
#include "log.hpp"
#include "topology.hpp"
#include "transport.hpp"
#include "cuda/runtime/gpu_device_knobs.hpp"
#include "cuda/runtime/gpu_queues.hpp"
#include "cuda/runtime/module_loading.hpp"
#include "cuda/runtime/stream_ops.hpp"
#include "meshmem/ipc/cuda_driver.hpp"
#include "meshmem/ipc/vmm.hpp"

namespace meshmem::detail {

// MESHMEM_STREAM_WAIT and MESHMEM_EARLY_LAUNCH: gpu_device_knobs.hpp.

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

GpuDevice::GpuDevice(const CommContext& ctx, int device)
    : rank_(ctx.topo.rank),
      device_(device),
      timeout_(ctx.options.timeout),
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
    head_ = "device " + std::to_string(device_) + " (" + prop.name + ", " + gpu.bus + ")";
    early_launch_ = kEarlyLaunch.get(ctx.options) == EarlyLaunch::Auto && prop.major >= 9 && cuda::early_launch_compiled();
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
  head_ += std::string(", stream waits ") + (wait_kernel_ ? "kernel" : "memop") +
           (shared_in_comm_ ? " (GPU shared with other ranks)" : "") + (early_launch_ ? ", early launch" : "");
  tail_ = ", " + describe_gpu_queues() + ", " + describe_module_loading();
}

void GpuDevice::wait_for_ticket(std::uint64_t* done, std::uint64_t ticket, int peer, cudaStream_t stream,
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
