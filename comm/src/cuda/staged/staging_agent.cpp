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

// `kind`: cudaMemcpyDefault unless both sides are known (device to host costs the host
// ~0.3 us less per call then on H200, driver_call_lab).
cudaError_t copy_rows(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch, std::size_t width,
                      std::size_t rows, cudaStream_t stream, cudaMemcpyKind kind = cudaMemcpyDefault) {
  return rows == 1 ? cudaMemcpyAsync(dst, src, width, kind, stream)
                   : cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, kind, stream);
}

}  // namespace

// One entry of a channel's ring, ControlWords::kDescriptorWords words, written by the
// writer's agent (host stores) before the posted count that covers it is written.
namespace {
// Raises `word` to `value`: a later count or end, written first (by a stream, or by another
// path of this thread), stands.
void raise_count(std::uint64_t* word, std::uint64_t value) {
  std::uint64_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
  while (seen < value && !__atomic_compare_exchange_n(word, &seen, value, true, __ATOMIC_RELEASE, __ATOMIC_ACQUIRE)) {
  }
}
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

StagingAgent::StagingAgent(Setup setup)
    : site_(site_of(setup)),
      faults_(std::move(setup.faults)),
      trace_(setup.trace_prefix.empty() ? "" : setup.trace_prefix + "." + std::to_string(setup.rank),
             setup.trace_prefix.empty() ? 0 : kTraceSteps),
      held_after_(site_.timeout.count() != 0 ? std::min(std::chrono::milliseconds(2000), site_.timeout / 2)
                                        : std::chrono::milliseconds(2000)),
      captured_(std::move(setup.captured)),
      fill_slots_(site_.control, cuda::kTransferGivenUp) {
  const std::string what = "staged transport on rank " + std::to_string(site_.rank);
  if (site_.control.transfer_count() < ControlWords::kLeastTransferWords)
    throw Error(ErrorCode::Unsupported, what + ": " + std::to_string(setup.node_ranks.size()) + " ranks on a node and " +
                                            std::to_string(setup.ranks) +
                                            " in the Comm leave too few of the staging pool's control words");
  std::memset(site_.control.base, 0, ControlWords::kBytes);
  for (std::size_t i = site_.control.transfer_count(); i-- > 0;) ledger_.free_words.push_back(i);
  outgoing_.resize(setup.node_ranks.size());
  peers_.resize(setup.node_ranks.size());
  for (int peer : site_.hidden) {
    if (static_cast<std::size_t>(peer) < setup.pids.size())
      peers_[site_.local_index(peer)].process = ipc::ProcessWatch(setup.pids[static_cast<std::size_t>(peer)]);
    if (!peers_[site_.local_index(peer)].process.watching())
      log(LogLevel::Info, what + ": rank " + std::to_string(peer) +
                              "'s process cannot be watched (pidfd_open refused): should it die, the staging slots "
                              "posted to it stay held");
  }
  for (int d : setup.devices) {
    if (lanes_.count(d)) continue;
    if (lanes_.size() == ControlWords::kLanes)
      throw Error(ErrorCode::Unsupported, what + ": more than " + std::to_string(ControlWords::kLanes) + " GPUs to drive");
    CurrentDevice current(d);
    // The signal and wait kernels may run on this GPU from the agent's thread: loaded now,
    // not at a first launch behind a polling kernel (kernels.hpp, preload_kernels).
    ipc::check_cuda(cuda::preload_kernels(), "cudaFuncGetAttributes (loading meshmem's kernels)", what);
    Lane& lane = lanes_[d];
    lane.ordinal = lanes_.size() - 1;
    ipc::check_cuda(cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", what);
    lane.copied.resize(static_cast<std::size_t>(site_.nslots), nullptr);
    lane.freed.resize(static_cast<std::size_t>(site_.nslots), nullptr);
    for (int s = 0; s < site_.nslots; ++s) {
      ipc::check_cuda(cudaEventCreateWithFlags(&lane.copied[s], cudaEventDisableTiming), "cudaEventCreateWithFlags", what);
      ipc::check_cuda(cudaEventCreateWithFlags(&lane.freed[s], cudaEventDisableTiming), "cudaEventCreateWithFlags", what);
    }
  }
  if (!site_.hidden.empty()) {
    // Its own stream: chunks from hidden peers never queue behind this rank's outgoing copies,
    // which may wait for those peers (two ranks sending to each other would hold each other).
    CurrentDevice current(site_.device);
    ipc::check_cuda(cudaStreamCreateWithFlags(&incoming_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", what);
  }
  slot_use_.assign(static_cast<std::size_t>(site_.nslots), SlotUse{});
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
  for (const CountAfterCopy& c : consumed_after_copies_)
    if (c.pooled) events_.give_back(c.copied);  // the pool destroys them
  for (auto& [d, lane] : lanes_) {
    CurrentDevice current(d);
    for (cudaEvent_t e : lane.copied) (void)cudaEventDestroy(e);
    for (cudaEvent_t e : lane.freed) (void)cudaEventDestroy(e);
    if (lane.stream) (void)cudaStreamDestroy(lane.stream);
  }
  if (incoming_) {
    CurrentDevice current(site_.device);
    (void)cudaStreamDestroy(incoming_);
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

std::size_t StagingAgent::take_word(const std::string& what) {
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
  return word;
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
    if (incoming_ == nullptr) return;
    CurrentDevice current(site_.device);
    for (cudaStream_t stream : {incoming_, lanes_.at(site_.device).stream}) {
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
    std::uint64_t& seen = peers_[site_.local_index(peer)].failed_seen;
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
  return incoming_ == nullptr || idle(incoming_, site_.device);
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
    if (!waiting.empty() || !visible_.empty()) return true;
    if (!posted_after_copies_.empty() || !consumed_after_copies_.empty()) return true;
    for (const auto& q : outgoing_)
      if (!q.empty()) return true;
    return false;
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
      streams_hold_work = watch_streams();
      pulse_->publish(describe_state(waiting.size()), pulse_now_ns());
      next_stream_watch_ = Clock::now() + std::chrono::milliseconds(100);
    }
    // This rank's transfers are posted before its peers' chunks are carried out: a post starts
    // the longer chain (the peer's GPU copy, its agent, the copy here, the done word back),
    // which the caller's stream waits for as much as for its incoming chunks.
    const bool started = start_ready(waiting);
    bool pumped = pump();
    const bool counted = write_counts_after_copies();
    const bool carried = poll_incoming();
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
  for (const VisibleTransfer& t : visible_) {
    __atomic_store_n(t.request.done, t.request.ticket, __ATOMIC_RELEASE);
    ++n;
  }
  visible_.clear();
  for (auto& queue : outgoing_) {
    for (const Outgoing& o : queue) {
      __atomic_store_n(site_.control_of(o.done_rank).transfer(o.done_word), o.ticket, __ATOMIC_RELEASE);
      ++n;
    }
    queue.clear();
  }
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
    visible_.push_back(VisibleTransfer{r, PieceCursor(r.width, r.rows, site_.chunk, site_.first_piece), Clock::now()});
    return;
  }
  Outgoing o;
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
  outgoing_[site_.local_index(r.peer)].push_back(std::move(o));
}

// Enqueues what it can: pieces of the oldest visible transfer, and of the oldest outgoing
// transfer of each hidden reader, while slots (and ring entries) are free; true if anything
// moved. A transfer that finds none stays, and fails once nothing moved for MESHMEM_TIMEOUT.
bool StagingAgent::pump() {
  bool any = false;
  while (!visible_.empty()) {
    VisibleTransfer& t = visible_.front();
    const StagedRequest& r = t.request;
    const std::string what = "staged transfer " + std::to_string(r.ticket) + " of rank " + std::to_string(site_.rank);
    bool moved = false;
    bool left = false;
    try {
      std::size_t s = 0;
      while (!t.pieces.done() && take_slot(false, &s)) {
        enqueue_visible_piece(r, t.pieces.current(), s, what);
        t.pieces.advance();
        moved = true;
      }
      if (t.pieces.done()) {
        end_visible(r, true, what);
        left = true;
      }
    } catch (const std::exception& e) {
      abandon_visible(r, e.what());
      left = true;
    }
    if (moved) t.moved = Clock::now();
    if (!left && stalled(t.moved)) {
      abandon_visible(r,
                      what + ": no staging slot came free within " + describe_timeout(site_.timeout) + " (" +
                          slot_holders() + ")" + gpu_queue_hint(),
                      ErrorCode::Timeout);
      left = true;
    }
    any = any || moved || left;
    if (!left) break;
    visible_.pop_front();
    if (!visible_.empty()) visible_.front().moved = Clock::now();  // its turn starts now
    ended(false);
  }
  for (auto& queue : outgoing_) {
    while (!queue.empty()) {
      Outgoing& o = queue.front();
      bool moved = false;
      bool left = false;
      if (peers_[site_.local_index(o.reader)].gone) {
        // One that watch_readers already ended was reported there (once).
        if (__atomic_load_n(site_.control_of(o.done_rank).transfer(o.done_word), __ATOMIC_ACQUIRE) < o.ticket)
          abandon_outgoing(o, o.what + ": rank " + std::to_string(o.reader) + "'s process (pid " +
                                  std::to_string(peers_[site_.local_index(o.reader)].process.pid()) + ") has ended");
        left = true;
      } else {
        try {
          left = advance_outgoing(o, &moved);
        } catch (const std::exception& e) {
          abandon_outgoing(o, e.what());
          left = true;
        }
      }
      if (moved) o.moved = Clock::now();
      if (!left && stalled(o.moved)) {
        abandon_outgoing(o,
                         o.what + ": rank " + std::to_string(o.reader) + " took nothing from this rank's channel within " +
                             describe_timeout(site_.timeout) + " (" + slot_holders() + ")" + gpu_queue_hint(),
                         ErrorCode::Timeout);
        left = true;
      }
      if (left && o.ends_at_timeout) mark_posted(o.done_word, o.ticket);
      any = any || moved || left;
      if (!left) break;
      const bool answer = o.answer;
      queue.pop_front();
      if (!queue.empty()) queue.front().moved = Clock::now();  // its turn starts now
      ended(answer);
    }
  }
  return any;
}

// One piece of a visible transfer through slot `s`: device-to-host on the source GPU's lane,
// host-to-device on the target's.
void StagingAgent::enqueue_visible_piece(const StagedRequest& r, const PieceCursor::Piece& p, std::size_t s,
                                         const std::string& what) {
  Lane& from = lanes_.at(r.src_device);
  Lane& to = lanes_.at(r.dst_device);
  const char* src = static_cast<const char*>(r.src) + p.row * r.src_pitch + p.col;
  char* dst = static_cast<char*>(r.dst) + p.row * r.dst_pitch + p.col;
  char* slot = site_.slots + s * site_.chunk;
  {
    CurrentDevice current(r.src_device);
    if (slot_use_[s].event != nullptr)
      ipc::check_cuda(cudaStreamWaitEvent(from.stream, slot_use_[s].event, 0), "cudaStreamWaitEvent", what);
    ipc::check_cuda(copy_rows(slot, p.width, src, r.src_pitch, p.width, p.rows, from.stream),
                    "cudaMemcpyAsync (to the staging slot)", what);
    ipc::check_cuda(cudaEventRecord(from.copied[s], from.stream), "cudaEventRecord", what);
  }
  CurrentDevice current(r.dst_device);
  ipc::check_cuda(cudaStreamWaitEvent(to.stream, from.copied[s], 0), "cudaStreamWaitEvent", what);
  ipc::check_cuda(copy_rows(dst, r.dst_pitch, slot, p.width, p.width, p.rows, to.stream),
                  "cudaMemcpyAsync (from the staging slot)", what);
  ipc::check_cuda(cudaEventRecord(to.freed[s], to.stream), "cudaEventRecord", what);
  slot_use_[s] = SlotUse{to.freed[s], -1, 0};
  to.pieces.push_back(s);
}

// After a visible transfer's last piece (on the target's lane): its signal (unless it is
// abandoned), its done word, which the caller's stream waits for, then the lane's counter
// (the host takes the word back once it passed).
void StagingAgent::end_visible(const StagedRequest& r, bool signal, const std::string& what) {
  Lane& to = lanes_.at(r.dst_device);
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
  std::lock_guard<std::mutex> lock(ledger_.m);
  ++to.ended;
  if (r.word_is_lent) to.lent.push_back(Lane::LentEnd{to.ended, r.word, r.ticket});
}

// A visible transfer that cannot go on: no signal; its done word ends it after the pieces
// already enqueued (or at once, from the host, if even that fails); the error goes to the
// caller's next call.
void StagingAgent::abandon_visible(const StagedRequest& r, const std::string& message, ErrorCode code) {
  log(LogLevel::Error, message);
  keep_error(message, code);
  try {
    end_visible(r, false, message);
  } catch (const std::exception& e) {
    fail(r, e.what());
  }
}

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
      const auto* from = static_cast<const char*>(resolve(o.src_window, o.src + p.row * o.src_pitch + p.col, p.width,
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

void StagingAgent::watch_readers() {
  for (int peer : site_.hidden) {
    const std::size_t i = site_.local_index(peer);
    if (peers_[i].gone || !peers_[i].process.ended()) continue;
    // What it posted before it died is carried out first (its chunks lie in the pool, which
    // this process maps too): a get it answered in full ends as usual, and the ends below are
    // enqueued behind every copy of its chunks. Later chunks for this rank's gets from it are
    // not carried out (carry_out).
    (void)poll_incoming();
    peers_[i].gone = true;
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
      auto answered = [&](const RemoteEnd& e) {
        const auto it = last_answered_.find(e.word);
        return it != last_answered_.end() && it->second == e.ticket;
      };
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
        run_stream_batch(ops, incoming_, "staged transfer (ending gets a dead peer did not answer)", site_.rank);
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
  if (incoming_ != nullptr) {
    std::uint64_t done = 0, left = 0;
    for (int writer : site_.hidden) {
      const std::size_t from = site_.local_index(writer);
      if (peers_[from].broken) continue;
      const std::uint64_t consumed = __atomic_load_n(site_.control.consumed(from), __ATOMIC_ACQUIRE);
      done += consumed;
      if (consumed < peers_[from].seen) left += peers_[from].seen - consumed;
    }
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
    if (peers_[i].posted != taken || peers_[i].seen != consumed)
      add("channel to rank " + std::to_string(peer) + ": " + std::to_string(peers_[i].posted) + " posted, " +
          std::to_string(posted) + " of them counted, " + std::to_string(taken) +
          " taken there; from it: " + std::to_string(peers_[i].seen) + " seen, " + std::to_string(consumed) + " consumed here");
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

std::uint64_t StagingAgent::consumed_by(int reader) const {
  return __atomic_load_n(site_.control_of(reader).consumed(site_.local_index(site_.rank)), __ATOMIC_ACQUIRE);
}

// The channel to `reader` has an entry free: the one posted kRing entries ago was consumed.
bool StagingAgent::ring_has_room(int reader) const {
  const std::uint64_t n = peers_[site_.local_index(reader)].posted + 1;
  return n <= ControlWords::kRing || consumed_by(reader) >= n - ControlWords::kRing;
}


bool StagingAgent::write_counts_after_copies() {
  bool any = false;
  for (auto* pending : {&posted_after_copies_, &consumed_after_copies_}) {
    // One stream's copies end in order: the oldest not done holds the rest.
    while (!pending->empty()) {
      const CountAfterCopy c = pending->front();
      // A later count the stream wrote covers it already.
      const cudaError_t rc =
          __atomic_load_n(c.word, __ATOMIC_ACQUIRE) >= c.value ? cudaSuccess : cudaEventQuery(c.copied);
      if (rc == cudaErrorNotReady) break;
      pending->pop_front();
      if (c.pooled) events_.give_back(c.copied);
      if (rc != cudaSuccess) {
        // The transfer's last count (its stream's) ends it or its wait times out; the error
        // goes to this rank's next call.
        (void)cudaGetLastError();
        const bool posted = pending == &posted_after_copies_;
        const std::string message = "staged transport on rank " + std::to_string(site_.rank) + ": cudaEventQuery after " +
                                    (posted ? "a chunk's copy to rank " : "the copy of a chunk from rank ") +
                                    std::to_string(c.peer) + " failed (its " + (posted ? "posted" : "consumed") +
                                    " count " + std::to_string(c.value) + " is not written): " + cudaGetErrorString(rc);
        log(LogLevel::Error, message);
        keep_error(message);
        continue;
      }
      raise_count(c.word, c.value);
      any = true;
    }
  }
  return any;
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

// Takes every descriptor hidden peers posted here since the last look; true if any. What they
// ask for is enqueued on incoming_ together at the end (flush_incoming), under windows_' lock from
// the first descriptor's resolve to the enqueueing: a window freed meanwhile waits for it.
bool StagingAgent::poll_incoming() {
  bool any = false;
  const std::size_t me = site_.local_index(site_.rank);
  std::unique_lock<std::mutex> windows = windows_.lock(std::defer_lock);
  std::optional<CurrentDevice> current;  // once something came: a look that finds nothing costs no call
  for (int writer : site_.hidden) {
    const std::size_t from = site_.local_index(writer);
    if (peers_[from].broken) continue;
    const ControlWords theirs = site_.control_of(writer);
    const std::uint64_t posted = __atomic_load_n(theirs.posted(me), __ATOMIC_ACQUIRE);
    while (peers_[from].seen < posted) {
      const std::uint64_t n = peers_[from].seen + 1;
      Descriptor d;
      const volatile std::uint64_t* entry =
          theirs.ring(me) + ((n - 1) % ControlWords::kRing) * ControlWords::kDescriptorWords;
      auto* words = reinterpret_cast<std::uint64_t*>(&d);
      for (std::size_t i = 0; i < ControlWords::kDescriptorWords; ++i) words[i] = entry[i];
      peers_[from].seen = n;
      any = true;
      if (d.sequence != n) {
        // Stale or overwritten: nothing of this channel can be trusted any more. Its
        // transfers' waits time out on the writer's side.
        peers_[from].broken = true;
        log(LogLevel::Error, "staged transport on rank " + std::to_string(site_.rank) + ": the channel from rank " +
                                 std::to_string(writer) + " holds descriptor " + std::to_string(d.sequence) +
                                 " where " + std::to_string(n) + " was due; nothing more from that rank is carried out");
        __atomic_add_fetch(site_.control.failed(from), 1, __ATOMIC_RELEASE);
        break;
      }
      if (faults_.armed() && windows.owns_lock()) {
        // A fault may stop this thread here: not while it holds the windows.
        flush_incoming();
        windows.unlock();
      }
      faults_.hit(FaultPoint::StagedCarry);
      if (!windows.owns_lock()) windows.lock();
      if (!current) current.emplace(site_.device);
      trace_.record('I', writer, d.ticket, static_cast<std::int64_t>(d.done_rank));
      carry_out(writer, n, d);
      incoming_batch_.traced.push_back({writer, d.ticket, static_cast<std::int64_t>(d.done_rank)});
    }
  }
  flush_incoming();
  return any;
}

// One descriptor from hidden peer `writer`: a chunk copied onto this GPU (then, for the last
// one, the signal and the initiator's done word), or a get answered with chunks. The
// consumed count moves on in either case, also when the descriptor is refused (a window freed
// here, a range outside it): then nothing is copied, no signal is raised for that transfer,
// the failure is counted once (for the writer, or for this rank's own get) and the done word
// still ends the transfer. Under windows_' lock; the copy and the writes go into incoming_batch_
// (flush_incoming enqueues them), except a strided chunk's copy and an Add signal's kernel,
// which are enqueued at once, after what the batch holds.
void StagingAgent::carry_out(int writer, std::uint64_t sequence, const Descriptor& d) {
  // For messages only (built when one is needed: this runs per descriptor, on the halo's path).
  const auto what = [&] {
    return "staged transfer from rank " + std::to_string(writer) + " to rank " + std::to_string(site_.rank);
  };
  const std::size_t from = site_.local_index(writer);
  IncomingBatch& batch = incoming_batch_;
  std::string problem;
  std::uint64_t* done = site_.control_of(static_cast<int>(d.done_rank)).transfer(d.done_word);
  // A transfer's refusal is its own: the first descriptor of another one starts clean (one the
  // writer abandoned midway never sent its last).
  const std::pair<std::uint64_t, std::uint64_t> transfer{d.done_rank, d.ticket};
  if (d.kind() == Descriptor::kChunk && peers_[from].current != transfer) {
    peers_[from].refused = false;
    peers_[from].current = transfer;
  }
  // Its done word already reached its ticket: the writer abandoned it (a timeout: its agent's
  // end_overdue, or its wait kernel's kTransferGivenUp), and its caller went on. Nothing of it
  // lands any more, and the word (maybe lent to a later transfer by now) is not written.
  // Nor does a chunk of this rank's get from a writer whose process ended: watch_readers ended
  // that get (enqueued) once it had carried out what the writer posted before it died.
  const bool abandoned = d.kind() == Descriptor::kChunk &&
                         (__atomic_load_n(done, __ATOMIC_ACQUIRE) >= d.ticket ||
                          (peers_[from].gone && d.done_rank == static_cast<std::uint64_t>(site_.rank)));
  const bool own_get = d.kind() == Descriptor::kChunk && d.window == StagedRequest::kAddress;
  bool answered = false;      // a get's answer is queued
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
      void* dst = d.width == 0 ? nullptr : resolve(d.window, d.dst, d.width, d.rows, d.dst_pitch, &problem);
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
              flush_incoming();
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
          flush_incoming();
          ipc::check_cuda(copy_rows(dst, d.dst_pitch, slot, d.width, d.width, d.rows, incoming_),
                          "cudaMemcpy2DAsync (from a hidden peer's staging slot)", what());
        }
      }
      if (!problem.empty()) peers_[from].refused = true;
      if (d.last() && !peers_[from].refused && d.signal_window != StagedRequest::kAddress) {
        auto* word = static_cast<std::uint64_t*>(
            resolve(d.signal_window, d.signal_index * sizeof(std::uint64_t), sizeof(std::uint64_t), 1, 0, &problem));
        if (word != nullptr && d.op() == SignalOp::Add) {
          bool copy_failed = false;  // then refused and counted by the flush: no signal
          flush_incoming(copy_batched ? &copy_failed : nullptr);  // the kernel after the copy
          if (!copy_failed)
            ipc::check_cuda(cuda::launch_copy(nullptr, nullptr, 0, word, d.value, d.op(), incoming_, false),
                            "signal kernel launch", what());
        } else if (word != nullptr) {
          batch.signals.push_back(
              {stream_write_op(word, d.value), copy_batched ? static_cast<long>(batch.dsts.size()) - 1 : -1});
        }
      }
    } else if (d.kind() == Descriptor::kGet) {
      // Checked now (a refused get is answered with its done word alone), resolved again
      // piece by piece: the window may be freed meanwhile.
      const bool readable = resolve(d.window, d.src_offset, d.width, d.rows, d.src_pitch, &problem) != nullptr;
      Outgoing o;
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
      o.moved = Clock::now();
      o.what = "answer to rank " + std::to_string(writer) + "'s staged get (its transfer " + std::to_string(d.ticket) +
               ") on rank " + std::to_string(site_.rank);
      {
        std::lock_guard<std::mutex> lock(ledger_.m);
        ++ledger_.answers;
      }
      outgoing_[from].push_back(std::move(o));
      answered = true;
      if (!problem.empty()) peers_[from].refused = true;
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
    peers_[from].refused = true;
    if (answered) outgoing_[from].back().failure_counted = true;  // counted below
    if (d.kind() == Descriptor::kGet && !answered) raise_count(done, d.ticket);  // no answer comes
    try {  // the channel and the initiator's wait still move on
      flush_incoming();
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
  if (ends && peers_[from].refused) {
    peers_[from].refused = false;
    count_refusal(writer, own_get);
    // Its copy, still in the batch, is not counted again if the batch fails.
    if (copy_batched && batch.round == batch_round) batch.copied.back().counted = true;
  }
  // A transfer ends with its last chunk: a failed copy of one of its earlier chunks, still in
  // the batch, no longer marks the channel's next transfer (see flush_incoming).
  if (d.kind() == Descriptor::kChunk && d.last()) peers_[from].current = kNoTransfer;
}

// A transfer from `writer` refused here, counted once: for the writer (its failed count), or,
// for the answer to this rank's own get, as this rank's error.
void StagingAgent::count_refusal(int writer, bool own_get) {
  if (own_get)
    keep_error("a staged get from rank " + std::to_string(writer) + " was refused there or here (see the logs)");
  else
    __atomic_add_fetch(site_.control.failed(site_.local_index(writer)), 1, __ATOMIC_RELEASE);
}

// Enqueues incoming_batch_ on incoming_: its copies (one cudaMemcpyBatchAsync where more than
// one), then its stream writes in one batch, signals first, each after every copy of the
// batch; where only consumed counts of chunks that more chunks follow wait, one event after
// the copies instead, and this thread writes them (CountAfterCopy). A batch whose copies could
// not be enqueued refuses their transfers (no signal; counted as carry_out counts a refusal)
// and still writes the done words and counts: the channels and the initiators' waits move on.
void StagingAgent::flush_incoming(bool* last_copy_failed) noexcept {
  if (incoming_batch_.empty()) return;
  try {
    enqueue_incoming(last_copy_failed);
  } catch (const std::exception& e) {  // memory for the batch's bookkeeping
    if (last_copy_failed != nullptr) *last_copy_failed = true;
    try {
      log(LogLevel::Error, "staged transport on rank " + std::to_string(site_.rank) + ": carrying out " +
                               std::to_string(incoming_batch_.traced.size()) + " descriptor(s) (chunks, get requests) from hidden peers failed: " +
                               e.what() + " (their initiators' waits will time out)");
      keep_error(e.what());
    } catch (...) {
    }
  }
  incoming_batch_.clear();
}

void StagingAgent::enqueue_incoming(bool* last_copy_failed) {
  IncomingBatch& b = incoming_batch_;
  const auto what = [&] { return "staged transport on rank " + std::to_string(site_.rank); };  // messages only
  // Copies that could not be enqueued, by place in the batch.
  std::vector<bool> failed(b.dsts.size(), false);
  if (!b.dsts.empty()) {
    cudaError_t rc = cudaErrorNotSupported;
    const bool injected = faults_.hit(FaultPoint::StagedCopyIn);  // MESHMEM_FAULT ...:staged.copy_in:fail
#if CUDART_VERSION >= 13000
    if (b.dsts.size() > 1 && batch_copies_ && !injected) {
      cudaMemcpyAttributes attributes{};
      attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      std::size_t first = 0;
      rc = cudaMemcpyBatchAsync(b.dsts.data(), b.srcs.data(), b.sizes.data(), b.dsts.size(), &attributes, &first, 1,
                                incoming_);
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
        rc = injected ? cudaErrorUnknown : cudaMemcpyAsync(b.dsts[i], b.srcs[i], b.sizes[i], cudaMemcpyDefault, incoming_);
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
        } else if (peers_[from].current == c.transfer) {
          peers_[from].refused = true;
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
      copied = events_.take(what());
      if (cudaEventRecord(copied, incoming_) != cudaSuccess) {
        (void)cudaGetLastError();
        events_.give_back(copied);
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
  for (const auto& [writer, ticket, done_rank] : b.traced) trace_.record('E', writer, ticket, done_rank);
  if (!b.traced.empty()) trace_.record('L', -1, b.traced.size(), static_cast<std::int64_t>(b.dsts.size()));
}

void StagingAgent::write_ends(std::vector<CUstreamBatchMemOpParams>& ops, const std::vector<IncomingBatch::End>& ends,
                              const char* call) {
  for (const auto& e : ends) ops.push_back(e.op);
  if (faults_.hit(FaultPoint::StagedEndsIn))  // MESHMEM_FAULT ...:staged.ends_in:fail
    throw Error(ErrorCode::Cuda, std::string(call) + ": cuStreamBatchMemOp of " + std::to_string(ops.size()) +
                                     " stream writes on rank " + std::to_string(site_.rank) +
                                     " failed (MESHMEM_FAULT staged.ends_in)");
  run_stream_batch(ops, incoming_, call, site_.rank);
  for (const auto& e : ends)
    if (e.answered_word != IncomingBatch::kNoWord) last_answered_[e.answered_word] = e.ticket;
}

void* StagingAgent::resolve(std::uint64_t window, std::uint64_t offset, std::size_t width, std::size_t rows,
                            std::size_t pitch, std::string* problem) {
  if (window == StagedRequest::kAddress) return reinterpret_cast<void*>(offset);  // an address of this process
  char* at = windows_.resolve(window, offset, width, rows, pitch, problem);
  if (at == nullptr) *problem += "; nothing was written";
  return at;
}

}  // namespace meshmem::detail
