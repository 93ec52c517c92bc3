// The staging agent's watchdogs (StagingAgent, part 3 of 3): hidden peers whose process ended
// (their slots taken back, the transfers they were to end ended here), puts whose live reader
// has not ended them MESHMEM_TIMEOUT after they were posted, the agent's streams held back (a
// report, and a held lane's ends written from the host), and what the agent holds, for the
// timeout errors of callers' threads. docs/transports/staged.md describes each.
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

void StagingAgent::watch_readers() {
  for (int peer : site_.hidden) {
    const std::size_t i = site_.local_index(peer);
    if (peers_[i].gone || !peers_[i].process.ended()) continue;
    // What it posted before it died is carried out first (its chunks lie in the pool, which
    // this process maps too): a get it answered in full ends as usual, and the ends below are
    // enqueued behind every copy of its chunks. Later chunks for this rank's gets from it are
    // not carried out (carry_out).
    (void)reader_.poll();
    peers_[i].gone = true;
    reader_.writer_gone(i);
    // Its context, and every copy it had enqueued out of these slots, went with the process.
    std::size_t slots = 0;
    Lane& own = lanes_.at(site_.device);
    for (std::size_t s = 0; s < slot_use_.size(); ++s) {
      if (slot_use_[s].reader != peer) continue;
      if (consumed_by(peer) < slot_use_[s].sequence) ++slots;
      // After this rank's own copy into it: recorded now (a last piece's copy has no event of
      // its own), behind every copy of the lane so far.
      if (cudaEventRecord(own.copied[s], own.stream) != cudaSuccess) (void)cudaGetLastError();  // the lane failed
      slot_use_[s] = SlotUse{own.copied[s], -1, 0};
    }
    // Puts it was to end, and gets of this rank's it had not answered in full: nothing will
    // write their done words now. The error is recorded before they end, so that a caller
    // whose stream goes on then finds it.
    std::vector<std::pair<std::uint64_t*, std::uint64_t>> gets;  // (done word, ticket)
    {
      std::lock_guard<std::mutex> lock(ledger_.m);
      // The last chunk of the answer to this rank's get was carried out: its done word is
      // enqueued on the incoming stream.
      auto answered = [&](const RemoteEnd& e) { return reader_.answered(e.word, e.ticket); };
      std::vector<const RemoteEnd*> puts;
      for (const RemoteEnd& e : ledger_.remote_lent) {
        if (e.peer != peer || __atomic_load_n(e.done, __ATOMIC_ACQUIRE) >= e.ticket) continue;
        if (e.writer == peer)
          puts.push_back(&e);
        else if (!answered(e))
          gets.emplace_back(const_cast<std::uint64_t*>(e.done), e.ticket);
      }
      const std::string message = "staged transport on rank " + std::to_string(site_.rank) + ": rank " +
                                  std::to_string(peer) + "'s process (pid " + std::to_string(peers_[i].process.pid()) +
                                  ") has ended; " + std::to_string(slots) + " staging slot(s) it held are taken back, " +
                                  std::to_string(puts.size()) + " put(s) to it and " + std::to_string(gets.size()) +
                                  " get(s) from it ended unfinished, and transfers with it fail";
      log(LogLevel::Warn, message);
      if (!puts.empty() || !gets.empty()) keep_error_locked(message, ErrorCode::Cuda);
      // A put's done word is the dead reader's to write: set from here.
      for (const RemoteEnd* e : puts) __atomic_store_n(const_cast<std::uint64_t*>(e->done), e->ticket, __ATOMIC_RELEASE);
      // The words of puts to it that ended are free again; those of puts ended here are never
      // lent again (a few per dead peer): a write of the dead process's that landed late (a
      // deferred context teardown, MPS) must not move a reused word back. Gets' words stay:
      // reclaim_words takes them back once their ends below landed.
      ledger_.remote_lent.erase(std::remove_if(ledger_.remote_lent.begin(), ledger_.remote_lent.end(),
                                        [&](const RemoteEnd& e) {
                                          if (e.peer != peer || e.writer != peer) return false;
                                          if (std::find(puts.begin(), puts.end(), &e) == puts.end() &&
                                              (__atomic_load_n(e.done, __ATOMIC_ACQUIRE) & cuda::kTransferGivenUp) == 0)
                                            ledger_.free_words.push_back(e.word);
                                          return true;
                                        }),
                         ledger_.remote_lent.end());
    }
    // A get's end is this GPU's to write: on the incoming stream, after the copies of the
    // chunks that did come (the caller's stream must not go on while they still write into
    // its buffer). Outside ledger_.m: a CUDA call may wait (a full queue), and callers take ledger_.m.
    if (!gets.empty()) {
      std::vector<CUstreamBatchMemOpParams> ops;
      for (const auto& [done, ticket] : gets) ops.push_back(stream_write_op(done, ticket));
      try {
        CurrentDevice current(site_.device);
        run_stream_batch(ops, reader_.stream(), "staged transfer (ending gets a dead peer did not answer)", site_.rank);
      } catch (const std::exception& e) {
        log(LogLevel::Error, std::string(e.what()) + "; the gets' ends are set from the host");
        for (const auto& [done, ticket] : gets) __atomic_store_n(done, ticket, __ATOMIC_RELEASE);
      }
    }
  }
}

void StagingAgent::mark_posted(std::size_t word, std::uint64_t ticket) {
  std::lock_guard<std::mutex> lock(ledger_.m);
  for (RemoteEnd& e : ledger_.remote_lent)
    if (e.word == word && e.ticket == ticket) e.posted = Clock::now();
}

// The callers' streams wait for these with stream memory waits, which cannot time out by
// themselves (ends_at_timeout: a put on a shared GPU whose reader copies a chunk small enough
// to wait for a polling kernel's time slice there, studies/timeslice_lab). A put whose reader
// lives but has not ended it is ended from the host, the error kept first. Its word is never lent again: the peer may still
// write its end later, which must not move a reused word back; and its done word having
// reached its ticket, chunks of it that still come are not carried out (carry_out).
void StagingAgent::end_overdue() {
  if (site_.timeout.count() == 0) return;
  const auto now = Clock::now();
  std::vector<std::pair<std::uint64_t*, std::uint64_t>> ends;  // (done word, ticket)
  {
    std::lock_guard<std::mutex> lock(ledger_.m);
    for (auto it = ledger_.remote_lent.begin(); it != ledger_.remote_lent.end();) {
      const RemoteEnd& e = *it;
      if (!e.ends_at_timeout || !e.posted || now - *e.posted < site_.timeout ||
          __atomic_load_n(e.done, __ATOMIC_ACQUIRE) >= e.ticket) {
        ++it;
        continue;
      }
      const std::string message =
          "staged put to rank " + std::to_string(e.peer) + " (transfer " + std::to_string(e.ticket) + " of rank " +
          std::to_string(site_.rank) + "): rank " + std::to_string(e.peer) + " did not land it within " +
          describe_timeout(site_.timeout) + " of its last descriptor; ended from the host, its data may be incomplete (" +
          slot_holders() + ")";
      log(LogLevel::Error, message);
      keep_error_locked(message, ErrorCode::Timeout);
      ends.emplace_back(const_cast<std::uint64_t*>(e.done), e.ticket);
      it = ledger_.remote_lent.erase(it);
    }
  }
  // After the error: a caller whose stream goes on finds it at its next call.
  for (const auto& [done, ticket] : ends) raise_count(done, ticket);
}

// Each stream's progress: a lane's pieces and transfer ends (and, on this rank's GPU, its
// channel posts), the incoming stream's consumed counts. A piece's `freed` event may have been
// recorded again for a later piece of its slot: done then means done up to that later one, and
// not done only that the stream has not reached it, so progress is at worst seen late.
bool StagingAgent::watch_streams() {
  bool pending_any = false;
  for (auto& [device, lane] : lanes_) {
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
        if (posted < peers_[to].posted) posts += peers_[to].posted - posted;
      }
      pending = pending || posts != 0;
      holds += " and " + std::to_string(posts) + " chunk(s) for hidden peers";
    }
    watch(lane.watch, done, pending, "lane of device " + std::to_string(device), holds);
    if (pending && site_.timeout.count() != 0 && lane.watch.unmoved_for(Clock::now()) >= site_.timeout)
      end_held(lane, device);
    pending_any = pending_any || pending;
  }
  if (reader_.stream() != nullptr) {
    std::uint64_t done = 0, left = 0;
    reader_.progress(&done, &left);
    watch(incoming_watch_, done, left != 0, "incoming stream (device " + std::to_string(site_.device) + ")",
          std::to_string(left) + " chunk(s) of hidden peers");
    pending_any = pending_any || left != 0;
  }
  return pending_any;
}

void StagingAgent::watch(StreamWatch& w, std::uint64_t done, bool pending, const std::string& stream,
                         const std::string& holds) {
  const auto now = Clock::now();
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
  std::lock_guard<std::mutex> lock(ledger_.m);
  held_report_ = report;
}

// The ends still held on the lane are written from the host, once per transfer (a later end
// of the GPU's writes the same ticket); their words are taken back only once the lane's counter
// passes them, as always, so no held write lands in a word lent again. Their streams go on;
// what the held copies still write lands later ("its data may be incomplete", as for a wait
// kernel's timeout).
void StagingAgent::end_held(Lane& lane, int device) {
  std::vector<std::pair<std::uint64_t*, std::uint64_t>> ends;  // (done word, ticket)
  {
    std::lock_guard<std::mutex> lock(ledger_.m);
    for (const Lane::LentEnd& l : lane.lent) {
      std::uint64_t* done = site_.control.transfer(l.word);
      if (__atomic_load_n(done, __ATOMIC_ACQUIRE) < l.ticket) ends.emplace_back(done, l.ticket);
    }
  }
  if (ends.empty()) return;
  const std::string message =
      "staged transport on rank " + std::to_string(site_.rank) + ": " + std::to_string(ends.size()) +
      " transfer(s) whose end was held on the agent's lane of device " + std::to_string(device) + " for " +
      describe_timeout(site_.timeout) + " were ended from the host: their streams went on, their data may be incomplete" +
      gpu_queue_hint();
  log(LogLevel::Error, message);
  // The error first: a caller whose stream goes on at the write below finds it at its next call.
  keep_error(message, ErrorCode::Timeout);
  for (const auto& [done, ticket] : ends) raise_count(done, ticket);
}

std::string StagingAgent::describe_state(std::size_t waiting) const {
  const auto now = Clock::now();
  const auto ago = [&](Clock::time_point t) {
    return describe_timeout(std::chrono::duration_cast<std::chrono::milliseconds>(now - t));
  };
  std::string s;
  const auto add = [&](const std::string& part) { s += (s.empty() ? "" : ", ") + part; };
  if (waiting > 0) add(std::to_string(waiting) + " transfer(s) whose source is not known to be ready");
  if (!visible_.empty())
    add(std::to_string(visible_.size()) + " between visible GPUs (the oldest, transfer " +
        std::to_string(visible_.front().request.ticket) + ", last moved " + ago(visible_.front().moved) + " ago)");
  for (std::size_t i = 0; i < outgoing_.size(); ++i) {
    if (outgoing_[i].empty()) continue;
    const Outgoing& o = outgoing_[i].front();
    add(std::to_string(outgoing_[i].size()) + " for rank " + std::to_string(o.reader) + " (the oldest, " + o.what +
        (o.pieces.done() ? "" : ", last moved " + ago(o.moved) + " ago") + ")");
  }
  for (int peer : site_.hidden) {
    const std::size_t i = site_.local_index(peer);
    const std::uint64_t posted = __atomic_load_n(site_.control.posted(i), __ATOMIC_ACQUIRE);
    const std::uint64_t taken = consumed_by(peer);
    const std::uint64_t consumed = __atomic_load_n(site_.control.consumed(i), __ATOMIC_ACQUIRE);
    if (peers_[i].posted != taken || reader_.seen(i) != consumed)
      add("channel to rank " + std::to_string(peer) + ": " + std::to_string(peers_[i].posted) + " posted, " +
          std::to_string(posted) + " of them counted, " + std::to_string(taken) +
          " taken there; from it: " + std::to_string(reader_.seen(i)) + " seen, " + std::to_string(consumed) + " consumed here");
  }
  for (const auto& [device, lane] : lanes_) {
    const std::uint64_t ended = __atomic_load_n(site_.control.lane_done(lane.ordinal), __ATOMIC_ACQUIRE);
    if (ended < lane.ended || !lane.pieces.empty())
      add("lane of device " + std::to_string(device) + ": " + std::to_string(lane.ended - std::min(ended, lane.ended)) +
          " transfer end(s) and up to " + std::to_string(lane.pieces.size()) + " piece(s) not run");
  }
  if (s.empty()) return {};
  return s + "; " + slot_holders();
}

std::string StagingAgent::held_report() {
  std::lock_guard<std::mutex> lock(ledger_.m);
  return held_report_;
}

// Which hidden readers hold this rank's slots, for a timeout's message.
std::string StagingAgent::slot_holders() const {
  std::map<int, int> held;
  for (const SlotUse& use : slot_use_)
    if (use.reader >= 0 && consumed_by(use.reader) < use.sequence) ++held[use.reader];
  if (held.empty()) return "no hidden peer holds a slot of this rank";
  std::string s;
  for (const auto& [reader, count] : held)
    s += (s.empty() ? "" : ", ") + std::to_string(count) + " slot(s) not yet taken by rank " + std::to_string(reader);
  return s;
}

}  // namespace meshmem::detail
