// LandingWindows: this rank's device windows by id, as a host helper thread resolves what a
// peer names (a window id and an offset) to an address here before it enqueues a copy into or
// out of it. The staging agent (hidden peers' chunks and gets) and the transfer proxy (the
// wire's puts and gets) each hold one: a window is added when it is allocated and erased when
// it is freed, and every copy is enqueued under the lock, so once erase() returned nothing
// more is enqueued into the window (what was is the owner's to wait for).
//
// CUDA-free (tests/unit/test_landing_windows.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace meshmem::detail {

class LandingWindows {
 public:
  void add(std::uint64_t id, void* local, std::size_t bytes) {
    std::lock_guard<std::mutex> lock(m_);
    windows_[id] = {static_cast<char*>(local), bytes};
  }
  void erase(std::uint64_t id) {
    std::lock_guard<std::mutex> lock(m_);
    windows_.erase(id);
  }
  // Held from resolve() until the copy into (or out of) the window is enqueued.
  std::unique_lock<std::mutex> lock() { return std::unique_lock<std::mutex>(m_); }
  std::unique_lock<std::mutex> lock(std::defer_lock_t) { return std::unique_lock<std::mutex>(m_, std::defer_lock); }
  // Under lock(): erases window `id` (the caller then marks what its streams hold, still under it).
  void erase_locked(std::uint64_t id) { windows_.erase(id); }

  // Under lock(): window `window` at `offset`, checked to hold `rows` rows of `width` bytes
  // `pitch` apart (one row: `width` bytes). Null (and why, in *problem) if the window is not
  // here or the range is outside it.
  char* resolve(std::uint64_t window, std::uint64_t offset, std::size_t width, std::size_t rows, std::size_t pitch,
                std::string* problem) const {
    const auto it = windows_.find(window);
    if (it == windows_.end()) {
      *problem = "window #" + std::to_string(window) + " is not (or no longer) allocated here";
      return nullptr;
    }
    const std::size_t bytes = it->second.second;
    const std::uint64_t last = rows == 0 ? 0 : (rows - 1) * static_cast<std::uint64_t>(pitch) + width;
    if (offset > bytes || last > bytes - offset) {
      *problem = "bytes " + std::to_string(offset) + " .. " + std::to_string(offset + last) + " are outside window #" +
                 std::to_string(window) + " (" + std::to_string(bytes) + " bytes here)";
      return nullptr;
    }
    return it->second.first + offset;
  }

 private:
  std::mutex m_;
  std::map<std::uint64_t, std::pair<char*, std::size_t>> windows_;
};

}  // namespace meshmem::detail
