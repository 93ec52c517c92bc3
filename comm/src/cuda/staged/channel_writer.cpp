// ChannelWriter (channel_writer.hpp): the staging agent's writer side of the channels to its
// hidden node peers.
#include "cuda/staged/channel_writer.hpp"

#include <atomic>
#include <cstring>
#include <utility>

#include "backoff.hpp"
#include "log.hpp"
#include "cuda/runtime/cuda_owners.hpp"
#include "cuda/runtime/gpu_queues.hpp"
#include "cuda/runtime/kernels.hpp"
#include "cuda/runtime/stream_ops.hpp"
#include "cuda/staged/channel_reader.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

ChannelWriter::ChannelWriter(Agent agent)
    : agent_(std::move(agent)),
      site_(*agent_.site),
      posted_(site_.control.node_ranks, 0),
      outgoing_(site_.control.node_ranks) {}

StagedOutgoing& ChannelWriter::queue(std::size_t to, StagedOutgoing o) {
  outgoing_[to].push_back(std::move(o));
  return outgoing_[to].back();
}

bool ChannelWriter::busy() const {
  if (!posted_after_copies_.empty()) return true;
  for (const auto& q : outgoing_)
    if (!q.empty()) return true;
  return false;
}

std::size_t ChannelWriter::give_up_all() {
  std::size_t n = 0;
  for (auto& queue : outgoing_) {
    for (const StagedOutgoing& o : queue) {
      __atomic_store_n(site_.control_of(o.done_rank).transfer(o.done_word), o.ticket, __ATOMIC_RELEASE);
      ++n;
    }
    queue.clear();
  }
  return n;
}

bool ChannelWriter::pump() {
  const auto stalled = [&](ipc::AwakeClock::time_point moved) {
    return site_.timeout.count() != 0 && ipc::AwakeClock::now() - moved >= site_.timeout;
  };
  bool any = false;
  for (auto& queue : outgoing_) {
    while (!queue.empty()) {
      StagedOutgoing& o = queue.front();
      bool moved = false;
      bool left = false;
      if (agent_.peers->gone(o.reader)) {
        // One that watch_readers already ended was reported there (once).
        if (__atomic_load_n(site_.control_of(o.done_rank).transfer(o.done_word), __ATOMIC_ACQUIRE) < o.ticket)
          abandon(o, o.what + ": rank " + std::to_string(o.reader) + "'s process (pid " +
                                  std::to_string(agent_.peers->pid(o.reader)) + ") has ended");
        left = true;
      } else {
        try {
          left = advance(o, &moved);
        } catch (const std::exception& e) {
          abandon(o, e.what());
          left = true;
        }
      }
      if (moved) o.moved = ipc::AwakeClock::now();
      if (!left && stalled(o.moved)) {
        abandon(o,
                         o.what + ": rank " + std::to_string(o.reader) + " took nothing from this rank's channel within " +
                             describe_timeout(site_.timeout) + " (" + agent_.slots->holders() + ")" + gpu_queue_hint(),
                         ErrorCode::Timeout);
        left = true;
      }
      if (left && o.ends_at_timeout) agent_.posted_in_full(o.done_word, o.ticket);
      any = any || moved || left;
      if (!left) break;
      const bool answer = o.answer;
      const std::uint64_t ticket = o.ticket;
      queue.pop_front();
      if (!queue.empty()) queue.front().moved = ipc::AwakeClock::now();  // its turn starts now
      agent_.ended(answer, ticket);
    }
  }
  return any;
}

// Posts what it can of `o` on its channel; true once all of it is posted (the last
// descriptor carries the signal and the done word).
bool ChannelWriter::advance(StagedOutgoing& o, bool* moved) {
  // Given up meanwhile (its caller's wait timed out and marked the done word, kTransferGivenUp,
  // or this rank ended it): nothing more of it is read from its source, which its caller may
  // reuse or free now, nor posted. Its error was reported where it was given up.
  if (__atomic_load_n(site_.control_of(o.done_rank).transfer(o.done_word), __ATOMIC_ACQUIRE) >= o.ticket) return true;
  CurrentDevice current(site_.device);
  Descriptor d;
  d.window = o.window;
  d.dst = o.dst;
  d.dst_pitch = o.dst_pitch;
  d.done_rank = static_cast<std::uint64_t>(o.done_rank);
  d.done_word = o.done_word;
  d.ticket = o.ticket;
  if (o.get_request) {
    if (!ring_has_room(o.reader)) return false;
    d.control = Descriptor::kGet;
    d.width = o.width;
    d.rows = o.rows;
    d.src_offset = o.src;
    d.src_pitch = o.src_pitch;
    post(o.reader, d);
    *moved = true;
    return true;
  }
  d.signal_window = o.signal_window;
  d.signal_index = o.signal_index;
  d.value = o.value;
  const std::uint64_t chunk = Descriptor::kChunk | static_cast<std::uint64_t>(o.op) << 16;
  StagingLane& own = *agent_.lane;
  if (o.width == 0 || o.rows == 0) {  // nothing to copy: a descriptor with the signal and the done word alone
    if (!ring_has_room(o.reader)) return false;
    d.width = 0;
    d.rows = 1;
    d.control = chunk | Descriptor::kLast;
    post(o.reader, d);
    *moved = true;
    return true;
  }
  if (o.filled_slot != kChannelAddress) {  // a stream-filled put: its bytes are in its slot, one piece
    if (!ring_has_room(o.reader)) return false;
    d.slot_offset = o.filled_slot;
    d.width = o.width;
    d.rows = o.rows;
    d.control = chunk | Descriptor::kLast;
    agent_.trace->record('P', o.reader, o.ticket, static_cast<std::int64_t>(o.width * o.rows));
    post(o.reader, d, nullptr, true);
    agent_.trace->record('O', o.reader, o.ticket, 1);
    *moved = true;
    return true;
  }
  std::size_t s = 0;
  while (!o.pieces.done() && ring_has_room(o.reader) && agent_.slots->take(o.host_source, &s)) {
    const PieceCursor::Piece p = o.pieces.current();
    bool copy_pending = false;  // a last piece's copy into slot s, enqueued without an event
    char* slot = agent_.slots->address(s);
    {
      // A window of this rank (an answer) stays allocated while its copy is enqueued;
      // remove_window waits for what was enqueued from it.
      const auto windows = agent_.windows->lock();
      std::string problem;
      const auto* from = static_cast<const char*>(resolve_for_channel(*agent_.windows, o.src_window, o.src + p.row * o.src_pitch + p.col, p.width,
                                                          p.rows, o.src_pitch, &problem));
      if (from == nullptr) throw Error(ErrorCode::InvalidArgument, o.what + ": " + problem);
      if (o.host_source) {
        for (std::size_t r = 0; r < p.rows; ++r) std::memcpy(slot + r * p.width, from + r * o.src_pitch, p.width);
        std::atomic_thread_fence(std::memory_order_seq_cst);  // before the post that the reader's copy follows
      } else {
        if (agent_.slots->last_copy_out(s) != nullptr)
          ipc::check_cuda(cudaStreamWaitEvent(own.stream, agent_.slots->last_copy_out(s), 0), "cudaStreamWaitEvent", o.what);
        agent_.trace->record('P', o.reader, o.ticket, static_cast<std::int64_t>(p.width * p.rows));
        ipc::check_cuda(copy_rows(slot, p.width, from, o.src_pitch, p.width, p.rows, own.stream, o.to_slot),
                        "cudaMemcpyAsync (to the staging slot)", o.what);
        // A piece that more follow has an event (its count is written once it is done); a
        // last piece's post follows its copy on the lane, and only a failed post records one.
        if (!p.last) ipc::check_cuda(cudaEventRecord(own.copied[s], own.stream), "cudaEventRecord", o.what);
        // Until the post below succeeds, the slot is held by this copy (a failed post must not
        // leave it free while the copy into it is pending).
        agent_.slots->held_by_copy(s, own.copied[s]);
        copy_pending = p.last;
      }
    }
    d.slot_offset = s * site_.chunk;
    d.width = p.width;
    d.rows = p.rows;
    d.dst = o.dst + p.row * o.dst_pitch + p.col;
    d.control = chunk | (p.last ? Descriptor::kLast : 0);
    // More pieces follow: this thread writes the count once the slot's copy event is done, the
    // lane goes on with the next copy. (Where a dead reader's slots are freed, a slot's event
    // can be recorded again before its count is looked at: the counts behind it then wait for
    // that later copy of the lane. A count reused slots cover is dropped unqueried.)
    const cudaEvent_t copied = o.host_source || p.last ? nullptr : own.copied[s];
    std::uint64_t sequence = 0;
    try {
      if (p.last && o.source_complete) {
        // Every piece of the source is copied (or enqueued to be, on the lane, before the
        // event): then this thread raises the done word to ticket - 1, which the caller's
        // stream waits for. Raised, never stored: the reader's end (the ticket), or one
        // written here (a dead reader, the timeout), may come first, and the word must not
        // move back.
        std::uint64_t* done = site_.control_of(o.done_rank).transfer(o.done_word);
        if (o.host_source) {
          raise_count(done, o.ticket - 1);
        } else {
          cudaEvent_t read = agent_.events->take(o.what);
          const cudaError_t rc = cudaEventRecord(read, own.stream);
          if (rc != cudaSuccess) {
            agent_.events->give_back(read);
            ipc::check_cuda(rc, "cudaEventRecord (source read)", o.what);
          }
          posted_after_copies_.push_back(CountAfterCopy{read, true, o.reader, done, o.ticket - 1});
        }
      }
      sequence = post(o.reader, d, copied);
    } catch (...) {
      // The slot stays held until the copy into it is done (if this record fails too, the
      // lane failed: nothing more of it runs).
      if (copy_pending && cudaEventRecord(own.copied[s], own.stream) != cudaSuccess) (void)cudaGetLastError();
      throw;
    }
    agent_.slots->posted_to(s, o.reader, sequence);
    agent_.trace->record('O', o.reader, o.ticket, p.last ? 1 : 0);
    o.pieces.advance();
    *moved = true;
    if (o.answer) agent_.faults->hit(FaultPoint::StagedAnswer);
  }
  return o.pieces.done();
}

// An outgoing transfer that cannot go on: nothing more of it is posted, its done word is set
// from the host (the reader never sees its last descriptor), and the error goes to whoever
// initiated it: this rank's next call, or (an answer) the reader's, through the failed count.
void ChannelWriter::abandon(const StagedOutgoing& o, const std::string& message, ErrorCode code) {
  log(LogLevel::Error, message);
  if (o.answer) {
    // Once per transfer: a refused get was counted when it was refused (carry_out).
    if (!o.failure_counted) __atomic_add_fetch(site_.control.failed(site_.local_index(o.reader)), 1, __ATOMIC_RELEASE);
  } else {
    agent_.keep_error(message, code);
  }
  raise_count(site_.control_of(o.done_rank).transfer(o.done_word), o.ticket);  // a given-up mark stays
}

// The channel to `reader` has an entry free: the one posted kRing entries ago was consumed.
bool ChannelWriter::ring_has_room(int reader) const {
  const std::uint64_t n = posted_[site_.local_index(reader)] + 1;
  return n <= ControlWords::kRing || site_.consumed_by(reader) >= n - ControlWords::kRing;
}

bool ChannelWriter::write_counts_after_copies() {
  return meshmem::detail::write_counts_after_copies(posted_after_copies_, *agent_.events, true, site_.rank,
                                                    [&](const std::string& m) { agent_.keep_error(m, ErrorCode::Cuda); });
}

// Writes descriptor `d` into the next entry of the channel to `reader` (from this thread: the
// entry is free, and the reader reads it only once the count covers it), then the posted
// count from this rank's GPU, after the copies before it on its lane (from this thread once
// `copied` is done, where it is given: CountAfterCopy); returns its number. The caller saw the
// entry free (ring_has_room). One stream write per chunk: sixteen (one per descriptor word)
// cost about a quarter of the channel's bandwidth on H200.
std::uint64_t ChannelWriter::post(int reader, Descriptor d, cudaEvent_t copied, bool filled) {
  static_assert(sizeof(Descriptor) == ControlWords::kDescriptorWords * sizeof(std::uint64_t),
                "a descriptor fills its ring entry");
  StagingLane& own = *agent_.lane;
  const std::size_t to = site_.local_index(reader);
  const std::uint64_t n = posted_[to] + 1;
  d.sequence = n;
  std::uint64_t* entry = site_.control.ring(to) + ((n - 1) % ControlWords::kRing) * ControlWords::kDescriptorWords;
  const auto* words = reinterpret_cast<const std::uint64_t*>(&d);
  for (std::size_t i = 0; i < ControlWords::kDescriptorWords; ++i) __atomic_store_n(entry + i, words[i], __ATOMIC_RELAXED);
  // The entry is out before the count is enqueued. On x86 stores are seen in order and the
  // GPU's write of the count follows the driver's doorbell write; a host with a weaker order
  // (ARM) needs a store fence here that makes the entry visible to another CPU first.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (filled && __atomic_load_n(site_.control.posted(to), __ATOMIC_ACQUIRE) + 1 >= n) {
    // Its bytes are in the slot, and every count before it is written: this thread writes
    // it (a stream write would cost a driver call and the lane's latency).
    raise_count(site_.control.posted(to), n);
  } else if (copied != nullptr) {
    posted_after_copies_.push_back(CountAfterCopy{copied, false, reader, site_.control.posted(to), n});
  } else {
    std::vector<CUstreamBatchMemOpParams> ops{stream_write_op(site_.control.posted(to), n)};
    run_stream_batch(ops, own.stream, "staged transfer (channel post)", site_.rank);
  }
  posted_[to] = n;  // only once enqueued: a failed post leaves no gap in the numbers
  return n;
}

}  // namespace meshmem::detail
