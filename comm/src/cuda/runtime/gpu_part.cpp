// The anchor of the GPU part. The meshmem target's link option --undefined=meshmem_gpu_part
// makes the linker take this object out of the archive; its references take the rest of
// the GPU part, whose functions then satisfy the core's weak references (../gpu_part.hpp).
#define MESHMEM_DEFINING_GPU_PART
#include "gpu_part.hpp"

#include "device_interface.hpp"

extern "C" {
extern const void* const meshmem_gpu_part[];
const void* const meshmem_gpu_part[] = {
    reinterpret_cast<const void*>(&meshmem::detail::gpu_available),
    reinterpret_cast<const void*>(&meshmem::detail::gpu_set_device_modulo),
    reinterpret_cast<const void*>(&meshmem::detail::gpu_start_device_runtime),
    reinterpret_cast<const void*>(&meshmem::detail::make_ipc_transport),
    reinterpret_cast<const void*>(&meshmem::detail::make_staged_transport),
    reinterpret_cast<const void*>(&meshmem::detail::make_nccl_transport),
    reinterpret_cast<const void*>(&meshmem::detail::make_mpi_device_transport),
};
}
