#!/usr/bin/env bash
# The staged pipeline's chunk size and slot count on a machine of 2 or more GPUs, from a pack
# built elsewhere (tests/gpu/run_entries.sh --pack): pipeline_lab (the floor with GPU-side
# dependencies only), then staged_bench up to 256 MiB under each MESHMEM_STAGED_CHUNK /
# MESHMEM_STAGED_SLOTS pair, then the default pair up to 1 GiB with every call's host time.
#   there: COMMIT=<hash> studies/run_staging_sweep.sh PACK OUT MACHINE     (about 2 minutes)
# OUT gets lab.txt, sweep.csv (the machine column names chunk and slots), default_1g.csv,
# bench_logs.tgz and summary.txt.
set -uo pipefail
pack=$(cd "${1:?pack}" && pwd); out=${2:?out}; machine=${3:?machine}
mkdir -p "$out"; out=$(cd "$out" && pwd)
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
c=${COMMIT:-unknown}; d=$(date -u +%F)
cd "$pack" || exit 1
{ timeout 60 studies/pipeline_lab --slots 4; timeout 60 studies/pipeline_lab --slots 8 --chunks 256K,512K,1M,2M; } > "$out/lab.txt" 2>&1
echo "pipeline_lab rc $?" >> "$out/summary.txt"
rc=0
# CONFIGS: CHUNK/SLOTS pairs, the chunk in whole MiB (nM).
for cfg in ${CONFIGS:-4M/4 2M/4 2M/8 1M/8 1M/16 8M/4}; do
  chunk=${cfg%/*}; slots=${cfg#*/}
  bytes=$(( ${chunk%M} * 1048576 ))
  log="$out/bench_${chunk}_${slots}.txt"
  MESHMEM_STAGED_CHUNK=$bytes MESHMEM_STAGED_SLOTS=$slots timeout 120 mpirun -np 2 --bind-to none bench/staged_bench \
    --max-bytes 256M --csv "$out/sweep_${chunk}_${slots}.csv" --commit "$c" --machine "$machine-chunk$chunk-slots$slots" --date "$d" > "$log" 2>&1
  r=$?; [ $r = 0 ] || rc=$r
  { echo "== chunk $chunk, slots $slots: rc $r"; grep -E "^staged_(put|get) .*MiB:|host-call" "$log" | grep -v "^ "; } >> "$out/summary.txt"
done
timeout 150 mpirun -np 2 --bind-to none bench/staged_bench --call-times --csv "$out/default_1g.csv" --commit "$c" \
  --machine "$machine" --date "$d" > "$out/bench_default_1g.txt" 2>&1
r=$?; [ $r = 0 ] || rc=$r
{ echo "== default, 1 GiB, call times: rc $r"; grep -E "^staged_(put|get) .*(MiB|B\)):" "$out/bench_default_1g.txt"; } >> "$out/summary.txt"
cat "$out"/sweep_*.csv > "$out/sweep.csv" 2>/dev/null; rm -f "$out"/sweep_*.csv
(cd "$out" && tar czf bench_logs.tgz bench_*.txt && rm -f bench_*.txt)
exit $rc
