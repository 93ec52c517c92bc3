# nvshmem_bench: the NVSHMEM peer of meshmem's GPU benchmarks (bench/nvshmem_bench.cu), built
# only where CUDA and an NVSHMEM 3.x install (the nvidia-nvshmem Python wheel's layout:
# include/nvshmem.h, lib/libnvshmem_host.so.3, lib/libnvshmem_device.a, bootstrap plugins in lib/)
# are found. Included from bench/CMakeLists.txt.
#
#   -DMESHMEM_NVSHMEM_HOME=/path/to/nvshmem   (default: the torch venv's wheel where it exists)

set(_meshmem_nvshmem_default "")
if(EXISTS "/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nvshmem/include/nvshmem.h")
  set(_meshmem_nvshmem_default "/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nvshmem")
endif()
set(MESHMEM_NVSHMEM_HOME "${_meshmem_nvshmem_default}" CACHE PATH
    "NVSHMEM 3.x install (include/nvshmem.h, lib/libnvshmem_host.so.3, lib/libnvshmem_device.a) for nvshmem_bench")
unset(_meshmem_nvshmem_default)

set(_nvshmem_inc "${MESHMEM_NVSHMEM_HOME}/include")
set(_nvshmem_lib "${MESHMEM_NVSHMEM_HOME}/lib")
if(NOT MESHMEM_HAVE_CUDA)
  message(STATUS "nvshmem_bench: no CUDA, skipped")
elseif(MESHMEM_NVSHMEM_HOME STREQUAL ""
       OR NOT EXISTS "${_nvshmem_inc}/nvshmem.h"
       OR NOT EXISTS "${_nvshmem_lib}/libnvshmem_host.so.3"
       OR NOT EXISTS "${_nvshmem_lib}/libnvshmem_device.a")
  message(STATUS "nvshmem_bench: NVSHMEM not found, skipped")
else()
  message(STATUS "nvshmem_bench: NVSHMEM in ${MESHMEM_NVSHMEM_HOME}")
  # The wheel ships no unversioned libnvshmem_host.so: link through a symlink of our own.
  set(_nvshmem_link_dir "${CMAKE_CURRENT_BINARY_DIR}/nvshmem_lib")
  file(MAKE_DIRECTORY "${_nvshmem_link_dir}")
  file(CREATE_LINK "${_nvshmem_lib}/libnvshmem_host.so.3" "${_nvshmem_link_dir}/libnvshmem_host.so" SYMBOLIC)

  add_executable(nvshmem_bench "${CMAKE_CURRENT_LIST_DIR}/nvshmem_bench.cu")
  target_include_directories(nvshmem_bench PRIVATE "${_nvshmem_inc}")
  target_compile_definitions(nvshmem_bench PRIVATE
    OMPI_SKIP_MPICXX=1 MPICH_SKIP_MPICXX=1
    MESHMEM_NVSHMEM_LIBDIR="${_nvshmem_lib}")
  # libnvshmem_device.a holds relocatable device code: -rdc and a device link of the executable.
  # One CUDA runtime in the process (the shared one), not the static one CMake adds by default
  # next to the shared one that CUDA::cudart brings.
  set_target_properties(nvshmem_bench PROPERTIES
    CUDA_SEPARABLE_COMPILATION ON
    CUDA_RESOLVE_DEVICE_SYMBOLS ON
    CUDA_RUNTIME_LIBRARY Shared
    BUILD_RPATH "${_nvshmem_lib}"
    INSTALL_RPATH "${_nvshmem_lib}")
  target_link_libraries(nvshmem_bench PRIVATE
    "${_nvshmem_link_dir}/libnvshmem_host.so"
    "${_nvshmem_lib}/libnvshmem_device.a"
    CUDA::cudart
    MPI::MPI_C)
endif()
unset(_nvshmem_inc)
unset(_nvshmem_lib)
unset(_nvshmem_link_dir)
