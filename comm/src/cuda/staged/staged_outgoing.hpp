// StagedOutgoing: a transfer to a hidden reader (a put, or the answer to its get), or this
// rank's request for a get from it, as far as the staging agent has posted it on the channel.
// The agent's writer side advances it; the reader side queues the answers to peers' gets.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "piece_cursor.hpp"
#include "cuda/staged/channel_layout.hpp"
#include "meshmem/ipc/awake_clock.hpp"
#include "meshmem/types.hpp"

namespace meshmem::detail {

struct StagedOutgoing {
  int reader = -1;
  bool get_request = false;  // a get's request: one descriptor, no data
  bool answer = false;       // answers the reader's get (not one of this rank's transfers)
  std::uint64_t filled_slot = kChannelAddress;  // a stream-filled put's slot, its bytes there already
  bool host_source = false;  // the source is pageable host memory: copied by the agent's thread
  bool source_complete = false;  // StagedRequest::source_complete
  bool ends_at_timeout = false;  // StagedRequest::ends_at_timeout
  cudaMemcpyKind to_slot = cudaMemcpyDefault;  // the copies into slots (device to host where known)
  bool failure_counted = false;  // an answer to a refused get: its reader was told already
  // The source: this rank's window (answers) or kChannelAddress and an address; no data when
  // `width` is 0 (a signal alone, or a refused get).
  std::uint64_t src_window = kChannelAddress, src = 0;
  std::size_t width = 0, rows = 1, src_pitch = 0, dst_pitch = 0;
  std::uint64_t window = kChannelAddress;  // the reader's window (the one read, for a request), or kChannelAddress
  std::uint64_t dst = 0;                   // offset in it, or an address of the reader (of this rank, for a request)
  std::uint64_t signal_window = kChannelAddress, signal_index = 0, value = 0;
  SignalOp op = SignalOp::Set;
  int done_rank = -1;  // whose transfer word ends it
  std::uint64_t done_word = 0, ticket = 0;
  PieceCursor pieces;
  ipc::AwakeClock::time_point moved;
  std::string what;  // for messages
};

}  // namespace meshmem::detail
