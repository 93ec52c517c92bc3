// StagingSite: what every part of a rank's staging agent reads and none changes after setup:
// the node's staging pool as mapped here (this rank's slots and control words, and every node
// peer's region), the slot size and count, this rank and its GPU, the node peers by place, the
// hidden ones (whose GPU this process cannot see), and MESHMEM_TIMEOUT.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/staged/channel_layout.hpp"
#include "cuda/staged/staging_pool.hpp"

namespace meshmem::detail {

struct StagingSite {
  std::unique_ptr<StagingPool> pool;
  char* slots = nullptr;  // this rank's region: nslots slots of `chunk` bytes, then FillSlots, then the control words
  std::size_t chunk = 0;
  std::size_t first_piece = 0;  // MESHMEM_STAGED_FIRST_PIECE (PieceCursor's ramp; 0: none)
  int nslots = 0;
  ControlWords control;  // this rank's
  int rank = 0;
  int device = -1;                    // this rank's GPU
  std::vector<std::size_t> local_of;  // by rank: place in Topology::node_ranks
  std::vector<int> hidden;            // node peers whose GPU this process cannot see
  std::chrono::milliseconds timeout{0};

  std::size_t local_index(int r) const { return local_of[static_cast<std::size_t>(r)]; }
  // Rank r's control words, in its region of the pool as mapped here (node ranks).
  ControlWords control_of(int r) const {
    return ControlWords{reinterpret_cast<std::uint64_t*>(static_cast<char*>(pool->region(r)) +
                                                         chunk * static_cast<std::size_t>(nslots) + FillSlots::kBytes),
                        control.ranks, control.node_ranks};
  }
  // How many of this rank's descriptors `reader` (a node peer) has consumed from its channel.
  std::uint64_t consumed_by(int reader) const {
    return __atomic_load_n(control_of(reader).consumed(local_index(rank)), __ATOMIC_ACQUIRE);
  }
  // Where fill slot i lies in this rank's region (an offset from `slots`).
  std::size_t fill_offset(std::size_t i) const { return chunk * static_cast<std::size_t>(nslots) + i * FillSlots::kSlotBytes; }
};

}  // namespace meshmem::detail
