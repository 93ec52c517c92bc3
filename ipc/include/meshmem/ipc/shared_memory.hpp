// Host memory that other processes can map: a memfd, and mappings of it.
#pragma once

#include <cstddef>

#include "meshmem/ipc/unique_fd.hpp"

namespace meshmem::ipc {

// Owns one mmap'd range; munmap on destruction. Move-only.
class MappedRegion {
 public:
  MappedRegion() = default;
  MappedRegion(void* addr, std::size_t bytes) noexcept : addr_(addr), bytes_(bytes) {}
  MappedRegion(MappedRegion&& other) noexcept;
  MappedRegion& operator=(MappedRegion&& other) noexcept;
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;
  ~MappedRegion();

  void* data() const noexcept { return addr_; }
  std::size_t size() const noexcept { return bytes_; }

 private:
  void* addr_ = nullptr;
  std::size_t bytes_ = 0;
};

// A memfd of `bytes` (rounded up to whole pages, at least one), mapped shared and zeroed.
class SharedMemory {
 public:
  SharedMemory() = default;
  static SharedMemory create(std::size_t bytes, const char* debug_name);

  void* data() const noexcept { return mapping_.data(); }
  std::size_t size() const noexcept { return mapping_.size(); }  // mapped bytes
  int fd() const noexcept { return fd_.get(); }                   // to pass to peers

 private:
  UniqueFd fd_;
  MappedRegion mapping_;
};

// Maps a memfd received from a peer (read-write, shared). The caller closes `fd` afterwards
// (the mapping keeps the memory alive). Checks that the file holds at least `bytes`.
MappedRegion map_shared(int fd, std::size_t bytes);

// Bytes rounded up to whole pages, at least one page.
std::size_t round_to_pages(std::size_t bytes);

}  // namespace meshmem::ipc
