// VisibleCopier (visible_copier.hpp): the staging agent's path between two GPUs it sees.
#include "cuda/staged/visible_copier.hpp"

#include <vector>

#include "backoff.hpp"
#include "log.hpp"
#include "cuda/runtime/cuda_owners.hpp"
#include "cuda/runtime/gpu_queues.hpp"
#include "cuda/runtime/kernels.hpp"
#include "cuda/runtime/stream_ops.hpp"
#include "cuda/staged/channel_counts.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

void VisibleCopier::queue(const StagedRequest& r) {
  transfers_.push_back(Transfer{r, PieceCursor(r.width, r.rows, site_.chunk, site_.first_piece), ipc::AwakeClock::now()});
}

std::size_t VisibleCopier::give_up_all() {
  for (const Transfer& t : transfers_) __atomic_store_n(t.request.done, t.request.ticket, __ATOMIC_RELEASE);
  const std::size_t n = transfers_.size();
  transfers_.clear();
  return n;
}

std::string VisibleCopier::describe(ipc::AwakeClock::time_point now) const {
  if (transfers_.empty()) return {};
  return std::to_string(transfers_.size()) + " between visible GPUs (the oldest, transfer " +
         std::to_string(transfers_.front().request.ticket) + ", last moved " +
         describe_timeout(std::chrono::duration_cast<std::chrono::milliseconds>(now - transfers_.front().moved)) + " ago)";
}

// Pieces of the oldest transfer while slots are free; a transfer that finds none stays, and
// fails once nothing moved for MESHMEM_TIMEOUT.
bool VisibleCopier::pump() {
  const auto stalled = [&](ipc::AwakeClock::time_point moved) {
    return site_.timeout.count() != 0 && ipc::AwakeClock::now() - moved >= site_.timeout;
  };
  bool any = false;
  while (!transfers_.empty()) {
    Transfer& t = transfers_.front();
    const StagedRequest& r = t.request;
    const std::string what = "staged transfer " + std::to_string(r.ticket) + " of rank " + std::to_string(site_.rank);
    bool moved = false;
    bool left = false;
    try {
      std::size_t s = 0;
      while (!t.pieces.done() && agent_.slots->take(false, &s)) {
        enqueue_piece(r, t.pieces.current(), s, what);
        t.pieces.advance();
        moved = true;
      }
      if (t.pieces.done()) {
        end(r, true, what);
        left = true;
      }
    } catch (const std::exception& e) {
      abandon(r, e.what());
      left = true;
    }
    if (moved) t.moved = ipc::AwakeClock::now();
    if (!left && stalled(t.moved)) {
      abandon(r,
                      what + ": no staging slot came free within " + describe_timeout(site_.timeout) + " (" +
                          agent_.slots->holders() + ")" + gpu_queue_hint(),
                      ErrorCode::Timeout);
      left = true;
    }
    any = any || moved || left;
    if (!left) break;
    const std::uint64_t ticket = r.ticket;
    transfers_.pop_front();
    if (!transfers_.empty()) transfers_.front().moved = ipc::AwakeClock::now();  // its turn starts now
    agent_.ended(ticket);
  }
  return any;
}

// One piece of a visible transfer through slot `s`: device-to-host on the source GPU's lane,
// host-to-device on the target's.
void VisibleCopier::enqueue_piece(const StagedRequest& r, const PieceCursor::Piece& p, std::size_t s,
                                         const std::string& what) {
  StagingLane& from = agent_.lanes->at(r.src_device);
  StagingLane& to = agent_.lanes->at(r.dst_device);
  const char* src = static_cast<const char*>(r.src) + p.row * r.src_pitch + p.col;
  char* dst = static_cast<char*>(r.dst) + p.row * r.dst_pitch + p.col;
  char* slot = agent_.slots->address(s);
  {
    CurrentDevice current(r.src_device);
    if (agent_.slots->last_copy_out(s) != nullptr)
      ipc::check_cuda(cudaStreamWaitEvent(from.stream, agent_.slots->last_copy_out(s), 0), "cudaStreamWaitEvent", what);
    ipc::check_cuda(copy_rows(slot, p.width, src, r.src_pitch, p.width, p.rows, from.stream),
                    "cudaMemcpyAsync (to the staging slot)", what);
    ipc::check_cuda(cudaEventRecord(from.copied[s], from.stream), "cudaEventRecord", what);
  }
  CurrentDevice current(r.dst_device);
  ipc::check_cuda(cudaStreamWaitEvent(to.stream, from.copied[s], 0), "cudaStreamWaitEvent", what);
  ipc::check_cuda(copy_rows(dst, r.dst_pitch, slot, p.width, p.width, p.rows, to.stream),
                  "cudaMemcpyAsync (from the staging slot)", what);
  ipc::check_cuda(cudaEventRecord(to.freed[s], to.stream), "cudaEventRecord", what);
  agent_.slots->held_by_copy(s, to.freed[s]);
  to.pieces.push_back(s);
}

// After a visible transfer's last piece (on the target's lane): its signal (unless it is
// abandoned), its done word, which the caller's stream waits for, then the lane's counter
// (the host takes the word back once it passed).
void VisibleCopier::end(const StagedRequest& r, bool signal, const std::string& what) {
  StagingLane& to = agent_.lanes->at(r.dst_device);
  CurrentDevice current(r.dst_device);
  std::vector<CUstreamBatchMemOpParams> ops;
  if (signal && r.signal != nullptr && r.op == SignalOp::Add) {
    ipc::check_cuda(cuda::launch_copy(nullptr, nullptr, 0, r.signal, r.value, r.op, to.stream, false),
                    "signal kernel launch", what);
  } else if (signal && r.signal != nullptr) {
    ops.push_back(stream_write_op(r.signal, r.value));  // fenced: the data lands first
  }
  ops.push_back(stream_write_op(r.done, r.ticket));
  ops.push_back(stream_write_op(site_.control.lane_done(to.ordinal), to.ended + 1));
  run_stream_batch(ops, to.stream, "staged transfer", site_.rank);
  agent_.end_enqueued(to, r);
}

// A visible transfer that cannot go on: no signal; its done word ends it after the pieces
// already enqueued (or at once, from the host, if even that fails); the error goes to the
// caller's next call.
void VisibleCopier::abandon(const StagedRequest& r, const std::string& message, ErrorCode code) {
  log(LogLevel::Error, message);
  agent_.keep_error(message, code);
  try {
    end(r, false, message);
  } catch (const std::exception& e) {
    agent_.fail(r, e.what());
  }
}

}  // namespace meshmem::detail
