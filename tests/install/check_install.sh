#!/usr/bin/env bash
# Installs the build into a scratch prefix and builds tests/install/consumer against it the
# three ways users do: CMake find_package(meshmem) from a project declaring only CXX, the same
# declaring CXX CUDA (where a CUDA compiler exists), and a Makefile with mpicxx + pkg-config;
# each runs on 2 ranks (the CMake ones with meshmem::meshmem and meshmem::core).
#   check_install.sh BUILD_DIR SOURCE_DIR MPIEXEC
set -euo pipefail
build=$1; src=$2; mpiexec=$3
work="$build/install-check"
rm -rf "$work"
mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log" 2>&1 || { cat "$work/install.log"; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
run() { "$mpiexec" -np 2 --oversubscribe --bind-to none "$@"; }

languages=("CXX")
if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then languages+=("CXX;CUDA"); fi
for langs in "${languages[@]}"; do
  dir="$work/cmake-${langs//;/-}"
  cmake -S "$src/tests/install/consumer" -B "$dir" -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release \
    "-DCONSUMER_LANGUAGES=$langs" -DCMAKE_CUDA_ARCHITECTURES=80 -DCMAKE_CUDA_COMPILER="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" \
    > "$dir.log" 2>&1 || { cat "$dir.log"; echo "find_package(meshmem) from a project declaring LANGUAGES $langs: FAILED"; exit 1; }
  cmake --build "$dir" -j 2
  for exe in consumer consumer_core; do run "$dir/$exe"; done
  echo "CMake project (LANGUAGES $langs): OK"
done

mkdir -p "$work/make"
cp "$src/tests/install/consumer/Makefile" "$src/tests/install/consumer/consumer.cpp" "$work/make/"
PKG_CONFIG_PATH="$work/prefix/lib/pkgconfig:$work/prefix/lib64/pkgconfig" make -C "$work/make" --no-print-directory
run "$work/make/consumer"
echo "Makefile project (mpicxx + pkg-config): OK"
echo "installed meshmem found and used: OK"
