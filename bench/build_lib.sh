# Sourced by the bench scripts that build two source trees in one device call
# (run_before_after.sh, run_staged_paths.sh).
#   bench_build SRC DIR LOG TARGET...
# configures SRC into DIR (Release, CUDA arch 90, Ninja where it is found: the GPU machines'
# /opt/torch/.venv/bin/ninja) and builds the targets, writing cmake's output to LOG; its status
# is cmake's.
bench_gen=()
bench_ninja=$(command -v ninja || ls /opt/torch/.venv/bin/ninja 2>/dev/null || true)
[ -n "$bench_ninja" ] && bench_gen=(-G Ninja -DCMAKE_MAKE_PROGRAM="$bench_ninja")
bench_build() {
  local src=$1 dir=$2 log=$3
  shift 3
  cmake -S "$src" -B "$dir" "${bench_gen[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > "$log" 2>&1 &&
    cmake --build "$dir" -j "$(nproc)" --target "$@" >> "$log" 2>&1
}
