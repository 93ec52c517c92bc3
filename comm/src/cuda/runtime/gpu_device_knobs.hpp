// The knobs GpuDevice reads (gpu_device.cpp): MESHMEM_STREAM_WAIT, MESHMEM_EARLY_LAUNCH. CUDA-free: knobs.cpp includes this file too, so that every build checks their values
// (knobs.hpp).
#pragma once

#include <utility>

#include "knobs.hpp"

namespace meshmem::detail {

enum class StreamWait { Auto, Memop, Kernel };
inline constexpr std::pair<const char*, StreamWait> kStreamWaits[] = {
    {"auto", StreamWait::Auto}, {"memop", StreamWait::Memop}, {"kernel", StreamWait::Kernel}};

inline const TuningKnob<StreamWait> kStreamWait{
    Tier::Tuning, "device", "MESHMEM_STREAM_WAIT", StreamWait::Auto, parse_named<kStreamWaits>,
    print_named<kStreamWaits>,
    "how a stream waits (device `wait_until`, transfers' ends, halos): `kernel` (polling, times out), `memop` "
    "(cuStreamWaitValue64), `auto`",
    "Device `wait_until`, the stream's wait for the end of a staged, nccl or mpi-device transfer, and an uncaptured "
    "halo exchange's wait for its neighbours: `kernel` (a polling kernel that gives up after MESHMEM_TIMEOUT and "
    "reports it; about 2x lower put_signal latency than memop), `memop` (cuStreamWaitValue64: holds no SM, so it is "
    "faster where ranks share a GPU, but a `wait_until` cannot time out; a transfer is still ended at the timeout, "
    "by the staging agent (also one held in a GPU queue), by the proxy thread's watchdog or by the halo exchange's "
    "watch thread; staged transfers through a hidden peer's channel keep the kernel, as only that peer ends them, "
    "except puts whose reader copies a chunk under 28 KiB (or rows), which a kernel would hold for its time slice "
    "where the GPU is shared: this rank's staging agent ends those MESHMEM_TIMEOUT after they were posted in full, "
    "and drops their late chunks); `auto` = `kernel`, or `memop` where another rank of the Comm uses this rank's GPU "
    "(same UUID, on this node or another: containers, simulated nodes; a MIG instance is a GPU of its own; a polling "
    "kernel would hold the time-sliced GPU from the ranks it waits for). Either wait stalls its GPU queue (a kernel "
    "once work is queued behind it): see MESHMEM_GPU_QUEUES"};

enum class EarlyLaunch { Auto, Off };
inline constexpr std::pair<const char*, EarlyLaunch> kEarlyLaunches[] = {{"auto", EarlyLaunch::Auto},
                                                                         {"off", EarlyLaunch::Off}};

inline const TuningKnob<EarlyLaunch> kEarlyLaunch{
    Tier::Tuning, "device", "MESHMEM_EARLY_LAUNCH", EarlyLaunch::Auto, parse_named<kEarlyLaunches>,
    print_named<kEarlyLaunches>,
    "`auto`: meshmem's kernels are programmatic dependent launches where the GPU has them (compute capability 9.0+); "
    "`off`: ordinary launches",
    "Meshmem's barrier, wait, halo and put kernels as programmatic dependent launches: `auto` where the GPU has them "
    "(compute capability 9.0+ and kernels built for it): such a kernel is set up while the kernel before it on the "
    "stream runs and waits on the GPU for it to finish; the copy kernels also let the next programmatic launch start "
    "early (so a kernel launched with programmatic stream serialization after a meshmem put must call "
    "cudaGridDependencySynchronize before touching any buffer of that put, as that attribute requires); `off`: "
    "ordinary launches"};

}  // namespace meshmem::detail
