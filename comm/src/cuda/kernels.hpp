// Launchers of meshmem's own kernels (comm/src/cuda/kernels.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "meshmem/types.hpp"

namespace meshmem::detail::cuda {

// SM copy of `bytes` (dst, src device-accessible). If `signal` is non-null, the word is
// updated (system-scope release) after the whole copy is written: one launch for a small
// put_signal. bytes may be 0 (signal only).
cudaError_t launch_copy(void* dst, const void* src, std::size_t bytes, std::uint64_t* signal,
                        std::uint64_t value, SignalOp op, cudaStream_t stream);

// Blocks `stream` until *word compares true (for the comparisons stream memory operations
// lack).
cudaError_t launch_wait(const std::uint64_t* word, Cmp cmp, std::uint64_t value, cudaStream_t stream);

// One block, one thread per rank: stores `epoch` into word `rank` of every peer's flags
// (peer_flags: device array of the peers' flag words), then waits until every peer's word
// here reaches `epoch`.
cudaError_t launch_barrier(std::uint64_t* const* peer_flags, std::uint64_t* my_flags, int rank, int size,
                           std::uint64_t epoch, cudaStream_t stream);

// Runs `count` 2-D copies described by `table` (device memory, DeviceCopy layout) in one
// launch: blockIdx.y picks the copy, 16-byte accesses where the copy's layout allows.
struct Copy2D {
  char* dst;
  const char* src;
  std::uint64_t width, height, src_pitch, dst_pitch;
};
cudaError_t launch_copies(const Copy2D* table, int count, std::uint64_t largest, cudaStream_t stream);

}  // namespace meshmem::detail::cuda
