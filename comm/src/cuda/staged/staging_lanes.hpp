// StagingLanes: the staging agent's streams, one per GPU it drives (this rank's first, then
// the visible peers' GPUs of the one-agent path), each with an event per slot for the copies
// into and out of it, and what the lane has enqueued to end (its done counter's goal, the
// eager transfers whose done words go back once the counter passes them). Owned here: the
// streams and events are made at setup and destroyed with the agent.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "progress_watch.hpp"
#include "meshmem/ipc/awake_clock.hpp"

namespace meshmem::detail {

struct StagingLane {
  using StreamWatch = ProgressWatch<ipc::AwakeClock>;  // how far the GPU got with the lane
  std::size_t ordinal = 0;          // its done counter: ControlWords::lane_done(ordinal)
  cudaStream_t stream = nullptr;
  std::vector<cudaEvent_t> copied;  // per slot: the device-to-host copy into it is done
  std::vector<cudaEvent_t> freed;   // per slot: the host-to-device copy out of it is done
  std::uint64_t ended = 0;          // transfers enqueued to end on this lane (its counter's goal)
  std::deque<std::size_t> pieces;  // slots of pieces whose copy out is enqueued here, oldest first
  std::uint64_t pieces_done = 0;   // pieces seen done (their `freed` event, or a later one of the slot)
  StreamWatch watch;
};

class StagingLanes {
 public:
  // A lane per distinct GPU of `devices`, each with `slots` pairs of events; `what` begins
  // the errors. Loads meshmem's kernels on each GPU (the agent's thread may launch them).
  StagingLanes(const std::vector<int>& devices, int slots, std::size_t most, const std::string& what);
  StagingLanes(const StagingLanes&) = delete;
  StagingLanes& operator=(const StagingLanes&) = delete;
  ~StagingLanes();

  StagingLane& at(int device) { return lanes_.at(device); }
  const StagingLane& at(int device) const { return lanes_.at(device); }
  auto begin() { return lanes_.begin(); }
  auto end() { return lanes_.end(); }
  auto begin() const { return lanes_.begin(); }
  auto end() const { return lanes_.end(); }

 private:
  void release() noexcept;
  std::map<int, StagingLane> lanes_;  // by device
};

}  // namespace meshmem::detail
