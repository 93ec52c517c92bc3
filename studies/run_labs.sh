#!/usr/bin/env bash
# The design studies (barrier_lab, copy_lab, alloc_lab, stream_path_lab) in one GPU session;
# logs and CSV rows (barrier_lab, copy_lab, stream_path_lab) in OUT_DIR.
#   studies/run_labs.sh OUT_DIR MACHINE_NAME [BUILD_DIR]
set -uo pipefail
out=${1:?out dir}; machine=${2:?machine name}
root=$(cd "$(dirname "$0")/.." && pwd)
build=${3:-$root/build-gpu}
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ninja=$(command -v ninja || echo /opt/torch/.venv/bin/ninja)
if [ ! -x "$build/studies/alloc_lab" ] || [ ! -x "$build/studies/stream_path_lab" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_MAKE_PROGRAM="$ninja" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DMESHMEM_BUILD_STUDIES=ON > "$out/configure.log" 2>&1 || { tail -40 "$out/configure.log"; exit 1; }
  cmake --build "$build" -j "$(nproc)" --target barrier_lab copy_lab alloc_lab stream_path_lab > "$out/build.log" 2>&1 ||
    { grep -E "error|Error" "$out/build.log" | head -40; exit 1; }
fi
commit=${COMMIT:-$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)}
args=(--csv "$out/labs.csv" --commit "$commit" --machine "$machine" --date "$(date -u +%F)")
ngpu=$(nvidia-smi -L | wc -l)
for np in 2 4; do
  [ "$np" -le "$ngpu" ] || continue
  # (--bind-to core measured the same as none.)
  echo "== barrier_lab np$np"
  timeout 120 mpirun -np $np --bind-to none "$build/studies/barrier_lab" "${args[@]}" 2>&1 | tee "$out/barrier_lab_np$np.txt"
done
echo "== copy_lab"
timeout 200 mpirun -np 2 --bind-to none "$build/studies/copy_lab" "${args[@]}" 2>&1 | tee "$out/copy_lab.txt"
np=$(( ngpu < 4 ? ngpu : 4 ))
echo "== alloc_lab np$np"
timeout 120 mpirun -np $np --bind-to none "$build/studies/alloc_lab" 2>&1 | tee "$out/alloc_lab.txt"
echo "== stream_path_lab"  # 2 ranks, on one GPU or a GPU each (node rank % GPUs); about 30 s
timeout 180 mpirun -np 2 --bind-to none "$build/studies/stream_path_lab" "${args[@]}" 2>&1 | tee "$out/stream_path_lab.txt"
