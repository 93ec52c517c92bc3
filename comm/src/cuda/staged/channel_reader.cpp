#include "cuda/staged/channel_reader.hpp"

#include <cstring>
#include <exception>
#include <optional>

#include "log.hpp"
#include "cuda/runtime/cuda_owners.hpp"
#include "cuda/runtime/kernels.hpp"
#include "cuda/runtime/stream_ops.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

ChannelReader::ChannelReader(Agent agent)
    : agent_(std::move(agent)), site_(*agent_.site), writers_(site_.control.node_ranks) {
  if (site_.hidden.empty()) return;
  // Its own stream: chunks from hidden peers never queue behind this rank's outgoing copies,
  // which may wait for those peers (two ranks sending to each other would hold each other).
  CurrentDevice current(site_.device);
  ipc::check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags",
                  "staged transport on rank " + std::to_string(site_.rank));
}

ChannelReader::~ChannelReader() {
  for (const CountAfterCopy& c : consumed_after_copies_)
    if (c.pooled) agent_.events->give_back(c.copied);  // the pool destroys them
  if (stream_ != nullptr) {
    CurrentDevice current(site_.device);
    (void)cudaStreamDestroy(stream_);
  }
}

bool ChannelReader::write_counts_after_copies() {
  return meshmem::detail::write_counts_after_copies(consumed_after_copies_, *agent_.events, false, site_.rank,
                                                    [&](const std::string& m) { keep_error(m); });
}

void ChannelReader::progress(std::uint64_t* done, std::uint64_t* left) const {
  *done = 0;
  *left = 0;
  for (int writer : site_.hidden) {
    const std::size_t from = site_.local_index(writer);
    if (writers_[from].broken) continue;
    const std::uint64_t consumed = __atomic_load_n(site_.control.consumed(from), __ATOMIC_ACQUIRE);
    *done += consumed;
    if (consumed < writers_[from].seen) *left += writers_[from].seen - consumed;
  }
}

// Takes every descriptor hidden peers posted here since the last look; true if any. What they
// ask for is enqueued on stream_ together at the end (flush_incoming), under windows_' lock from
// the first descriptor's resolve to the enqueueing: a window freed meanwhile waits for it.
bool ChannelReader::poll() {
  bool any = false;
  const std::size_t me = site_.local_index(site_.rank);
  std::unique_lock<std::mutex> windows = agent_.windows->lock(std::defer_lock);
  std::optional<CurrentDevice> current;  // once something came: a look that finds nothing costs no call
  for (int writer : site_.hidden) {
    const std::size_t from = site_.local_index(writer);
    if (writers_[from].broken) continue;
    const ControlWords theirs = site_.control_of(writer);
    const std::uint64_t posted = __atomic_load_n(theirs.posted(me), __ATOMIC_ACQUIRE);
    while (writers_[from].seen < posted) {
      const std::uint64_t n = writers_[from].seen + 1;
      Descriptor d;
      const volatile std::uint64_t* entry =
          theirs.ring(me) + ((n - 1) % ControlWords::kRing) * ControlWords::kDescriptorWords;
      auto* words = reinterpret_cast<std::uint64_t*>(&d);
      for (std::size_t i = 0; i < ControlWords::kDescriptorWords; ++i) words[i] = entry[i];
      writers_[from].seen = n;
      any = true;
      if (d.sequence != n) {
        // Stale or overwritten: nothing of this channel can be trusted any more. Its
        // transfers' waits time out on the writer's side.
        writers_[from].broken = true;
        log(LogLevel::Error, "staged transport on rank " + std::to_string(site_.rank) + ": the channel from rank " +
                                 std::to_string(writer) + " holds descriptor " + std::to_string(d.sequence) +
                                 " where " + std::to_string(n) + " was due; nothing more from that rank is carried out");
        __atomic_add_fetch(site_.control.failed(from), 1, __ATOMIC_RELEASE);
        break;
      }
      if (agent_.faults->armed() && windows.owns_lock()) {
        // A fault may stop this thread here: not while it holds the windows.
        flush();
        windows.unlock();
      }
      agent_.faults->hit(FaultPoint::StagedCarry);
      if (!windows.owns_lock()) windows.lock();
      if (!current) current.emplace(site_.device);
      agent_.trace->record('I', writer, d.ticket, static_cast<std::int64_t>(d.done_rank));
      carry_out(writer, n, d);
      batch_.traced.push_back({writer, d.ticket, static_cast<std::int64_t>(d.done_rank)});
    }
  }
  flush();
  return any;
}

// One descriptor from hidden peer `writer`: a chunk copied onto this GPU (then, for the last
// one, the signal and the initiator's done word), or a get answered with chunks. The
// consumed count moves on in either case, also when the descriptor is refused (a window freed
// here, a range outside it): then nothing is copied, no signal is raised for that transfer,
// the failure is counted once (for the writer, or for this rank's own get) and the done word
// still ends the transfer. Under windows_' lock; the copy and the writes go into batch_
// (flush_incoming enqueues them), except a strided chunk's copy and an Add signal's kernel,
// which are enqueued at once, after what the batch holds.
void ChannelReader::carry_out(int writer, std::uint64_t sequence, const Descriptor& d) {
  // For messages only (built when one is needed: this runs per descriptor, on the halo's path).
  const auto what = [&] {
    return "staged transfer from rank " + std::to_string(writer) + " to rank " + std::to_string(site_.rank);
  };
  const std::size_t from = site_.local_index(writer);
  IncomingBatch& batch = batch_;
  std::string problem;
  std::uint64_t* done = site_.control_of(static_cast<int>(d.done_rank)).transfer(d.done_word);
  // A transfer's refusal is its own: the first descriptor of another one starts clean (one the
  // writer abandoned midway never sent its last).
  const std::pair<std::uint64_t, std::uint64_t> transfer{d.done_rank, d.ticket};
  if (d.kind() == Descriptor::kChunk && writers_[from].current != transfer) {
    writers_[from].refused = false;
    writers_[from].current = transfer;
  }
  // Its done word already reached its ticket: the writer abandoned it (a timeout: its agent's
  // end_overdue, or its wait kernel's kTransferGivenUp), and its caller went on. Nothing of it
  // lands any more, and the word (maybe lent to a later transfer by now) is not written.
  // Nor does a chunk of this rank's get from a writer whose process ended: watch_readers ended
  // that get (enqueued) once it had carried out what the writer posted before it died.
  const bool abandoned = d.kind() == Descriptor::kChunk &&
                         (__atomic_load_n(done, __ATOMIC_ACQUIRE) >= d.ticket ||
                          (writers_[from].gone && d.done_rank == static_cast<std::uint64_t>(site_.rank)));
  const bool own_get = d.kind() == Descriptor::kChunk && d.window == kChannelAddress;
  StagedOutgoing* answer = nullptr;  // a get's answer, as queued
  bool copy_batched = false;  // its copy went into the batch (the batch's round then)
  std::uint64_t batch_round = 0;
  auto end_ops = [&] {  // what moves the channel on and ends the transfer, whatever happened
    std::vector<IncomingBatch::End> end;
    if (d.kind() == Descriptor::kChunk && d.last() && !abandoned) {
      IncomingBatch::End e;
      e.op = stream_write_op(done, d.ticket);
      if (d.done_rank == static_cast<std::uint64_t>(site_.rank)) {
        e.answered_word = d.done_word;
        e.ticket = d.ticket;
      }
      end.push_back(e);
    }
    IncomingBatch::End count;
    count.op = stream_write_op(site_.control.consumed(from), sequence);
    end.push_back(count);
    return end;
  };
  try {
    if (d.kind() == Descriptor::kChunk && abandoned) {
      // only the channel moves on
    } else if (d.kind() == Descriptor::kChunk) {
      void* dst = d.width == 0 ? nullptr : resolve_for_channel(*agent_.windows, d.window, d.dst, d.width, d.rows, d.dst_pitch, &problem);
      if (dst != nullptr) {
        const char* slot = static_cast<const char*>(site_.pool->region(writer)) + d.slot_offset;
        if (d.rows == 1) {
          // The copies of one batch run in no set order: one onto bytes that an earlier chunk
          // of the batch writes (two puts of one stream to the same place, whose stream went
          // on at their source read: MESHMEM_STAGED_COMPLETION=source) waits for the next.
          const auto* to = static_cast<const char*>(dst);
          for (std::size_t i = 0; i < batch.dsts.size(); ++i) {
            const auto* other = static_cast<const char*>(batch.dsts[i]);
            if (to < other + batch.sizes[i] && other < to + d.width) {
              flush();
              break;
            }
          }
          batch.dsts.push_back(dst);
          batch.srcs.push_back(slot);
          batch.sizes.push_back(d.width);
          batch.copied.push_back({writer, transfer, d.last(), own_get, false});
          copy_batched = true;
          batch_round = batch.round;
        } else {
          flush();
          ipc::check_cuda(copy_rows(dst, d.dst_pitch, slot, d.width, d.width, d.rows, stream_),
                          "cudaMemcpy2DAsync (from a hidden peer's staging slot)", what());
        }
      }
      if (!problem.empty()) writers_[from].refused = true;
      if (d.last() && !writers_[from].refused && d.signal_window != kChannelAddress) {
        auto* word = static_cast<std::uint64_t*>(
            resolve_for_channel(*agent_.windows, d.signal_window, d.signal_index * sizeof(std::uint64_t), sizeof(std::uint64_t), 1, 0, &problem));
        if (word != nullptr && d.op() == SignalOp::Add) {
          bool copy_failed = false;  // then refused and counted by the flush: no signal
          flush(copy_batched ? &copy_failed : nullptr);  // the kernel after the copy
          if (!copy_failed)
            ipc::check_cuda(cuda::launch_copy(nullptr, nullptr, 0, word, d.value, d.op(), stream_, false),
                            "signal kernel launch", what());
        } else if (word != nullptr) {
          batch.signals.push_back(
              {stream_write_op(word, d.value), copy_batched ? static_cast<long>(batch.dsts.size()) - 1 : -1});
        }
      }
    } else if (d.kind() == Descriptor::kGet) {
      // Checked now (a refused get is answered with its done word alone), resolved again
      // piece by piece: the window may be freed meanwhile.
      const bool readable = resolve_for_channel(*agent_.windows, d.window, d.src_offset, d.width, d.rows, d.src_pitch, &problem) != nullptr;
      StagedOutgoing o;
      o.reader = writer;
      o.answer = true;
      o.to_slot = cudaMemcpyDeviceToHost;  // from a device window of this rank
      o.src_window = d.window;
      o.src = d.src_offset;
      o.width = readable ? d.width : 0;
      o.failure_counted = !readable;  // counted below, at the request's end
      o.rows = d.rows;
      o.src_pitch = d.src_pitch;
      o.dst_pitch = d.dst_pitch;
      o.dst = d.dst;
      o.done_rank = static_cast<int>(d.done_rank);
      o.done_word = d.done_word;
      o.ticket = d.ticket;
      o.pieces = PieceCursor(o.width, o.rows, site_.chunk, site_.first_piece);
      o.moved = ipc::AwakeClock::now();
      o.what = "answer to rank " + std::to_string(writer) + "'s staged get (its transfer " + std::to_string(d.ticket) +
               ") on rank " + std::to_string(site_.rank);
      answer = &agent_.answer(from, std::move(o));
      if (!problem.empty()) writers_[from].refused = true;
    } else {
      problem = "descriptor " + std::to_string(sequence) + " has an unknown kind " + std::to_string(d.kind());
    }
    // A chunk that more chunks of its transfer follow has only its consumed count to write:
    // this thread writes it once the copy is done (CountAfterCopy), unless the batch's stream
    // writes go out anyway.
    if (d.kind() == Descriptor::kChunk && !d.last() && !abandoned) {
      IncomingBatch::End mid;
      mid.op = stream_write_op(site_.control.consumed(from), sequence);
      mid.mid_writer = writer;
      mid.word = site_.control.consumed(from);
      mid.value = sequence;
      batch.ends.push_back(mid);
    } else {
      for (const auto& e : end_ops()) batch.ends.push_back(e);
    }
  } catch (const std::exception& e) {
    problem = e.what();
    writers_[from].refused = true;
    if (answer != nullptr) answer->failure_counted = true;  // counted below
    if (d.kind() == Descriptor::kGet && answer == nullptr) raise_count(done, d.ticket);  // no answer comes
    try {  // the channel and the initiator's wait still move on
      flush();
      std::vector<CUstreamBatchMemOpParams> ops;
      write_ends(ops, end_ops(), "staged transfer (from a hidden peer, after an error)");
    } catch (const std::exception& again) {
      problem += "; then: " + std::string(again.what()) + " (the initiator's wait will time out)";
    }
  }
  if (!problem.empty()) log(LogLevel::Error, what() + ": " + problem);
  // Counted once per transfer, at its end: for the writer (its put or the request of its get),
  // or, for an answer to this rank's own get, here.
  const bool ends = d.kind() == Descriptor::kGet || d.last();
  if (ends && writers_[from].refused) {
    writers_[from].refused = false;
    count_refusal(writer, own_get);
    // Its copy, still in the batch, is not counted again if the batch fails.
    if (copy_batched && batch.round == batch_round) batch.copied.back().counted = true;
  }
  // A transfer ends with its last chunk: a failed copy of one of its earlier chunks, still in
  // the batch, no longer marks the channel's next transfer (see flush_incoming).
  if (d.kind() == Descriptor::kChunk && d.last()) writers_[from].current = kNoTransfer;
}

// A transfer from `writer` refused here, counted once: for the writer (its failed count), or,
// for the answer to this rank's own get, as this rank's error.
void ChannelReader::count_refusal(int writer, bool own_get) {
  if (own_get)
    keep_error("a staged get from rank " + std::to_string(writer) + " was refused there or here (see the logs)");
  else
    __atomic_add_fetch(site_.control.failed(site_.local_index(writer)), 1, __ATOMIC_RELEASE);
}

// Enqueues batch_ on stream_: its copies (one cudaMemcpyBatchAsync where more than
// one), then its stream writes in one batch, signals first, each after every copy of the
// batch; where only consumed counts of chunks that more chunks follow wait, one event after
// the copies instead, and this thread writes them (CountAfterCopy). A batch whose copies could
// not be enqueued refuses their transfers (no signal; counted as carry_out counts a refusal)
// and still writes the done words and counts: the channels and the initiators' waits move on.
void ChannelReader::flush(bool* last_copy_failed) noexcept {
  if (batch_.empty()) return;
  try {
    enqueue_batch(last_copy_failed);
  } catch (const std::exception& e) {  // memory for the batch's bookkeeping
    if (last_copy_failed != nullptr) *last_copy_failed = true;
    try {
      log(LogLevel::Error, "staged transport on rank " + std::to_string(site_.rank) + ": carrying out " +
                               std::to_string(batch_.traced.size()) + " descriptor(s) (chunks, get requests) from hidden peers failed: " +
                               e.what() + " (their initiators' waits will time out)");
      keep_error(e.what());
    } catch (...) {
    }
  }
  batch_.clear();
}

void ChannelReader::enqueue_batch(bool* last_copy_failed) {
  IncomingBatch& b = batch_;
  const auto what = [&] { return "staged transport on rank " + std::to_string(site_.rank); };  // messages only
  // Copies that could not be enqueued, by place in the batch.
  std::vector<bool> failed(b.dsts.size(), false);
  if (!b.dsts.empty()) {
    cudaError_t rc = cudaErrorNotSupported;
    const bool injected = agent_.faults->hit(FaultPoint::StagedCopyIn);  // MESHMEM_FAULT ...:staged.copy_in:fail
#if CUDART_VERSION >= 13000
    if (b.dsts.size() > 1 && batch_copies_ && !injected) {
      cudaMemcpyAttributes attributes{};
      attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      std::size_t first = 0;
      rc = cudaMemcpyBatchAsync(b.dsts.data(), b.srcs.data(), b.sizes.data(), b.dsts.size(), &attributes, &first, 1,
                                stream_);
      if (rc != cudaSuccess) {
        (void)cudaGetLastError();
        // Each copy on its own then (one that is enqueued twice lands the same bytes twice,
        // before the writes that follow).
        if (rc == cudaErrorNotSupported) batch_copies_ = false;
        log(LogLevel::Warn, what() + ": cudaMemcpyBatchAsync of " + std::to_string(b.dsts.size()) +
                                " chunks from hidden peers failed (" + cudaGetErrorString(rc) + "); copied one by one" +
                                (batch_copies_ ? "" : ", from now on too"));
      }
    }
#endif
    if (rc != cudaSuccess) {
      for (std::size_t i = 0; i < b.dsts.size(); ++i) {
        rc = injected ? cudaErrorUnknown : cudaMemcpyAsync(b.dsts[i], b.srcs[i], b.sizes[i], cudaMemcpyDefault, stream_);
        if (rc == cudaSuccess) continue;
        (void)cudaGetLastError();
        failed[i] = true;
        const IncomingBatch::Copied& c = b.copied[i];
        log(LogLevel::Error, what() + ": cudaMemcpyAsync of " + std::to_string(b.sizes[i]) + " bytes from rank " +
                                 std::to_string(c.writer) + "'s staging slot failed: " + cudaGetErrorString(rc) +
                                 (injected ? " (MESHMEM_FAULT staged.copy_in)" : "") +
                                 "; its transfer is refused (no signal; " +
                                 (c.own_get ? "this rank's next call says so)" : "the writer's next call says so)"));
        // A transfer whose last chunk this is is counted now (unless carry_out counted it),
        // one that goes on at its end.
        const std::size_t from = site_.local_index(c.writer);
        if (c.last) {
          if (!c.counted) count_refusal(c.writer, c.own_get);
        } else if (writers_[from].current == c.transfer) {
          writers_[from].refused = true;
        }
      }
    }
    if (last_copy_failed != nullptr) *last_copy_failed = failed.back();
  }
  std::vector<CUstreamBatchMemOpParams> ops;
  for (const auto& [op, copy] : b.signals)
    if (copy < 0 || !failed[static_cast<std::size_t>(copy)]) ops.push_back(op);
  bool only_mid_counts = ops.empty() && !b.ends.empty();
  for (const auto& e : b.ends) only_mid_counts = only_mid_counts && e.mid_writer >= 0;
  cudaEvent_t copied = nullptr;
  if (only_mid_counts) {
    try {
      copied = agent_.events->take(what());
      if (cudaEventRecord(copied, stream_) != cudaSuccess) {
        (void)cudaGetLastError();
        agent_.events->give_back(copied);
        copied = nullptr;
      }
    } catch (const std::exception&) {
      copied = nullptr;
    }
  }
  if (copied != nullptr) {
    // One event for them all, given back with the last.
    for (std::size_t i = 0; i < b.ends.size(); ++i)
      consumed_after_copies_.push_back(
          CountAfterCopy{copied, i + 1 == b.ends.size(), b.ends[i].mid_writer, b.ends[i].word, b.ends[i].value});
  } else {
    try {
      write_ends(ops, b.ends, "staged transfer (from a hidden peer)");
    } catch (const std::exception& e) {
      log(LogLevel::Error, what() + ": " + e.what() + " (the initiators' waits will time out)");
      keep_error(e.what());
    }
  }
  for (const auto& [writer, ticket, done_rank] : b.traced) agent_.trace->record('E', writer, ticket, done_rank);
  if (!b.traced.empty()) agent_.trace->record('L', -1, b.traced.size(), static_cast<std::int64_t>(b.dsts.size()));
}

void ChannelReader::write_ends(std::vector<CUstreamBatchMemOpParams>& ops, const std::vector<IncomingBatch::End>& ends,
                              const char* call) {
  for (const auto& e : ends) ops.push_back(e.op);
  if (agent_.faults->hit(FaultPoint::StagedEndsIn))  // MESHMEM_FAULT ...:staged.ends_in:fail
    throw Error(ErrorCode::Cuda, std::string(call) + ": cuStreamBatchMemOp of " + std::to_string(ops.size()) +
                                     " stream writes on rank " + std::to_string(site_.rank) +
                                     " failed (MESHMEM_FAULT staged.ends_in)");
  run_stream_batch(ops, stream_, call, site_.rank);
  for (const auto& e : ends)
    if (e.answered_word != IncomingBatch::kNoWord) last_answered_[e.answered_word] = e.ticket;
}

}  // namespace meshmem::detail
