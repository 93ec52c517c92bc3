# The Python tests: pytest on every rank of an mpirun job (python/tests/conftest.py agrees
# failures across ranks; a run where every test skipped exits 77, reported as skipped).
# Labels: python (CPU, host windows), python;gpu (device windows; they skip without a GPU,
# CuPy or PyTorch), python;hosts (two namespace hosts; skipped where none can be made).
include(${PROJECT_SOURCE_DIR}/cmake/MeshmemMpiTest.cmake)  # MESHMEM_MPIEXEC_IS_OPEN_MPI
set(_pytests ${CMAKE_CURRENT_SOURCE_DIR}/tests)
# pytest from python/third_party/pylib (python/tests/carry_for_gpu.sh) where the interpreter has none.
set(_pypath "${CMAKE_CURRENT_BINARY_DIR}")
execute_process(COMMAND ${MESHMEM_PYTHON_EXE} -c "import pytest" RESULT_VARIABLE _no_pytest OUTPUT_QUIET ERROR_QUIET)
if(_no_pytest AND EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/third_party/pylib/pytest)
  string(APPEND _pypath ":${CMAKE_CURRENT_SOURCE_DIR}/third_party/pylib")
elseif(_no_pytest)
  message(STATUS "meshmem: ${MESHMEM_PYTHON_EXE} has no pytest: the Python tests will fail (Debian: python3-pytest)")
endif()
set(_pyenv "PYTHONPATH=${_pypath}" "PYTHONDONTWRITEBYTECODE=1" "OMPI_ALLOW_RUN_AS_ROOT=1"
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1" "OMPI_MCA_rmaps_base_oversubscribe=1")
set(_pytest_args -m pytest -q -rs --color=no -p no:cacheprovider --rootdir=${_pytests})
set(_mpi_flags ${MPIEXEC_PREFLAGS})
if(MESHMEM_MPIEXEC_IS_OPEN_MPI)
  list(APPEND _mpi_flags --oversubscribe --bind-to none)
endif()

# meshmem_add_python_test(NAME <name> FILES <test files> RANKS <n>... [ENV ...] [LABELS ...] [TIMEOUT s] [EST s])
# EST: seconds per rank count on 1 x H200 (ranks sharing the GPU), required with LABELS gpu: the
# fast GPU tier's budget counts it (tests/gpu/check_tier_budget.py).
function(meshmem_add_python_test)
  cmake_parse_arguments(T "" "NAME;TIMEOUT;EST" "FILES;RANKS;ENV;LABELS" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  set(files "")
  foreach(f IN LISTS T_FILES)
    list(APPEND files ${_pytests}/${f})
  endforeach()
  foreach(n IN LISTS T_RANKS)
    add_test(NAME ${T_NAME}.np${n}
      COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${n} ${_mpi_flags}
              ${MESHMEM_PYTHON_EXE} ${_pytest_args} ${files})
    set_tests_properties(${T_NAME}.np${n} PROPERTIES
      TIMEOUT ${T_TIMEOUT} SKIP_RETURN_CODE 77 PROCESSORS ${n} LABELS "python;${T_LABELS}"
      ENVIRONMENT "${_pyenv};${T_ENV}")
  endforeach()
endfunction()

set(_host test_host.py test_errors.py)
meshmem_add_python_test(NAME python.host.one_node FILES ${_host} RANKS 2 4 ENV MESHMEM_TIMEOUT=60)
meshmem_add_python_test(NAME python.host.simulated_nodes FILES ${_host} RANKS 2 4
  ENV MESHMEM_TIMEOUT=60 MESHMEM_SIMULATE_NODES=2)
# Without mpi4py (as in a GPU machine's virtual environment): meshmem.Comm() over MPI_COMM_WORLD.
meshmem_add_python_test(NAME python.host.no_mpi4py FILES ${_host} RANKS 2
  ENV MESHMEM_TIMEOUT=60 MESHMEM_TEST_NO_MPI4PY=1)
meshmem_add_python_test(NAME python.host.mpi_only FILES ${_host} RANKS 2 ENV MESHMEM_TIMEOUT=60 MESHMEM_TRANSPORTS=mpi)

# Two hosts made of namespaces (launch/meshmem-hosts), 2 ranks each.
if(MESHMEM_MPIEXEC_IS_OPEN_MPI)
  add_test(NAME python.host.two_hosts.np4
    COMMAND ${PROJECT_SOURCE_DIR}/launch/meshmem-hosts --hosts 2 --ranks-per-host 2 --gpus-per-host 0
            --timeout 280 --unavailable-exit 77 --
            --oversubscribe --bind-to none -x PYTHONPATH -x PYTHONDONTWRITEBYTECODE -x MESHMEM_TEST_EXPECT_NODES
            ${MESHMEM_PYTHON_EXE} ${_pytest_args} ${_pytests}/test_host.py)
  set_tests_properties(python.host.two_hosts.np4 PROPERTIES
    TIMEOUT 300 SKIP_RETURN_CODE 77 PROCESSORS 4 LABELS "python;hosts"
    ENVIRONMENT "${_pyenv};MESHMEM_TIMEOUT=60;MESHMEM_TEST_EXPECT_NODES=2")
endif()

# Device windows with CuPy and PyTorch, on one node and with every route forced.
set(_gpu test_device.py)
meshmem_add_python_test(NAME python.gpu.one_node FILES ${_gpu} RANKS 2 4 LABELS gpu EST 12 ENV MESHMEM_TIMEOUT=120)
meshmem_add_python_test(NAME python.gpu.ipc FILES ${_gpu} RANKS 2 LABELS gpu EST 8
  ENV MESHMEM_TIMEOUT=120 MESHMEM_TRANSPORTS=ipc,shm,mpi)
meshmem_add_python_test(NAME python.gpu.staged FILES ${_gpu} RANKS 2 LABELS gpu EST 10
  ENV MESHMEM_TIMEOUT=120 MESHMEM_TRANSPORTS=staged,shm,mpi)
# The nccl route is the C++ suite's (gpu.nccl_simulated); from Python it runs in the long tier.
meshmem_add_python_test(NAME python.gpu.nccl_simulated FILES ${_gpu} RANKS 2 LABELS gpu-long
  ENV MESHMEM_TIMEOUT=120 MESHMEM_SIMULATE_NODES=2)

# python -m meshmem.info beside meshmem-info; the Jacobi example against its one-rank run.
add_test(NAME python.info COMMAND ${MESHMEM_PYTHON_EXE} ${_pytest_args} ${_pytests}/test_info.py)
set_tests_properties(python.info PROPERTIES TIMEOUT 300 PROCESSORS 2 LABELS python SKIP_RETURN_CODE 77
  ENVIRONMENT "${_pyenv}")
# (With NumPy and host windows everywhere, with CuPy where there is a GPU.)
meshmem_add_python_test(NAME python.examples.jacobi FILES test_jacobi.py RANKS 2 LABELS gpu EST 20 ENV MESHMEM_TIMEOUT=120)
meshmem_add_python_test(NAME python.examples.jacobi FILES test_jacobi.py RANKS 4 LABELS gpu-long ENV MESHMEM_TIMEOUT=120)
