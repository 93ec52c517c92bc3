#!/usr/bin/env bash
# The staged transport's paths side by side in one device call: staged_bench (put, get,
# put_signal ping-pong, host time per call) and the Jacobi example staged, for the code before
# (OLD_SRC) and this tree with the agents only (MESHMEM_STAGED_STREAM_PATH=off), the stream path
# (=65536) and the stream path split as between two GPUs (MESHMEM_STAGED_STREAM_PATH_SPLIT=on),
# taking turns; every byte checked (staged_bench) and every Jacobi run against one GPU.
#   bench/run_staged_paths.sh OLD_SRC OUT [ROUNDS]
#     OLD_SRC  a source tree of the code before (`git archive <rev> | tar -x -C build-old-src`;
#              carried: /build*/ is ignored), built in OLD_SRC/build (staged_bench, 03_jacobi)
#     OUT      where paths.csv, bench.txt and the build logs go
#   Environment: SIZES (staged_bench --min-bytes,--max-bytes; default 8,65536), JACOBI_SIZES (grid
#   sides, default 4096: one halo row is 8 x that many bytes), JACOBI_HALOS (03_jacobi --halo
#   values, default meshmem; e.g. "meshmem meshmem-putsignal mpi"), MACHINE, DATE.
#   The stream path's threshold: JACOBI_SIZES="512 1024 2048 3072 3584 4096 4608 6144" (4 to 48 KiB rows).
# Builds with Ninja where it is found (the GPU machines' /opt/torch/.venv/bin/ninja), this tree
# into build-paths/.
set -uo pipefail
old_src=$(cd "${1:?old source tree}" && pwd); out=${2:?out}; rounds=${3:-2}
new_src=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"; out=$(cd "$out" && pwd)
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
machine=${MACHINE:-gpu}; date=${DATE:-$(date +%F)}
IFS=, read -r min max <<< "${SIZES:-8,65536}"
jacobi_sizes=${JACOBI_SIZES:-4096}; jacobi_halos=${JACOBI_HALOS:-meshmem}
. "$new_src/bench/build_lib.sh"
build() {  # src dir targets...
  local src=$1 dir=$2; shift 2
  bench_build "$src" "$dir" "$out/build-$(basename "$dir").log" "$@"
}
build "$old_src" "$old_src/build" staged_bench 03_jacobi & p_old=$!
build "$new_src" "$new_src/build-paths" staged_bench 03_jacobi; rc_new=$?
wait $p_old; rc_old=$?
[ "$rc_old" = 0 ] && [ "$rc_new" = 0 ] || { echo "builds: old rc $rc_old, new rc $rc_new"; tail -30 "$out"/build-*.log; exit 1; }
csv=$out/paths.csv; log=$out/bench.txt; status=0
run() {  # label build-dir variables...
  local label=$1 dir=$2; shift 2
  echo "== $label" >> "$log"
  env "$@" timeout 120 mpirun -np 2 --bind-to none "$dir/bench/staged_bench" --min-bytes "$min" --max-bytes "$max" \
    --call-times --csv "$csv" --commit "$label" --machine "$machine" --date "$date" >> "$log" 2>&1 ||
    { echo "FAILED staged_bench $label" | tee -a "$log"; status=1; }
  local n halo
  for halo in $jacobi_halos; do
    for n in $jacobi_sizes; do
      env "$@" MESHMEM_TRANSPORTS=staged,shm,mpi timeout 60 mpirun -np 2 --bind-to none "$dir/examples/03_jacobi" --size "$n" \
        --iters 2000 --halo="$halo" --decomp=rows --check --csv "$csv" --commit "$label" --machine "$machine" --date "$date" \
        >> "$log" 2>&1 || { echo "FAILED jacobi $label $halo $n" | tee -a "$log"; status=1; }
    done
  done
}
for ((k = 1; k <= rounds; k++)); do
  run "old-r$k" "$old_src/build" BENCH_SIDE=old
  run "agent-r$k" "$new_src/build-paths" MESHMEM_STAGED_STREAM_PATH=off
  run "stream-r$k" "$new_src/build-paths" MESHMEM_STAGED_STREAM_PATH=65536
  run "split-r$k" "$new_src/build-paths" MESHMEM_STAGED_STREAM_PATH=65536 MESHMEM_STAGED_STREAM_PATH_SPLIT=on
done
grep -h "^jacobi\|pingpong\|FAILED" "$log" | head -40
exit $status
