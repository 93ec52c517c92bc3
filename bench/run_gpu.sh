#!/usr/bin/env bash
# One GPU session: build, run the GPU tests, run the device benchmarks (meshmem, CUDA IPC,
# NCCL, NVSHMEM where present; staged_bench), and leave logs and the results CSV in OUT_DIR.
#   bench/run_gpu.sh OUT_DIR MACHINE_NAME [--skip-tests] [--quick]
set -uo pipefail
out=${1:?out dir}; machine=${2:?machine name}; shift 2
skip_tests=0; quick=""
for a in "$@"; do
  case "$a" in --skip-tests) skip_tests=1 ;; --quick) quick=--quick ;; esac
done
root=$(cd "$(dirname "$0")/.." && pwd)
# NVLink multicast stays off: it can take a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ninja=$(command -v ninja || echo /opt/torch/.venv/bin/ninja)
ngpu=$(nvidia-smi -L | wc -l)
nvidia-smi topo -m > "$out/topo.txt" 2>&1
cmake -S "$root" -B "$root/build-gpu" -G Ninja -DCMAKE_MAKE_PROGRAM="$ninja" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES=90 > "$out/configure.log" 2>&1 || { tail -40 "$out/configure.log"; exit 1; }
cmake --build "$root/build-gpu" -j "$(nproc)" > "$out/build.log" 2>&1 || { grep -E "error|Error" "$out/build.log" | head -40; exit 1; }
cd "$root/build-gpu"
if [ "$skip_tests" = 0 ]; then
  ctest -L gpu --output-on-failure --timeout 300 > "$out/gpu_tests.log" 2>&1
  grep -E "Test +#|tests passed|tests failed" "$out/gpu_tests.log"
fi
# The device machine gets the working tree without .git: pass COMMIT=... from here.
commit=${COMMIT:-$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)}
date=$(date -u +%F)
csv="$out/results.csv"
np=$(( ngpu < 4 ? ngpu : 4 ))
[ "$np" -ge 2 ] || { echo "fewer than 2 GPUs: no pairwise benchmarks"; exit 0; }
flags="--bind-to none --oversubscribe"
timeout 400 mpirun -np "$np" $flags ./bench/device_bench --csv "$csv" --commit "$commit" --machine "$machine" --date "$date" $quick \
  2>&1 | tee "$out/device_bench.txt" | grep -A40 "# summary"
if [ -x ./bench/nvshmem_bench ]; then
  # Pairwise figures and 2-rank barriers from the 2-rank run; the job-wide run adds only
  # what depends on the job size (no duplicate rows).
  timeout 200 mpirun -np 2 $flags ./bench/nvshmem_bench --csv "$csv" --commit "$commit" --machine "$machine" --date "$date" \
    > "$out/nvshmem_bench_np2.txt" 2>&1; echo "nvshmem_bench np2 exit $?"
  if [ "$np" -gt 2 ]; then
    timeout 200 mpirun -np "$np" $flags ./bench/nvshmem_bench --benchmarks barrier,barrier200,barrier_busy,barrier200_busy,alloc --csv "$csv" \
      --commit "$commit" --machine "$machine" --date "$date" > "$out/nvshmem_bench_np$np.txt" 2>&1
    echo "nvshmem_bench np$np exit $?"
  fi
else
  echo "nvshmem_bench not built (see configure.log)"
fi
# The staged transport (forced: staged_bench sets MESHMEM_TRANSPORTS=staged,shm,mpi) against
# D2H / H2D copies and the driver's host-staged cudaMemcpyPeerAsync; 2 ranks, GPUs 0 and 1.
timeout 300 mpirun -np 2 $flags ./bench/staged_bench --csv "$csv" --commit "$commit" --machine "$machine" --date "$date" \
  ${quick:+--max-bytes 64M} > "$out/staged_bench.txt" 2>&1
echo "staged_bench exit $?"
grep -A12 "# summary" "$out/staged_bench.txt"
