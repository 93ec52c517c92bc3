#!/usr/bin/env bash
# The Python-vs-C++ per-call host cost of put_signal / wait_until (bench/python_host_cost.py),
# host windows, and device windows where a GPU is present; rows into a results CSV.
#   bench/python_host_cost.sh BUILD_DIR MACHINE [RANKS] [PYTHON]
set -euo pipefail
build=$1 machine=$2 ranks=${3:-2} python=${4:-python3}
root=$(cd "$(dirname "$0")/.." && pwd)
commit=${MESHMEM_COMMIT:-$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)}
out=$root/bench/results/$(date -u +%Y-%m-%d)-$machine-python-host-cost.csv
export PYTHONPATH=$build/python${PYTHONPATH:+:$PYTHONPATH}
[ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi=(mpirun -np "$ranks" --oversubscribe --bind-to none)
memories=(host)
"$python" -c 'import meshmem, sys; sys.exit(0 if meshmem.gpu_available()[0] else 1)' && memories+=(device)
for memory in "${memories[@]}"; do
  calls=20000
  [ "$memory" = device ] && calls=2000  # stream forms: the enqueue, before the GPU's queue fills
  tmp=$(mktemp)
  "${mpi[@]}" "$build/python/python_host_cost_cpp" --memory "$memory" --calls "$calls" | tee "$tmp"
  "${mpi[@]}" "$python" "$root/bench/python_host_cost.py" --memory "$memory" --calls "$calls" \
    --cpp-results "$tmp" --csv "$out" --machine "$machine" --commit "$commit"
  rm -f "$tmp"
done
echo "rows in $out"
