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

bool IpcTransport::use_sm(const void* local, std::size_t bytes) const {
  return bytes <= sm_copy_max_ && device_accessible(local);
}

void IpcTransport::put(const WindowState& win, int target, std::size_t offset, const void* src,
                       std::size_t bytes, const SignalUpdate& signal, Stream stream) {
  const std::string what = "ipc put from rank " + std::to_string(rank_) + " to rank " + std::to_string(target);
  char* dst = static_cast<char*>(win.peer[target]) + offset;
  const bool sm = bytes > 0 && use_sm(src, bytes);
  std::uint64_t* word = nullptr;
  if (signal.sig != nullptr) word = static_cast<std::uint64_t*>(signal.sig->peer[target]) + signal.index;

  if (word != nullptr && (bytes == 0 || sm)) {
    ipc::check_cuda(cuda::launch_copy(dst, src, bytes, word, signal.value, signal.op, stream),
                    "copy+signal kernel launch", what);
    return;
  }
  if (bytes > 0) {
    if (sm)
      ipc::check_cuda(cuda::launch_copy(dst, src, bytes, nullptr, 0, SignalOp::Set, stream), "copy kernel launch", what);
    else
      ipc::check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream), "cudaMemcpyAsync", what);
  }
  if (word == nullptr) return;
  if (signal.op == SignalOp::Set) {
    // The default flags put a memory barrier before the write: the copy lands first.
    ipc::check_cu(ipc::cuda_driver().cuStreamWriteValue64(stream, reinterpret_cast<CUdeviceptr>(word), signal.value, 0),
                  "cuStreamWriteValue64", what);
  } else {
    ipc::check_cuda(cuda::launch_copy(nullptr, nullptr, 0, word, signal.value, signal.op, stream),
                    "signal kernel launch", what);
  }
}

void IpcTransport::get(void* dst, const WindowState& win, int target, std::size_t offset,
                       std::size_t bytes, Stream stream) {
  if (bytes == 0) return;
  const std::string what = "ipc get by rank " + std::to_string(rank_) + " from rank " + std::to_string(target);
  const char* src = static_cast<const char*>(win.peer[target]) + offset;
  if (use_sm(dst, bytes))
    ipc::check_cuda(cuda::launch_copy(dst, src, bytes, nullptr, 0, SignalOp::Set, stream), "copy kernel launch", what);
  else
    ipc::check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream), "cudaMemcpyAsync", what);
}

}  // namespace meshmem::detail
