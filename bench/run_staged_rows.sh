#!/usr/bin/env bash
# Issue 10's rows on a machine of 2 or more GPUs, in one device call, from a pack built on
# another machine: staged_bench (4 KiB .. 1 GiB, 2 ranks), the staging memory lab (4 ranks),
# the Jacobi example with staged forced against MPI host-staged (2 and 4 GPUs, both sizes), then
# the placements of the GPU suite: isolated, staged forced, and ipc beside staged in one job
# (4 ranks on 2 GPUs with peer access off). Steps that would end past BUDGET are skipped.
#   here:  (BUILD with -DMESHMEM_BUILD_STUDIES=ON, for staging_memory_lab) cmake --build BUILD --target test_device_window test_device_real_use test_staged \
#            test_staging_pool test_gpu_soak staged_bench staging_memory_lab 03_jacobi
#          tests/gpu/run_entries.sh --pack BUILD gpu-pack     (gpu-pack is in .gitignore; carry it)
#   there: COMMIT=<short hash> BUDGET=500 bench/run_staged_rows.sh gpu-pack OUT MACHINE   (about 8 min)
# OUT gets staged.csv, jacobi.csv, jacobi_serial.csv (MESHMEM_HALO_SENDS=serial), summary.txt
# and logs.tgz (the device tool returns 8 files).
set -uo pipefail
. "$(dirname "$0")/study_steps.sh"
study_begin "$@"
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
{ nvidia-smi topo -m; nvidia-smi -L; } > "$logs/topo.txt" 2>&1
# Each step is a shell command run in the pack (tests/gpu/run_entries.sh 'cmd'); its lines
# that start with RESULT go into the summary.
staged="mpirun -np 2 --bind-to none bench/staged_bench --call-times --csv \$O/staged.csv --commit \$C --machine \$M --date \$D $(result '^staged_'); exit \${PIPESTATUS[0]}"
memlab="mpirun -np 4 --bind-to none studies/staging_memory_lab --bytes 4G $(result '^ +[0-9]+ +[0-9a-f]+:'); exit \${PIPESTATUS[0]}"
jacobi() {  # ranks [halos] [csv]: both sizes, staged forced (--halo=meshmem) and --halo=mpi, every run checked
  echo "for s in '4096 2000' '16384 1000'; do set -- \$s; for h in ${2:-meshmem mpi}; do" \
    "MESHMEM_TRANSPORTS=staged,shm,mpi timeout 60 mpirun -np $1 --bind-to none examples/03_jacobi --size \$1" \
    "--iters \$2 --halo=\$h --decomp=rows --check --csv \$O/${3:-jacobi.csv} --commit \$C --machine \$M --date \$D" \
    "$(result '^jacobi ');" \
    "[ \${PIPESTATUS[0]} = 0 ] || echo \"RESULT FAILED: np $1 size \$1 halo \$h\"; done; done"
}
# 4 ranks on 2 GPUs under peer access off: ranks sharing a GPU on ipc, the others staged.
mix() { echo "CUDA_VISIBLE_DEVICES=0,1 ctest --test-dir . -R '^$1\$' --output-on-failure --timeout 200 $(result 'Test +#'); exit \${PIPESTATUS[0]}"; }
steps=("cmd staged_bench 120 $staged" "cmd memlab 45 $memlab" "cmd jacobi_np2 80 $(jacobi 2)")
# MESHMEM_HALO_SENDS=serial (the middle ranks' two staged neighbours one after the other, the
# default until 2026-11-28) as the control: its own CSV, whose meshmem rows are that variant.
[ "$ngpu" -ge 4 ] && steps+=("cmd jacobi_np4 110 $(jacobi 4)"
  "cmd jacobi_np4_serial 130 MESHMEM_HALO_SENDS=serial; export MESHMEM_HALO_SENDS; $(jacobi 4 meshmem jacobi_serial.csv)"
  "entry gpu.halo_sends_concurrent.np4 120" "entry gpu.halo_sends_concurrent_window.np4 120"
  "entry gpu.halo_sends_serial.np4 120" "entry gpu.halo_sends_serial_window.np4 120"
  "entry gpu.isolated_forced_staged.np4 120")
steps+=("cmd mix_peer_access_off 150 $(mix gpu.peer_access_off.np4)"
        "cmd mix_peer_access_off_real_use 120 $(mix gpu.peer_access_off_real_use.np4)"
        "cmd mix_soak 90 $(mix gpu.soak_peer_access_off.np4)"
        "entry gpu.forced_staged.np4 150" "entry gpu.staged.np4 90" "entry gpu.staging_pool.np4 60"
        "entry gpu.soak_forced_staged.np4 90" "entry gpu.forced_staged_real_use.np2 120"
        "entry gpu.isolated_staged.np2 60" "entry gpu.staged_one_agent.np4 90" "entry gpu.staged_held_lane.np2 90")
"$root/tests/gpu/run_entries.sh" "$pack" "$logs/steps" "${steps[@]}"
study_end $? staged.csv jacobi.csv jacobi_serial.csv
