// The staging agent's writer side of the channels to hidden node peers (StagingAgent, part 2
// of 3): transfers to a hidden reader (puts, answers to its gets) and this rank's get requests
// cut into pieces, each copied into a staging slot and posted as a descriptor in the reader's
// ring; the slots' turns and the posted counts. The reader's side: channel_reader.hpp.
#include "cuda/staged/staging_agent.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "backoff.hpp"
#include "log.hpp"
#include "cuda/runtime/cuda_owners.hpp"
#include "cuda/runtime/device_sync.hpp"
#include "cuda/runtime/stream_ops.hpp"
#include "cuda/runtime/gpu_queues.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

// Posts what it can of `o` on its channel; true once all of it is posted (the last
// descriptor carries the signal and the done word).
bool StagingAgent::advance_outgoing(Outgoing& o, bool* moved) {
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
  Lane& own = lanes_.at(site_.device);
  if (o.width == 0 || o.rows == 0) {  // nothing to copy: a descriptor with the signal and the done word alone
    if (!ring_has_room(o.reader)) return false;
    d.width = 0;
    d.rows = 1;
    d.control = chunk | Descriptor::kLast;
    post(o.reader, d);
    *moved = true;
    return true;
  }
  if (o.filled_slot != StagedRequest::kAddress) {  // a stream-filled put: its bytes are in its slot, one piece
    if (!ring_has_room(o.reader)) return false;
    d.slot_offset = o.filled_slot;
    d.width = o.width;
    d.rows = o.rows;
    d.control = chunk | Descriptor::kLast;
    trace_.record('P', o.reader, o.ticket, static_cast<std::int64_t>(o.width * o.rows));
    post(o.reader, d, nullptr, true);
    trace_.record('O', o.reader, o.ticket, 1);
    *moved = true;
    return true;
  }
  std::size_t s = 0;
  while (!o.pieces.done() && ring_has_room(o.reader) && take_slot(o.host_source, &s)) {
    const PieceCursor::Piece p = o.pieces.current();
    bool copy_pending = false;  // a last piece's copy into slot s, enqueued without an event
    char* slot = site_.slots + s * site_.chunk;
    {
      // A window of this rank (an answer) stays allocated while its copy is enqueued;
      // remove_window waits for what was enqueued from it.
      const auto windows = windows_.lock();
      std::string problem;
      const auto* from = static_cast<const char*>(resolve_for_channel(windows_, o.src_window, o.src + p.row * o.src_pitch + p.col, p.width,
                                                          p.rows, o.src_pitch, &problem));
      if (from == nullptr) throw Error(ErrorCode::InvalidArgument, o.what + ": " + problem);
      if (o.host_source) {
        for (std::size_t r = 0; r < p.rows; ++r) std::memcpy(slot + r * p.width, from + r * o.src_pitch, p.width);
        std::atomic_thread_fence(std::memory_order_seq_cst);  // before the post that the reader's copy follows
      } else {
        if (slot_use_[s].event != nullptr)
          ipc::check_cuda(cudaStreamWaitEvent(own.stream, slot_use_[s].event, 0), "cudaStreamWaitEvent", o.what);
        trace_.record('P', o.reader, o.ticket, static_cast<std::int64_t>(p.width * p.rows));
        ipc::check_cuda(copy_rows(slot, p.width, from, o.src_pitch, p.width, p.rows, own.stream, o.to_slot),
                        "cudaMemcpyAsync (to the staging slot)", o.what);
        // A piece that more follow has an event (its count is written once it is done); a
        // last piece's post follows its copy on the lane, and only a failed post records one.
        if (!p.last) ipc::check_cuda(cudaEventRecord(own.copied[s], own.stream), "cudaEventRecord", o.what);
        // Until the post below succeeds, the slot is held by this copy (a failed post must not
        // leave it free while the copy into it is pending).
        slot_use_[s] = SlotUse{own.copied[s], -1, 0};
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
          cudaEvent_t read = events_.take(o.what);
          const cudaError_t rc = cudaEventRecord(read, own.stream);
          if (rc != cudaSuccess) {
            events_.give_back(read);
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
    slot_use_[s] = SlotUse{nullptr, o.reader, sequence};
    trace_.record('O', o.reader, o.ticket, p.last ? 1 : 0);
    o.pieces.advance();
    *moved = true;
    if (o.answer) faults_.hit(FaultPoint::StagedAnswer);
  }
  return o.pieces.done();
}

// An outgoing transfer that cannot go on: nothing more of it is posted, its done word is set
// from the host (the reader never sees its last descriptor), and the error goes to whoever
// initiated it: this rank's next call, or (an answer) the reader's, through the failed count.
void StagingAgent::abandon_outgoing(const Outgoing& o, const std::string& message, ErrorCode code) {
  log(LogLevel::Error, message);
  if (o.answer) {
    // Once per transfer: a refused get was counted when it was refused (carry_out).
    if (!o.failure_counted) __atomic_add_fetch(site_.control.failed(site_.local_index(o.reader)), 1, __ATOMIC_RELEASE);
  } else {
    keep_error(message, code);
  }
  raise_count(site_.control_of(o.done_rank).transfer(o.done_word), o.ticket);  // a given-up mark stays
}

// A slot that may be written now, the next in turn first: one a hidden reader consumed (as
// the host sees), or one whose last copy out was a visible transfer's (its event: waited for
// on the GPU, or, `on_host`, seen done). False if none.
bool StagingAgent::take_slot(bool on_host, std::size_t* s) {
  const auto n = static_cast<std::size_t>(site_.nslots);
  for (std::size_t k = 0; k < n; ++k) {
    const std::size_t i = (next_slot_ + k) % n;
    const SlotUse& use = slot_use_[i];
    bool usable = true;
    if (use.reader >= 0) {
      usable = consumed_by(use.reader) >= use.sequence;
    } else if (use.event != nullptr && on_host) {
      const cudaError_t rc = cudaEventQuery(use.event);
      usable = rc != cudaErrorNotReady;
      if (rc != cudaSuccess && rc != cudaErrorNotReady) (void)cudaGetLastError();
    }
    if (usable) {
      *s = i;
      next_slot_ = (i + 1) % n;
      return true;
    }
  }
  return false;
}

std::uint64_t StagingAgent::consumed_by(int reader) const {
  return __atomic_load_n(site_.control_of(reader).consumed(site_.local_index(site_.rank)), __ATOMIC_ACQUIRE);
}

// The channel to `reader` has an entry free: the one posted kRing entries ago was consumed.
bool StagingAgent::ring_has_room(int reader) const {
  const std::uint64_t n = peers_[site_.local_index(reader)].posted + 1;
  return n <= ControlWords::kRing || consumed_by(reader) >= n - ControlWords::kRing;
}

bool StagingAgent::write_counts_after_copies() {
  const bool posted = meshmem::detail::write_counts_after_copies(posted_after_copies_, events_, true, site_.rank,
                                                                 [&](const std::string& m) { keep_error(m); });
  const bool consumed = reader_.write_counts_after_copies();
  return posted || consumed;
}

// Writes descriptor `d` into the next entry of the channel to `reader` (from this thread: the
// entry is free, and the reader reads it only once the count covers it), then the posted
// count from this rank's GPU, after the copies before it on its lane (from this thread once
// `copied` is done, where it is given: CountAfterCopy); returns its number. The caller saw the
// entry free (ring_has_room). One stream write per chunk: sixteen (one per descriptor word)
// cost about a quarter of the channel's bandwidth on H200.
std::uint64_t StagingAgent::post(int reader, Descriptor d, cudaEvent_t copied, bool filled) {
  static_assert(sizeof(Descriptor) == ControlWords::kDescriptorWords * sizeof(std::uint64_t),
                "a descriptor fills its ring entry");
  Lane& own = lanes_.at(site_.device);
  const std::size_t to = site_.local_index(reader);
  const std::uint64_t n = peers_[to].posted + 1;
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
  peers_[to].posted = n;  // only once enqueued: a failed post leaves no gap in the numbers
  return n;
}

}  // namespace meshmem::detail
