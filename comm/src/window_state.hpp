// What a Window handle points to: the window's identity, its memory here, the peers'
// memory mapped here, and what each transport keeps for it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "meshmem/types.hpp"

namespace meshmem::detail {

class CommImpl;

// Owner of this rank's part of a window (memfd, VMM allocation, device peer table).
class WindowMemory {
 public:
  virtual ~WindowMemory() = default;
};

// What one transport keeps for one window (peer mappings, a registration); its destructor
// detaches the window from the transport.
class WindowAttachment {
 public:
  virtual ~WindowAttachment() = default;
};

struct WindowState {
  CommImpl* owner = nullptr;       // null once freed
  std::uint64_t comm_uid = 0;      // which Comm made it
  std::uint64_t id = 0;            // same on every rank (allocs are collective)
  std::size_t bytes = 0;
  Memory memory = Memory::Host;
  bool is_signals = false;
  void* local = nullptr;
  std::vector<void*> peer;         // rank -> mapped pointer, or nullptr
  void* device_peer_table = nullptr;  // device windows: `peer` copied to device memory
  std::unique_ptr<WindowMemory> storage;
  std::vector<std::unique_ptr<WindowAttachment>> attachments;  // in attach order

  bool freed() const { return owner == nullptr; }

  // Detaches the transports (last attached first), then frees this rank's part.
  void release_memory() {
    while (!attachments.empty()) attachments.pop_back();
    peer.clear();
    device_peer_table = nullptr;
    storage.reset();
    local = nullptr;
  }
};

}  // namespace meshmem::detail
