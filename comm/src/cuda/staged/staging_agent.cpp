// StagingAgent: its thread, the queue of transfers handed over and their done words, and
// teardown; what its roles (VisibleCopier, ChannelWriter, ChannelReader, StreamWatchdog) reach
// of it. Its watches of hidden peers: staging_agent_watch.cpp.
#include "cuda/staged/staging_agent.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "backoff.hpp"
#include "helper_cpus.hpp"
#include "log.hpp"
#include "cuda/runtime/cuda_owners.hpp"
#include "cuda/runtime/device_sync.hpp"
#include "cuda/runtime/stream_ops.hpp"
#include "cuda/runtime/gpu_queues.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

namespace {

constexpr std::size_t kTraceSteps = std::size_t(1) << 20;  // MESHMEM_STAGED_TRACE: steps kept per rank

}  // namespace


StagingSite StagingAgent::site_of(Setup& setup) {
  StagingSite site;
  site.pool = std::move(setup.pool);
  site.slots = static_cast<char*>(site.pool->region(setup.rank));
  site.chunk = setup.chunk;
  site.first_piece = setup.first_piece;
  site.nslots = setup.slots;
  site.control = ControlWords{nullptr, static_cast<std::size_t>(setup.ranks), setup.node_ranks.size()};
  site.rank = setup.rank;
  site.device = setup.devices.front();
  site.local_of.assign(static_cast<std::size_t>(setup.ranks), 0);
  for (std::size_t i = 0; i < setup.node_ranks.size(); ++i) {
    site.local_of[static_cast<std::size_t>(setup.node_ranks[i])] = i;
    if (setup.hidden[static_cast<std::size_t>(setup.node_ranks[i])]) site.hidden.push_back(setup.node_ranks[i]);
  }
  site.timeout = setup.timeout;
  site.control = site.control_of(setup.rank);
  return site;
}

ChannelReader::Agent StagingAgent::reader_links() {
  ChannelReader::Agent a;
  a.site = &site_;
  a.faults = &faults_;
  a.trace = &trace_;
  a.events = &events_;
  a.windows = &windows_;
  a.keep_error = [this](const std::string& message) { keep_error(message); };
  a.answer = [this](std::size_t from, StagedOutgoing answer) -> StagedOutgoing& {
    {
      std::lock_guard<std::mutex> lock(ledger_.m);
      ++ledger_.answers;
    }
    return writer_.queue(from, std::move(answer));
  };
  return a;
}

ChannelWriter::Agent StagingAgent::writer_links() {
  ChannelWriter::Agent a;
  a.site = &site_;
  a.faults = &faults_;
  a.trace = &trace_;
  a.events = &events_;
  a.windows = &windows_;
  a.slots = &slots_;
  a.lane = &lanes_.at(site_.device);
  a.peers = &hidden_peers_;
  a.keep_error = [this](const std::string& message, ErrorCode code) { keep_error(message, code); };
  a.posted_in_full = [this](std::size_t word, std::uint64_t ticket) { mark_posted(word, ticket); };
  a.ended = [this](bool answer) { ended(answer); };
  return a;
}

VisibleCopier::Agent StagingAgent::copier_links() {
  VisibleCopier::Agent a;
  a.site = &site_;
  a.lanes = &lanes_;
  a.slots = &slots_;
  a.keep_error = [this](const std::string& message, ErrorCode code) { keep_error(message, code); };
  a.fail = [this](const StagedRequest& r, const std::string& message) { fail(r, message); };
  a.end_enqueued = [this](Lane& to, const StagedRequest& r) {
    std::lock_guard<std::mutex> lock(ledger_.m);
    ++to.ended;
    if (r.word_is_lent) to.lent.push_back(Lane::LentEnd{to.ended, r.word, r.ticket});
  };
  a.ended = [this] { ended(false); };
  return a;
}

StreamWatchdog::Agent StagingAgent::watchdog_links() {
  StreamWatchdog::Agent a;
  a.site = &site_;
  a.lanes = &lanes_;
  a.writer = &writer_;
  a.reader = &reader_;
  a.keep_error = [this](const std::string& message, ErrorCode code) { keep_error(message, code); };
  a.unended = [this](const Lane& lane) {
    std::vector<std::pair<std::uint64_t*, std::uint64_t>> ends;
    std::lock_guard<std::mutex> lock(ledger_.m);
    for (const Lane::LentEnd& l : lane.lent) {
      std::uint64_t* done = site_.control.transfer(l.word);
      if (__atomic_load_n(done, __ATOMIC_ACQUIRE) < l.ticket) ends.emplace_back(done, l.ticket);
    }
    return ends;
  };
  return a;
}

namespace {
std::string agent_name(int rank) { return "staged transport on rank " + std::to_string(rank); }
}  // namespace

StagingAgent::StagingAgent(Setup setup)
    : site_(site_of(setup)),
      faults_(std::move(setup.faults)),
      trace_(setup.trace_prefix.empty() ? "" : setup.trace_prefix + "." + std::to_string(setup.rank),
             setup.trace_prefix.empty() ? 0 : kTraceSteps),
      lanes_(setup.devices, setup.slots, ControlWords::kLanes, agent_name(setup.rank)),
      slots_(site_),
      hidden_peers_(site_, setup.pids, agent_name(setup.rank)),
      failed_seen_(setup.node_ranks.size(), 0),
      captured_(std::move(setup.captured)),
      fill_slots_(site_.control, cuda::kTransferGivenUp),
      writer_(writer_links()),
      copier_(copier_links()),
      reader_(reader_links()),
      watchdog_(watchdog_links()) {
  const std::string what = agent_name(site_.rank);
  if (site_.control.transfer_count() < ControlWords::kLeastTransferWords)
    throw Error(ErrorCode::Unsupported, what + ": " + std::to_string(setup.node_ranks.size()) + " ranks on a node and " +
                                            std::to_string(setup.ranks) +
                                            " in the Comm leave too few of the staging pool's control words");
  std::memset(site_.control.base, 0, ControlWords::kBytes);
  for (std::size_t i = site_.control.transfer_count(); i-- > 0;) ledger_.free_words.push_back(i);
  pulse_ = std::make_shared<WorkerPulse>("the staging agent of rank " + std::to_string(site_.rank));
  register_worker_pulse(pulse_);
  thread_ = std::thread([this] { run(); });
  place_helper_thread(thread_, "staging agent");  // off a caller bound to one core (helper_cpus.hpp)
}

StagingAgent::~StagingAgent() {
  // Bounded: a transfer's source can sit behind a caller's stream that never moves on (a wait
  // for a signal that never comes), or a hidden peer may be gone. Streams and events with
  // pending work may be destroyed; CUDA releases them once that work is done.
  if (!drain()) log(LogLevel::Error, "staged transport: transfers still waiting or running at teardown");
  stop();
  if (trace_.on()) {
    const std::string problem = trace_.write();
    log(problem.empty() ? LogLevel::Info : LogLevel::Warn,
        "staged transport on rank " + std::to_string(site_.rank) + ": step trace (MESHMEM_STAGED_TRACE) of " +
            std::to_string(trace_.recorded()) + " steps " + (problem.empty() ? "written" : "not written: " + problem));
  }
}

void StagingAgent::stop() noexcept {
  {
    std::lock_guard<std::mutex> lock(ledger_.m);
    ledger_.stop = true;
  }
  ledger_.cv.notify_all();
  if (thread_.joinable()) thread_.join();
  if (pulse_) pulse_->stop();  // the agent may live on (window attachments): not "stuck"
}

bool StagingAgent::try_take_word(std::size_t* word) {
  std::lock_guard<std::mutex> lock(ledger_.m);
  reclaim_words();  // every time, not only when none is left: words are reused at once (and so tested)
  if (ledger_.free_words.empty()) return false;
  *word = ledger_.free_words.back();
  ledger_.free_words.pop_back();
  return true;
}

std::uint64_t* StagingAgent::lend_word(StagedRequest& r, const std::string& what) {
  Deadline deadline(site_.timeout);
  Backoff backoff;
  std::size_t word = 0;
  while (!try_take_word(&word)) {
    if (deadline.expired())
      throw Error(ErrorCode::Timeout, what + ": " + std::to_string(site_.control.transfer_count()) +
                                          " staged transfers of this rank are waiting or running (or captured) and "
                                          "none ended within " + describe_timeout(site_.timeout) + "; nothing was enqueued" +
                                          describe_worker_pulses());
    backoff.pause();
  }
  r.word = word;
  r.done = site_.control.transfer(word);
  r.word_is_lent = true;
  std::uint64_t* ready = site_.control.ready(word);
  r.ready = ready;
  return ready;
}

bool StagingAgent::try_hold_word(StagedRequest& r) {
  if (!try_take_word(&r.word)) return false;
  r.done = site_.control.transfer(r.word);
  return true;
}

void StagingAgent::release_word(std::size_t word) {
  std::lock_guard<std::mutex> lock(ledger_.m);
  ledger_.free_words.push_back(word);
}

void StagingAgent::release_captured_word(std::size_t word, const std::uint64_t* done, std::uint64_t last) {
  std::lock_guard<std::mutex> lock(ledger_.m);
  if (last == 0 || __atomic_load_n(done, __ATOMIC_ACQUIRE) >= last)
    ledger_.free_words.push_back(word);
  else
    ledger_.released_captured.push_back(CapturedEnd{done, last, word});
}

std::uint64_t StagingAgent::submit(StagedRequest r) {
  std::lock_guard<std::mutex> lock(ledger_.m);
  // Even: a put with source completion has its source read written as ticket - 1, which no
  // earlier transfer of its word can have reached.
  r.ticket = 2 * ++ledger_.submitted;
  trace_.record('S', r.peer, r.ticket);
  ledger_.queue.push_back(r);
  ledger_.cv.notify_all();
  return r.ticket;
}

void StagingAgent::withdraw(std::uint64_t ticket, std::uint64_t* ready) {
  {
    std::lock_guard<std::mutex> lock(ledger_.m);
    ledger_.withdrawn.push_back(ticket);
    ledger_.withdrawn_count.store(ledger_.withdrawn.size(), std::memory_order_release);
  }
  __atomic_store_n(ready, ticket, __ATOMIC_RELEASE);  // after the list: the agent looks there once it sees this
}

void StagingAgent::captured_added() {
  // Under ledger_.m: the thread either sees the capture when it next decides to sleep, or sleeps
  // already and gets the notification.
  { std::lock_guard<std::mutex> lock(ledger_.m); }
  ledger_.cv.notify_all();
}

void StagingAgent::add_window(std::uint64_t id, void* local, std::size_t bytes) { windows_.add(id, local, bytes); }

void StagingAgent::remove_window(std::uint64_t id) {
  // Chunks from hidden peers (incoming stream) and answers to their gets (this GPU's lane) are
  // enqueued under this lock: none is being enqueued into or from the window now, and none
  // will be. What was enqueued before is behind an event on each of those streams.
  std::vector<cudaEvent_t> enqueued;
  {
    const auto lock = windows_.lock();
    windows_.erase_locked(id);
    if (reader_.stream() == nullptr) return;
    CurrentDevice current(site_.device);
    for (cudaStream_t stream : {reader_.stream(), lanes_.at(site_.device).stream}) {
      cudaEvent_t e = nullptr;
      if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess || cudaEventRecord(e, stream) != cudaSuccess) {
        (void)cudaGetLastError();
        if (e) (void)cudaEventDestroy(e);
        e = nullptr;
      }
      enqueued.push_back(e);
    }
  }
  // Those copies end before the window's memory goes (bounded), whatever else is in flight.
  Deadline deadline(site_.timeout);
  Backoff backoff;
  bool ended = true;
  for (cudaEvent_t e : enqueued) {
    if (e == nullptr) ended = false;
    while (ended && e != nullptr && cudaEventQuery(e) == cudaErrorNotReady) {
      if (deadline.expired()) {
        ended = false;
        break;
      }
      backoff.pause();
    }
  }
  (void)cudaGetLastError();
  for (cudaEvent_t e : enqueued)
    if (e) (void)cudaEventDestroy(e);
  if (!ended)
    log(LogLevel::Error, "staged transport on rank " + std::to_string(site_.rank) + ": copies between hidden peers and window #" +
                             std::to_string(id) + " did not end before it was freed");
}

// The first error since the caller last took it is the one its next call raises; later ones
// are only logged.
void StagingAgent::keep_error(const std::string& message, ErrorCode code) {
  std::lock_guard<std::mutex> lock(ledger_.m);
  keep_error_locked(message, code);
}

void StagingAgent::keep_error_locked(const std::string& message, ErrorCode code) {
  if (!ledger_.error.empty()) return;
  ledger_.error = message;
  ledger_.error_code = code;
}

std::string StagingAgent::take_error(ErrorCode* code) {
  *code = ErrorCode::Cuda;
  std::string failed;
  for (int peer : site_.hidden) {
    const std::uint64_t now = __atomic_load_n(site_.control_of(peer).failed(site_.local_index(site_.rank)), __ATOMIC_ACQUIRE);
    std::uint64_t& seen = failed_seen_[site_.local_index(peer)];
    if (now > seen) {
      failed += (failed.empty() ? "" : "; ") + std::string("rank ") + std::to_string(peer) + " could not carry out " +
                std::to_string(now - seen) + " staged transfer(s) from this rank (its log says why)";
      seen = now;
    }
  }
  std::lock_guard<std::mutex> lock(ledger_.m);
  if (!ledger_.error.empty()) *code = ledger_.error_code;
  if (!failed.empty()) return ledger_.error.empty() ? failed : std::exchange(ledger_.error, std::string()) + "; " + failed;
  return std::exchange(ledger_.error, std::string());
}

bool StagingAgent::drain() noexcept {
  const auto deadline = Clock::now() + (site_.timeout.count() == 0 ? std::chrono::hours(24 * 365) : site_.timeout);
  {
    std::unique_lock<std::mutex> lock(ledger_.m);
    if (!ledger_.cv.wait_until(lock, deadline, [&] { return (ledger_.handled == ledger_.submitted && ledger_.answers == 0) || ledger_.stop; })) return false;
  }
  Backoff backoff;
  auto idle = [&](cudaStream_t stream, int device) {
    CurrentDevice current(device);
    while (cudaStreamQuery(stream) == cudaErrorNotReady) {
      if (Clock::now() > deadline) return false;
      backoff.pause();
    }
    (void)cudaGetLastError();
    return true;
  };
  for (auto& [d, lane] : lanes_)
    if (!idle(lane.stream, d)) return false;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(ledger_.m);
      reclaim_words();
      if (ledger_.remote_lent.empty()) break;
    }
    if (Clock::now() > deadline) return false;
    backoff.pause();
  }
  return reader_.stream() == nullptr || idle(reader_.stream(), site_.device);
}

void StagingAgent::reclaim_words() {
  for (auto& [d, lane] : lanes_) {
    const std::uint64_t done = __atomic_load_n(site_.control.lane_done(lane.ordinal), __ATOMIC_ACQUIRE);
    while (!lane.lent.empty() && lane.lent.front().count <= done) {
      ledger_.free_words.push_back(lane.lent.front().word);
      lane.lent.pop_front();
    }
  }
  // A hidden peer (or this rank's incoming stream) wrote the done word itself: its last write;
  // a released graph's word: its last transfer's end. Either way the word is free once the
  // done word reached the ticket. One its caller's wait kernel gave up (kTransferGivenUp) is
  // never lent again, as end_overdue's: the reader may still write its end later.
  auto ended = [&](const auto& e) {
    const std::uint64_t done = __atomic_load_n(e.done, __ATOMIC_ACQUIRE);
    if (done < e.ticket) return false;
    if ((done & cuda::kTransferGivenUp) == 0) ledger_.free_words.push_back(e.word);
    return true;
  };
  ledger_.remote_lent.erase(std::remove_if(ledger_.remote_lent.begin(), ledger_.remote_lent.end(), ended), ledger_.remote_lent.end());
  ledger_.released_captured.erase(std::remove_if(ledger_.released_captured.begin(), ledger_.released_captured.end(), ended),
                           ledger_.released_captured.end());
}

void StagingAgent::run() {
  relax_capture_mode_of_this_thread();
  tighten_timer_slack();
  ReadyQueue<StagedRequest> waiting;  // handed over; sources not known to be ready yet
  // While some source is not ready or some transfer waits for a slot: at most 20 us between
  // polls, so a transfer starts (or goes on) at most that late.
  Backoff backoff(std::chrono::microseconds(20));
  auto last_work = Clock::now();
  bool streams_hold_work = false;
  auto busy = [&] {
    return !waiting.empty() || copier_.busy() || writer_.busy() || reader_.counts_pending();
  };
  // Hidden peers may post chunks, and replays of captured transfers ring, at any time.
  auto polls = [&] { return !site_.hidden.empty() || captured_->live(); };
  for (;;) {
    // Outside ledger_.m: a replay's hand-off submits (which takes it).
    if (captured_->poll()) last_work = Clock::now();
    const bool working = busy();
    pulse_->turn(pulse_now_ns());
    {
      std::unique_lock<std::mutex> lock(ledger_.m);
      auto woken = [&] { return ledger_.stop || !ledger_.queue.empty(); };
      // A capture makes polls() true and wakes this thread (captured_added).
      auto woken_or_polls = [&] { return woken() || polls(); };
      if (!working && !polls() && !streams_hold_work) {
        pulse_->sleep(pulse_now_ns());
        ledger_.cv.wait(lock, woken_or_polls);
      } else if (!working && !polls()) {
        ledger_.cv.wait_for(lock, std::chrono::milliseconds(100), woken_or_polls);  // the next look at the streams
      } else if (!working) {
        // Poll, yielding for 1 ms after recent work
        // (the next chunk, or the next exchange of an iterating code, is near: a halo exchange
        // every few hundred us must not wait for a sleeping agent), then every 20 us, and every
        // 200 us after 20 ms without work (a first chunk after a quiet spell starts up to that
        // late).
        const auto quiet = Clock::now() - last_work;
        if (quiet < std::chrono::milliseconds(1)) {
          lock.unlock();
          std::this_thread::yield();
          lock.lock();
        } else {
          ledger_.cv.wait_for(lock, quiet < std::chrono::milliseconds(20) ? std::chrono::microseconds(20)
                                                                   : std::chrono::microseconds(200),
                       woken);
        }
      }
      while (!ledger_.queue.empty()) {
        waiting.push(ledger_.queue.front());
        ledger_.queue.pop_front();
      }
      // Stopping: after drain (bounded) gave up on sources that never became ready (or on
      // transfers that found no slot), their done words are set from here so that no
      // caller's stream waits for ever (MESHMEM_TIMEOUT=0); chunks hidden peers still post
      // are not carried out.
      if (ledger_.stop) {
        lock.unlock();
        (void)write_counts_after_copies();  // copies already done still free their slots for the peers
        give_up_all(waiting);
        return;
      }
    }
    if (!site_.hidden.empty() && Clock::now() >= next_watch_) {
      watch_readers();
      end_overdue();
      next_watch_ = Clock::now() + std::chrono::milliseconds(10);
    }
    if (Clock::now() >= next_stream_watch_) {
      give_up_if_context_failed(waiting);
      streams_hold_work = watchdog_.look();
      pulse_->publish(describe_state(waiting.size()), pulse_now_ns());
      next_stream_watch_ = Clock::now() + std::chrono::milliseconds(100);
    }
    // This rank's transfers are posted before its peers' chunks are carried out: a post starts
    // the longer chain (the peer's GPU copy, its agent, the copy here, the done word back),
    // which the caller's stream waits for as much as for its incoming chunks.
    const bool started = start_ready(waiting);
    bool pumped = pump();
    const bool counted = write_counts_after_copies();
    const bool carried = reader_.poll();
    if (carried) pumped = pump() || pumped;  // answers to peers' gets go out in this turn too
    if (started || counted || carried || pumped) {
      streams_hold_work = true;  // until the next look at the streams says otherwise
      backoff.reset();
      last_work = Clock::now();
      continue;
    }
    if (busy()) backoff.pause();
  }
}

// At stop, what is still waiting or half enqueued ends here: its done word is set from the
// host (the caller's stream goes on), and the log says so.
void StagingAgent::give_up_all(ReadyQueue<StagedRequest>& waiting) {
  std::size_t n = 0;
  waiting.take_all([&](const StagedRequest& r) {
    __atomic_store_n(r.done, r.ticket, __ATOMIC_RELEASE);
    ++n;
  });
  n += copier_.give_up_all();
  n += writer_.give_up_all();
  if (n > 0)
    log(LogLevel::Error, "staged transport on rank " + std::to_string(site_.rank) + ": " + std::to_string(n) +
                             " transfer(s) still waiting or running when the agent stopped were ended unfinished");
}

// A failed context (an illegal address in some kernel of this process, say) fails every call
// for good: the callers' streams never reach the operations that set the ready words of the
// transfers still waiting, so these end here, with the error (before, their events' queries
// returned it). An error that a second look no longer returns was not the context's.
void StagingAgent::give_up_if_context_failed(ReadyQueue<StagedRequest>& waiting) {
  if (waiting.empty()) return;
  CurrentDevice current(site_.device);
  const cudaStream_t lane = lanes_.at(site_.device).stream;
  cudaError_t rc = cudaStreamQuery(lane);
  if (rc == cudaSuccess || rc == cudaErrorNotReady) return;
  (void)cudaGetLastError();
  rc = cudaStreamQuery(lane);
  if (rc == cudaSuccess || rc == cudaErrorNotReady) return;
  (void)cudaGetLastError();
  const std::string message = "staged transport on rank " + std::to_string(site_.rank) +
                              ": the GPU context failed before the callers' streams reached their transfers (" +
                              cudaGetErrorString(rc) + ")";
  std::size_t n = 0;
  waiting.take_all([&](const StagedRequest& r) {
    end_unstarted(r);
    ended(false);
    ++n;
  });
  log(LogLevel::Error, message + "; " + std::to_string(n) + " transfer(s) ended unstarted");
  keep_error(message);
}

// Starts every waiting transfer whose source is ready (ReadyQueue: one look per stream, not
// one per transfer, at a word its stream wrote); true if any.
bool StagingAgent::start_ready(ReadyQueue<StagedRequest>& waiting) {
  auto ready = [](const StagedRequest& r) {
    return __atomic_load_n(r.ready, __ATOMIC_ACQUIRE) >= r.ticket ? cudaSuccess : cudaErrorNotReady;
  };
  return waiting.take_ready(ready, [&](const StagedRequest& r, cudaError_t) {
    trace_.record('R', r.peer, r.ticket);
    if (r.ready != nullptr && ledger_.withdrawn_count.load(std::memory_order_acquire) != 0 && take_withdrawn(r.ticket)) {
      end_unstarted(r);  // its caller raised the error already
      ended(false);
      return;
    }
    execute(r);
  });
}

bool StagingAgent::take_withdrawn(std::uint64_t ticket) {
  std::lock_guard<std::mutex> lock(ledger_.m);
  const auto it = std::find(ledger_.withdrawn.begin(), ledger_.withdrawn.end(), ticket);
  if (it == ledger_.withdrawn.end()) return false;
  ledger_.withdrawn.erase(it);
  ledger_.withdrawn_count.store(ledger_.withdrawn.size(), std::memory_order_release);
  return true;
}

void StagingAgent::ended(bool answer) {
  {
    std::lock_guard<std::mutex> lock(ledger_.m);
    if (answer)
      --ledger_.answers;
    else
      ++ledger_.handled;
  }
  ledger_.cv.notify_all();
}

// A transfer that could not be enqueued: the error goes to the caller's next call, and its
// done word is set from the host so that its stream is not held for a whole timeout
// (earlier transfers of that stream ended before its source was ready: stream order).
void StagingAgent::fail(const StagedRequest& r, const std::string& message) {
  log(LogLevel::Error, message);
  keep_error(message);
  end_unstarted(r);
}

// Ends a transfer that never started from the host: its done word (its caller's stream goes
// on) and, lent, the word back.
void StagingAgent::end_unstarted(const StagedRequest& r) {
  __atomic_store_n(r.done, r.ticket, __ATOMIC_RELEASE);
  if (r.word_is_lent) release_word(r.word);
}

// Its source is ready: the transfer joins the visible transfers or its hidden peer's channel
// queue, and pump() cuts it into pieces as slots free up.
void StagingAgent::execute(const StagedRequest& r) {
  if (r.route == StagedRequest::Route::Visible) {
    copier_.queue(r);
    return;
  }
  StagedOutgoing o;
  o.reader = r.peer;
  o.width = r.width;
  o.rows = r.rows;
  o.src_pitch = r.src_pitch;
  o.dst_pitch = r.dst_pitch;
  o.window = r.window;
  o.done_rank = site_.rank;
  o.done_word = r.word;
  o.ticket = r.ticket;
  o.moved = Clock::now();
  o.what = "staged transfer " + std::to_string(r.ticket) + " of rank " + std::to_string(site_.rank) + " with rank " +
           std::to_string(r.peer);
  if (r.route == StagedRequest::Route::ToHidden) {
    o.src = reinterpret_cast<std::uint64_t>(r.src);
    o.dst = r.offset;
    o.signal_window = r.signal_window;
    o.signal_index = r.signal_index;
    o.value = r.value;
    o.op = r.op;
    o.filled_slot = r.filled_slot;
    o.source_complete = r.source_complete;
    o.ends_at_timeout = r.ends_at_timeout;
    if (r.filled_slot != StagedRequest::kAddress &&
        (__atomic_load_n(r.ready, __ATOMIC_ACQUIRE) & cuda::kSlotNotFilled) != 0) {
      // The kernel found the slot still held (a timed-out transfer's reader may copy out of
      // it): copied from the source like any put. The word goes back to a plain ticket before
      // it can be lent again (it is, only once this transfer ends).
      o.filled_slot = StagedRequest::kAddress;
      __atomic_store_n(const_cast<std::uint64_t*>(r.ready), r.ticket, __ATOMIC_RELEASE);
      log(LogLevel::Warn, o.what + ": its stream's fill slot is retired (a transfer that timed out held it, and its "
                                   "reader may still copy out of it); copied by the staging agent instead");
    }
    // A source in pageable host memory: cudaMemcpyAsync from it returns only once the lane's
    // earlier work is done, holding this thread; such chunks are copied by this thread into
    // slots the host sees free.
    if (r.width > 0 && o.filled_slot == StagedRequest::kAddress) {
      cudaPointerAttributes attributes{};
      const bool known = cudaPointerGetAttributes(&attributes, r.src) == cudaSuccess;
      (void)cudaGetLastError();
      o.host_source = !known || attributes.type == cudaMemoryTypeUnregistered;
      o.to_slot = known && attributes.type == cudaMemoryTypeDevice ? cudaMemcpyDeviceToHost : cudaMemcpyDefault;
    }
    o.pieces = PieceCursor(o.width, o.rows, site_.chunk, site_.first_piece);
  } else {  // FromHidden: the peer's agent answers with chunks of its window
    o.get_request = true;
    o.src = r.offset;  // in the peer's window `window`
    o.dst = reinterpret_cast<std::uint64_t>(r.dst);
  }
  if (r.word_is_lent) {
    std::lock_guard<std::mutex> lock(ledger_.m);
    ledger_.remote_lent.push_back(
        RemoteEnd{r.done, r.ticket, r.word, r.route == StagedRequest::Route::ToHidden ? r.peer : site_.rank, r.peer,
                  r.ends_at_timeout, std::nullopt});
  }
  writer_.queue(site_.local_index(r.peer), std::move(o));
}

// Enqueues what it can: pieces of the oldest visible transfer, and of the oldest outgoing
// transfer of each hidden reader, while slots (and ring entries) are free; true if anything moved.
bool StagingAgent::pump() {
  const bool visible = copier_.pump();
  const bool outgoing = writer_.pump();
  return visible || outgoing;
}

// Writes the posted counts (and the reader's consumed ones) whose copies are done; true if any.
bool StagingAgent::write_counts_after_copies() {
  const bool posted = writer_.write_counts_after_copies();
  const bool consumed = reader_.write_counts_after_copies();
  return posted || consumed;
}

}  // namespace meshmem::detail
