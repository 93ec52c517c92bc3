// FillSlotTable: which caller's stream owns which fill slot (FillSlots, channel_layout.hpp) of
// this rank's region of the staging pool. A stream-filled put has its stream copy the source
// into the stream's slot before the agent posts it; a slot stays its stream's while that
// stream's last transfer there has not ended, so a fill never waits on another stream. Used
// under the agent's hand-over lock (StagingAgent::hand_over).
//
// CUDA-free (a stream is an opaque key here): tests/unit/test_fill_slot_table.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>

#include "cuda/staged/channel_layout.hpp"

namespace meshmem::detail {

class FillSlotTable {
 public:
  // A slot's last transfer: its done word reaches `ticket` at its end (null: never used).
  struct Use {
    const std::uint64_t* done = nullptr;
    std::uint64_t ticket = 0;
    int peer = -1;
  };
  // `control`: this rank's control words (their fill_retired flags); `given_up`: the bit a done
  // word carries when the caller's wait gave its transfer up (cuda::kTransferGivenUp).
  FillSlotTable(ControlWords control, std::uint64_t given_up) : control_(control), given_up_(given_up) {}

  // `stream`'s slot: the one it has (unless retired), else one never used or whose stream's
  // last transfer there ended (taken over: the new stream's first fill waits for nothing);
  // false where every slot is retired or held by another stream's unfinished transfer. A
  // slot whose last put was given up (its reader may still copy out of it) is retired here,
  // as the next fill kernel there would (cuda::SlotFill), and never filled again.
  bool slot_of(const void* stream, std::size_t* slot) {
    const auto it = of_.find(stream);
    if (it != of_.end()) {
      if (!retired(it->second)) {
        *slot = it->second;
        return true;
      }
      of_.erase(it);
    }
    for (std::size_t i = 0; i < FillSlots::kSlots; ++i) {
      if (retired(i)) continue;
      const Use& last = last_[i];
      const std::uint64_t reached = last.done == nullptr ? 0 : __atomic_load_n(last.done, __ATOMIC_ACQUIRE);
      if (used_[i] && last.done != nullptr && reached == (last.ticket | given_up_)) {
        __atomic_store_n(control_.fill_retired(i), 1, __ATOMIC_RELEASE);
        continue;
      }
      const bool ended = last.done == nullptr || reached >= last.ticket;
      if (used_[i] && !ended) continue;
      if (used_[i]) of_.erase(stream_[i]);
      used_[i] = true;
      stream_[i] = stream;
      of_[stream] = i;
      *slot = i;
      return true;
    }
    return false;
  }
  // Slot i's last transfer (what a fill there waits for), and the one submitted now.
  const Use& last(std::size_t i) const { return last_[i]; }
  void used(std::size_t i, Use u) { last_[i] = u; }

 private:
  bool retired(std::size_t i) const { return __atomic_load_n(control_.fill_retired(i), __ATOMIC_ACQUIRE) != 0; }

  ControlWords control_;
  std::uint64_t given_up_;
  std::map<const void*, std::size_t> of_;            // each stream's slot
  const void* stream_[FillSlots::kSlots] = {};       // each used slot's stream
  bool used_[FillSlots::kSlots] = {};
  Use last_[FillSlots::kSlots];
};

}  // namespace meshmem::detail
