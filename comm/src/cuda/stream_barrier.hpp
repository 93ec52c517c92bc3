// barrier(stream) variants (MESHMEM_BARRIER), one chosen per Comm:
//   flag    batched stream memory operations on flag words mapped between the node's ranks
//   kernel  a one-block kernel polling the same flags
//   event   a host meeting, then IPC events of the ranks whose stream was busy
//   auto    a host meeting; nothing more when every stream was idle, else kernel (flag
//           where ranks share a GPU)
// Where some pair of ranks is not reached through a mapped transport (other nodes, GPUs
// without peer access), a proxy thread meets the ranks over MPI instead
// (stream_barrier_proxy.hpp).
#pragma once

#include <memory>

#include "../device_runtime.hpp"

namespace meshmem::detail {

class CudaDeviceRuntime;

// Collective over the Comm.
std::unique_ptr<StreamBarrier> make_stream_barrier(const CommContext& ctx, const BarrierContext& bctx,
                                                   CudaDeviceRuntime& device);

}  // namespace meshmem::detail
