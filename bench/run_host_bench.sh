#!/usr/bin/env bash
# Runs host_bench on 2 ranks from an existing build (builds nothing) and keeps its results:
#   bench/results/<date>-<machine>-host.csv   the rows (date,commit,machine,benchmark,...)
#   bench/results/<date>-<machine>-host.txt   the printed tables and summary
#
# usage: bench/run_host_bench.sh [--machine NAME] [--commit ID] BUILD_DIR [host_bench options...]
#   --machine NAME   recorded in the rows and the file names (default: short host name)
#   --commit ID      recorded in the rows (default: git rev-parse --short HEAD)
#   MPIRUN           environment: the launcher (default mpirun, Open MPI syntax)
# Run it on an idle machine: host_bench reports how much CPU other processes took meanwhile.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
machine=$(hostname -s 2>/dev/null || echo unknown)
commit=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --machine) machine=${2:?--machine needs a value}; shift 2 ;;
    --commit) commit=${2:?--commit needs a value}; shift 2 ;;
    -h|--help) sed -n '2,10p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || { echo "usage: $0 [--machine NAME] [--commit ID] BUILD_DIR [host_bench options...]" >&2; exit 2; }
build=$(cd "$1" 2>/dev/null && pwd) || { echo "$0: no build directory $1" >&2; exit 2; }
shift
bench="$build/bench/host_bench"
[[ -x "$bench" ]] || { echo "$0: $bench not found; build it first (cmake --build $1 --target host_bench)" >&2; exit 2; }
if [[ -z "$commit" ]]; then
  commit=$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)
fi
case "$machine" in */*|*' '*|'') echo "$0: machine name '$machine' must be non-empty, without '/' or spaces" >&2; exit 2 ;; esac

date=$(date -u +%Y-%m-%d)
results="$repo/bench/results"
mkdir -p "$results"
csv="$results/$date-$machine-host.csv"
txt="$results/$date-$machine-host.txt"
[[ -e "$csv" || -e "$txt" ]] && echo "note: replacing $csv / $txt" >&2

# Open MPI refuses to start as root without these; they change nothing otherwise.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
"${MPIRUN:-mpirun}" -np 2 --oversubscribe --bind-to none "$bench" \
  --csv "$csv" --commit "$commit" --machine "$machine" "$@" 2>&1 | tee "$txt"
echo "results: $csv" >&2
echo "         $txt" >&2
