// StreamWatchdog (stream_watchdog.hpp): the staging agent's look at its own streams.
#include "cuda/staged/stream_watchdog.hpp"

#include <algorithm>

#include "backoff.hpp"
#include "log.hpp"
#include "cuda/runtime/gpu_queues.hpp"
#include "cuda/staged/channel_counts.hpp"

namespace meshmem::detail {

StreamWatchdog::StreamWatchdog(Agent agent)
    : agent_(std::move(agent)),
      site_(*agent_.site),
      held_after_(site_.timeout.count() != 0 ? std::min(std::chrono::milliseconds(2000), site_.timeout / 2)
                                             : std::chrono::milliseconds(2000)) {}

std::string StreamWatchdog::report() const {
  std::lock_guard<std::mutex> lock(report_m_);
  return report_;
}

// Each stream's progress: a lane's pieces and transfer ends (and, on this rank's GPU, its
// channel posts), the incoming stream's consumed counts. A piece's `freed` event may have been
// recorded again for a later piece of its slot: done then means done up to that later one, and
// not done only that the stream has not reached it, so progress is at worst seen late.
bool StreamWatchdog::look() {
  bool pending_any = false;
  for (auto& [device, lane] : *agent_.lanes) {
    while (!lane.pieces.empty() && cudaEventQuery(lane.freed[lane.pieces.front()]) == cudaSuccess) {
      lane.pieces.pop_front();
      ++lane.pieces_done;
    }
    (void)cudaGetLastError();
    const std::uint64_t ended = __atomic_load_n(site_.control.lane_done(lane.ordinal), __ATOMIC_ACQUIRE);
    std::uint64_t done = lane.pieces_done + ended;
    bool pending = !lane.pieces.empty() || ended < lane.ended;
    std::string holds = std::to_string(lane.pieces.size()) + " piece(s) and " +
                        std::to_string(lane.ended - std::min(ended, lane.ended)) + " transfer end(s)";
    if (device == site_.device) {
      std::uint64_t posts = 0;
      for (int reader : site_.hidden) {
        const std::size_t to = site_.local_index(reader);
        const std::uint64_t posted = __atomic_load_n(site_.control.posted(to), __ATOMIC_ACQUIRE);
        done += posted;
        if (posted < agent_.writer->posted(to)) posts += agent_.writer->posted(to) - posted;
      }
      pending = pending || posts != 0;
      holds += " and " + std::to_string(posts) + " chunk(s) for hidden peers";
    }
    watch(lane.watch, done, pending, "lane of device " + std::to_string(device), holds);
    if (pending && site_.timeout.count() != 0 && lane.watch.unmoved_for(ipc::AwakeClock::now()) >= site_.timeout)
      end_held(lane, device);
    pending_any = pending_any || pending;
  }
  if (agent_.reader->stream() != nullptr) {
    std::uint64_t done = 0, left = 0;
    agent_.reader->progress(&done, &left);
    watch(incoming_, done, left != 0, "incoming stream (device " + std::to_string(site_.device) + ")",
          std::to_string(left) + " chunk(s) of hidden peers");
    pending_any = pending_any || left != 0;
  }
  return pending_any;
}

void StreamWatchdog::watch(StreamWatch& w, std::uint64_t done, bool pending, const std::string& stream,
                         const std::string& holds) {
  const auto now = ipc::AwakeClock::now();
  const StreamWatch::Seen seen = w.observe(done, pending, now, held_after_);
  if (seen == StreamWatch::Seen::MovesAgain)
    log(LogLevel::Warn,
        "staged transport on rank " + std::to_string(site_.rank) + ": the agent's " + stream + " moves again");
  if (seen != StreamWatch::Seen::Held) return;
  const std::string report =
      "on rank " + std::to_string(site_.rank) + " the staging agent's " + stream + " has not moved for " +
      describe_timeout(std::chrono::duration_cast<std::chrono::milliseconds>(w.unmoved_for(now))) + " (it holds " +
      holds +
      "); it waits for nothing outside this process, so a stream of this process that waits sits ahead of it in a GPU "
      "queue they share and holds it back (README \"GPU queues\"; " + describe_gpu_queues() + ")";
  log(LogLevel::Warn, "staged transport: " + report);
  note_held_stream(report);
  std::lock_guard<std::mutex> lock(report_m_);
  report_ = report;
}

// The ends still held on the lane are written from the host, once per transfer (a later end
// of the GPU's writes the same ticket); their words are taken back only once the lane's counter
// passes them, as always, so no held write lands in a word lent again. Their streams go on;
// what the held copies still write lands later ("its data may be incomplete", as for a wait
// kernel's timeout).
void StreamWatchdog::end_held(StagingLane& lane, int device) {
  const std::vector<std::pair<std::uint64_t*, std::uint64_t>> ends = agent_.unended(lane);  // (done word, ticket)
  if (ends.empty()) return;
  const std::string message =
      "staged transport on rank " + std::to_string(site_.rank) + ": " + std::to_string(ends.size()) +
      " transfer(s) whose end was held on the agent's lane of device " + std::to_string(device) + " for " +
      describe_timeout(site_.timeout) + " were ended from the host: their streams went on, their data may be incomplete" +
      gpu_queue_hint();
  log(LogLevel::Error, message);
  // The error first: a caller whose stream goes on at the write below finds it at its next call.
  agent_.keep_error(message, ErrorCode::Timeout);
  for (const auto& [done, ticket] : ends) raise_count(done, ticket);
}

}  // namespace meshmem::detail
