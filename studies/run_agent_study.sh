#!/usr/bin/env bash
# The staging agent's study for issue 10's last open row (Jacobi 4096^2 on 4 GPUs, staged
# against MPI host-staged), in one device call, from a pack built on another machine:
#   1. Jacobi on RANKS ranks (4 by default; one GPU each), 4096^2: staged forced
#      (MESHMEM_TRANSPORTS=staged,shm,mpi) with small puts through the agent's copy
#      (MESHMEM_STAGED_STREAM_FILL=off), then filled by the caller's stream (=on), then MPI host-staged, three
#      times interleaved; 16384^2 once each; every run checked against a single GPU;
#   2. one more staged run (stream fill on) with MESHMEM_STAGED_TRACE and bench/agent_trace.py's
#      summary (where each transfer's time went, writer to reader);
#   3. staged_bench to 256 KiB on 2 ranks, the fill off then on (small puts' and gets' latency);
#   4. with LAB=1 first: studies/driver_call_lab (what each CUDA call of the agent costs).
#   here:  (BUILD configured with -DMESHMEM_BUILD_STUDIES=ON) cmake --build BUILD --target 03_jacobi driver_call_lab
#          tests/gpu/run_entries.sh --pack BUILD gpu-pack     (gpu-pack is in .gitignore; carry it)
#   there: COMMIT=<short hash> studies/run_agent_study.sh gpu-pack OUT MACHINE   (about 2.5 min)
# OUT gets jacobi.csv, staged_small.csv, summary.txt (the RESULT lines) and logs.tgz.
set -uo pipefail
. "$(dirname "$0")/../bench/study_steps.sh"
study_begin "$@"
ranks=${RANKS:-4}
run() {  # size halo [env]: one checked Jacobi run
  echo "echo 'RESULT next: $1 $2 ${3:-}';" \
    "${3:-} MESHMEM_TRANSPORTS=staged,shm,mpi timeout 60 mpirun -np $ranks --bind-to none examples/03_jacobi" \
    "--size $1 --iters 2000 --halo=$2 --decomp=rows --check --csv \$O/jacobi.csv --commit \$C --machine \$M --date \$D" \
    "$(result '^jacobi ');"
}
ab() {  # size
  echo "$(run "$1" meshmem MESHMEM_STAGED_STREAM_FILL=off) $(run "$1" meshmem MESHMEM_STAGED_STREAM_FILL=on) $(run "$1" mpi)"
}
lab="studies/driver_call_lab --threads 1,2,4 $(result '^[a-z]'); exit \${PIPESTATUS[0]}"
trace="$(run 4096 meshmem "MESHMEM_STAGED_STREAM_FILL=on MESHMEM_STAGED_TRACE=\$O/trace") python3 $root/bench/agent_trace.py \$O/trace $(result '^[0-9]')"
steps=()
[ "${LAB:-0}" = 1 ] && steps+=("cmd driver_call_lab 120 $lab")
# Small staged puts and gets between two of the GPUs, the fill off then on (latency column).
small="for f in off on; do echo \"RESULT next: staged_bench fill \$f\"; MESHMEM_STAGED_STREAM_FILL=\$f timeout 50 mpirun -np 2 --bind-to none bench/staged_bench --max-bytes 256K --iters 50 --csv \$O/staged_small.csv --commit \$C --machine \$M $(result 'staged_(put|get) (meshmem|d2h) '); done"
steps+=("cmd jacobi 150 for rep in 1 2 3; do $(ab 4096) done; $(ab 16384)" "cmd trace 60 $trace" "cmd staged_small 110 $small")
"$root/tests/gpu/run_entries.sh" "$pack" "$logs/steps" "${steps[@]}"
study_end $? jacobi.csv staged_small.csv
