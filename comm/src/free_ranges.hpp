// FreeRanges: the free bytes of one block-pool chunk (cuda/block_pool.hpp), first fit, freed
// ranges merged with their neighbours. No CUDA here, so it is unit-tested anywhere.
#pragma once

#include <cstddef>
#include <iterator>
#include <map>

namespace meshmem::detail {

class FreeRanges {
 public:
  explicit FreeRanges(std::size_t bytes) : bytes_(bytes) {
    if (bytes > 0) free_.emplace(0, bytes);
  }
  // The offset of `want` bytes taken from the lowest range that holds them; size() if none does.
  std::size_t take(std::size_t want) {
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < want) continue;
      const std::size_t offset = it->first, left = it->second - want;
      free_.erase(it);
      if (left > 0) free_.emplace(offset + want, left);
      held_ += want;
      return offset;
    }
    return bytes_;
  }
  // Gives back what take() returned at `offset` (`bytes` as asked then).
  void put(std::size_t offset, std::size_t bytes) {
    held_ -= bytes;
    auto next = free_.lower_bound(offset);
    if (next != free_.end() && offset + bytes == next->first) {
      bytes += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == offset) {
        prev->second += bytes;
        return;
      }
    }
    free_.emplace(offset, bytes);
  }
  std::size_t size() const { return bytes_; }
  std::size_t held() const { return held_; }      // taken and not given back
  std::size_t ranges() const { return free_.size(); }  // free ranges (1 when all is free)

 private:
  std::size_t bytes_;
  std::size_t held_ = 0;
  std::map<std::size_t, std::size_t> free_;  // offset -> bytes, never two adjacent
};

}  // namespace meshmem::detail
