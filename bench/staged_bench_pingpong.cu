#include "staged_bench_pingpong.hpp"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>

#include "bench_check.hpp"
#include "staged_bench_data.cuh"

namespace staged_pingpong {

namespace {
using Clock = std::chrono::steady_clock;
constexpr std::size_t kLoopBytes = std::size_t{1} << 30;  // a loop moves at most this much each way
}  // namespace

std::vector<Row> put_signal_pingpong(meshmem::Comm& comm, const meshmem::Window& win, const std::vector<std::size_t>& sizes,
                                     int iters_wanted, int reps, cudaStream_t s, unsigned long long* counters, int rank) {
  const int peer = 1 - rank;
  const std::size_t max_size = *std::max_element(sizes.begin(), sizes.end());
  void* src = nullptr;
  CK(cudaMalloc(&src, max_size));
  meshmem::Signals sig = comm.alloc_signals(1);
  std::uint64_t value = 0;  // the signal only grows: no reset between loops
  std::vector<Row> rows;
  for (std::size_t size : sizes) {
    Row row;
    row.size = size;
    const int iters = static_cast<int>(std::max<std::size_t>(3, std::min<std::size_t>(iters_wanted, kLoopBytes / size)));
    // Each rank sends its own pattern; the check reads the peer's.
    const auto seed_of = [size](int r) { return 0x3000ull + size + static_cast<unsigned long long>(r); };
    staged_data::fill(src, size, seed_of(rank), s);
    CK(cudaMemsetAsync(win.local(), staged_data::kPoison, size + staged_data::kGuard, s));
    CK(cudaStreamSynchronize(s));
    comm.barrier();
    double best_s = 1e30, best_put_ns = 1e30, best_wait_ns = 1e30;
    for (int rep = -1; rep < reps; ++rep) {  // rep -1: the warm-up loop
      comm.barrier();
      double put_ns = 0, wait_ns = 0;
      const auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) {
        ++value;
        const auto a = Clock::now();
        if (rank == 0) comm.put_signal(win, peer, 0, src, size, sig, 0, value, meshmem::SignalOp::Set, s);
        else comm.wait_until(sig, 0, meshmem::Cmp::GE, value, s);
        const auto b = Clock::now();
        if (rank == 0) comm.wait_until(sig, 0, meshmem::Cmp::GE, value, s);
        else comm.put_signal(win, peer, 0, src, size, sig, 0, value, meshmem::SignalOp::Set, s);
        const auto c = Clock::now();
        put_ns += std::chrono::duration<double, std::nano>(rank == 0 ? b - a : c - b).count();
        wait_ns += std::chrono::duration<double, std::nano>(rank == 0 ? c - b : b - a).count();
      }
      CK(cudaStreamSynchronize(s));
      const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
      if (rep < 0) continue;
      best_s = std::min(best_s, secs);
      best_put_ns = std::min(best_put_ns, put_ns / iters);
      best_wait_ns = std::min(best_wait_ns, wait_ns / iters);
    }
    comm.quiet(s);
    CK(cudaStreamSynchronize(s));
    comm.barrier();
    // Every byte: this rank's part holds the peer's pattern, the guard behind it still poison.
    const staged_data::Mismatch data = staged_data::compare(win.local(), size, seed_of(peer), -1, counters, s);
    const staged_data::Mismatch tail = staged_data::compare(static_cast<const char*>(win.local()) + size, staged_data::kGuard,
                                                            0, staged_data::kPoison, counters, s);
    if (data.count != 0 || tail.count != 0)
      std::fprintf(stderr, "rank %d: put_signal ping-pong %zu B: CHECK FAILED: %llu bytes wrong (first at %llu), %llu written past the end\n",
                   rank, size, data.count, data.first, tail.count);
    int ok_here = data.count == 0 && tail.count == 0 ? 1 : 0, ok_all = 0;
    MK(MPI_Allreduce(&ok_here, &ok_all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
    row.ok = ok_all != 0;
    row.one_way_us = best_s * 1e6 / (2.0 * iters);
    row.put_signal_call_us = best_put_ns / 1e3;
    row.wait_call_us = best_wait_ns / 1e3;
    rows.push_back(row);
  }
  sig.free();
  CK(cudaFree(src));
  return rows;
}

}  // namespace staged_pingpong
