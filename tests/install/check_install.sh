#!/usr/bin/env bash
# Installs the build into a scratch prefix, builds tests/install/consumer against it with
# find_package(meshmem), and runs it on 2 ranks (meshmem::meshmem and meshmem::core).
#   check_install.sh BUILD_DIR SOURCE_DIR MPIEXEC
set -euo pipefail
build=$1; src=$2; mpiexec=$3
work="$build/install-check"
rm -rf "$work"
cmake --install "$build" --prefix "$work/prefix" > "$work.log" 2>&1 || { cat "$work.log"; exit 1; }
cmake -S "$src/tests/install/consumer" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release
cmake --build "$work/consumer" -j 2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for exe in consumer consumer_core; do
  "$mpiexec" -np 2 --oversubscribe --bind-to none "$work/consumer/$exe"
done
echo "installed meshmem found and used: OK"
