#!/usr/bin/env bash
# Runs chosen GPU test entries of a build made on another machine (the GPU machines get a
# copy of the built tests, not the toolchain run), each under its own limit, and loops an
# entry to catch rare stalls, with stack traces of the ranks of a run that outlives its limit.
#
#   tests/gpu/run_entries.sh PACK OUT STEP...
#     PACK  a folder made by `tests/gpu/run_entries.sh --pack BUILD PACK` here
#     OUT   where logs go (one per step, summary.txt)
#     STEP  'entry NAME LIMIT'        one CTest entry (e.g. gpu.staged.np2), LIMIT seconds
#           'loop NAME N LIMIT'       the entry N times; a run past LIMIT gets its ranks'
#                                     stacks dumped (gdb, or cuda-gdb) and is killed
#           'alt SUFFIX NAME N LIMIT' as loop, with the entry's test binary's name + SUFFIX
#                                     (another build of it, e.g. the code before a fix)
#           'cmd LABEL LIMIT COMMAND' a shell command run in PACK (bench labs)
#   Environment: BUDGET (seconds; steps that would start past it are skipped), LOOPENV
#   (variables for loop runs, e.g. 'MESHMEM_TIMEOUT=15'), LOOPARGS (extra test arguments
#   for loop runs, e.g. '--gtest_filter=*Graph*'), LOOPKEEP=1 (keep every loop run's output).
#
#   tests/gpu/run_entries.sh --pack BUILD PACK
#     copies BUILD's GPU test binaries, queue_lab, staged_bench, staging_memory_lab, pipeline_lab,
#     driver_call_lab, fill_lab, timeslice_lab, the Jacobi example and meshmem-info (stripped, those that were built) and
#     its CTest files into PACK,
#     recording BUILD's path and this source tree's so the entries run where PACK lands.
set -uo pipefail

if [ "${1:-}" = "--pack" ]; then
  build=$(cd "${2:?build folder}" && pwd); pack=${3:?pack folder}
  src=$(cd "$(dirname "$0")/../.." && pwd)
  rm -rf "$pack"; mkdir -p "$pack"; pack=$(cd "$pack" && pwd)
  (cd "$build" && find . -name "*.cmake" -not -path "*/CMakeFiles/*" -print0 | xargs -0 cp --parents -t "$pack")
  for f in "$build"/tests/gpu/test_* "$build"/bench/queue_lab "$build"/launch/meshmem-info \
           "$build"/bench/staged_bench "$build"/bench/staging_memory_lab "$build"/bench/pipeline_lab \
           "$build"/bench/driver_call_lab "$build"/bench/fill_lab "$build"/bench/timeslice_lab "$build"/examples/03_jacobi; do
    [ -x "$f" ] || continue
    rel=${f#"$build"/}; mkdir -p "$pack/$(dirname "$rel")"
    strip -o "$pack/$rel" "$f"
  done
  printf '%s\n%s\n' "$build" "$src" > "$pack/ORIGIN"
  du -sh "$pack"
  exit 0
fi

pack=$(cd "${1:?pack}" && pwd); out=${2:?out}; shift 2
mkdir -p "$out"
here=$(cd "$(dirname "$0")/../.." && pwd)
{ read -r old_build; read -r old_src; } < "$pack/ORIGIN"
if [ "$old_build" != "$pack" ]; then
  find "$pack" -name CTestTestfile.cmake -exec sed -i "s#$old_build#$pack#g; s#$old_src#$here#g" {} +
  printf '%s\n%s\n' "$pack" "$here" > "$pack/ORIGIN"
fi
# NVLink multicast stays off: it can take a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
start=$(date +%s)
budget=${BUDGET:-100000}
summary="$out/summary.txt"
gdb_bin=$(command -v gdb || command -v cuda-gdb || ls /usr/local/cuda/bin/cuda-gdb 2>/dev/null || true)

left() { echo $(( budget - ($(date +%s) - start) )); }
note() { echo "$*" | tee -a "$summary"; }

# The command line of CTest entry $1, as the arguments of its test.
entry_command() {
  ctest --test-dir "$pack" -R "^$1\$" --show-only=json-v1 2>/dev/null |
    python3 -c 'import json,sys; t=json.load(sys.stdin)["tests"]; print("\0".join(t[0]["command"]) if t else "", end="")'
}
entry_env() {
  ctest --test-dir "$pack" -R "^$1\$" --show-only=json-v1 2>/dev/null |
    python3 -c 'import json,sys
t=json.load(sys.stdin)["tests"]
for p in (t[0].get("properties",[]) if t else []):
    if p["name"]=="ENVIRONMENT": print("\n".join(p["value"]))'
}

dump_stacks() {  # $1: log; the ranks are the test binaries' processes
  local pids; pids=$(pgrep -f "^$pack/tests/gpu/test_" || true)
  for p in $pids; do
    echo "=== stacks of pid $p: $(tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null | cut -c1-200)" >> "$1"
    if [ -n "$gdb_bin" ]; then
      timeout 60 "$gdb_bin" -p "$p" -batch -ex 'set pagination off' -ex 'thread apply all bt 12' >> "$1" 2>&1
    else
      cat /proc/$p/task/*/stack >> "$1" 2>&1
    fi
  done
}

for step in "$@"; do
  set -f; set -- $step; set +f  # words, not file names: a cmd step's patterns stay as written
  kind=$1
  case "$kind" in
    entry)
      name=$2; limit=$3
      if [ "$(left)" -lt "$limit" ]; then note "SKIP $name (budget)"; continue; fi
      t0=$(date +%s.%N)
      ctest --test-dir "$pack" -R "^$name\$" --output-on-failure --timeout "$limit" > "$out/$name.log" 2>&1
      rc=$?
      secs=$(awk "BEGIN{print $(date +%s.%N) - $t0}")
      if grep -q "(Skipped)" "$out/$name.log"; then r=SKIPPED  # not a pass
      elif grep -q "100% tests passed" "$out/$name.log"; then r=PASS
      elif grep -q "No tests were found" "$out/$name.log"; then r=MISSING
      else r=FAIL; fi
      # ctest's --timeout yields to an entry's own TIMEOUT property: a run past LIMIT is said so.
      over=$(awk "BEGIN{print ($secs > $limit) ? \" past its limit of $limit s\" : \"\"}")
      note "$r $name $(printf %.1f "$secs") s (rc $rc)$over"
      [ "$r" = PASS ] || grep -E "FAILED|Failure|error|Timeout|timed out" "$out/$name.log" | head -12 | tee -a "$summary"
      ;;
    loop|alt)
      suffix=""
      if [ "$kind" = alt ]; then suffix=$2; shift; fi
      name=$2; n=$3; limit=$4
      mapfile -d '' cmd < <(entry_command "$name")
      if [ -n "$suffix" ]; then
        for i in "${!cmd[@]}"; do
          case "${cmd[$i]}" in "$pack"/tests/gpu/test_*) cmd[$i]="${cmd[$i]}$suffix" ;; esac
        done
      fi
      [ "${#cmd[@]}" -gt 0 ] || { note "MISSING $name"; continue; }
      mapfile -t envs < <(entry_env "$name")
      pass=0; fail=0; hung=0; skipped=0; slowest=0; slow=""; log="$out/$kind$suffix-$name.log"
      for i in $(seq 1 "$n"); do
        if [ "$(left)" -lt "$limit" ]; then note "loop $name: stopped at run $i (budget)"; break; fi
        t0=$(date +%s.%N)
        env -u CUDA_MODULE_LOADING -u MESHMEM_MODULE_LOADING "${envs[@]}" ${LOOPENV:-} "${cmd[@]}" ${LOOPARGS:-} > "$out/run.log" 2>&1 &
        pid=$!; waited=0
        while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "$limit" ]; do sleep 1; waited=$((waited + 1)); done
        if kill -0 "$pid" 2>/dev/null; then
          hung=$((hung + 1)); echo "### run $i past ${limit} s" >> "$log"; dump_stacks "$log"
          pkill -9 -f "^$pack/tests/gpu/test_"; kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
          cat "$out/run.log" >> "$log"; continue
        fi
        wait "$pid"; rc=$?
        [ -n "${LOOPKEEP:-}" ] && { echo "### run $i rc $rc" >> "$log"; cat "$out/run.log" >> "$log"; }
        secs=$(awk "BEGIN{print $(date +%s.%N) - $t0}")
        slowest=$(awk "BEGIN{print ($secs > $slowest) ? $secs : $slowest}")
        # A run that took more than half its limit: a stall that ended by itself shows here.
        # Its output is kept (unless a failure keeps it below): what the stall was.
        is_slow=""; awk "BEGIN{exit !($secs * 2 > $limit)}" && { is_slow=1; slow="$slow run $i ($(printf %.0f "$secs") s)"; }
        if [ "$rc" = 0 ]; then pass=$((pass + 1)); elif [ "$rc" = 77 ]; then skipped=$((skipped + 1)); else
          fail=$((fail + 1)); is_slow=""; echo "### run $i rc $rc after $secs s" >> "$log"; cat "$out/run.log" >> "$log"; fi
        [ -n "$is_slow" ] && [ -z "${LOOPKEEP:-}" ] && { echo "### run $i (slow) rc $rc after $secs s" >> "$log"; cat "$out/run.log" >> "$log"; }
      done
      note "$kind$suffix $name ${LOOPENV:-} ${LOOPARGS:-}: $pass passed, $fail failed, $hung past ${limit} s, $skipped skipped; slowest $(printf %.1f "$slowest") s${slow:+; over half the limit:$slow}"
      ;;
    cmd)
      label=$2; limit=$3; shift 3
      if [ "$(left)" -lt "$limit" ]; then note "SKIP $label (budget)"; continue; fi
      (cd "$pack" && timeout "$limit" bash -c "$*") > "$out/$label.log" 2>&1
      note "cmd $label rc $?"
      grep -E "^RESULT" "$out/$label.log" | tee -a "$summary"
      ;;
    *) note "unknown step: $step" ;;
  esac
done
note "total $(( $(date +%s) - start )) s"
