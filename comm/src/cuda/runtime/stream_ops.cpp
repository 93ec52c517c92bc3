#include "cuda/runtime/stream_ops.hpp"

#include <algorithm>
#include <string>

#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

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

}  // namespace meshmem::detail
