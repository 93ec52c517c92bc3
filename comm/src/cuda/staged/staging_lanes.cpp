#include "cuda/staged/staging_lanes.hpp"

#include "cuda/runtime/cuda_owners.hpp"
#include "cuda/runtime/kernels.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

StagingLanes::StagingLanes(const std::vector<int>& devices, int slots, std::size_t most, const std::string& what) {
  try {
    for (int d : devices) {
      if (lanes_.count(d)) continue;
      if (lanes_.size() == most)
        throw Error(ErrorCode::Unsupported, what + ": more than " + std::to_string(most) + " GPUs to drive");
      CurrentDevice current(d);
      // The signal and wait kernels may run on this GPU from the agent's thread: loaded now,
      // not at a first launch behind a polling kernel (kernels.hpp, preload_kernels).
      ipc::check_cuda(cuda::preload_kernels(), "cudaFuncGetAttributes (loading meshmem's kernels)", what);
      StagingLane& lane = lanes_[d];
      lane.ordinal = lanes_.size() - 1;
      ipc::check_cuda(cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", what);
      lane.copied.resize(static_cast<std::size_t>(slots), nullptr);
      lane.freed.resize(static_cast<std::size_t>(slots), nullptr);
      for (std::size_t s = 0; s < lane.copied.size(); ++s) {
        ipc::check_cuda(cudaEventCreateWithFlags(&lane.copied[s], cudaEventDisableTiming), "cudaEventCreateWithFlags", what);
        ipc::check_cuda(cudaEventCreateWithFlags(&lane.freed[s], cudaEventDisableTiming), "cudaEventCreateWithFlags", what);
      }
    }
  } catch (...) {
    release();
    throw;
  }
}

// Streams and events with pending work may be destroyed; CUDA releases them once that work is done.
StagingLanes::~StagingLanes() { release(); }

void StagingLanes::release() noexcept {
  for (auto& [d, lane] : lanes_) {
    CurrentDevice current(d);
    for (cudaEvent_t e : lane.copied)
      if (e) (void)cudaEventDestroy(e);
    for (cudaEvent_t e : lane.freed)
      if (e) (void)cudaEventDestroy(e);
    if (lane.stream) (void)cudaStreamDestroy(lane.stream);
  }
  lanes_.clear();
}

}  // namespace meshmem::detail
