// MESHMEM_MODULE_LOADING (module_loading.cpp reads it at load). CUDA-free: knobs.cpp includes
// this file too, so that every build checks its value (knobs.hpp).
#pragma once

#include "knobs.hpp"
#include "startup_env.hpp"

namespace meshmem::detail {

// Read at load, not through Options (which exist only once a Comm is made, too late for
// CUDA); declared here so that it is in the knob table and checked like every other.
inline const TuningKnob<StartupSetting> kModuleLoading{
    Tier::Tuning, "device", "MESHMEM_MODULE_LOADING", StartupSetting::Auto, parse_named<kStartupSettings>,
    print_named<kStartupSettings>,
    "`auto`: meshmem sets CUDA_MODULE_LOADING=EAGER at program start unless it is set; `keep`: leave it alone",
    "`auto`: when the program starts, meshmem sets CUDA_MODULE_LOADING=EAGER unless the variable is set: under "
    "CUDA's lazy loading (its default) an application kernel launched for the first time waits for the GPU to be "
    "idle, and a stream that waits for a staged, nccl or mpi-device transfer is not, since threads of the same "
    "process end those transfers: the launch and the transfer stalled until MESHMEM_TIMEOUT (1 x H100). Eager "
    "loading costs the GPU memory and start-up time of every kernel in the process. `keep`: leave the variable "
    "alone (a Comm with such routes under lazy loading logs a warning). Read from the environment when meshmem is "
    "loaded, with the rules of MESHMEM_GPU_QUEUES",
    false};

}  // namespace meshmem::detail
