// StagedRequest: one staged transfer as the callers' side (transport_staged.hpp) hands it to
// the staging agent: its route, both ends, its shape, its signal, and the words that say its
// source is ready and that it ended.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "cuda/staged/channel_layout.hpp"
#include "meshmem/types.hpp"

namespace meshmem::detail {

// One transfer, as the agent enqueues it: `rows` rows of `width` bytes, `src_pitch` /
// `dst_pitch` apart (a contiguous transfer is one row).
struct StagedRequest {
  static constexpr std::uint64_t kAddress = kChannelAddress;  // a window id that is none: a raw address
  enum class Route { Visible, ToHidden, FromHidden };
  Route route = Route::Visible;
  int peer = -1;                // the other rank
  // ToHidden, a stream-filled put: the caller's stream copied the source into this slot (an offset
  // in this rank's region of the pool, FillSlots) before it set `ready`; kAddress: none.
  std::uint64_t filled_slot = kAddress;
  // Set to `ticket` by the caller's stream once the source is ready (ControlWords::ready;
  // null: handed over by a captured doorbell, rung once it is).
  const std::uint64_t* ready = nullptr;
  cudaStream_t stream = nullptr;  // the caller's stream (with `ready`): its transfers become ready in order
  void* dst = nullptr;          // Visible, FromHidden: an address here
  int dst_device = -1;
  const void* src = nullptr;    // Visible, ToHidden: an address here
  int src_device = -1;
  std::size_t width = 0;
  std::size_t rows = 1;
  std::size_t src_pitch = 0;
  std::size_t dst_pitch = 0;
  std::uint64_t* signal = nullptr;  // Visible: on dst_device, or null
  std::uint64_t value = 0;
  SignalOp op = SignalOp::Set;
  // ToHidden: the target's window and offset (and signal word); FromHidden: the window read.
  std::uint64_t window = kAddress;
  std::uint64_t offset = 0;
  std::uint64_t signal_window = kAddress;
  std::uint64_t signal_index = 0;
  // Its done word (ControlWords::transfer(word)) reaches `ticket` at its end; the caller's
  // stream waits for that.
  std::size_t word = 0;
  std::uint64_t* done = nullptr;
  bool word_is_lent = false;  // an eager transfer's word: back to the free list after its end
  // ToHidden, not stream-filled (MESHMEM_STAGED_COMPLETION=source): the done word reaches
  // ticket - 1 once the source is copied into the slots, which the caller's stream waits for.
  bool source_complete = false;
  // ToHidden: the caller's stream waits with a stream memory wait, which cannot time out: the
  // agent ends the transfer if its reader has not MESHMEM_TIMEOUT after it was posted in full
  // (end_overdue).
  bool ends_at_timeout = false;
  std::uint64_t ticket = 0;  // even (StagingAgent::submit)
  std::size_t bytes() const { return width * rows; }
};

}  // namespace meshmem::detail
