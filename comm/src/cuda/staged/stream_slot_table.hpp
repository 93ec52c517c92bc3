// StreamSlotTable: which of the stream path's pinned slots (stream_path.hpp) a caller stream's
// transfer may take. Slots are taken in rotation; a slot is free for a stream if it was never
// used, if that stream used it last (its own order covers the reuse), or if the events after its
// last use have all ended, so that no stream's transfer waits on the GPU behind another
// stream's (which may itself wait for this one). A slot that a failed use left with work no
// event covers is retired: never taken again. Used under the stream path's lock.
//
// CUDA-free (an event and a stream are opaque here): tests/unit/test_stream_slot_table.cpp.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

namespace meshmem::detail {

template <class Event, class Key>
class StreamSlotTable {
 public:
  explicit StreamSlotTable(std::size_t slots) : slots_(slots) {}
  std::size_t size() const { return slots_.size(); }

  // The first slot from the rotation's turn on that `key` may take (`ended(event)`: whether that
  // event's work ended, asked only of other streams' slots); the turn moves past it. False,
  // with nothing changed, where none is free.
  template <class Ended>
  bool choose(const Key& key, Ended&& ended, std::size_t* slot) {
    for (std::size_t k = 0; k < slots_.size(); ++k) {
      const std::size_t i = (next_ + k) % slots_.size();
      if (!free_for(slots_[i], key, ended)) continue;
      next_ = (i + 1) % slots_.size();
      *slot = i;
      return true;
    }
    return false;
  }
  // The events after the slot's last use (empty: never used): its next use waits for them.
  const std::vector<Event>& last(std::size_t slot) const { return slots_[slot].last; }
  // A use of the slot by `key`, every piece of it before `after`.
  void used(std::size_t slot, const Key& key, std::vector<Event> after) {
    slots_[slot].user = key;
    slots_[slot].last = std::move(after);
  }
  void retire(std::size_t slot) { slots_[slot].retired = true; }
  bool retired(std::size_t slot) const { return slots_[slot].retired; }
  // Every event after some slot's last use (what a drain waits for).
  std::vector<Event> all_last() const {
    std::vector<Event> all;
    for (const Slot& s : slots_) all.insert(all.end(), s.last.begin(), s.last.end());
    return all;
  }

 private:
  struct Slot {
    std::vector<Event> last;
    Key user{};
    bool retired = false;
  };
  template <class Ended>
  static bool free_for(const Slot& s, const Key& key, Ended& ended) {
    if (s.retired) return false;
    if (s.last.empty() || s.user == key) return true;
    for (const Event& e : s.last)
      if (!ended(e)) return false;
    return true;
  }

  std::vector<Slot> slots_;
  std::size_t next_ = 0;
};

}  // namespace meshmem::detail
