#!/usr/bin/env bash
# Issue 10's rows still open after stop 49, on a machine of 2 or more GPUs (one GPU per rank), in
# one device call from a pack built elsewhere (about 3-4 minutes on 4 x H200):
#   1. staged_bench 1 MiB .. 256 MiB under MESHMEM_STAGED_COMPLETION (target, source) x
#      MESHMEM_STAGED_FIRST_PIECE (off, 256K): is 64 MiB >= 0.9 x min(d2h, h2d) with either, and
#      does the ramp pay where each rank has its own GPU (on one shared H200 it did not)?
#   2. the Jacobi example, staged forced, under both completions, against MPI host-staged, on 2
#      and (with 4 GPUs) 4 GPUs, 4096^2 and 16384^2, every run --check'ed.
#   here:  cmake --build BUILD --target staged_bench 03_jacobi meshmem-info
#          tests/gpu/run_entries.sh --pack BUILD gpu-pack     (gpu-pack is in .gitignore; carry it)
#   there: COMMIT=<short hash> BUDGET=500 bench/run_open_rows.sh gpu-pack OUT MACHINE
# OUT gets staged.csv (the machine column names completion and first piece), jacobi.csv (the
# machine column names the completion; MPI rows plain), summary.txt and logs.tgz.
set -uo pipefail
. "$(dirname "$0")/study_steps.sh"
study_begin "$@"
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
{ nvidia-smi topo -m; nvidia-smi -L; } > "$logs/topo.txt" 2>&1
steps=()
for completion in target source; do
  for first in off 256K; do
    steps+=("cmd staged_${completion}_${first} 90 MESHMEM_STAGED_COMPLETION=$completion MESHMEM_STAGED_FIRST_PIECE=$first \
mpirun -np 2 --bind-to none -x MESHMEM_STAGED_COMPLETION -x MESHMEM_STAGED_FIRST_PIECE bench/staged_bench \
--min-bytes 1M --max-bytes 256M --csv \$O/staged_${completion}_${first}.csv --commit \$C \
--machine \$M-completion-$completion-first-piece-$first --date \$D $(result '^staged_'); exit \${PIPESTATUS[0]}")
  done
done
jacobi() {  # ranks: both sizes; meshmem under each completion, then MPI
  echo "for s in '4096 2000' '16384 1000'; do set -- \$s;" \
    "for v in meshmem:target meshmem:source mpi:target; do h=\${v%:*}; c=\${v#*:}; m=\$M; [ \$h = meshmem ] && m=\$M-completion-\$c;" \
    "MESHMEM_STAGED_COMPLETION=\$c MESHMEM_TRANSPORTS=staged,shm,mpi timeout 60 mpirun -np $1 --bind-to none" \
    "-x MESHMEM_STAGED_COMPLETION -x MESHMEM_TRANSPORTS examples/03_jacobi --size \$1 --iters \$2 --halo=\$h" \
    "--decomp=rows --check --csv \$O/jacobi.csv --commit \$C --machine \$m --date \$D $(result '^jacobi ');" \
    "[ \${PIPESTATUS[0]} = 0 ] || echo \"RESULT FAILED: np $1 size \$1 halo \$h completion \$c\"; done; done"
}
steps+=("cmd jacobi_np2 100 $(jacobi 2)")
[ "$ngpu" -ge 4 ] && steps+=("cmd jacobi_np4 130 $(jacobi 4)")
"$root/tests/gpu/run_entries.sh" "$pack" "$logs/steps" "${steps[@]}"
rc=$?
cat "$logs"/staged_*.csv > "$logs/staged.csv" 2>/dev/null
study_end $rc staged.csv jacobi.csv
