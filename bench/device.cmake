# device_bench: device windows (meshmem default / copy engine / copy kernel) against
# cudaMemcpyAsync into a CUDA-IPC-mapped peer buffer, NCCL and meshmem's barrier variants.
if(MESHMEM_HAVE_CUDA)
  add_executable(device_bench device_bench.cu)
  target_link_libraries(device_bench PRIVATE meshmem::meshmem)
  if(MESHMEM_NCCL_LIBRARY_PATH AND MESHMEM_NCCL_INCLUDE)
    target_compile_definitions(device_bench PRIVATE MESHMEM_BENCH_HAVE_NCCL=1)
    target_include_directories(device_bench PRIVATE ${MESHMEM_NCCL_INCLUDE})
    target_link_libraries(device_bench PRIVATE ${MESHMEM_NCCL_LIBRARY_PATH})
  else()
    message(STATUS "device_bench: NCCL not found, its NCCL baselines are left out")
  endif()
  if(EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/nvshmem.cmake)
    include(${CMAKE_CURRENT_SOURCE_DIR}/nvshmem.cmake)
  endif()
endif()
# staged_bench: the staged transport (forced with MESHMEM_TRANSPORTS=staged,shm,mpi) against
# D2H / H2D copies and the driver's host-staged cudaMemcpyPeerAsync (bench/README.md).
if(MESHMEM_HAVE_CUDA)
  add_executable(staged_bench staged_bench.cu staged_bench_pingpong.cu)
  target_link_libraries(staged_bench PRIVATE meshmem::meshmem)
endif()
# cross_host_bench: device windows between two nodes (separate hosts or simulated): meshmem's
# nccl and mpi-device transports against raw ncclSend / ncclRecv, and barrier(stream) against
# an NCCL all-reduce of one word (bench/README.md).
if(MESHMEM_HAVE_CUDA AND MESHMEM_NCCL_LIBRARY_PATH AND MESHMEM_NCCL_INCLUDE)
  add_executable(cross_host_bench cross_host_bench.cu)
  target_link_libraries(cross_host_bench PRIVATE meshmem::meshmem ${MESHMEM_NCCL_LIBRARY_PATH})
  target_include_directories(cross_host_bench PRIVATE ${MESHMEM_NCCL_INCLUDE})
elseif(MESHMEM_HAVE_CUDA)
  message(STATUS "cross_host_bench: NCCL not found, not built")
endif()
