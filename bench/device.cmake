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
# barrier_lab: candidate stream-ordered barriers side by side (the study behind the
# barrier defaults; bench/README.md).
if(MESHMEM_HAVE_CUDA)
  add_executable(barrier_lab barrier_lab.cu)
  target_link_libraries(barrier_lab PRIVATE meshmem::meshmem)
endif()
# copy_lab: copy engine against copy-kernel shapes, rank 0 -> rank 1 (the study behind the
# SM copy kernel; bench/README.md).
if(MESHMEM_HAVE_CUDA)
  add_executable(copy_lab copy_lab.cu)
  target_link_libraries(copy_lab PRIVATE meshmem::meshmem)
endif()
# alloc_lab: where the time of mapping peers' 1 GiB allocations goes, call by call.
if(MESHMEM_HAVE_CUDA)
  add_executable(alloc_lab alloc_lab.cu)
  target_link_libraries(alloc_lab PRIVATE meshmem::meshmem)
endif()
# staging_memory_lab: GPU memory taken by pinned staging memory: meshmem's shared host-NUMA
# pool against cudaHostRegister in every process.
if(MESHMEM_HAVE_CUDA)
  add_executable(staging_memory_lab staging_memory_lab.cu)
  target_link_libraries(staging_memory_lab PRIVATE meshmem::meshmem)
endif()
# queue_lab: does a waiting stream hold back another stream's work (the study behind
# comm/src/cuda/gpu_queues.hpp)? CUDA only, no meshmem.
if(MESHMEM_HAVE_CUDA)
  add_executable(queue_lab queue_lab.cu)
  target_link_libraries(queue_lab PRIVATE CUDA::cuda_driver CUDA::cudart ${CMAKE_DL_LIBS})
endif()
# staged_bench: the staged transport (forced with MESHMEM_TRANSPORTS=staged,shm,mpi) against
# D2H / H2D copies and the driver's host-staged cudaMemcpyPeerAsync (bench/README.md).
if(MESHMEM_HAVE_CUDA)
  add_executable(staged_bench staged_bench.cu)
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
# pipeline_lab: the floor of a host-staged pipeline GPU 0 -> pinned host -> GPU 1 by chunk
# size, with and without the channel's stream writes (the study behind MESHMEM_STAGING_CHUNK).
if(MESHMEM_HAVE_CUDA)
  add_executable(pipeline_lab pipeline_lab.cu)
  target_link_libraries(pipeline_lab PRIVATE meshmem::meshmem CUDA::cuda_driver)
endif()
# driver_call_lab: the host cost of each CUDA call the staging agent makes per small transfer,
# and whether threads making them at once on streams of their own get through them faster.
if(MESHMEM_HAVE_CUDA)
  add_executable(driver_call_lab driver_call_lab.cu)
  target_link_libraries(driver_call_lab PRIVATE meshmem::meshmem CUDA::cuda_driver)
endif()
# fill_lab: GPU time of a stream-filled put's copy into a pinned slot (blocks, threads, source
# alignment) against the copy engine's.
if(MESHMEM_HAVE_CUDA)
  add_executable(fill_lab fill_lab.cu)
  target_link_libraries(fill_lab PRIVATE meshmem::meshmem CUDA::cuda_driver)
endif()
# timeslice_lab: two processes sharing one GPU, one's stream waiting for a word the other's
# stream writes after a copy (the study behind small staged puts between ranks sharing a GPU).
if(MESHMEM_HAVE_CUDA)
  add_executable(timeslice_lab timeslice_lab.cu)
  target_link_libraries(timeslice_lab PRIVATE CUDA::cuda_driver CUDA::cudart MPI::MPI_C)
  target_compile_definitions(timeslice_lab PRIVATE OMPI_SKIP_MPICXX=1 MPICH_SKIP_MPICXX=1)
endif()
