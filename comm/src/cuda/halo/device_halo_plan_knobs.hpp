// The knob the device halo plan reads (device_halo_plan.cpp): MESHMEM_HALO_SENDS. CUDA-free: knobs.cpp includes this file too, so that every build checks their values
// (knobs.hpp).
#pragma once

#include <utility>

#include "knobs.hpp"

namespace meshmem::detail {

enum class HaloSends { Serial, Concurrent };
inline constexpr std::pair<const char*, HaloSends> kHaloSendsKinds[] = {{"serial", HaloSends::Serial},
                                                                        {"concurrent", HaloSends::Concurrent}};

inline const TuningKnob<HaloSends> kHaloSends{
    Tier::Tuning, "device", "MESHMEM_HALO_SENDS", HaloSends::Concurrent, parse_named<kHaloSendsKinds>,
    print_named<kHaloSendsKinds>,
    "device halo exchanges to unmapped neighbours: `concurrent` (a stream of their own each) or `serial` (one after "
    "the other on the caller's stream)",
    "For neighbours whose windows are not mapped (staged, nccl, mpi-device): `concurrent` sends to each on a stream "
    "of the exchange's own, forked from the caller's stream and joined back before the exchange waits for its own "
    "halos (under graph capture too); `serial` sends to them one after the other on the caller's stream, each "
    "transfer ending before the next starts, so their latencies add. Jacobi with staged forced on 4 x H200, 4 GPUs: "
    "4096^2 107 -> 102 us per iteration, 16384^2 418 -> 397 us (serial -> concurrent)",
    /*must_agree=*/false};

}  // namespace meshmem::detail
