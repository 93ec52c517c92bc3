# meshmem_add_mpi_test(NAME <name> TARGET <exe> RANKS <n>... [ENV <VAR=value>...] [LABELS ...])
# Registers one CTest test per rank count, launched with mpirun. Several ranks share the
# cores of a small machine (--oversubscribe), so tests must never spin without yielding.
set(MESHMEM_MPIEXEC_EXTRA_FLAGS "" CACHE STRING "Extra mpirun flags for the multi-rank tests")
function(meshmem_add_mpi_test)
  cmake_parse_arguments(T "" "NAME;TARGET;TIMEOUT" "RANKS;ENV;LABELS;ARGS" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  set(flags ${MPIEXEC_PREFLAGS})
  if(MPI_C_LIBRARY_VERSION_STRING MATCHES "Open MPI")
    # --oversubscribe: more ranks than cores on CI. --bind-to none: ranks must not be pinned
    # to one core each when there are fewer cores than ranks.
    list(APPEND flags --oversubscribe --bind-to none)
  endif()
  separate_arguments(extra UNIX_COMMAND "${MESHMEM_MPIEXEC_EXTRA_FLAGS}")
  list(APPEND flags ${extra})
  foreach(n IN LISTS T_RANKS)
    set(test_name ${T_NAME}.np${n})
    add_test(NAME ${test_name}
      COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${n} ${flags}
              $<TARGET_FILE:${T_TARGET}> ${T_ARGS})
    # Root may run the tests (containers, CI): Open MPI refuses root unless told.
    set_tests_properties(${test_name} PROPERTIES
      TIMEOUT ${T_TIMEOUT}
      SKIP_RETURN_CODE 77
      PROCESSORS ${n}
      LABELS "${T_LABELS}"
      ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1;${T_ENV}")
  endforeach()
endfunction()
