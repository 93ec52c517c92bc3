// What a Window handle points to: the window's identity, its memory here, and the peers'
// memory mapped here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "meshmem/comm.hpp"

namespace meshmem::detail {

class CommImpl;

// Owner of a window's memory on this rank (its own part and the peers' mappings).
class WindowMemory {
 public:
  virtual ~WindowMemory() = default;
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

  bool freed() const { return owner == nullptr; }
};

}  // namespace meshmem::detail
