// ChannelWriter: the staging agent's side of the channels to its hidden node peers (the
// readers): transfers to a hidden reader (puts, answers to its gets) and this rank's get
// requests, each reader's oldest first, cut into pieces, each copied into a staging slot and
// posted as a descriptor in the reader's ring; the posted counts, written by this rank's GPU
// or, where a copy is seen done, by this thread. It runs on the agent's thread only. The
// reader's side: channel_reader.hpp; the design: docs/transports/staged.md.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "fault.hpp"
#include "step_trace.hpp"
#include "cuda/agent/landing_windows.hpp"
#include "cuda/runtime/event_pool.hpp"
#include "cuda/staged/channel_counts.hpp"
#include "cuda/staged/channel_layout.hpp"
#include "cuda/staged/hidden_peers.hpp"
#include "cuda/staged/slot_ring.hpp"
#include "cuda/staged/staged_outgoing.hpp"
#include "cuda/staged/staging_lanes.hpp"
#include "cuda/staged/staging_site.hpp"
#include "meshmem/error.hpp"
#include "meshmem/types.hpp"

namespace meshmem::detail {

class ChannelWriter {
 public:
  // What the writer reaches of its agent (all outlive it).
  struct Agent {
    const StagingSite* site = nullptr;
    FaultPlan* faults = nullptr;  // staged.answer
    StepTrace* trace = nullptr;
    EventPool* events = nullptr;
    LandingWindows* windows = nullptr;  // where answers are read from
    SlotRing* slots = nullptr;
    StagingLane* lane = nullptr;  // this rank's GPU's: the copies into slots and the posts
    const HiddenPeers* peers = nullptr;
    // Keeps an error for the rank's next call.
    std::function<void(const std::string&, ErrorCode)> keep_error;
    // This rank's transfer with done word `word` and `ticket` left its queue (posted in full,
    // or abandoned) and its stream waits with a memory wait: end_overdue's clock starts.
    std::function<void(std::size_t word, std::uint64_t ticket)> posted_in_full;
    // Transfer `ticket` left the agent's hands (`answer`: the answer to a peer's get, whose
    // ticket is the peer's).
    std::function<void(bool answer, std::uint64_t ticket)> ended;
  };
  explicit ChannelWriter(Agent agent);

  // Queues `o` behind the reader's others (`to`: its node index); returns it as queued.
  StagedOutgoing& queue(std::size_t to, StagedOutgoing o);
  // Posts what it can of each reader's oldest transfer while slots and ring entries are free;
  // true if anything moved. One that finds none stays, and fails once nothing moved for
  // MESHMEM_TIMEOUT; one to a reader that is gone fails at once.
  bool pump();
  // Writes the posted counts whose copies are done; true if any.
  bool write_counts_after_copies();
  bool busy() const;
  // At stop: every queued transfer ends unfinished (its done word set from the host); returns how many.
  std::size_t give_up_all();
  // Descriptors posted to the reader at node index `to`.
  std::uint64_t posted(std::size_t to) const { return posted_[to]; }
  // Each reader's queue, for the agent's state report.
  const std::vector<std::deque<StagedOutgoing>>& queues() const { return outgoing_; }

 private:
  using Descriptor = ChannelDescriptor;
  bool advance(StagedOutgoing& o, bool* moved);
  void abandon(const StagedOutgoing& o, const std::string& message, ErrorCode code = ErrorCode::Cuda);
  bool ring_has_room(int reader) const;
  // Writes descriptor `d` into the next entry of the channel to `reader`, then its posted
  // count (see the .cpp); returns its number.
  std::uint64_t post(int reader, Descriptor d, cudaEvent_t copied = nullptr, bool filled = false);

  Agent agent_;
  const StagingSite& site_;
  std::vector<std::uint64_t> posted_;                // by node index of the reader: descriptors posted
  std::vector<std::deque<StagedOutgoing>> outgoing_;  // by node index of the reader: oldest first, one at a time on a channel
  std::deque<CountAfterCopy> posted_after_copies_;    // this GPU's lane: posted counts
};

}  // namespace meshmem::detail
