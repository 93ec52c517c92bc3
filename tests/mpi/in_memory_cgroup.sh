#!/usr/bin/env bash
# in_memory_cgroup.sh LIMIT_BYTES -- COMMAND [ARGS...]
#
# Runs COMMAND (mpirun and its ranks) in a new memory cgroup limited to LIMIT_BYTES, made as a
# child of this process's own memory cgroup (so every limit already placed on the caller still
# holds): cgroup v1's memory controller, or cgroup v2 where the memory controller can be given
# to a child. Swap is not allowed in it where the kernel lets us say so. COMMAND learns the
# cgroup's folder from MESHMEM_TEST_MEMORY_CGROUP. Prints the cgroup's OOM kills afterwards.
#
# The cgroup is removed when COMMAND ends, fails, or this script is interrupted (INT, TERM,
# HUP); one left by a run killed with SIGKILL is removed by the next run. Exit status:
# COMMAND's, or 77 (CTest: skipped) with the reason where no such cgroup can be made here (not
# root, no memory controller, cgroupfs read-only).
set -uo pipefail

skip() { echo "in_memory_cgroup.sh: skipped: $*" >&2; exit 77; }
die() { echo "in_memory_cgroup.sh: $*" >&2; exit 1; }

[ $# -ge 3 ] && [ "$2" = "--" ] || die "usage: in_memory_cgroup.sh LIMIT_BYTES -- COMMAND [ARGS...]"
limit=$1
shift 2
[[ "$limit" =~ ^[1-9][0-9]*$ ]] || die "LIMIT_BYTES must be a positive number of bytes, not '$limit'"
[ "$(id -u)" = 0 ] || skip "making a cgroup and moving processes into it needs root"

# The memory hierarchy's mount (the first v1 mount carrying the memory controller, else the v2
# mount) and this process's cgroup in it. mountinfo fields: 4 = the mount's root within the
# hierarchy, 5 = mount point; after " - ": type, source, super options.
version="" mount="" root=""
while IFS= read -r line; do
  pre=${line%% - *} post=${line#* - }
  read -r fstype _ opts <<<"$post"
  read -r _ _ _ mroot mpoint _ <<<"$pre"
  if [ "$fstype" = cgroup ] && [[ ",$opts," == *,memory,* ]]; then
    version=1 mount=$mpoint root=$mroot
    break
  fi
  if [ "$fstype" = cgroup2 ] && [ -z "$version$mount" ]; then
    mount=$mpoint root=$mroot
  fi
done </proc/self/mountinfo
[ -n "$mount" ] || skip "no cgroup hierarchy is mounted"
[ -n "$version" ] || version=2
path=""
while IFS=: read -r _ controllers cpath; do
  if [ "$version" = 1 ] && [[ ",$controllers," == *,memory,* ]]; then path=$cpath; fi
  if [ "$version" = 2 ] && [ -z "$controllers" ]; then path=$cpath; fi
done </proc/self/cgroup
[ -n "$path" ] || skip "this process has no cgroup v$version memory path in /proc/self/cgroup"
if [ "$root" != / ] && [ "${path#"$root"}" != "$path" ]; then path=${path#"$root"}; fi
own="$mount${path%/}"
[ -d "$own" ] || skip "this process's memory cgroup $own is not visible here"
if [ "$version" = 2 ]; then
  [ -f "$own/cgroup.subtree_control" ] || skip "$own has no cgroup.subtree_control"
  if ! grep -qw memory "$own/cgroup.subtree_control"; then
    # Refused (EBUSY) where $own holds processes and is not the root: cgroup v2 gives controllers
    # only to the children of cgroups without processes of their own.
    echo +memory 2>/dev/null >"$own/cgroup.subtree_control" ||
      skip "cgroup v2: the memory controller cannot be given to children of $own (it is not available there, or $own holds processes)"
  fi
fi

# Cgroups of earlier runs killed before they could clean up: their script is gone and they are
# empty (a cgroup with processes cannot be removed and is left alone).
for old in "$own"/meshmem-memlimit.*; do
  [ -d "$old" ] || continue
  pid=${old##*.}
  if ! kill -0 "$pid" 2>/dev/null && [ ! -s "$old/cgroup.procs" ]; then rmdir "$old" 2>/dev/null || true; fi
done

cg="$own/meshmem-memlimit.$$"
mkdir "$cg" 2>/dev/null || skip "cannot make a cgroup under $own (cgroupfs read-only, or no permission)"

oom_kills() {
  if [ "$version" = 1 ]; then awk '$1 == "oom_kill" { print $2 }' "$cg/memory.oom_control" 2>/dev/null
  else awk '$1 == "oom_kill" { print $2 }' "$cg/memory.events" 2>/dev/null; fi
}

cleanup() {
  trap - EXIT INT TERM HUP
  [ -d "$cg" ] || return 0
  echo "in_memory_cgroup.sh: OOM kills in the cgroup: $(oom_kills)" >&2
  echo $$ >"$own/cgroup.procs" 2>/dev/null || true
  # What COMMAND left behind in the cgroup (ours: started inside it), one process at a time.
  local i pid
  for i in $(seq 50); do
    [ -s "$cg/cgroup.procs" ] || break
    if [ "$i" = 30 ]; then
      while read -r pid; do
        echo "in_memory_cgroup.sh: killing process $pid left in the cgroup" >&2
        kill -KILL "$pid" 2>/dev/null || true
      done <"$cg/cgroup.procs"
    fi
    sleep 0.2
  done
  for i in $(seq 25); do
    rmdir "$cg" 2>/dev/null && return 0
    sleep 0.2
  done
  echo "in_memory_cgroup.sh: could not remove $cg" >&2
}
child=""
# A signal to this script goes on to COMMAND (which then ends its ranks), then cleans up.
on_signal() {
  if [ -n "$child" ]; then
    kill -"$1" "$child" 2>/dev/null || true
    wait "$child" 2>/dev/null || true
  fi
  cleanup
  exit "$2"
}
trap cleanup EXIT
trap 'on_signal INT 130' INT
trap 'on_signal TERM 143' TERM
trap 'on_signal HUP 129' HUP

if [ "$version" = 1 ]; then
  echo "$limit" >"$cg/memory.limit_in_bytes" || skip "cannot set $cg/memory.limit_in_bytes"
  # Memory + swap: the same limit (no swap), where the kernel accounts swap.
  if [ -f "$cg/memory.memsw.limit_in_bytes" ]; then echo "$limit" >"$cg/memory.memsw.limit_in_bytes" 2>/dev/null || true; fi
  set_to=$(cat "$cg/memory.limit_in_bytes")
else
  echo "$limit" >"$cg/memory.max" || skip "cannot set $cg/memory.max"
  if [ -f "$cg/memory.swap.max" ]; then echo 0 >"$cg/memory.swap.max" 2>/dev/null || true; fi
  set_to=$(cat "$cg/memory.max")
fi
# The kernel rounds the limit down to whole pages.
[ "$set_to" -le "$limit" ] && [ "$set_to" -gt $((limit / 2)) ] || die "asked for a limit of $limit bytes, $cg has $set_to"
echo $$ >"$cg/cgroup.procs" || skip "cannot move a process into $cg"
echo "in_memory_cgroup.sh: running in cgroup v$version $cg, limit $set_to bytes" >&2

export MESHMEM_TEST_MEMORY_CGROUP=$cg
# In the background, so that a signal reaches the trap while COMMAND runs; stdin stays its own.
"$@" <&0 &
child=$!
wait "$child"
rc=$?
child=""
cleanup
exit $rc
