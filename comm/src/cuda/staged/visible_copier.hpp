// VisibleCopier: the staging agent's one-agent path, for a transfer between two GPUs that this
// process both sees (MESHMEM_STAGED_CHANNELS=when-hidden): each piece is copied into a staging
// slot on the source GPU's lane and out of it on the target's, the oldest transfer first; its
// signal, done word and the lane's counter follow its last piece on the target's lane. It runs
// on the agent's thread only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <utility>
#include <string>

#include "piece_cursor.hpp"
#include "cuda/staged/slot_ring.hpp"
#include "cuda/staged/staged_request.hpp"
#include "cuda/staged/staging_lanes.hpp"
#include "cuda/staged/staging_site.hpp"
#include "meshmem/ipc/awake_clock.hpp"
#include "meshmem/error.hpp"
#include "meshmem/types.hpp"

namespace meshmem::detail {

class VisibleCopier {
 public:
  // What the copier reaches of its agent (all outlive it).
  struct Agent {
    const StagingSite* site = nullptr;
    StagingLanes* lanes = nullptr;
    SlotRing* slots = nullptr;
    // Keeps an error for the rank's next call.
    std::function<void(const std::string&, ErrorCode)> keep_error;
    // A transfer that could not even be ended on the GPU: logged, kept, ended from the host.
    std::function<void(const StagedRequest&, const std::string&)> fail;
    // Its end is enqueued on `lane` (the lane's goal moves on; a lent word goes back once the
    // lane's counter passes it).
    std::function<void(StagingLane& lane, const StagedRequest&)> end_enqueued;
    // Transfer `ticket` left the agent's hands.
    std::function<void(std::uint64_t ticket)> ended;
  };
  explicit VisibleCopier(Agent agent) : agent_(std::move(agent)), site_(*agent_.site) {}

  void queue(const StagedRequest& r);
  // Enqueues pieces of the oldest transfers while slots are free; true if anything moved. One
  // that finds no slot for MESHMEM_TIMEOUT fails.
  bool pump();
  bool busy() const { return !transfers_.empty(); }
  // At stop: every queued transfer ends unfinished (its done word set from the host); returns how many.
  std::size_t give_up_all();
  // "" or how many wait and how long ago the oldest moved, for the agent's state report.
  std::string describe(ipc::AwakeClock::time_point now) const;

 private:
  struct Transfer {
    StagedRequest request;
    PieceCursor pieces;
    ipc::AwakeClock::time_point moved;  // when a piece was last enqueued (or it started)
  };
  void enqueue_piece(const StagedRequest& r, const PieceCursor::Piece& p, std::size_t s, const std::string& what);
  void end(const StagedRequest& r, bool signal, const std::string& what);
  void abandon(const StagedRequest& r, const std::string& message, ErrorCode code = ErrorCode::Cuda);

  Agent agent_;
  const StagingSite& site_;
  std::deque<Transfer> transfers_;  // oldest first; only the oldest takes slots
};

}  // namespace meshmem::detail
