// StreamWatchdog: the staging agent's look at its own streams (every ~100 ms while they hold
// work): a lane or the incoming stream whose work has not moved for 2 s (or half of
// MESHMEM_TIMEOUT) is reported once, as held back by a stream of this process ahead of it in a
// GPU queue (its report kept for describe()); a lane held past MESHMEM_TIMEOUT has the ends of
// its eager transfers written from the host. It runs on the agent's thread; report() on any.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cuda/staged/channel_reader.hpp"
#include "cuda/staged/channel_writer.hpp"
#include "cuda/staged/staging_lanes.hpp"
#include "cuda/staged/staging_site.hpp"
#include "meshmem/error.hpp"

namespace meshmem::detail {

class StreamWatchdog {
 public:
  // What the watchdog reaches of its agent (all outlive it).
  struct Agent {
    const StagingSite* site = nullptr;
    StagingLanes* lanes = nullptr;
    const ChannelWriter* writer = nullptr;  // its posted counts
    const ChannelReader* reader = nullptr;  // the incoming stream's progress
    std::function<void(const std::string&, ErrorCode)> keep_error;
    // The lane's eager transfers whose done word has not reached its ticket: (done word, ticket).
    std::function<std::vector<std::pair<std::uint64_t*, std::uint64_t>>(const StagingLane&)> unended;
  };
  explicit StreamWatchdog(Agent agent);

  // One look at every stream; true while any holds work.
  bool look();
  // The latest report of a stream held back, or "".
  std::string report() const;

 private:
  using StreamWatch = StagingLane::StreamWatch;
  void watch(StreamWatch& w, std::uint64_t done, bool pending, const std::string& stream, const std::string& holds);
  void end_held(StagingLane& lane, int device);

  Agent agent_;
  const StagingSite& site_;
  std::chrono::milliseconds held_after_;  // 2 s, or half of MESHMEM_TIMEOUT if that is less
  StreamWatch incoming_;
  mutable std::mutex report_m_;
  std::string report_;
};

}  // namespace meshmem::detail
