#!/usr/bin/env bash
# Mutation check for the GPU machine: two broken barriers (auto and event skipping the GPU
# wait for busy peers) are built from a copy of the tree, and BarrierOrdersBusyAndIdleStreams
# must fail under each. Run from the repository root: tests/gpu/check_barrier_test_bites.sh OUT
# (ran on 4 x H200 at 22ef171: both mutants failed the test, as they must).
set -u
out=${1:?out dir}
for mutant in auto event; do
  m=/tmp/mut-$mutant
  rm -rf $m && mkdir -p $m && cp -r comm ipc tests examples bench cmake launch CMakeLists.txt $m/ 2>/dev/null
  f=$m/comm/src/cuda/device_backend_cuda.cpp
  if [ $mutant = auto ]; then
    sed -i 's/    if (std::none_of(topo.node_ranks.begin(), topo.node_ranks.end(), \[&\](int r) { return peer_busy_\[r\]; })) return;/    return;/' $f
    env=""
  else
    sed -i 's/if (r != topo.rank \&\& peer_busy_\[r\])/if (false)/' $f
    env="MESHMEM_BARRIER=event"
  fi
  diff -q $f comm/src/cuda/device_backend_cuda.cpp >/dev/null && { echo "$mutant: mutation not applied"; continue; }
  cmake -S $m -B $m/build -G Ninja -DCMAKE_MAKE_PROGRAM=/opt/torch/.venv/bin/ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > $out/mut_$mutant.configure.log 2>&1
  cmake --build $m/build -j 64 --target test_device_window > $out/mut_$mutant.build.log 2>&1 || { tail -20 $out/mut_$mutant.build.log; continue; }
  env $env MESHMEM_TIMEOUT=60 timeout 120 mpirun --allow-run-as-root -np 4 --bind-to none $m/build/tests/gpu/test_device_window --gtest_filter='*BusyAndIdle*' > $out/mutation_$mutant.log 2>&1
  echo "mutant $mutant: test exit $? (nonzero expected)"; grep -E "rounds in which|PASSED|FAILED  " $out/mutation_$mutant.log | head -3
done
