// The counts that move a staging channel on (a writer's posted count, a reader's consumed
// count, a transfer's done word), as both sides of the staging agent write them, and the row
// copies both enqueue.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>

#include "log.hpp"
#include "cuda/runtime/event_pool.hpp"

namespace meshmem::detail {

// Raises `word` to `value`: a later count or end, written first (by a stream, or by another
// path of the agent's thread), stands.
inline void raise_count(std::uint64_t* word, std::uint64_t value) {
  std::uint64_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
  while (seen < value && !__atomic_compare_exchange_n(word, &seen, value, true, __ATOMIC_RELEASE, __ATOMIC_ACQUIRE)) {
  }
}

// `rows` rows of `width` bytes. `kind`: cudaMemcpyDefault unless both sides are known (device
// to host costs the host less per call then, studies/driver_call_lab).
inline cudaError_t copy_rows(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch,
                             std::size_t width, std::size_t rows, cudaStream_t stream,
                             cudaMemcpyKind kind = cudaMemcpyDefault) {
  return rows == 1 ? cudaMemcpyAsync(dst, src, width, kind, stream)
                   : cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, kind, stream);
}

// A channel count that the agent's thread writes once a copy is done, instead of a stream
// write after the copy: a stream write between two copies on one stream idles that copy
// engine (studies/pipeline_lab), and a stream of its own for the writes would be one more
// stream that a waiting stream of this process can hold (docs/semantics.md "GPU queues").
// Only for pieces that more pieces of their transfer follow: a transfer's last piece has its
// count (and end) written by its stream, which covers the pieces before it. The host raises a
// count, never lowers it, so that a later count the stream wrote first stands.
struct CountAfterCopy {
  cudaEvent_t copied;  // recorded after the copy
  bool pooled;         // `copied` came from the agent's EventPool (incoming chunks; given back
                       // once looked at, by the last of the entries that share it)
  int peer;            // the reader (posted) or the writer (consumed), for errors
  std::uint64_t* word;
  std::uint64_t value;
};

// Writes the counts of `pending` (one stream's, oldest first) whose copies are done; true if
// any. A failed event query leaves its count unwritten (the transfer's last count, its
// stream's, ends it or its wait times out): logged, and passed to keep_error(message) for the
// rank's next call. `posted`: the writer's posted counts (else a reader's consumed ones).
template <class KeepError>
bool write_counts_after_copies(std::deque<CountAfterCopy>& pending, EventPool& events, bool posted, int rank,
                               KeepError keep_error) {
  bool any = false;
  while (!pending.empty()) {
    const CountAfterCopy c = pending.front();
    // A later count the stream wrote covers it already.
    const cudaError_t rc = __atomic_load_n(c.word, __ATOMIC_ACQUIRE) >= c.value ? cudaSuccess : cudaEventQuery(c.copied);
    if (rc == cudaErrorNotReady) break;  // one stream's copies end in order: the oldest not done holds the rest
    pending.pop_front();
    if (c.pooled) events.give_back(c.copied);
    if (rc != cudaSuccess) {
      (void)cudaGetLastError();
      const std::string message = "staged transport on rank " + std::to_string(rank) + ": cudaEventQuery after " +
                                  (posted ? "a chunk's copy to rank " : "the copy of a chunk from rank ") +
                                  std::to_string(c.peer) + " failed (its " + (posted ? "posted" : "consumed") +
                                  " count " + std::to_string(c.value) + " is not written): " + cudaGetErrorString(rc);
      log(LogLevel::Error, message);
      keep_error(message);
      continue;
    }
    raise_count(c.word, c.value);
    any = true;
  }
  return any;
}

}  // namespace meshmem::detail
