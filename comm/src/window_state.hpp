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
  // The window is being freed (WindowState::release_memory), this attachment next to go: a
  // transport whose given-up requests may still read or write the window's memory keeps
  // `memory` (shared) until they end. Detaching itself stays the destructor's.
  virtual void releasing(const std::shared_ptr<WindowMemory>& memory) { (void)memory; }
  // The window is freed (its ranks have met) and this attachment goes later, once the
  // device's work issued before now has ended (WindowReleaser): what it waits for then is
  // what was handed over before now.
  virtual void freed() {}
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

  // Detaches the transports (last attached first), then frees this rank's part, unless a
  // transport still keeps it for requests MPI may complete (WindowAttachment::releasing).
  void release_memory() {
    std::shared_ptr<WindowMemory> part(std::move(storage));
    while (!attachments.empty()) {
      if (part) attachments.back()->releasing(part);
      attachments.pop_back();
    }
    peer.clear();
    device_peer_table = nullptr;
    part.reset();
    local = nullptr;
  }
};

}  // namespace meshmem::detail
