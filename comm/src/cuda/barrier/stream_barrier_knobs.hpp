// The stream barrier's knobs (stream_barrier.cpp reads them). CUDA-free: knobs.cpp includes
// this file too, so that every build checks their values (knobs.hpp).
#pragma once

#include <utility>

#include "knobs.hpp"

namespace meshmem::detail {

enum class BarrierKind { Auto, Kernel, Meeting, Flag, Event };
inline constexpr std::pair<const char*, BarrierKind> kBarrierKinds[] = {{"auto", BarrierKind::Auto},
                                                                        {"kernel", BarrierKind::Kernel},
                                                                        {"meeting", BarrierKind::Meeting},
                                                                        {"flag", BarrierKind::Flag},
                                                                        {"event", BarrierKind::Event}};

inline const TuningKnob<BarrierKind> kBarrier{
    Tier::Tuning, "device", "MESHMEM_BARRIER", BarrierKind::Auto, parse_named<kBarrierKinds>,
    print_named<kBarrierKinds>,
    "`barrier(stream)` on one node: `kernel`, `meeting`, `flag`, `event`, or `auto` (kernel, or a host meeting then "
    "flag where ranks share a GPU)",
    "`kernel` (a one-block kernel on flag words mapped between the ranks; its barrier count lives on the GPU, so it "
    "is capturable; its waits time out) never blocks the host. `meeting` meets the node's ranks on the host first "
    "and enqueues nothing when every stream was idle, else the kernel (capturable: the meeting happens at capture). "
    "`flag` (batched stream memory operations, no SM held; no timeout) and `event` (a host meeting, then IPC events "
    "of the busy streams) are not capturable. `auto` = `kernel`, except where ranks share a GPU (a polling kernel "
    "would hold the time-sliced GPU from the ranks it waits for): there a host meeting, then `flag`, or the kernel "
    "when a rank captures a graph. Where some node pairs are staged (GPUs without peer access), the kernel's flags "
    "live in the staging pool and this setting is ignored except `kernel` (no host meeting first on a shared GPU). "
    "Where ranks span nodes, MESHMEM_BARRIER_ACROSS_NODES chooses"};

enum class AcrossNodes { Auto, Nccl, Proxy };
inline constexpr std::pair<const char*, AcrossNodes> kAcrossNodesKinds[] = {
    {"auto", AcrossNodes::Auto}, {"nccl", AcrossNodes::Nccl}, {"proxy", AcrossNodes::Proxy}};

inline const TuningKnob<AcrossNodes> kAcrossNodes{
    Tier::Tuning, "device", "MESHMEM_BARRIER_ACROSS_NODES", AcrossNodes::Auto, parse_named<kAcrossNodesKinds>,
    print_named<kAcrossNodesKinds>,
    "`barrier(stream)` where ranks span nodes: `nccl` (hierarchical, an all-reduce of the node leaders), `proxy` "
    "(a proxy thread meets the ranks over MPI), or `auto`",
    "`nccl` is hierarchical, all on the stream: the node's ranks meet in the barrier kernel, the node leaders "
    "(lowest rank of each node) run an ncclAllReduce of one word, and the node's ranks meet again; a watchdog "
    "aborts the leaders' communicator when the all-reduce did not end within twice MESHMEM_TIMEOUT, and the next "
    "call names the other leaders (cross-node barriers fail from then on). It needs every pair of ranks on "
    "different nodes routed through the nccl transport, and each node's peers all mapped or all staged; a barrier "
    "captured into a graph on one leader must be captured on every leader (NCCL's rule). `proxy` hands the barrier "
    "to a proxy thread that meets every rank over MPI once the stream reaches it (cudaLaunchHostFunc) and releases "
    "the stream through a pinned host word; captured into a graph, a one-thread kernel rings a doorbell that hands "
    "each replay's barrier to that proxy (which polls them while such graphs exist) and waits for its release. "
    "Neither blocks the host; both are capturable. `auto` = `nccl` where it can be used and no rank's GPU is shared "
    "with another rank (there NCCL's spinning kernel holds the time-sliced GPU from the ranks it waits for: 4.7 ms "
    "per barrier against 48 us on 1 x H100), else `proxy`"};

}  // namespace meshmem::detail
