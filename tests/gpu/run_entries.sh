#!/usr/bin/env bash
# Runs the GPU test entries on the GPU machine.
#
#   tests/gpu/run_entries.sh tier TIER [--build DIR] [--deadline S] [--only REGEX] [--from NAME]
#                                      [--rest RUN_FILE...] [--probe]
#     One tier in one device call, from the repository root, writing under $OUT (or --out DIR):
#     builds (Release, Ninja, arch 90, 16 jobs: about a minute) into build-gpu/ unless --build
#     names a build made earlier (carried, or kept from an earlier call; built there if it holds
#     none), runs the tier's entries
#     one at a time (TIER gpu: the fast tier, ctest -L '^gpu$'; gpu-long: ctest -L gpu-long;
#     python: every Python entry, ctest -L python, in a build made with the package), starts
#     none whose estimate (tests/gpu/entries.txt) no longer fits before the deadline (default
#     540 s after the start) and ends one still running there, and writes summary.md (first line
#     `total: N s`, the test time summed over the entries that ran; then entry, result (with the
#     count of its cases passed, skipped and failed, GoogleTest's or pytest's), seconds, placement;
#     the entries not run) and the same file named for tests/gpu/runs/, and logs/ of every entry
#     that did not pass. --only: the entries whose name matches REGEX; --from NAME:
#     the tier's entries from NAME on (where an earlier call's deadline stopped); --rest RUN_FILE...
#     (up to the next option): the entries that none of those run files has as PASS or SKIPPED
#     (a tier run over several calls, or finished in a later session). --probe: first
#     the barrier probe (BarrierTenThousandRounds at 500 rounds under each barrier variant, 2 and
#     4 ranks: microseconds per barrier, in barrier_probe.txt). A folder build-ip/ (made by
#     tests/gpu/bundle_ip.sh and carried) gives launch/meshmem-hosts its `ip`.
#
# The steps below run chosen entries of a build made on another machine (the GPU machines get a
# copy of the built tests, not the toolchain run), each under its own limit, and loop an
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
#     driver_call_lab, fill_lab, timeslice_lab, stream_path_lab, release_lab, the Jacobi example and meshmem-info (stripped, those that were built) and
#     its CTest files into PACK,
#     recording BUILD's path and this source tree's so the entries run where PACK lands.
set -uo pipefail

# NVLink multicast stays off: it can take a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

if [ "${1:-}" = "tier" ]; then
  tier=${2:?tier: gpu, gpu-long or python}; shift 2
  case "$tier" in
    gpu) labels='^gpu$' ;; gpu-long) labels='^gpu-long$' ;;
    python) labels='^python$' ;;  # every Python entry, host and device (a build with the package)
    *) echo "tier: gpu, gpu-long or python" >&2; exit 2 ;;
  esac
  build=""; fresh=""; deadline=540; only=""; from=""; probe=""; out=${OUT:-}; done_runs=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --build) build=$2; shift 2 ;;
      --deadline) deadline=$2; shift 2 ;;
      --only) only=$2; shift 2 ;;
      --from) from=$2; shift 2 ;;
      --probe) probe=1; shift ;;
      --rest) shift; while [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; do done_runs+=("$1"); shift; done ;;
      --out) out=$2; shift 2 ;;
      *) echo "unknown option $1" >&2; exit 2 ;;
    esac
  done
  [ -n "$out" ] || { echo "tier: set OUT (or --out DIR)" >&2; exit 2; }
  mkdir -p "$out/logs"
  start=$(date +%s)
  elapsed() { echo $(( $(date +%s) - start )); }
  src=$(pwd)
  if [ -d build-ip ] && [ -z "${MESHMEM_HOSTS_IP:-}" ]; then
    export MESHMEM_HOSTS_IP=$src/build-ip/ip MESHMEM_HOSTS_IP_LIBS=$src/build-ip/lib
  fi
  # A build folder that holds no build yet (a fresh machine) is built, as without --build.
  [ -n "$build" ] && [ ! -f "$build/CTestTestfile.cmake" ] && { echo "no build in $build: building it"; fresh=$build; build=""; }
  if [ -z "$build" ]; then
    build=${fresh:-build-gpu}
    ninja=${NINJA:-/opt/torch/.venv/bin/ninja}
    { cmake -S . -B "$build" -G Ninja -DCMAKE_MAKE_PROGRAM="$ninja" -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CUDA_ARCHITECTURES=90 && cmake --build "$build" -j 16; } > "$out/build.log" 2>&1 ||
      { echo "build failed after $(elapsed) s"; tail -40 "$out/build.log"; exit 1; }
    echo "built in $(elapsed) s"
  fi
  build=$(cd "$build" && pwd)
  device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr 'A-Z ' 'a-z-' | sed 's/^nvidia-//')
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  device=${device:-no-gpu}
  # The device machine's copy of the tree may carry another HEAD than the tree it came from: the
  # developer's machine passes MESHMEM_COMMIT.
  commit=${MESHMEM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  commit=${commit//[^A-Za-z0-9._-]/-}  # the run file's name comes back from the device machine only so
  day=$(date -u +%Y-%m-%d)
  tsv="$build/tests/gpu/entries.tsv"
  field() { awk -F'\t' -v n="$1" -v f="$2" '$1 == n {print $f; exit}' "$tsv"; }
  cases() {  # what an entry's cases came to, from its log: GoogleTest's or pytest's summary (first rank's)
    local text p s f
    text=$(sed 's/\x1b\[[0-9;]*m//g' "$1")
    p=$(grep -m1 -oE '\[  PASSED  \] [0-9]+ test' <<< "$text" | grep -oE '[0-9]+')
    if [ -n "$p" ]; then
      s=$(grep -m1 -oE '\[  SKIPPED \] [0-9]+ test' <<< "$text" | grep -oE '[0-9]+')
      f=$(grep -m1 -oE '\[  FAILED  \] [0-9]+ test' <<< "$text" | grep -oE '[0-9]+')
      echo "cases: $p passed${s:+, $s skipped}${f:+, $f failed}"; return
    fi
    p=$(grep -m1 -oE '[0-9]+ (passed|failed|skipped|error)[^=]* in [0-9.]+s' <<< "$text")
    [ -n "$p" ] && { echo "pytest per rank: ${p% in *}"; return; }
    p=$(grep -cE '\[ +OK \] ' <<< "$text"); s=$(grep -cE '\[  SKIPPED \] [^0-9]' <<< "$text")
    [ "$p$s" != 00 ] && echo "cases ended before: $p passed, $s skipped"
  }
  gone() {  # ends what a killed entry left: the build's test processes, by id
    for p in $(pgrep -f "^$build/(tests/gpu|examples)/" || true); do kill -9 "$p" 2>/dev/null; done
  }

  if [ -n "$probe" ]; then
    # The barrier probe: one case, timed by itself, under each barrier(stream) variant.
    probe_out="$out/barrier_probe.txt"
    echo "# BarrierTenThousandRounds at 500 rounds (MESHMEM_TEST_TIER=fast), $gpus x $device: us per barrier" > "$probe_out"
    for np in 2 4; do
      for variant in "auto" "kernel" "meeting" "flag" "event" "staged:auto" "staged:kernel"; do
        envs=(MESHMEM_TEST_TIER=fast MESHMEM_TIMEOUT=120)
        case "$variant" in
          staged:*) envs+=(MESHMEM_TRANSPORTS=staged,shm,mpi MESHMEM_BARRIER=${variant#staged:}) ;;
          *) envs+=(MESHMEM_BARRIER=$variant) ;;
        esac
        t0=$(date +%s.%N)
        line=$(env -u CUDA_MODULE_LOADING "${envs[@]}" timeout -k 5 90 mpirun -np "$np" --oversubscribe --bind-to none \
                 "$build/tests/gpu/test_device_window" --gtest_filter=DeviceWindow.BarrierTenThousandRounds 2>&1 |
               grep -E '\[ barrier timing \]|FAILED|rank [0-9]+\]' | head -3 | tr '\n' ' ')
        printf '%-14s np%s  %6.1f s  %s\n' "$variant" "$np" "$(awk "BEGIN{print $(date +%s.%N) - $t0}")" \
          "${line:-no timing line (killed at 90 s?)}" >> "$probe_out"
        gone
      done
    done
    cat "$probe_out"
  fi

  mapfile -t entries < <(ctest --test-dir "$build" -N -L "$labels" | sed -n 's/^ *Test *#[0-9]*: //p' |
                         { if [ -n "$only" ]; then grep -E "$only"; else cat; fi; } |
                         { if [ -n "$from" ]; then sed -n "/^${from//./\\.}\$/,\$p"; else cat; fi; } |
                         { if [ ${#done_runs[@]} -gt 0 ]; then
                             grep -vxF -f <(sed -n -E 's/^\| ([^ |]+) \| (PASS|SKIPPED)( |\|).*/\1/p' "${done_runs[@]}") || true
                           else cat; fi; })
  rows=(); notrun=(); total=0; estimate=0
  for name in "${entries[@]}"; do
    # Entries outside entries.txt (the Python ones) have no estimate: about 10 s each on 1 x H200.
    est=$(field "$name" 5); case "$est" in ''|-) est=15 ;; esac
    left=$(( deadline - $(elapsed) ))
    if [ "$est" -gt "$left" ] || [ "$left" -lt 5 ]; then notrun+=("$name"); continue; fi
    estimate=$((estimate + est))
    log="$out/logs/$name.log"
    t0=$(date +%s.%N)
    timeout -k 15 "$left" ctest --test-dir "$build" -R "^${name//./\\.}\$" -V > "$log" 2>&1
    rc=$?
    secs=$(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}")
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then r="KILLED at the deadline"; gone
    elif grep -q "(Skipped)" "$log"; then r=SKIPPED
    elif grep -q "100% tests passed" "$log"; then r=PASS
    elif grep -q "Timeout" "$log"; then r="FAIL (its CTest timeout)"
    else r=FAIL; fi
    total=$(awk "BEGIN{print $total + $secs}")
    counted=$(cases "$log"); [ -n "$counted" ] && r="$r ($counted)"
    rows+=("| $name | $r | $secs | $(field "$name" 4) |")
    timing=$(grep -ho '\[ barrier timing \].*' "$log" | head -2 | tr '\n' ' ')
    [ -n "$timing" ] && rows[-1]="| $name | $r | $secs | $(field "$name" 4); $timing |"
    echo "$r $name $secs s"
    [ "${r%% *}" = PASS ] && rm -f "$log"
  done
  run="$out/$gpus-x-$device-$commit-$day-$tier.md"
  {
    printf 'total: %.0f s\n\n' "$total"
    echo "Tier \`$tier\` (ctest -L '$labels'${only:+, entries matching $only}) on $gpus x $device, meshmem $commit, $day:"
    echo "${#rows[@]} of ${#entries[@]} entries run${from:+ (from $from on)}${done_runs:+ (those not passed or skipped in ${done_runs[*]##*/})}, test time summed over them (estimates of entries.txt: $estimate s);"
    echo "$(elapsed) s from the start of the call, the build included. Produced by tests/gpu/run_entries.sh tier."
    echo
    echo "| entry | result | seconds | placement |"
    echo "| --- | --- | --- | --- |"
    printf '%s\n' "${rows[@]}"
    echo
    if [ ${#notrun[@]} -gt 0 ]; then echo "not run (deadline $deadline s): ${notrun[*]}"; else echo "every entry selected ran"; fi
    [ -n "$probe" ] && { echo; echo '```'; cat "$out/barrier_probe.txt"; echo '```'; }
  } > "$run"
  cp "$run" "$out/summary.md"
  cat "$run"
  exit 0
fi

if [ "${1:-}" = "--pack" ]; then
  build=$(cd "${2:?build folder}" && pwd); pack=${3:?pack folder}
  src=$(cd "$(dirname "$0")/../.." && pwd)
  rm -rf "$pack"; mkdir -p "$pack"; pack=$(cd "$pack" && pwd)
  (cd "$build" && find . -name "*.cmake" -not -path "*/CMakeFiles/*" -print0 | xargs -0 cp --parents -t "$pack")
  for f in "$build"/tests/gpu/test_* "$build"/studies/queue_lab "$build"/launch/meshmem-info \
           "$build"/bench/staged_bench "$build"/studies/staging_memory_lab "$build"/studies/pipeline_lab \
           "$build"/studies/driver_call_lab "$build"/studies/fill_lab "$build"/studies/timeslice_lab \
           "$build"/studies/stream_path_lab "$build"/studies/release_lab "$build"/examples/03_jacobi; do
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
