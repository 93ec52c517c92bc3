// barrier(stream) variants, one chosen per Comm.
// On one node (MESHMEM_BARRIER):
//   kernel   a one-block kernel polling flag words mapped between the node's ranks
//            (where some node pairs are staged, the flags live in the staging pool)
//   flag     batched stream memory operations on the same flags
//   meeting  a host meeting; nothing more when every stream was idle, else the kernel
//   event    a host meeting, then IPC events of the ranks whose stream was busy
//   auto     kernel, or where ranks share a GPU a host meeting, then flag (kernel in graphs)
// Across nodes (MESHMEM_BARRIER_ACROSS_NODES):
//   nccl     hierarchical: the node kernel, the node leaders' ncclAllReduce of one word on the
//            stream (leader_all_reduce.hpp: its communicator and watchdog), the node kernel
//   proxy    a proxy thread meets the ranks over MPI (stream_barrier_proxy.hpp), also where
//            some node pair is reached by no mapped or staged transport
//   auto     nccl where every pair across nodes is nccl and no GPU is shared, else proxy
#pragma once

#include <memory>

#include "device_interface.hpp"

namespace meshmem::detail {

class GpuDevice;

// Collective over the Comm.
std::unique_ptr<StreamBarrier> make_stream_barrier(const CommContext& ctx, const BarrierContext& bctx,
                                                   GpuDevice& device);

}  // namespace meshmem::detail
