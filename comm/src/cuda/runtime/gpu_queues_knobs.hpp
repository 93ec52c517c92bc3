// MESHMEM_GPU_QUEUES (gpu_queues.cpp reads it at load). CUDA-free: knobs.cpp includes this file
// too, so that every build checks its value (knobs.hpp).
#pragma once

#include "knobs.hpp"
#include "startup_env.hpp"

namespace meshmem::detail {

// Read at load, not through Options (which exist only once a Comm is made, too late for
// CUDA); declared here so that it is in the knob table and checked like every other.
inline const TuningKnob<StartupSetting> kGpuQueues{
    Tier::Tuning, "device", "MESHMEM_GPU_QUEUES", StartupSetting::Auto, parse_named<kStartupSettings>,
    print_named<kStartupSettings>,
    "`auto`: meshmem sets CUDA_DEVICE_MAX_CONNECTIONS=32 at program start unless it is set; `keep`: leave it alone",
    "`auto`: when the program starts, meshmem sets CUDA_DEVICE_MAX_CONNECTIONS=32 (CUDA's most hardware queues per "
    "device; 8 by default) unless the variable is set: a stream that waits stalls the queue it shares with other "
    "streams of its process, and the staged, nccl and mpi-device transfers that such a wait waits for run on "
    "meshmem's own streams of the same process (with 8 queues, on 1 x H100, a soak's transfers did not start within "
    "MESHMEM_TIMEOUT). `keep`: leave the variable alone. Read from the environment when meshmem is loaded "
    "(Options cannot change it); nothing is set where other threads already run then (a library loaded by dlopen), "
    "and where CUDA started before meshmem was loaded the request comes too late: export "
    "CUDA_DEVICE_MAX_CONNECTIONS=32 yourself there. A Comm that routes a peer through those transports with fewer "
    "than 32 queues logs a warning (once per process)",
    false};

}  // namespace meshmem::detail
