#!/usr/bin/env bash
# launch/meshrun as users call it, on a machine without GPUs: the node's GPUs come from a
# topology file (MESHRUN_TOPOLOGY), so placement, isolation and binding can be checked here.
#   check_meshrun.sh MESHRUN MESHMEM_INFO
set -euo pipefail
meshrun=$1; info=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAILED: $*"; exit 1; }
ok() { echo "ok: $*"; }

# Two GPUs, each near its own CPU where there are two (CPU 0 for both otherwise).
cpu_b=$(( $(nproc) > 1 ? 1 : 0 ))
printf '0000:19:00.0 0 0\n0000:3b:00.0 0 %s\n' "$cpu_b" > "$work/topo"
export MESHRUN_TOPOLOGY=$work/topo
probe='echo "R=$OMPI_COMM_WORLD_RANK CVD=${CUDA_VISIBLE_DEVICES-unset} ORDER=${CUDA_DEVICE_ORDER-unset} AFF=$(taskset -pc $$ | sed "s/.*: //")"'

# 4 ranks on 2 GPUs (and more ranks than cores here): GPU = local rank mod 2, all GPUs
# visible, PCI order, bound to that GPU's CPUs, one --verbose line per rank.
"$meshrun" --verbose -np 4 sh -c "$probe" > "$work/out" 2> "$work/err" || { cat "$work/out" "$work/err"; fail "meshrun -np 4"; }
for r in 0 1 2 3; do
  want_cpu=$(( r % 2 == 0 ? 0 : cpu_b ))
  line=$(grep "^R=$r " "$work/out") || fail "rank $r did not run"
  [[ $line == *"CVD=unset"* ]] || fail "rank $r: CUDA_VISIBLE_DEVICES set without --isolate: $line"
  [[ $line == *"ORDER=PCI_BUS_ID"* ]] || fail "rank $r: CUDA_DEVICE_ORDER: $line"
  if ! command -v numactl >/dev/null; then
    [[ $line == *"AFF=$want_cpu" ]] || fail "rank $r: bound to CPUs '${line##*AFF=}', expected $want_cpu"
  fi
  grep -q "meshrun: rank $r on .*local rank $r: GPU $((r % 2)) " "$work/err" || { cat "$work/err"; fail "rank $r: --verbose line"; }
done
ok "GPU by node-local rank, every GPU visible, PCI order, CPUs of its GPU, --verbose per rank"

# --gpu-map: the rank's GPU only, in CUDA_VISIBLE_DEVICES.
"$meshrun" --gpu-map 1,1,0 -np 3 sh -c "$probe" > "$work/out" || fail "meshrun --gpu-map"
for r in 0 1 2; do
  want=$([ "$r" = 2 ] && echo 0 || echo 1)
  grep -q "^R=$r CVD=$want " "$work/out" || { cat "$work/out"; fail "rank $r: expected CUDA_VISIBLE_DEVICES=$want"; }
done
ok "--gpu-map 1,1,0 isolates each rank on its GPU"

# --no-bind leaves the affinity alone.
"$meshrun" --no-bind --verbose -np 2 sh -c "$probe" > "$work/out" 2> "$work/err" || fail "meshrun --no-bind"
grep -q "not bound (--no-bind)" "$work/err" || fail "--no-bind: not said"
ok "--no-bind"

# A bad map and a map past the node's GPUs are refused, naming the problem.
if "$meshrun" --gpu-map 0,x -np 2 true 2> "$work/err"; then fail "--gpu-map 0,x accepted"; fi
grep -q "expected comma-separated GPU indices" "$work/err" || fail "bad --gpu-map: $(cat "$work/err")"
if "$meshrun" --gpu-map 5 -np 1 true 2> "$work/err"; then fail "--gpu-map 5 accepted with 2 GPUs"; fi
grep -q "names GPU 5, but this node has 2" "$work/err" || fail "GPU past the node's: $(cat "$work/err")"
ok "bad maps refused"

# No GPU on the node: the job runs, unbound, and says so; the program's failure is the job's.
: > "$work/topo"
"$meshrun" --verbose -np 2 true 2> "$work/err" || fail "a job without GPUs"
grep -q "no GPU on this node, not bound" "$work/err" || fail "no-GPU placement not said"
if "$meshrun" -np 2 sh -c 'exit 7' 2> /dev/null; then fail "a failing program's exit code was lost"; fi
ok "no GPU: runs unbound; failures propagate"

# Launcher options after meshrun's, "--" before the program, and a real meshmem program.
unset MESHRUN_TOPOLOGY
MESHMEM_TIMEOUT=20s "$meshrun" -np 2 --tag-output -- "$info" --job > "$work/out" 2>&1 || { cat "$work/out"; fail "meshmem-info --job under meshrun"; }
grep -q "MESHMEM_TIMEOUT=20000ms" "$work/out" || { cat "$work/out"; fail "MESHMEM_TIMEOUT not seen by the ranks"; }
ok "meshmem-info --job under meshrun, MESHMEM_* forwarded"
"$meshrun" --help | grep -q -- "--gpu-map" || fail "--help"
ok "--help"
