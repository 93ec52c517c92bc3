#!/usr/bin/env bash
# Two builds of meshmem side by side in one device call: the figures of a change that must not
# move any (a restructuring) measured with the old and the new binaries taking turns, then GPU
# test entries of the new build.
#   bench/run_before_after.sh OLD_SRC OUT [ENTRY_REGEX]
#     OLD_SRC  a source tree of the code before (e.g. `git archive <rev> | tar -x -C build-old-src`;
#              carry it: /build*/ is ignored), built in OLD_SRC/build
#     OUT      where the CSV, the summary and the logs go
#     ENTRY_REGEX  ctest -R of the new build's entries to run after the figures (none: skip)
#   Environment: ROUNDS (turns of old and new, default 3), BUDGET (seconds for the entries),
#   OLD_TARGETS (what of the old tree is built: default staged_bench 03_jacobi),
#   COMMIT_OLD, COMMIT_NEW, MACHINE, DATE (for the CSV rows; give the commits from the machine
#   that has the git history: a copied tree may report another HEAD).
# Builds with Ninja where it is found (the GPU machines' /opt/torch/.venv/bin/ninja).
set -uo pipefail
old_src=$(cd "${1:?old source tree}" && pwd); out=${2:?out}; regex=${3:-}
new_src=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"; out=$(cd "$out" && pwd)
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
rounds=${ROUNDS:-3}; machine=${MACHINE:-gpu}; date=${DATE:-$(date +%F)}
summary=$out/summary.txt
note() { echo "$*" | tee -a "$summary"; }
. "$new_src/bench/build_lib.sh"
build() {  # src dir targets...
  local src=$1 dir=$2; shift 2
  bench_build "$src" "$dir" "$out/cmake-$(basename "$src").log" "$@"
}
t0=$(date +%s)
build "$old_src" "$old_src/build" ${OLD_TARGETS:-staged_bench 03_jacobi} & p_old=$!
build "$new_src" "$new_src/build-new" all; rc_new=$?
wait $p_old; rc_old=$?
note "builds: old rc $rc_old, new rc $rc_new, $(( $(date +%s) - t0 )) s"
[ "$rc_old" = 0 ] && [ "$rc_new" = 0 ] || { tail -30 "$out"/cmake-*.log; exit 1; }
csv=$out/before_after.csv
echo "date,commit,machine,benchmark,variant,ranks,size_bytes,latency_us,bandwidth_gbps" > "$csv"
for ((k = 1; k <= rounds; k++)); do
  for side in old new; do
    if [ $side = old ]; then b=$old_src/build; c=${COMMIT_OLD:-old}; else b=$new_src/build-new; c=${COMMIT_NEW:-new}; fi
    for size in 4096 67108864; do
      timeout 120 mpirun -np 2 --bind-to none "$b/bench/staged_bench" --min-bytes $size --max-bytes $size \
        --csv "$out/sb.csv" --commit "$c" --machine "$machine" --date "$date" > "$out/staged_${side}_${size}_$k.log" 2>&1 ||
        note "FAILED staged_bench $side $size round $k"
    done
    MESHMEM_TRANSPORTS=staged,shm,mpi timeout 120 mpirun -np 2 --bind-to none "$b/examples/03_jacobi" --size 4096 \
      --iters 2000 --halo=meshmem --decomp=rows --check --csv "$out/sb.csv" --commit "$c" --machine "$machine" \
      --date "$date" > "$out/jacobi_${side}_$k.log" 2>&1 || note "FAILED jacobi $side round $k"
  done
done
grep -v '^date,' "$out/sb.csv" >> "$csv" 2>/dev/null; rm -f "$out/sb.csv"
# The ratio new/old of each row's best figure (latency: lower is better; bandwidth: higher).
python3 - "$csv" "${COMMIT_OLD:-old}" "${COMMIT_NEW:-new}" <<'PY' | tee -a "$summary"
import csv, sys, collections
rows = list(csv.DictReader(open(sys.argv[1]))); old, new = sys.argv[2], sys.argv[3]
best = collections.defaultdict(dict)
for r in rows:
    key = (r['benchmark'], r['variant'], r['size_bytes'])
    lat = float(r['latency_us']) if r['latency_us'] else None
    bw = float(r['bandwidth_gbps']) if r['bandwidth_gbps'] else None
    b = best[key].setdefault(r['commit'], [None, None])
    if lat is not None: b[0] = lat if b[0] is None else min(b[0], lat)
    if bw is not None: b[1] = bw if b[1] is None else max(b[1], bw)
print('# benchmark variant size  old_lat_us new_lat_us new/old  old_GBps new_GBps new/old')
for key, v in sorted(best.items()):
    if old not in v or new not in v or not key[1].startswith(('meshmem', 'jacobi')) and key[0] != 'jacobi': continue
    o, n = v[old], v[new]
    lr = f'{n[0]/o[0]:.3f}' if o[0] and n[0] else '-'
    br = f'{n[1]/o[1]:.3f}' if o[1] and n[1] else '-'
    print(*key, o[0], n[0], lr, o[1], n[1], br)
PY
note "figures: $(( $(date +%s) - t0 )) s"
if [ -n "$regex" ]; then
  (cd "$new_src/build-new" && timeout "${BUDGET:-400}" ctest -R "$regex" -L gpu --timeout 240 --output-on-failure > "$out/ctest.log" 2>&1)
  note "ctest rc $?: $(grep -E 'tests passed|tests failed' "$out/ctest.log")"
  grep -E '^ *[0-9]+/[0-9]+ Test' "$out/ctest.log" | sed 's/^ *//' >> "$summary"
fi
note "total: $(( $(date +%s) - t0 )) s"
