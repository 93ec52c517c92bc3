// Stream memory operations (cuStreamBatchMemOp): writes and waits of 64-bit words that the
// GPU's front end carries out in stream order, without a kernel.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <vector>

#include "meshmem/types.hpp"

namespace meshmem::detail {

// Enqueues stream memory operations in order, 256 per driver call (the driver's limit).
// The error message (call, rank) is built only when a call fails: this is a hot path.
void run_stream_batch(std::vector<CUstreamBatchMemOpParams>& ops, Stream stream, const char* call, int rank);
// One stream write of `value` to `address`. It comes with a memory barrier first (the v2
// batch API has no way to leave it out), so the copies and writes before it land first.
CUstreamBatchMemOpParams stream_write_op(std::uint64_t* address, std::uint64_t value);
// One stream wait until the word at `address` compares with `value` as `flags` say
// (CU_STREAM_WAIT_VALUE_GEQ or _EQ, with CU_STREAM_WAIT_VALUE_FLUSH where wanted).
CUstreamBatchMemOpParams stream_wait_op(const std::uint64_t* address, std::uint64_t value, unsigned flags);

}  // namespace meshmem::detail
