# The variables meshmem sets for CUDA at load (MESHMEM_MODULE_LOADING, MESHMEM_GPU_QUEUES) are
# cleared for a test unless its ENV names them, so that the suites run with meshmem's own choice
# whatever the shell running ctest exports (some CUDA containers export CUDA_MODULE_LOADING).
function(meshmem_startup_env_cleared out env)
  set(cleared "")
  foreach(var CUDA_MODULE_LOADING MESHMEM_MODULE_LOADING CUDA_DEVICE_MAX_CONNECTIONS MESHMEM_GPU_QUEUES)
    if(NOT "${env}" MATCHES "(^|;)${var}=")
      list(APPEND cleared "${var}=unset:")
    endif()
  endforeach()
  set(${out} "${cleared}" PARENT_SCOPE)
endfunction()

# meshmem_add_mpi_test(NAME <name> TARGET <exe> RANKS <n>... [ENV <VAR=value>...] [LABELS ...]
#                      [WRAPPER <command>...])
# Registers one CTest test per rank count, launched with mpirun (after WRAPPER's words where
# given: a command that runs the mpirun command line it is handed). Several ranks share the
# cores of a small machine (--oversubscribe), so tests must never spin without yielding.
set(MESHMEM_MPIEXEC_EXTRA_FLAGS "" CACHE STRING "Extra mpirun flags for the multi-rank tests")
# Which launcher: FindMPI leaves MPI_C_LIBRARY_VERSION_STRING empty unless asked to try_run,
# so ask the launcher itself. Open MPI's flags (--oversubscribe, --enable-recovery) only there.
set(MESHMEM_MPIEXEC_IS_OPEN_MPI FALSE)
if(MPIEXEC_EXECUTABLE)
  execute_process(COMMAND ${MPIEXEC_EXECUTABLE} --version OUTPUT_VARIABLE _meshmem_mpiexec_version
                  ERROR_QUIET RESULT_VARIABLE _meshmem_mpiexec_rc)
  if(_meshmem_mpiexec_rc EQUAL 0 AND _meshmem_mpiexec_version MATCHES "Open MPI|OpenRTE")
    set(MESHMEM_MPIEXEC_IS_OPEN_MPI TRUE)
  endif()
endif()
function(meshmem_add_mpi_test)
  # MPIEXEC_FLAGS: extra flags for this test's launcher (after the common ones).
  cmake_parse_arguments(T "" "NAME;TARGET;TIMEOUT" "RANKS;ENV;LABELS;ARGS;MPIEXEC_FLAGS;WRAPPER" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  set(flags ${MPIEXEC_PREFLAGS})
  if(MESHMEM_MPIEXEC_IS_OPEN_MPI)
    # --oversubscribe: more ranks than cores on CI. --bind-to none: ranks must not be pinned
    # to one core each when there are fewer cores than ranks.
    list(APPEND flags --oversubscribe --bind-to none)
  endif()
  separate_arguments(extra UNIX_COMMAND "${MESHMEM_MPIEXEC_EXTRA_FLAGS}")
  list(APPEND flags ${extra} ${T_MPIEXEC_FLAGS})
  meshmem_startup_env_cleared(cleared "${T_ENV}")
  foreach(n IN LISTS T_RANKS)
    set(test_name ${T_NAME}.np${n})
    add_test(NAME ${test_name}
      COMMAND ${T_WRAPPER} ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${n} ${flags}
              $<TARGET_FILE:${T_TARGET}> ${T_ARGS})
    # Root may run the tests (containers, CI): Open MPI refuses root unless told.
    set_tests_properties(${test_name} PROPERTIES
      TIMEOUT ${T_TIMEOUT}
      SKIP_RETURN_CODE 77
      PROCESSORS ${n}
      LABELS "${T_LABELS}"
      ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1;${T_ENV}"
      ENVIRONMENT_MODIFICATION "${cleared}")
  endforeach()
endfunction()

# meshmem_add_hosts_test(NAME <name> TARGET <exe> HOSTS <h> RANKS_PER_HOST <r> [GPUS_PER_HOST <g>]
#                        [ENV ...] [LABELS ...] [WRAPPER <launcher> ...])
# One CTest test <name>.np<h*r> run across <h> hosts made on this machine with network and UTS
# namespaces (launch/meshmem-hosts), <r> ranks on each: MPI and meshmem see separate nodes.
# Skipped (exit 77, with the reason) where namespaces cannot be made (not root); needs Open MPI.
function(meshmem_add_hosts_test)
  cmake_parse_arguments(T "" "NAME;TARGET;TIMEOUT;HOSTS;RANKS_PER_HOST;GPUS_PER_HOST" "ENV;LABELS;ARGS;WRAPPER" ${ARGN})
  if(NOT T_GPUS_PER_HOST)
    set(T_GPUS_PER_HOST 0)
  endif()
  if(NOT MESHMEM_MPIEXEC_IS_OPEN_MPI)
    return()
  endif()
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  math(EXPR n "${T_HOSTS} * ${T_RANKS_PER_HOST}")
  math(EXPR harness_timeout "${T_TIMEOUT} - 20")  # so that the harness, not CTest, kills a hung job and cleans up
  set(test_name ${T_NAME}.np${n})
  meshmem_startup_env_cleared(cleared "${T_ENV}")
  add_test(NAME ${test_name}
    COMMAND ${T_WRAPPER} ${PROJECT_SOURCE_DIR}/launch/meshmem-hosts --hosts ${T_HOSTS} --ranks-per-host ${T_RANKS_PER_HOST}
            --gpus-per-host ${T_GPUS_PER_HOST}
            --timeout ${harness_timeout} --unavailable-exit 77 --
            --oversubscribe --bind-to none $<TARGET_FILE:${T_TARGET}> ${T_ARGS})
  set_tests_properties(${test_name} PROPERTIES
    TIMEOUT ${T_TIMEOUT}
    SKIP_RETURN_CODE 77
    PROCESSORS ${n}
    LABELS "${T_LABELS}"
    ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;${T_ENV}"
    ENVIRONMENT_MODIFICATION "${cleared}")
endfunction()
