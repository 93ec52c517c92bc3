// The anchor of the GPU part. The meshmem target's link option --undefined=meshmem_gpu_part
// makes the linker take this object out of the archive; its references take the rest of
// the GPU part, whose functions then satisfy the core's weak references (../gpu_part.hpp).
#define MESHMEM_DEFINING_GPU_PART
#include "gpu_part.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bootstrap.hpp"
#include "topology.hpp"
#include "cuda/proxy/nccl_library.hpp"
#include "cuda/runtime/device_runtime.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

extern "C" {
extern const void* const meshmem_gpu_part[];
const void* const meshmem_gpu_part[] = {
    reinterpret_cast<const void*>(&meshmem::detail::gpu_available),
    reinterpret_cast<const void*>(&meshmem::detail::gpu_set_device_modulo),
    reinterpret_cast<const void*>(&meshmem::detail::gpu_start_device_runtime),
    reinterpret_cast<const void*>(&meshmem::detail::make_ipc_transport),
    reinterpret_cast<const void*>(&meshmem::detail::make_staged_transport),
    reinterpret_cast<const void*>(&meshmem::detail::make_nccl_transport),
    reinterpret_cast<const void*>(&meshmem::detail::make_mpi_device_transport),
};
}

namespace meshmem::detail {

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

}  // namespace meshmem::detail
