#include "transport_ipc.hpp"

#include <string>

#include "kernels.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

bool device_accessible(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error of an unknown pointer
    return false;
  }
  switch (attr.type) {
    case cudaMemoryTypeDevice:
    case cudaMemoryTypeManaged: return true;
    case cudaMemoryTypeHost: return attr.devicePointer == p;
    default: return false;
  }
}

bool IpcTransport::use_sm(const void* local, std::size_t bytes, std::size_t max) const {
  return bytes <= max && device_accessible(local);
}

std::string IpcTransport::what(const char* op, int target) const {
  return std::string("ipc ") + op + " between rank " + std::to_string(rank_) + " and rank " + std::to_string(target);
}

void IpcTransport::put(const WindowState& win, int target, std::size_t offset, const void* src,
                       std::size_t bytes, const SignalUpdate& signal, Stream stream) {
  char* dst = static_cast<char*>(win.peer[target]) + offset;
  std::uint64_t* word = nullptr;
  if (signal.sig != nullptr) word = static_cast<std::uint64_t*>(signal.sig->peer[target]) + signal.index;

  // Small put_signal: one kernel copies, then signals (no second stream operation). An Add
  // without data also needs the kernel; a Set without data is one stream write below.
  if (word != nullptr && ((bytes == 0 && signal.op == SignalOp::Add) || (bytes > 0 && use_sm(src, bytes, fused_signal_max_)))) {
    const cudaError_t rc = cuda::launch_copy(dst, src, bytes, word, signal.value, signal.op, stream);
    if (rc != cudaSuccess) ipc::check_cuda(rc, "copy+signal kernel launch", what("put_signal", target));
    return;
  }
  if (bytes > 0) {
    const bool sm = use_sm(src, bytes, sm_copy_max_);
    const cudaError_t rc = sm ? cuda::launch_copy(dst, src, bytes, nullptr, 0, SignalOp::Set, stream)
                              : cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream);
    if (rc != cudaSuccess) ipc::check_cuda(rc, sm ? "copy kernel launch" : "cudaMemcpyAsync", what("put", target));
  }
  if (word == nullptr) return;
  if (signal.op == SignalOp::Set) {
    // The default flags put a memory barrier before the write: the copy lands first.
    const CUresult rc = ipc::cuda_driver().cuStreamWriteValue64(stream, reinterpret_cast<CUdeviceptr>(word), signal.value, 0);
    if (rc != CUDA_SUCCESS) ipc::check_cu(rc, "cuStreamWriteValue64", what("put_signal", target));
  } else {
    const cudaError_t rc = cuda::launch_copy(nullptr, nullptr, 0, word, signal.value, signal.op, stream);
    if (rc != cudaSuccess) ipc::check_cuda(rc, "signal kernel launch", what("put_signal", target));
  }
}

void IpcTransport::put_strided(const WindowState& win, int target, std::size_t dst_offset, std::size_t dst_pitch,
                               const void* src, std::size_t src_pitch, std::size_t width, std::size_t height,
                               Stream stream) {
  if (width == 0 || height == 0) return;
  char* dst = static_cast<char*>(win.peer[target]) + dst_offset;
  // One copy-engine operation for the whole strided region (a column of a grid, say).
  const cudaError_t rc = cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, cudaMemcpyDefault, stream);
  if (rc != cudaSuccess) ipc::check_cuda(rc, "cudaMemcpy2DAsync", what("strided put", target));
}

void IpcTransport::get(void* dst, const WindowState& win, int target, std::size_t offset,
                       std::size_t bytes, Stream stream) {
  if (bytes == 0) return;
  const char* src = static_cast<const char*>(win.peer[target]) + offset;
  const bool sm = use_sm(dst, bytes, sm_copy_max_);
  const cudaError_t rc = sm ? cuda::launch_copy(dst, src, bytes, nullptr, 0, SignalOp::Set, stream)
                            : cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream);
  if (rc != cudaSuccess) ipc::check_cuda(rc, sm ? "copy kernel launch" : "cudaMemcpyAsync", what("get", target));
}

}  // namespace meshmem::detail
