#!/usr/bin/env bash
# The staging agent's study for issue 10's last open row (Jacobi 4096^2 on 4 GPUs, staged
# against MPI host-staged), in one device call, from a pack built on another machine:
#   1. bench/driver_call_lab: what each CUDA call the agent makes per small transfer costs the
#      host, and whether 2 or 4 threads making them on streams of their own go faster (fewer or
#      cheaper calls, or a second agent thread?);
#   2. Jacobi 4096^2 on 4 ranks, staged (MESHMEM_TRANSPORTS=staged,shm,mpi) then MPI, three
#      times interleaved, every run checked;
#   3. one more staged run with MESHMEM_TRACE_STAGED and bench/agent_trace.py's summary (where
#      each transfer's time went, writer to reader).
#   here:  cmake --build BUILD --target driver_call_lab 03_jacobi
#          tests/gpu/run_entries.sh --pack BUILD gpu-pack     (gpu-pack is in .gitignore; carry it)
#   there: COMMIT=<short hash> bench/run_agent_study.sh gpu-pack OUT MACHINE   (about 3 min, 4 GPUs)
# OUT gets jacobi.csv, summary.txt (the RESULT lines) and logs.tgz.
set -uo pipefail
. "$(dirname "$0")/study_steps.sh"
study_begin "$@"
run() {  # halo [env]: one Jacobi run of 4 ranks, 4096^2, 2000 iterations
  echo "${2:-} MESHMEM_TRANSPORTS=staged,shm,mpi timeout 60 mpirun -np 4 --bind-to none examples/03_jacobi --size 4096" \
    "--iters 2000 --halo=$1 --decomp=rows --check --csv \$O/jacobi.csv --commit \$C --machine \$M --date \$D $(result '^jacobi ');"
}
lab="bench/driver_call_lab --threads 1,2,4 $(result '^[a-z]'); exit \${PIPESTATUS[0]}"
ab="for rep in 1 2 3; do $(run meshmem) $(run mpi) done"
trace="$(run meshmem "MESHMEM_TRACE_STAGED=\$O/trace") python3 $root/bench/agent_trace.py \$O/trace $(result '^[0-9]')"
"$root/tests/gpu/run_entries.sh" "$pack" "$logs/steps" "cmd driver_call_lab 120 $lab" "cmd jacobi 150 $ab" \
  "cmd trace 60 $trace"
study_end $? jacobi.csv
