#!/usr/bin/env bash
# first_message.sh CAUSE -- COMMAND [ARGS...]
#
# Runs COMMAND (mpirun and a program that fails), with its output, and checks what a user
# reads: the first line from meshmem or the program (mpirun's own lines aside) contains CAUSE,
# and each rank's destructors (lines naming a destructor or ~Comm, or saying that the rank
# leaves its Comm on an error) add at most one line. Exit 0 when both hold, 1 otherwise.
set -uo pipefail
[ $# -ge 3 ] && [ "$2" = "--" ] || { echo "usage: first_message.sh CAUSE -- COMMAND [ARGS...]" >&2; exit 2; }
cause=$1
shift 2
out=$("$@" 2>&1)
echo "$out"
echo "---- first_message.sh: checking the output above"
first=$(echo "$out" | grep -E '^\[meshmem rank [0-9]+\]|^two_rank_program' | head -n 1)
ok=1
if [[ "$first" != *"$cause"* ]]; then
  echo "FAILED: the first message is not the cause ('$cause'): $first"
  ok=0
fi
for r in $(echo "$out" | grep -oE '^\[meshmem rank [0-9]+\]' | sort -u | grep -oE '[0-9]+'); do
  n=$(echo "$out" | grep -E "^\[meshmem rank $r\]" | grep -cE 'destructor|~Comm|leaves its Comm')
  if [ "$n" -gt 1 ]; then
    echo "FAILED: rank $r's destructors printed $n lines (at most 1)"
    ok=0
  fi
done
[ $ok = 1 ] && echo "PASSED: the first message is the cause, and each rank's destructors added at most one line"
[ $ok = 1 ]
