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
    core_.add_outside_work();
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
  a.ended = [this](bool answer, std::uint64_t ticket) { ended(answer, ticket); };
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
    ++to.ended;
    if (r.word_is_lent)
      core_.return_when(r.word, site_.control.lane_done(to.ordinal), to.ended, r.ticket, Core::Return::Always);
  };
  a.ended = [this](std::uint64_t ticket) { ended(false, ticket); };
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
    for (const auto& [word, ticket] : core_.returns_on(site_.control.lane_done(lane.ordinal))) {
      std::uint64_t* done = site_.control.transfer(word);
      if (__atomic_load_n(done, __ATOMIC_ACQUIRE) < ticket) ends.emplace_back(done, ticket);
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
      // Tickets go up by 2: a put with source completion has its source read written as
      // ticket - 1, which no earlier transfer of its word can have reached.
      core_(site_.control.transfer(0), site_.control.transfer_count(), site_.timeout, 2, cuda::kTransferGivenUp),
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
  core_.request_stop();
  if (thread_.joinable()) thread_.join();
  if (pulse_) pulse_->stop();  // the agent may live on (window attachments): not "stuck"
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

void StagingAgent::release_word(std::size_t word) { core_.release_word(word); }

// Free once its last replay's transfer ended, so that a late end of one whose wait gave up
// cannot move a reused word back.
void StagingAgent::release_captured_word(std::size_t word, const std::uint64_t* done, std::uint64_t last) {
  if (last == 0 || __atomic_load_n(done, __ATOMIC_ACQUIRE) >= last)
    core_.release_word(word);
  else
    core_.return_when(word, done, last, last, Core::Return::UnlessRetired);
}

std::uint64_t StagingAgent::submit(StagedRequest r) {
  return core_.submit(r, [&](const StagedRequest& numbered) { trace_.record('S', numbered.peer, numbered.ticket); });
}

void StagingAgent::withdraw(std::uint64_t ticket, std::uint64_t* ready) {
  {
    std::lock_guard<std::mutex> lock(withdrawn_.m);
    withdrawn_.tickets.push_back(ticket);
    withdrawn_.count.store(withdrawn_.tickets.size(), std::memory_order_release);
  }
  __atomic_store_n(ready, ticket, __ATOMIC_RELEASE);  // after the list: the agent looks there once it sees this
}

void StagingAgent::captured_added() {
  // The thread either sees the capture when it next decides to sleep, or sleeps already and
  // gets the notification.
  core_.wake();
}

void StagingAgent::add_window(std::uint64_t id, void* local, std::size_t bytes) { windows_.add(id, local, bytes); }

void StagingAgent::remove_window(std::uint64_t id) {
  // Chunks from hidden peers (incoming stream) and answers to their gets (this GPU's lane) are
  // enqueued under this lock: none is being enqueued into or from the window now, and none
  // will be. What was enqueued before is behind an event on each of those streams.
  StreamMarks enqueued;
  {
    const auto lock = windows_.lock();
    windows_.erase_locked(id);
    if (reader_.stream() == nullptr) return;
    for (cudaStream_t stream : {reader_.stream(), lanes_.at(site_.device).stream}) enqueued.add(stream, site_.device);
  }
  // Those copies end before the window's memory goes (bounded), whatever else is in flight.
  if (!enqueued.ended_by(Deadline(site_.timeout)))
    log(LogLevel::Error, "staged transport on rank " + std::to_string(site_.rank) + ": copies between hidden peers and window #" +
                             std::to_string(id) + " did not end before it was freed");
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
  ErrorCode kept = ErrorCode::Cuda;
  std::string error = core_.take_error(&kept);
  if (!error.empty()) *code = kept;
  if (!failed.empty()) return error.empty() ? failed : error + "; " + failed;
  return error;
}

bool StagingAgent::drain() noexcept {
  const Deadline deadline(site_.timeout);
  if (core_.wait_until_ended(deadline.until()) == Core::Ended::TimedOut) return false;
  Backoff backoff;
  auto idle = [&](cudaStream_t stream, int device) {
    CurrentDevice current(device);
    while (cudaStreamQuery(stream) == cudaErrorNotReady) {
      if (deadline.expired()) return false;
      backoff.pause();
    }
    (void)cudaGetLastError();
    return true;
  };
  for (auto& [d, lane] : lanes_)
    if (!idle(lane.stream, d)) return false;
  for (;;) {
    core_.reclaim();
    if (!remote_ends_pending()) break;
    if (deadline.expired()) return false;
    backoff.pause();
  }
  return reader_.stream() == nullptr || idle(reader_.stream(), site_.device);
}

bool StagingAgent::drain_through(std::uint64_t mark) noexcept {
  const Deadline deadline(site_.timeout);
  if (core_.wait_through(mark, deadline.until()) == Core::Ended::TimedOut) return false;
  // What those transfers enqueued is behind an event on each stream; later copies are not.
  StreamMarks enqueued;
  for (auto& [d, lane] : lanes_) enqueued.add(lane.stream, d);
  if (reader_.stream() != nullptr) enqueued.add(reader_.stream(), site_.device);
  if (!enqueued.ended_by(deadline)) return false;
  // Those that hidden peers end: this rank's puts, and its gets from them, whose answers land
  // in this rank's memory.
  Backoff backoff;
  while (remote_ends_pending(mark)) {
    if (deadline.expired()) return false;
    backoff.pause();
  }
  return true;
}

bool StagingAgent::remote_ends_pending(std::uint64_t through) {
  std::lock_guard<std::mutex> lock(remote_.m);
  remote_.drop_ended();
  return std::any_of(remote_.list.begin(), remote_.list.end(), [&](const RemoteEnd& e) { return e.ticket <= through; });
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
    // Outside the core's lock: a replay's hand-off submits (which takes it).
    if (captured_->poll()) last_work = Clock::now();
    const bool working = busy();
    pulse_->turn(pulse_now_ns());
    // A capture makes polls() true and wakes this thread (captured_added).
    if (!working && !polls() && !streams_hold_work) {
      pulse_->sleep(pulse_now_ns());
      core_.wait_for_requests(std::chrono::microseconds(0), polls);
    } else if (!working && !polls()) {
      core_.wait_for_requests(std::chrono::milliseconds(100), polls);  // the next look at the streams
    } else if (!working) {
      // Poll, yielding for 1 ms after recent work
      // (the next chunk, or the next exchange of an iterating code, is near: a halo exchange
      // every few hundred us must not wait for a sleeping agent), then every 20 us, and every
      // 200 us after 20 ms without work (a first chunk after a quiet spell starts up to that
      // late).
      const auto quiet = Clock::now() - last_work;
      if (quiet < std::chrono::milliseconds(1))
        std::this_thread::yield();
      else
        core_.wait_for_requests(quiet < std::chrono::milliseconds(20) ? std::chrono::microseconds(20)
                                                                      : std::chrono::microseconds(200),
                                [] { return false; });
    }
    // Stopping: after drain (bounded) gave up on sources that never became ready (or on
    // transfers that found no slot), their done words are set from here so that no
    // caller's stream waits for ever (MESHMEM_TIMEOUT=0); chunks hidden peers still post
    // are not carried out.
    if (core_.take_requests_seeing_stop(waiting)) {
      (void)write_counts_after_copies();  // copies already done still free their slots for the peers
      give_up_all(waiting);
      return;
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
    ended(false, r.ticket);
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
    if (r.ready != nullptr && withdrawn_.count.load(std::memory_order_acquire) != 0 && take_withdrawn(r.ticket)) {
      end_unstarted(r);  // its caller raised the error already
      ended(false, r.ticket);
      return;
    }
    execute(r);
  });
}

bool StagingAgent::take_withdrawn(std::uint64_t ticket) {
  std::lock_guard<std::mutex> lock(withdrawn_.m);
  const auto it = std::find(withdrawn_.tickets.begin(), withdrawn_.tickets.end(), ticket);
  if (it == withdrawn_.tickets.end()) return false;
  withdrawn_.tickets.erase(it);
  withdrawn_.count.store(withdrawn_.tickets.size(), std::memory_order_release);
  return true;
}

void StagingAgent::ended(bool answer, std::uint64_t ticket) {
  if (answer)
    core_.outside_work_ended();
  else
    core_.count_ended(ticket);
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
    // A hidden peer (or this rank's incoming stream) writes the done word itself, its last
    // write: the word is free once that reached the ticket, unless its caller's wait kernel gave
    // up (kTransferGivenUp: the reader may still write its end later).
    core_.return_when(r.word, r.done, r.ticket, r.ticket, Core::Return::UnlessRetired);
    std::lock_guard<std::mutex> lock(remote_.m);
    remote_.drop_ended();
    remote_.list.push_back(RemoteEnd{r.done, r.ticket, r.word,
                                     r.route == StagedRequest::Route::ToHidden ? r.peer : site_.rank, r.peer,
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
