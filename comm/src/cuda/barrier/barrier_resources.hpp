// What barrier(stream) asks of a transport of the GPU part (Transport::barrier_resources()),
// so that the barrier chooses its variant by what the Comm's routes offer, never by naming a
// transport.
#pragma once

#include <cstdint>

namespace meshmem::detail {

class NcclLibrary;

class BarrierResources {
 public:
  virtual ~BarrierResources() = default;
  // Node peers routed through this transport meet in flag words of memory that every rank of
  // the node maps (the staging pool) instead of in a mapped window.
  virtual bool keeps_node_flags() const { return false; }
  // Whether those words exist here (after connect), and rank r's words (one per rank, the word
  // of rank s written by s), mapped for this rank's GPU; node ranks only.
  virtual bool has_node_flags() const { return false; }
  virtual std::uint64_t* node_flags(int rank) const {
    (void)rank;
    return nullptr;
  }
  // Ranks of other nodes routed through this transport can take part in an NCCL all-reduce of
  // the node leaders...
  virtual bool reaches_nodes_over_nccl() const { return false; }
  // ...with this library, once this rank's communicators are connected (null before, or where
  // none are).
  virtual const NcclLibrary* nccl_library() const { return nullptr; }
};

}  // namespace meshmem::detail
