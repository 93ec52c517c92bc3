// The staging agent's watches of its hidden peers: peers whose process ended (their slots taken
// back, the transfers they were to end ended here), puts whose live reader has not ended them
// MESHMEM_TIMEOUT after they were posted; and what the agent holds, for the timeout errors of
// callers' threads. (Its streams held back: StreamWatchdog.) docs/transports/staged.md
// describes each.
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
  for (int peer : hidden_peers_.newly_ended()) {
    const std::size_t i = site_.local_index(peer);
    // What it posted before it died is carried out first (its chunks lie in the pool, which
    // this process maps too): a get it answered in full ends as usual, and the ends below are
    // enqueued behind every copy of its chunks. Later chunks for this rank's gets from it are
    // not carried out (carry_out).
    (void)reader_.poll();
    hidden_peers_.mark_gone(peer);
    reader_.writer_gone(i);
    // Its context, and every copy it had enqueued out of these slots, went with the process.
    Lane& own = lanes_.at(site_.device);
    const std::size_t slots = slots_.take_back_from(peer, own.copied, own.stream);
    // Puts it was to end, and gets of this rank's it had not answered in full: nothing will
    // write their done words now. The error is recorded before they end, so that a caller
    // whose stream goes on then finds it.
    std::vector<std::pair<std::uint64_t*, std::uint64_t>> gets;  // (done word, ticket)
    {
      std::lock_guard<std::mutex> lock(remote_.m);
      // The last chunk of the answer to this rank's get was carried out: its done word is
      // enqueued on the incoming stream.
      auto answered = [&](const RemoteEnd& e) { return reader_.answered(e.word, e.ticket); };
      // The words of puts to it that ended are free again (core_); those of puts ended here
      // are never lent again (a few per dead peer, retired before their ends are set): a write
      // of the dead process's that landed late (a deferred context teardown, MPS) must not move
      // a reused word back. Gets' words stay lent: they go back once their ends below landed.
      std::vector<const RemoteEnd*> puts;
      for (const RemoteEnd& e : remote_.list) {
        if (e.peer != peer || e.ended()) continue;
        if (e.writer == peer) {
          if (core_.retire(e.word, e.ticket)) puts.push_back(&e);
        } else if (!answered(e)) {
          gets.emplace_back(const_cast<std::uint64_t*>(e.done), e.ticket);
        }
      }
      const std::string message = "staged transport on rank " + std::to_string(site_.rank) + ": rank " +
                                  std::to_string(peer) + "'s process (pid " + std::to_string(hidden_peers_.pid(peer)) +
                                  ") has ended; " + std::to_string(slots) + " staging slot(s) it held are taken back, " +
                                  std::to_string(puts.size()) + " put(s) to it and " + std::to_string(gets.size()) +
                                  " get(s) from it ended unfinished, and transfers with it fail";
      log(LogLevel::Warn, message);
      if (!puts.empty() || !gets.empty()) keep_error(message, ErrorCode::Cuda);
      // A put's done word is the dead reader's to write: set from here.
      for (const RemoteEnd* e : puts) __atomic_store_n(const_cast<std::uint64_t*>(e->done), e->ticket, __ATOMIC_RELEASE);
      remote_.list.erase(std::remove_if(remote_.list.begin(), remote_.list.end(),
                                        [&](const RemoteEnd& e) { return e.peer == peer && e.writer == peer; }),
                         remote_.list.end());
    }
    // A get's end is this GPU's to write: on the incoming stream, after the copies of the
    // chunks that did come (the caller's stream must not go on while they still write into
    // its buffer). Outside remote_.m: a CUDA call may wait (a full queue).
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
  std::lock_guard<std::mutex> lock(remote_.m);
  for (RemoteEnd& e : remote_.list)
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
    std::lock_guard<std::mutex> lock(remote_.m);
    for (auto it = remote_.list.begin(); it != remote_.list.end();) {
      const RemoteEnd& e = *it;
      if (!e.ends_at_timeout || !e.posted || now - *e.posted < site_.timeout || e.ended()) {
        ++it;
        continue;
      }
      if (!core_.retire(e.word, e.ticket)) {  // it ended meanwhile
        it = remote_.list.erase(it);
        continue;
      }
      const std::string message =
          "staged put to rank " + std::to_string(e.peer) + " (transfer " + std::to_string(e.ticket) + " of rank " +
          std::to_string(site_.rank) + "): rank " + std::to_string(e.peer) + " did not land it within " +
          describe_timeout(site_.timeout) + " of its last descriptor; ended from the host, its data may be incomplete (" +
          slots_.holders() + ")";
      log(LogLevel::Error, message);
      keep_error(message, ErrorCode::Timeout);
      ends.emplace_back(const_cast<std::uint64_t*>(e.done), e.ticket);
      it = remote_.list.erase(it);
    }
  }
  // After the error: a caller whose stream goes on finds it at its next call.
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
  const std::string visible = copier_.describe(now);
  if (!visible.empty()) add(visible);
  const auto& outgoing = writer_.queues();
  for (std::size_t i = 0; i < outgoing.size(); ++i) {
    if (outgoing[i].empty()) continue;
    const StagedOutgoing& o = outgoing[i].front();
    add(std::to_string(outgoing[i].size()) + " for rank " + std::to_string(o.reader) + " (the oldest, " + o.what +
        (o.pieces.done() ? "" : ", last moved " + ago(o.moved) + " ago") + ")");
  }
  for (int peer : site_.hidden) {
    const std::size_t i = site_.local_index(peer);
    const std::uint64_t posted = __atomic_load_n(site_.control.posted(i), __ATOMIC_ACQUIRE);
    const std::uint64_t taken = site_.consumed_by(peer);
    const std::uint64_t consumed = __atomic_load_n(site_.control.consumed(i), __ATOMIC_ACQUIRE);
    if (writer_.posted(i) != taken || reader_.seen(i) != consumed)
      add("channel to rank " + std::to_string(peer) + ": " + std::to_string(writer_.posted(i)) + " posted, " +
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
  return s + "; " + slots_.holders();
}



}  // namespace meshmem::detail
