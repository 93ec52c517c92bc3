// The GPU part (comm/src/cuda/, library meshmem) seen from the CUDA-free core (library
// meshmem_core). The core refers to it only through these weak references: in a program
// linked with meshmem::meshmem they are the GPU part's functions (its link option
// --undefined=meshmem_gpu_part takes them out of the archive); with meshmem::core alone
// they are null, and device windows are "unavailable: built without the GPU part".
#pragma once

#include <memory>
#include <string>

#include "transport.hpp"

namespace meshmem::detail {

class DeviceRuntime;

// Weak for the core; the GPU part's own files define MESHMEM_DEFINING_GPU_PART first, so
// that their references pull the definitions out of the archive and their definitions are
// ordinary ones.
#ifdef MESHMEM_DEFINING_GPU_PART
#define MESHMEM_GPU_PART
#else
#define MESHMEM_GPU_PART __attribute__((weak))
#endif

// Whether this process can use a CUDA device (no collective).
MESHMEM_GPU_PART bool gpu_available(std::string* why);
// Makes `ordinal` modulo the visible devices current; returns it, or -1 without devices.
MESHMEM_GPU_PART int gpu_set_device_modulo(int ordinal);
// Collective: the device part of a Comm on the current device (all ranks or none; *why
// names the first rank that cannot, and why).
MESHMEM_GPU_PART std::unique_ptr<DeviceRuntime> gpu_start_device_runtime(const CommContext& ctx, std::string* why);

// The GPU part's transports (entries of the transport table).
MESHMEM_GPU_PART std::unique_ptr<Transport> make_ipc_transport(const CommContext& ctx);
MESHMEM_GPU_PART std::unique_ptr<Transport> make_staged_transport(const CommContext& ctx);
MESHMEM_GPU_PART std::unique_ptr<Transport> make_nccl_transport(const CommContext& ctx);
MESHMEM_GPU_PART std::unique_ptr<Transport> make_mpi_device_transport(const CommContext& ctx);

#undef MESHMEM_GPU_PART

inline constexpr const char* kNoGpuPart = "meshmem was built without its GPU part (no CUDA toolkit at build time, or the "
                                "program links meshmem::core)";

}  // namespace meshmem::detail
