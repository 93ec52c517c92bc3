#!/bin/sh
# The launcher of the GPU test entries (tests/cmake/MeshmemGpuEntries.cmake): on a machine with
# no GPU device nodes (no /dev/nvidiactl, and no /dev/dxg of WSL) no CUDA device can be opened,
# so the entry is skipped here, with the reason, before mpirun starts its ranks (each of which
# would find no GPU and skip; about 1.5 s an entry, 85 entries on CI). Elsewhere it runs the
# command, and the test binaries decide (GPUs hidden by CUDA_VISIBLE_DEVICES, too few GPUs).
if [ ! -e /dev/nvidiactl ] && [ ! -e /dev/dxg ]; then
  echo "skipped: no GPU on this machine (no /dev/nvidiactl or /dev/dxg): GPU entries run on GPU machines (docs/testing.md)"
  exit 77
fi
exec "$@"
