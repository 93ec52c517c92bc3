#!/usr/bin/env bash
# Mutation check for the GPU machine: broken barriers (and launches) are built from a copy of the tree and
# the barrier tests must fail under each:
#   kernel   the barrier kernel stores its flags but never waits for the peers' flags
#   meeting  the host meeting skips the GPU part even when a stream has work
#   event    busy peers' events are never waited on
#   proxy    the cross-node proxy releases the stream without meeting the other ranks
#   leaders  the hierarchical barrier across nodes leaves out the node leaders' all-reduce
#   watchdog the leaders' watchdog never starts: a leader that never comes holds the stream
#            (the timeout test must fail, its stream never ends)
#   early    early-launched kernels do not wait for the stream's previous kernel
#            (griddepcontrol.wait removed): the early-launch tests must fail
# Run from the repository root: [MUTANTS="kernel meeting"] tests/gpu/check_barrier_test_bites.sh OUT_DIR
set -u
out=${1:?out dir}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ninja=$(command -v ninja || echo /opt/torch/.venv/bin/ninja)
for mutant in ${MUTANTS:-kernel meeting event proxy leaders watchdog early}; do
  m=/tmp/mut-$mutant
  rm -rf $m && mkdir -p $m && cp -r comm ipc tests examples bench cmake launch CMakeLists.txt $m/ 2>/dev/null
  f=$m/comm/src/cuda/stream_barrier.cpp
  filter='*BusyAndIdle*'
  env=()
  target=test_device_window np=4
  case $mutant in
    kernel) f=$m/comm/src/cuda/kernels.cu
            sed -i 's/    wait_word(my_flags + r, Cmp::GE, epoch, limit, FaultKind::Barrier/    if (false) wait_word(my_flags + r, Cmp::GE, epoch, limit, FaultKind::Barrier/' $f
            env=(MESHMEM_BARRIER=kernel) ;;
    meeting) sed -i 's/    if ((all \& kBusy) == 0) return;/    return;/' $f
             env=(MESHMEM_BARRIER=meeting) ;;
    event) sed -i 's/      if (r == topo_.rank || !busy_\[r\]) continue;/      continue;/' $f; env=(MESHMEM_BARRIER=event) ;;
    proxy) f=$m/comm/src/cuda/stream_barrier_proxy.cpp
           sed -i 's/      boot_.arrive("comm.barrier(stream)");/      (void)0;/' $f
           filter='*AcrossNodes*'; env=(MESHMEM_SIMULATE_NODES=2 MESHMEM_BARRIER_ACROSS_NODES=proxy) ;;
    leaders) sed -i 's/        leaders_->enqueue(static_cast<cudaStream_t>(stream), capturing, where(topo_));/        (void)0;/' $f
             filter='*BarrierAcrossNodes*'; env=(MESHMEM_SIMULATE_NODES=2 MESHMEM_BARRIER_ACROSS_NODES=nccl) ;;
    watchdog) f=$m/comm/src/cuda/leader_all_reduce.cpp
              sed -i 's/  if (leader_ \&\& timeout_.count() > 0) watchdog_ = /  if (false) watchdog_ = /' $f
              filter='*.BarrierWithAPeerThatNeverComesTimesOut'; target=test_device_real_use; np=2
              env=(MESHMEM_SIMULATE_NODES=2 MESHMEM_BARRIER_ACROSS_NODES=nccl) ;;
    early) f=$m/comm/src/cuda/kernels.cu
           sed -i 's/  if (early) asm volatile("griddepcontrol.wait;" ::: "memory");/  (void)early;/' $f
           filter='*EarlyLaunched*'; target=test_device_real_use; np=2 ;;
  esac
  diff -q $f ${f#$m/} >/dev/null && { echo "mutant $mutant: mutation not applied (the code changed?)"; continue; }
  cmake -S $m -B $m/build -G Ninja -DCMAKE_MAKE_PROGRAM=$ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > $out/mut_$mutant.configure.log 2>&1
  cmake --build $m/build -j "$(nproc)" --target $target > $out/mut_$mutant.build.log 2>&1 || { tail -20 $out/mut_$mutant.build.log; continue; }
  env "${env[@]}" MESHMEM_TIMEOUT=60 timeout 120 mpirun -np $np --bind-to none $m/build/tests/gpu/$target --gtest_filter="$filter" > $out/mutation_$mutant.log 2>&1
  echo "mutant $mutant: test exit $? (nonzero expected)"; grep -E "rounds in which|rounds with|PASSED|FAILED  " $out/mutation_$mutant.log | head -3
done
