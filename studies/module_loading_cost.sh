#!/usr/bin/env bash
# What eager module loading (MESHMEM_MODULE_LOADING=auto sets CUDA_MODULE_LOADING=EAGER) costs
# a program: the most GPU memory per process that nvidia-smi shows, and the wall time, of one
# short two-rank test run, with CUDA_MODULE_LOADING LAZY, EAGER and unset (meshmem's choice);
# on the ipc route, and on simulated nodes, where NCCL is loaded too.
#
#   studies/module_loading_cost.sh BUILD [RUNS]     (BUILD: a build folder, or a GPU test pack)
set -euo pipefail
build=${1:?build folder}; runs=${2:-2}
test_bin="$build/tests/gpu/test_device_real_use"
[ -x "$test_bin" ] || { echo "no $test_bin" >&2; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
run=(mpiexec -n 2 --oversubscribe --bind-to none "$test_bin" --gtest_filter=RealUse.SignalsReadOnDeviceSignals)

measure() {  # $1 label; the rest: environment assignments
  local label=$1; shift
  local log; log=$(mktemp)
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms 50 > "$log" 2>/dev/null &
  local smi=$!
  local t0; t0=$(date +%s.%N)
  local rc=0; env "$@" "${run[@]}" > /dev/null 2>&1 || rc=$?
  local t1; t1=$(date +%s.%N)
  sleep 0.3; kill "$smi" 2>/dev/null || true; wait "$smi" 2>/dev/null || true
  local most; most=$(awk -F', ' '{ if ($2 > m[$1]) m[$1] = $2 } END { for (p in m) print m[p] }' "$log" | sort -n | tail -1)
  rm -f "$log"
  printf '%-22s %10s %10.2f %4s\n' "$label" "${most:-?}" "$(awk "BEGIN{print $t1 - $t0}")" "$rc"
}

echo "# meshmem module loading cost: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), 2 ranks"
printf '%-22s %10s %10s %4s\n' "# variant" "MiB/proc" "seconds" "rc"
for i in $(seq 1 "$runs"); do
  measure ipc-lazy CUDA_MODULE_LOADING=LAZY
  measure ipc-eager CUDA_MODULE_LOADING=EAGER
  measure ipc-meshmem-default -u CUDA_MODULE_LOADING -u MESHMEM_MODULE_LOADING
  measure nccl-lazy MESHMEM_SIMULATE_NODES=2 CUDA_MODULE_LOADING=LAZY
  measure nccl-eager MESHMEM_SIMULATE_NODES=2 CUDA_MODULE_LOADING=EAGER
  measure nccl-meshmem-default -u CUDA_MODULE_LOADING -u MESHMEM_MODULE_LOADING MESHMEM_SIMULATE_NODES=2
done
