#!/usr/bin/env bash
# The Jacobi benchmark of issue 4: 1, 2 and 4 GPUs, 4096^2 (2000 iterations) and 16384^2
# (1000 iterations), every halo variant, row bands and (4 GPUs) 2D blocks. Every run is
# checked against a single-GPU run of the same problem (--check). Writes OUT_DIR/jacobi.csv,
# OUT_DIR/jacobi.txt and, where matplotlib is present, OUT_DIR/jacobi.png.
#   bench/run_jacobi.sh BUILD_DIR OUT_DIR MACHINE   (COMMIT=... where the tree has no .git)
set -uo pipefail
build=${1:?build dir}; out=${2:?out dir}; machine=${3:?machine}
root=$(cd "$(dirname "$0")/.." && pwd)
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
commit=${COMMIT:-$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)}
date=$(date -u +%F)
ngpu=$(nvidia-smi -L | wc -l)
csv="$out/jacobi.csv"
bad=0
run() {  # ranks size iters halo decomp
  local np=$1 size=$2 iters=$3 halo=$4 decomp=$5
  local log="$out/run.log" rc
  timeout 300 mpirun -np "$np" --bind-to none "$build/examples/03_jacobi" --size "$size" --iters "$iters" \
    --halo="$halo" --decomp="$decomp" --check --csv "$csv" --commit "$commit" --machine "$machine" --date "$date" \
    > "$log" 2>&1
  rc=$?
  cat "$log" >> "$out/jacobi.txt"
  grep -E "^jacobi|rank [0-9]+:" "$log"
  [ "$rc" = 0 ] || { echo "FAILED (exit $rc): np $np size $size halo $halo $decomp"; tail -5 "$log"; bad=1; }
  rm -f "$log"
}
for spec in "4096 2000" "16384 1000"; do
  set -- $spec
  run 1 "$1" "$2" meshmem rows
  for np in 2 4; do
    [ "$np" -le "$ngpu" ] || continue
    for halo in mpi nccl meshmem meshmem-device; do
      run "$np" "$1" "$2" "$halo" rows
      [ "$np" = 4 ] && run "$np" "$1" "$2" "$halo" blocks
    done
  done
done
py=$(command -v /opt/torch/.venv/bin/python3 || command -v python3)
"$py" "$root/bench/plot_jacobi.py" "$csv" "$out/jacobi.png" >> "$out/jacobi.txt" 2>&1 || echo "no plot (matplotlib?)"
exit $bad
