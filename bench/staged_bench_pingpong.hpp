// staged_bench's put_signal ping-pong: rank 0 put_signals to rank 1, whose stream waits for the
// signal and put_signals back; one way = half a round trip. Stream-ordered on both sides, every
// byte of both destinations checked (and the guard behind them untouched).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

#include <meshmem/meshmem.hpp>

namespace staged_pingpong {

struct Row {
  std::size_t size = 0;
  double one_way_us = -1;        // the fastest loop's time / (2 x round trips)
  double put_signal_call_us = -1;  // this rank's host time inside one put_signal (mean of that loop)
  double wait_call_us = -1;        // this rank's host time inside one wait_until (mean of that loop)
  bool ok = false;               // every byte of both ranks' destinations as sent
};

// Collective on both ranks of `comm` (2 ranks): `win` holds at least max(sizes) + the guard
// (staged_data::kGuard) bytes on each; `s` is a stream of this rank's GPU, `counters` two words
// of its memory for the check. Every rank gets the rows (its own times; `ok` agreed by both);
// staged_bench records rank 0's.
std::vector<Row> put_signal_pingpong(meshmem::Comm& comm, const meshmem::Window& win, const std::vector<std::size_t>& sizes,
                                     int iters, int reps, cudaStream_t s, unsigned long long* counters, int rank);

}  // namespace staged_pingpong
