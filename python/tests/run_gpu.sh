#!/usr/bin/env bash
# The Python package on a GPU machine: build meshmem and the package with the machine's Python
# (default /opt/torch/.venv/bin/python), run every Python test (ctest -L python: the device tests
# with CuPy and PyTorch, each route forced, the Jacobi example) and the per-call benchmark.
#   python/tests/run_gpu.sh [BUILD_DIR] [RANKS_FOR_THE_BENCHMARK]
# It first reports what the interpreter has (Python.h, NumPy, mpi4py, CuPy, PyTorch, pybind11's
# headers) and stops (exit 3) where the package cannot be built: no Python.h for that version.
# pybind11's headers: the system's, python/third_party/pybind11/include (an ignored folder:
# copy /usr/include/pybind11 of a Debian machine there), or the ones PyTorch ships. Without
# mpi4py the tests run over meshmem's own MPI_COMM_WORLD (the Jacobi test and one host case skip).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build-python-gpu}
ranks=${2:-2}
py=${MESHMEM_PYTHON:-/opt/torch/.venv/bin/python}
[ -x "$py" ] || py=$(command -v python3)
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
[ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

echo "== interpreter: $py"
"$py" - <<'PY'
import importlib.util as u, os, sys, sysconfig
inc = sysconfig.get_paths().get("include") or ""
print(f"python {sys.version.split()[0]}; Python.h in {inc}: {os.path.exists(os.path.join(inc, 'Python.h'))}")
for m in ("numpy", "mpi4py", "cupy", "torch", "pybind11", "pytest"):
    s = u.find_spec(m)
    print(f"{m}: {'yes ' + (list(s.submodule_search_locations or [''])[0]) if s else 'no'}")
t = u.find_spec("torch")
if t:
    d = os.path.join(list(t.submodule_search_locations)[0], "include", "pybind11", "pybind11.h")
    print(f"torch's pybind11 headers: {os.path.exists(d)}")
try:
    import cupy
    print("cupy", cupy.__version__, "devices", cupy.cuda.runtime.getDeviceCount())
except Exception as e:  # noqa: BLE001
    print("cupy unusable:", e)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.cuda.is_available())
except Exception as e:  # noqa: BLE001
    print("torch unusable:", e)
PY
inc=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
if [ ! -e "$inc/Python.h" ]; then
  echo "run_gpu.sh: no Python.h for $py (looked in $inc): the package cannot be built here;" \
       "install that Python's development headers (python3.12-dev) or point MESHMEM_PYTHON at one that has them" >&2
  exit 3
fi
"$py" -c 'import numpy' || { echo "run_gpu.sh: $py lacks numpy" >&2; exit 3; }
pylib=$root/python/third_party/pylib  # python/tests/carry_for_gpu.sh
if ! "$py" -c 'import pytest' 2>/dev/null; then
  PYTHONPATH=$pylib "$py" -c 'import pytest' 2>/dev/null \
    || { echo "run_gpu.sh: $py has no pytest and none is carried (run python/tests/carry_for_gpu.sh on a Debian machine)" >&2; exit 3; }
  echo "pytest: carried ($pylib)"
fi

gen=()
[ -x /opt/torch/.venv/bin/ninja ] && gen=(-G Ninja -DCMAKE_MAKE_PROGRAM=/opt/torch/.venv/bin/ninja)
cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DMESHMEM_BUILD_PYTHON=ON -DMESHMEM_PYTHON="$py" || exit 1
cmake --build "$build" -j "$(nproc)" --target meshmem_python meshmem-info python_host_cost_cpp 03_jacobi || exit 1

status=0
ctest --test-dir "$build" -L python --output-on-failure --timeout 600 || status=1
# Why each skipped test skipped (pytest's -rs lines).
grep -h "^SKIPPED" "$build/Testing/Temporary/LastTest.log" | sort | uniq -c || true

echo "== Jacobi 4096^2, $ranks ranks: meshmem vs MPI halo (Python), the C++ example beside where built"
export PYTHONPATH=$build/python
if "$py" -c 'import cupy, mpi4py' 2>/dev/null; then
  machine="$(hostname -s)-gpu" commit=${MESHMEM_COMMIT:-$(git -C "$root" rev-parse --short HEAD)}
  csv=$root/bench/results/$(date -u +%Y-%m-%d)-$machine-python-jacobi.csv
  for halo in meshmem mpi; do
    mpirun -np "$ranks" --oversubscribe --bind-to none "$py" "$root/examples/python/jacobi.py" \
      --n 4096 --iters 200 --halo "$halo" --csv "$csv" --machine "$machine" --commit "$commit" || status=1
    mpirun -np "$ranks" --oversubscribe --bind-to none "$build/examples/03_jacobi" \
      --size 4096 --iters 200 --halo="$halo" --csv "$csv" --machine "$machine" --commit "$commit" || status=1
  done
  echo "rows in $csv"
else
  echo "skipped: the Jacobi example needs cupy and mpi4py"
fi
echo "== per-call host cost, Python vs C++"
"$root/bench/python_host_cost.sh" "$build" "$(hostname -s)-gpu" "$ranks" "$py" || status=1
exit $status
