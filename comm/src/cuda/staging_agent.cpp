#include "staging_agent.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "../backoff.hpp"
#include "../log.hpp"
#include "device_runtime.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

namespace {

// A stream write of one word. It comes with a memory barrier first (the v2 batch API has no
// way to leave it out), so the copies and writes before it on the stream land first.
CUstreamBatchMemOpParams write_op(std::uint64_t* address, std::uint64_t value) {
  CUstreamBatchMemOpParams op{};
  op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
  op.writeValue.address = reinterpret_cast<CUdeviceptr>(address);
  op.writeValue.value64 = value;
  return op;
}

cudaError_t copy_rows(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch, std::size_t width,
                      std::size_t rows, cudaStream_t stream) {
  return rows == 1 ? cudaMemcpyAsync(dst, src, width, cudaMemcpyDefault, stream)
                   : cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDefault, stream);
}

}  // namespace

// One entry of a channel's ring, ControlWords::kDescriptorWords words, written by the
// writer's GPU before the posted count that covers it.
struct StagingAgent::Descriptor {
  static constexpr std::uint64_t kChunk = 1, kGet = 2;  // kinds (bits 0..7 of `control`)
  static constexpr std::uint64_t kLast = 1u << 8;      // the last chunk: the signal and done word follow
  // Its number on the channel: the reader refuses an entry whose number is not the one it
  // expects (an entry overwritten after a guard wait timed out, or stale).
  std::uint64_t sequence = 0;
  std::uint64_t control = 0;      // kind | kLast | SignalOp << 16
  std::uint64_t slot_offset = 0;  // kChunk: the chunk's place in the writer's region
  std::uint64_t width = 0, rows = 1;
  // kChunk: where it lands (a window of the reader and an offset, or kAddress and an address
  // of the reader's). kGet: the reader's window to read (window, src_offset, src_pitch) and
  // the initiator's address for the answer (dst, dst_pitch).
  std::uint64_t window = StagedRequest::kAddress, dst = 0, dst_pitch = 0;
  std::uint64_t src_offset = 0, src_pitch = 0;
  std::uint64_t signal_window = StagedRequest::kAddress, signal_index = 0, value = 0;
  std::uint64_t done_rank = 0, done_word = 0, ticket = 0;
  std::uint64_t kind() const { return control & 0xff; }
  bool last() const { return (control & kLast) != 0; }
  SignalOp op() const { return static_cast<SignalOp>((control >> 16) & 0xff); }
};

StagingAgent::StagingAgent(Setup setup)
    : pool_(std::move(setup.pool)),
      slots_(static_cast<char*>(pool_->region(setup.rank))),
      chunk_(setup.chunk),
      nslots_(setup.slots),
      control_{nullptr, static_cast<std::size_t>(setup.ranks), setup.node_ranks.size()},
      rank_(setup.rank),
      device_(setup.devices.front()),
      local_of_(static_cast<std::size_t>(setup.ranks), 0),
      timeout_(setup.timeout),
      limit_(setup.limit) {
  const std::string what = "staged transport on rank " + std::to_string(rank_);
  for (std::size_t i = 0; i < setup.node_ranks.size(); ++i) {
    local_of_[static_cast<std::size_t>(setup.node_ranks[i])] = i;
    if (setup.hidden[static_cast<std::size_t>(setup.node_ranks[i])]) hidden_.push_back(setup.node_ranks[i]);
  }
  control_ = control_of(rank_);
  if (control_.transfer_count() < ControlWords::kLeastTransferWords)
    throw Error(ErrorCode::Unsupported, what + ": " + std::to_string(setup.node_ranks.size()) + " ranks on a node and " +
                                            std::to_string(setup.ranks) +
                                            " in the Comm leave too few of the staging pool's control words");
  std::memset(control_.base, 0, ControlWords::kBytes);
  for (std::size_t i = control_.transfer_count(); i-- > 0;) free_words_.push_back(i);
  next_post_.assign(setup.node_ranks.size(), 0);
  seen_.assign(setup.node_ranks.size(), 0);
  failed_seen_.assign(setup.node_ranks.size(), 0);
  waited_.assign(setup.node_ranks.size(), 0);
  refused_.assign(setup.node_ranks.size(), false);
  broken_.assign(setup.node_ranks.size(), false);
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
    lane.copied.resize(static_cast<std::size_t>(nslots_), nullptr);
    lane.freed.resize(static_cast<std::size_t>(nslots_), nullptr);
    for (int s = 0; s < nslots_; ++s) {
      ipc::check_cuda(cudaEventCreateWithFlags(&lane.copied[s], cudaEventDisableTiming), "cudaEventCreateWithFlags", what);
      ipc::check_cuda(cudaEventCreateWithFlags(&lane.freed[s], cudaEventDisableTiming), "cudaEventCreateWithFlags", what);
    }
  }
  if (!hidden_.empty()) {
    // Its own stream: chunks from hidden peers never queue behind this rank's outgoing copies,
    // which may wait for those peers (two ranks sending to each other would hold each other).
    CurrentDevice current(device_);
    ipc::check_cuda(cudaStreamCreateWithFlags(&incoming_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", what);
  }
  slot_use_.assign(static_cast<std::size_t>(nslots_), SlotUse{});
  thread_ = std::thread([this] { run(); });
}

StagingAgent::~StagingAgent() {
  // Bounded: a transfer's source can sit behind a caller's stream that never moves on (a wait
  // for a signal that never comes), or a hidden peer may be gone. Streams and events with
  // pending work may be destroyed; CUDA releases them once that work is done.
  if (!drain()) log(LogLevel::Error, "staged transport: transfers still waiting or running at teardown");
  stop();
  for (cudaEvent_t e : spare_) (void)cudaEventDestroy(e);
  for (auto& [d, lane] : lanes_) {
    CurrentDevice current(d);
    for (cudaEvent_t e : lane.copied) (void)cudaEventDestroy(e);
    for (cudaEvent_t e : lane.freed) (void)cudaEventDestroy(e);
    if (lane.stream) (void)cudaStreamDestroy(lane.stream);
  }
  if (incoming_) {
    CurrentDevice current(device_);
    (void)cudaStreamDestroy(incoming_);
  }
}

void StagingAgent::stop() noexcept {
  {
    std::lock_guard<std::mutex> lock(m_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

cudaEvent_t StagingAgent::take_event() {
  {
    std::lock_guard<std::mutex> lock(m_);
    if (!spare_.empty()) {
      cudaEvent_t e = spare_.back();
      spare_.pop_back();
      return e;
    }
  }
  cudaEvent_t e = nullptr;
  ipc::check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags",
                  "staged transport on rank " + std::to_string(rank_));
  return e;
}

void StagingAgent::give_back(cudaEvent_t e) {
  std::lock_guard<std::mutex> lock(m_);
  spare_.push_back(e);
}

bool StagingAgent::try_take_word(std::size_t* word) {
  std::lock_guard<std::mutex> lock(m_);
  reclaim_words();  // every time, not only when none is left: words are reused at once (and so tested)
  if (free_words_.empty()) return false;
  *word = free_words_.back();
  free_words_.pop_back();
  return true;
}

std::size_t StagingAgent::take_word(const std::string& what) {
  Deadline deadline(timeout_);
  Backoff backoff;
  std::size_t word = 0;
  while (!try_take_word(&word)) {
    if (deadline.expired())
      throw Error(ErrorCode::Timeout, what + ": " + std::to_string(control_.transfer_count()) +
                                          " staged transfers of this rank are waiting or running (or captured) and "
                                          "none ended within " + describe_timeout(timeout_) + "; nothing was enqueued");
    backoff.pause();
  }
  return word;
}

void StagingAgent::release_word(std::size_t word) {
  std::lock_guard<std::mutex> lock(m_);
  free_words_.push_back(word);
}

std::uint64_t StagingAgent::submit(StagedRequest r) {
  std::lock_guard<std::mutex> lock(m_);
  r.ticket = ++submitted_;
  queue_.push_back(r);
  cv_.notify_all();
  return r.ticket;
}

void StagingAgent::add_window(std::uint64_t id, void* local, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(windows_m_);
  windows_[id] = {static_cast<char*>(local), bytes};
}

void StagingAgent::remove_window(std::uint64_t id) {
  cudaEvent_t enqueued = nullptr;
  {
    // Chunks are carried out under this lock: none is being enqueued into the window now, and
    // none will be. What was enqueued before is behind an event on the incoming stream.
    std::lock_guard<std::mutex> lock(windows_m_);
    windows_.erase(id);
    if (incoming_ == nullptr) return;
    CurrentDevice current(device_);
    if (cudaEventCreateWithFlags(&enqueued, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventRecord(enqueued, incoming_) != cudaSuccess) {
      (void)cudaGetLastError();
      if (enqueued) (void)cudaEventDestroy(enqueued);
      enqueued = nullptr;
    }
  }
  // Those copies end before the window's memory goes (bounded), whatever else is in flight.
  Deadline deadline(timeout_);
  Backoff backoff;
  bool ended = enqueued != nullptr;
  while (ended && cudaEventQuery(enqueued) == cudaErrorNotReady) {
    if (deadline.expired()) {
      ended = false;
      break;
    }
    backoff.pause();
  }
  (void)cudaGetLastError();
  if (enqueued) (void)cudaEventDestroy(enqueued);
  if (!ended)
    log(LogLevel::Error, "staged transport on rank " + std::to_string(rank_) + ": copies from hidden peers into window #" +
                             std::to_string(id) + " did not end before it was freed");
}

ControlWords StagingAgent::control_of(int rank) const {
  return ControlWords{reinterpret_cast<std::uint64_t*>(static_cast<char*>(pool_->region(rank)) +
                                                       chunk_ * static_cast<std::size_t>(nslots_)),
                      control_.ranks, control_.node_ranks};
}

std::string StagingAgent::take_error() {
  std::string failed;
  for (int peer : hidden_) {
    const std::uint64_t now = __atomic_load_n(control_of(peer).failed(local_index(rank_)), __ATOMIC_ACQUIRE);
    std::uint64_t& seen = failed_seen_[local_index(peer)];
    if (now > seen) {
      failed += (failed.empty() ? "" : "; ") + std::string("rank ") + std::to_string(peer) + " could not carry out " +
                std::to_string(now - seen) + " staged transfer(s) from this rank (its log says why)";
      seen = now;
    }
  }
  std::lock_guard<std::mutex> lock(m_);
  if (!failed.empty()) return error_.empty() ? failed : std::exchange(error_, std::string()) + "; " + failed;
  return std::exchange(error_, std::string());
}

bool StagingAgent::drain() noexcept {
  const auto deadline = std::chrono::steady_clock::now() + (timeout_.count() == 0 ? std::chrono::hours(24 * 365) : timeout_);
  {
    std::unique_lock<std::mutex> lock(m_);
    if (!cv_.wait_until(lock, deadline, [&] { return handled_ == submitted_ || stop_; })) return false;
  }
  Backoff backoff;
  auto idle = [&](cudaStream_t stream, int device) {
    CurrentDevice current(device);
    while (cudaStreamQuery(stream) == cudaErrorNotReady) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      backoff.pause();
    }
    (void)cudaGetLastError();
    return true;
  };
  for (auto& [d, lane] : lanes_)
    if (!idle(lane.stream, d)) return false;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(m_);
      reclaim_words();
      if (remote_lent_.empty()) break;
    }
    if (std::chrono::steady_clock::now() > deadline) return false;
    backoff.pause();
  }
  return incoming_ == nullptr || idle(incoming_, device_);
}

void StagingAgent::reclaim_words() {
  for (auto& [d, lane] : lanes_) {
    const std::uint64_t done = __atomic_load_n(control_.lane_done(lane.ordinal), __ATOMIC_ACQUIRE);
    while (!lane.lent.empty() && lane.lent.front().first <= done) {
      free_words_.push_back(lane.lent.front().second);
      lane.lent.pop_front();
    }
  }
  // A hidden peer (or this rank's incoming stream) wrote the done word itself: its last write.
  auto ended = [&](const RemoteEnd& e) {
    if (__atomic_load_n(e.done, __ATOMIC_ACQUIRE) < e.ticket) return false;
    free_words_.push_back(e.word);
    return true;
  };
  remote_lent_.erase(std::remove_if(remote_lent_.begin(), remote_lent_.end(), ended), remote_lent_.end());
}

void StagingAgent::run() {
  // The application may capture a graph in global mode on another thread meanwhile; this
  // thread's calls touch only its own streams and must not be refused (nor invalidate it).
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  (void)cudaThreadExchangeStreamCaptureMode(&mode);
  tighten_timer_slack();
  std::list<StagedRequest> waiting;  // handed over; sources not known to be ready yet
  // While some source is not ready: at most 20 us between polls, so a transfer starts at most
  // that late after the kernel before it.
  Backoff backoff(std::chrono::microseconds(20));
  auto last_work = std::chrono::steady_clock::now();
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(m_);
      auto woken = [&] { return stop_ || !queue_.empty(); };
      if (waiting.empty() && hidden_.empty()) {
        cv_.wait(lock, woken);
      } else if (waiting.empty()) {
        // Hidden peers may post chunks at any time: poll, yielding for 100 us after recent work
        // (the next chunk of a transfer is near), then every 20 us, and every 200 us after 2 ms
        // without work (a first chunk after a quiet spell starts up to that late).
        const auto quiet = std::chrono::steady_clock::now() - last_work;
        if (quiet < std::chrono::microseconds(100)) {
          lock.unlock();
          std::this_thread::yield();
          lock.lock();
        } else {
          cv_.wait_for(lock, quiet < std::chrono::milliseconds(2) ? std::chrono::microseconds(20)
                                                                  : std::chrono::microseconds(200),
                       woken);
        }
      }
      while (!queue_.empty()) {
        waiting.push_back(queue_.front());
        queue_.pop_front();
      }
      // Stopping: after drain (bounded) gave up on sources that never became ready, their
      // callers' waits time out; chunks hidden peers still post are not carried out.
      if (stop_ && waiting.empty()) return;
    }
    const bool started = start_ready(waiting);
    const bool carried = poll_incoming();
    if (started || carried) {
      backoff.reset();
      last_work = std::chrono::steady_clock::now();
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(m_);
      if (stop_) return;
    }
    if (!waiting.empty()) backoff.pause();
  }
}

// Starts every waiting transfer whose source is ready, oldest first; true if any.
bool StagingAgent::start_ready(std::list<StagedRequest>& waiting) {
  bool any = false;
  for (auto it = waiting.begin(); it != waiting.end();) {
    const cudaError_t rc = it->ready == nullptr ? cudaSuccess : cudaEventQuery(it->ready);
    if (rc == cudaErrorNotReady) {
      ++it;
      continue;
    }
    const StagedRequest r = *it;
    it = waiting.erase(it);
    if (r.ready != nullptr) give_back(r.ready);
    if (rc != cudaSuccess) {
      (void)cudaGetLastError();
      fail(r, "staged transfer of rank " + std::to_string(rank_) + ": cudaEventQuery on the caller's stream failed: " +
                  cudaGetErrorString(rc));
    } else {
      try {
        execute(r);
      } catch (const std::exception& e) {
        fail(r, e.what());
      }
    }
    {
      std::lock_guard<std::mutex> lock(m_);
      ++handled_;
    }
    cv_.notify_all();
    any = true;
  }
  return any;
}

// A transfer that could not be enqueued: the error goes to the caller's next call, and its
// done word is set from the host so that its stream is not held for a whole timeout
// (earlier transfers of that stream ended before its source was ready: stream order).
void StagingAgent::fail(const StagedRequest& r, const std::string& message) {
  log(LogLevel::Error, message);
  {
    std::lock_guard<std::mutex> lock(m_);
    if (error_.empty()) error_ = message;
  }
  __atomic_store_n(r.done, r.ticket, __ATOMIC_RELEASE);
  if (r.word_is_lent) release_word(r.word);
}

void StagingAgent::execute(const StagedRequest& r) {
  const std::string what = "staged transfer " + std::to_string(r.ticket) + " of rank " + std::to_string(rank_) +
                           " with rank " + std::to_string(r.peer);
  if (r.route == StagedRequest::Route::Visible) {
    execute_visible(r);
    return;
  }
  if (r.route == StagedRequest::Route::ToHidden) {
    Outgoing o;
    o.reader = r.peer;
    o.src = static_cast<const char*>(r.src);
    o.width = r.width;
    o.rows = r.rows;
    o.src_pitch = r.src_pitch;
    o.dst_pitch = r.dst_pitch;
    o.window = r.window;
    o.dst = r.offset;
    o.signal_window = r.signal_window;
    o.signal_index = r.signal_index;
    o.value = r.value;
    o.op = r.op;
    o.done_rank = rank_;
    o.done_word = r.word;
    o.ticket = r.ticket;
    send_to_hidden(o, what);
  } else {  // FromHidden: the peer's agent answers with chunks of its window
    Descriptor d;
    d.control = Descriptor::kGet;
    d.width = r.width;
    d.rows = r.rows;
    d.window = r.window;
    d.src_offset = r.offset;
    d.src_pitch = r.src_pitch;
    d.dst = reinterpret_cast<std::uint64_t>(r.dst);
    d.dst_pitch = r.dst_pitch;
    d.done_rank = static_cast<std::uint64_t>(rank_);
    d.done_word = r.word;
    d.ticket = r.ticket;
    CurrentDevice current(device_);
    post(r.peer, d, what);
  }
  if (r.word_is_lent) {
    std::lock_guard<std::mutex> lock(m_);
    remote_lent_.push_back(RemoteEnd{r.done, r.ticket, r.word});
  }
}

// Both GPUs visible here: chunks through this rank's slots, device-to-host on the source
// GPU's lane, host-to-device on the target's.
void StagingAgent::execute_visible(const StagedRequest& r) {
  const std::string what = "staged transfer " + std::to_string(r.ticket) + " of rank " + std::to_string(rank_);
  Lane& from = lanes_.at(r.src_device);
  Lane& to = lanes_.at(r.dst_device);
  // Pieces of at most a chunk: whole rows where a row fits (packed in the slot), otherwise
  // a chunk of one row.
  const std::size_t rows_per = r.width == 0 ? 1 : r.width <= chunk_ ? chunk_ / r.width : 1;
  const std::size_t cut = r.width <= chunk_ ? r.width : chunk_;
  for (std::size_t row = 0; row < r.rows && r.width > 0; row += rows_per) {
    const std::size_t rows = std::min(rows_per, r.rows - row);
    for (std::size_t col = 0; col < r.width; col += cut) {
      const std::size_t width = std::min(cut, r.width - col);
      const char* src = static_cast<const char*>(r.src) + row * r.src_pitch + col;
      char* dst = static_cast<char*>(r.dst) + row * r.dst_pitch + col;
      const std::size_t s = next_slot_;
      next_slot_ = (next_slot_ + 1) % static_cast<std::size_t>(nslots_);
      char* slot = slots_ + s * chunk_;
      {
        CurrentDevice current(r.src_device);
        wait_slot(s, from, r.src_device, what);
        ipc::check_cuda(copy_rows(slot, width, src, r.src_pitch, width, rows, from.stream),
                        "cudaMemcpyAsync (to the staging slot)", what);
        ipc::check_cuda(cudaEventRecord(from.copied[s], from.stream), "cudaEventRecord", what);
      }
      CurrentDevice current(r.dst_device);
      ipc::check_cuda(cudaStreamWaitEvent(to.stream, from.copied[s], 0), "cudaStreamWaitEvent", what);
      ipc::check_cuda(copy_rows(dst, r.dst_pitch, slot, width, width, rows, to.stream),
                      "cudaMemcpyAsync (from the staging slot)", what);
      ipc::check_cuda(cudaEventRecord(to.freed[s], to.stream), "cudaEventRecord", what);
      slot_use_[s] = SlotUse{to.freed[s], -1, 0};
    }
  }
  CurrentDevice current(r.dst_device);
  std::vector<CUstreamBatchMemOpParams> ops;
  if (r.signal != nullptr && r.op == SignalOp::Add) {
    ipc::check_cuda(cuda::launch_copy(nullptr, nullptr, 0, r.signal, r.value, r.op, to.stream, false),
                    "signal kernel launch", what);
  } else if (r.signal != nullptr) {
    ops.push_back(write_op(r.signal, r.value));  // fenced: the data lands first
  }
  // The transfer's done word (the caller's stream waits for it), then the lane's counter
  // (the host takes the word back once it passed).
  ops.push_back(write_op(r.done, r.ticket));
  ops.push_back(write_op(control_.lane_done(to.ordinal), to.ended + 1));
  run_stream_batch(ops, to.stream, "staged transfer", rank_);
  std::lock_guard<std::mutex> lock(m_);
  ++to.ended;
  if (r.word_is_lent) to.lent.emplace_back(to.ended, r.word);
}

// Before slot `s` is written again on `lane` (of `device`): the copy out of it is done (an
// event), or its hidden reader consumed it (a count, waited for on this rank's GPU).
void StagingAgent::wait_slot(std::size_t s, Lane& lane, int device, const std::string& what) {
  const SlotUse& use = slot_use_[s];
  if (use.event != nullptr) {
    ipc::check_cuda(cudaStreamWaitEvent(lane.stream, use.event, 0), "cudaStreamWaitEvent", what);
    return;
  }
  if (use.reader < 0) return;
  Lane& own = lanes_.at(device_);
  if (device == device_) {
    wait_consumed(use.reader, use.sequence, lane.stream, what);
    return;
  }
  // Another GPU's lane: the wait runs on this rank's GPU and hands over through an event.
  CurrentDevice current(device_);
  wait_consumed(use.reader, use.sequence, own.stream, what);
  ipc::check_cuda(cudaEventRecord(own.freed[s], own.stream), "cudaEventRecord", what);
  CurrentDevice back(device);
  ipc::check_cuda(cudaStreamWaitEvent(lane.stream, own.freed[s], 0), "cudaStreamWaitEvent", what);
}

// Waits on this thread until slot `s` is free (its copy out ended, or its hidden reader
// consumed it), taking hidden peers' chunks meanwhile (their gets wait: answering one would
// reuse slots); bounded by MESHMEM_TIMEOUT.
void StagingAgent::wait_slot_on_host(std::size_t s, const std::string& what) {
  const SlotUse use = slot_use_[s];
  Deadline deadline(timeout_);
  Backoff backoff(std::chrono::microseconds(20));
  for (;;) {
    bool free = true;
    if (use.event != nullptr) {
      const cudaError_t rc = cudaEventQuery(use.event);
      free = rc != cudaErrorNotReady;
      if (rc != cudaSuccess) (void)cudaGetLastError();
    } else if (use.reader >= 0) {
      free = __atomic_load_n(control_of(use.reader).consumed(local_index(rank_)), __ATOMIC_ACQUIRE) >= use.sequence;
    }
    if (free) return;
    if (deadline.expired())
      throw Error(ErrorCode::Timeout, what + ": staging slot " + std::to_string(s) + " was not free within " +
                                          describe_timeout(timeout_) +
                                          (use.reader >= 0 ? " (rank " + std::to_string(use.reader) + " did not take it)" : ""));
    if (!poll_incoming(false)) backoff.pause();
  }
}

// `stream` (of this rank's GPU) waits until `reader` consumed `count` descriptors of this
// rank: a one-thread kernel polling the count in the reader's region, timing out like every
// device wait and naming the reader. Nothing is enqueued when the host already sees it.
void StagingAgent::wait_consumed(int reader, std::uint64_t count, cudaStream_t stream, const std::string& what) {
  const std::uint64_t* consumed = control_of(reader).consumed(local_index(rank_));
  if (__atomic_load_n(consumed, __ATOMIC_ACQUIRE) >= count) return;
  // This GPU's lane already waits for as much or more: everything after that wait sees it.
  const bool own = stream == lanes_.at(device_).stream;
  std::uint64_t& waited = waited_[local_index(reader)];
  if (own && waited >= count) return;
  ipc::check_cuda(cuda::launch_transfer_wait(consumed, count, nullptr, reader, limit_, stream, false),
                  "transfer wait kernel launch (a hidden peer's consumed count)", what);
  if (own) waited = count;
}

// Chunks of `o` to its hidden reader: each copied into a slot on this rank's GPU, then
// described on the channel; the last one carries the signal and the done word.
void StagingAgent::send_to_hidden(const Outgoing& o, const std::string& what) {
  CurrentDevice current(device_);
  Lane& own = lanes_.at(device_);
  Descriptor d;
  d.window = o.window;
  d.dst_pitch = o.dst_pitch;
  d.signal_window = o.signal_window;
  d.signal_index = o.signal_index;
  d.value = o.value;
  d.done_rank = static_cast<std::uint64_t>(o.done_rank);
  d.done_word = o.done_word;
  d.ticket = o.ticket;
  const std::uint64_t chunk = Descriptor::kChunk | static_cast<std::uint64_t>(o.op) << 16;
  const std::size_t width = o.src == nullptr ? 0 : o.width;
  const std::size_t rows_per = width == 0 ? 1 : width <= chunk_ ? chunk_ / width : 1;
  const std::size_t cut = width <= chunk_ ? width : chunk_;
  // A source in pageable host memory: cudaMemcpyAsync from it returns only once the stream's
  // earlier work is done, and that work may wait for the peer's consumed count, whose agent
  // may be stuck the same way (two ranks putting to each other from host buffers hung so).
  // Such chunks are copied by this thread once the host sees the slot free.
  bool host_source = false;
  if (width > 0) {
    cudaPointerAttributes attributes{};
    host_source = cudaPointerGetAttributes(&attributes, o.src) != cudaSuccess ||
                  attributes.type == cudaMemoryTypeUnregistered;
    (void)cudaGetLastError();
  }
  bool sent = false;
  for (std::size_t row = 0; row < o.rows && width > 0; row += rows_per) {
    const std::size_t rows = std::min(rows_per, o.rows - row);
    for (std::size_t col = 0; col < width; col += cut) {
      const std::size_t piece = std::min(cut, width - col);
      const std::size_t s = next_slot_;
      next_slot_ = (next_slot_ + 1) % static_cast<std::size_t>(nslots_);
      char* slot = slots_ + s * chunk_;
      const char* from = o.src + row * o.src_pitch + col;
      if (host_source) {
        wait_slot_on_host(s, what);
        for (std::size_t r = 0; r < rows; ++r) std::memcpy(slot + r * piece, from + r * o.src_pitch, piece);
        std::atomic_thread_fence(std::memory_order_seq_cst);  // before the post that the reader's copy follows
      } else {
        wait_slot(s, own, device_, what);
        ipc::check_cuda(copy_rows(slot, piece, from, o.src_pitch, piece, rows, own.stream),
                        "cudaMemcpyAsync (to the staging slot)", what);
      }
      d.slot_offset = s * chunk_;
      d.width = piece;
      d.rows = rows;
      d.dst = o.dst + row * o.dst_pitch + col;
      sent = row + rows >= o.rows && col + piece >= width;
      d.control = chunk | (sent ? Descriptor::kLast : 0);
      slot_use_[s] = SlotUse{nullptr, o.reader, post(o.reader, d, what)};
    }
  }
  if (!sent) {  // nothing to copy: a descriptor with the signal and the done word alone
    d.width = 0;
    d.rows = 1;
    d.dst = o.dst;
    d.control = chunk | Descriptor::kLast;
    post(o.reader, d, what);
  }
}

// Writes descriptor `d` into the next entry of the channel to `reader` and then the posted
// count, both from this rank's GPU (after the copies before them on its lane); returns its
// number. Waits (on the GPU) for the entry to be free.
std::uint64_t StagingAgent::post(int reader, Descriptor d, const std::string& what) {
  static_assert(sizeof(Descriptor) == ControlWords::kDescriptorWords * sizeof(std::uint64_t),
                "a descriptor fills its ring entry");
  Lane& own = lanes_.at(device_);
  const std::size_t to = local_index(reader);
  const std::uint64_t n = next_post_[to] + 1;
  if (n > ControlWords::kRing) wait_consumed(reader, n - ControlWords::kRing, own.stream, what);
  d.sequence = n;
  std::uint64_t* entry = control_.ring(to) + ((n - 1) % ControlWords::kRing) * ControlWords::kDescriptorWords;
  const auto* words = reinterpret_cast<const std::uint64_t*>(&d);
  std::vector<CUstreamBatchMemOpParams> ops;
  for (std::size_t i = 0; i < ControlWords::kDescriptorWords; ++i) ops.push_back(write_op(entry + i, words[i]));
  ops.push_back(write_op(control_.posted(to), n));
  run_stream_batch(ops, own.stream, "staged transfer (channel post)", rank_);
  next_post_[to] = n;  // only once enqueued: a failed post leaves no gap in the numbers
  return n;
}

// Takes every descriptor hidden peers posted here since the last look; true if any.
bool StagingAgent::poll_incoming(bool answer_gets) {
  bool any = false;
  const std::size_t me = local_index(rank_);
  for (int writer : hidden_) {
    const std::size_t from = local_index(writer);
    if (broken_[from]) continue;
    const ControlWords theirs = control_of(writer);
    const std::uint64_t posted = __atomic_load_n(theirs.posted(me), __ATOMIC_ACQUIRE);
    while (seen_[from] < posted) {
      const std::uint64_t n = seen_[from] + 1;
      Descriptor d;
      const volatile std::uint64_t* entry =
          theirs.ring(me) + ((n - 1) % ControlWords::kRing) * ControlWords::kDescriptorWords;
      auto* words = reinterpret_cast<std::uint64_t*>(&d);
      for (std::size_t i = 0; i < ControlWords::kDescriptorWords; ++i) words[i] = entry[i];
      if (!answer_gets && d.kind() == Descriptor::kGet) break;  // left for later
      seen_[from] = n;
      any = true;
      if (d.sequence != n) {
        // Overwritten or stale (the writer's guard wait timed out): nothing of this channel
        // can be trusted any more. Its transfers' waits time out on the writer's side.
        broken_[from] = true;
        log(LogLevel::Error, "staged transport on rank " + std::to_string(rank_) + ": the channel from rank " +
                                 std::to_string(writer) + " holds descriptor " + std::to_string(d.sequence) +
                                 " where " + std::to_string(n) + " was due (a wait for this rank timed out there); "
                                 "nothing more from that rank is carried out");
        __atomic_add_fetch(control_.failed(from), 1, __ATOMIC_RELEASE);
        break;
      }
      carry_out(writer, n, d);
    }
  }
  return any;
}

// One descriptor from hidden peer `writer`: a chunk copied onto this GPU (then, for the last
// one, the signal and the initiator's done word), or a get answered with chunks. The
// consumed count moves on in either case, also when the descriptor is refused (a window freed
// here, a range outside it): then nothing is copied, no signal is raised for that transfer,
// the failure is counted once (for the writer, or for this rank's own get) and the done word
// still ends the transfer.
void StagingAgent::carry_out(int writer, std::uint64_t sequence, const Descriptor& d) {
  const std::string what = "staged transfer from rank " + std::to_string(writer) + " to rank " + std::to_string(rank_);
  const std::size_t from = local_index(writer);
  std::string problem;
  std::lock_guard<std::mutex> windows(windows_m_);  // the windows resolved stay until the copies are enqueued
  std::vector<CUstreamBatchMemOpParams> ops;
  auto end_ops = [&] {  // what moves the channel on and ends the transfer, whatever happened
    std::vector<CUstreamBatchMemOpParams> end;
    if (d.kind() == Descriptor::kChunk && d.last())
      end.push_back(write_op(control_of(static_cast<int>(d.done_rank)).transfer(d.done_word), d.ticket));
    end.push_back(write_op(control_.consumed(from), sequence));
    return end;
  };
  try {
    CurrentDevice current(device_);
    if (d.kind() == Descriptor::kChunk) {
      void* dst = d.width == 0 ? nullptr : resolve(d.window, d.dst, d.width, d.rows, d.dst_pitch, &problem);
      if (dst != nullptr) {
        const char* slot = static_cast<const char*>(pool_->region(writer)) + d.slot_offset;
        ipc::check_cuda(copy_rows(dst, d.dst_pitch, slot, d.width, d.width, d.rows, incoming_),
                        "cudaMemcpyAsync (from a hidden peer's staging slot)", what);
      }
      if (!problem.empty()) refused_[from] = true;
      if (d.last() && !refused_[from] && d.signal_window != StagedRequest::kAddress) {
        auto* word = static_cast<std::uint64_t*>(
            resolve(d.signal_window, d.signal_index * sizeof(std::uint64_t), sizeof(std::uint64_t), 1, 0, &problem));
        if (word != nullptr && d.op() == SignalOp::Add)
          ipc::check_cuda(cuda::launch_copy(nullptr, nullptr, 0, word, d.value, d.op(), incoming_, false),
                          "signal kernel launch", what);
        else if (word != nullptr)
          ops.push_back(write_op(word, d.value));
      }
    } else if (d.kind() == Descriptor::kGet) {
      const void* src = resolve(d.window, d.src_offset, d.width, d.rows, d.src_pitch, &problem);
      Outgoing o;
      o.reader = writer;
      o.src = static_cast<const char*>(src);  // null when refused: the answer carries the done word alone
      o.width = d.width;
      o.rows = d.rows;
      o.src_pitch = d.src_pitch;
      o.dst_pitch = d.dst_pitch;
      o.dst = d.dst;
      o.done_rank = static_cast<int>(d.done_rank);
      o.done_word = d.done_word;
      o.ticket = d.ticket;
      send_to_hidden(o, what);
      if (!problem.empty()) refused_[from] = true;
    } else {
      problem = "descriptor " + std::to_string(sequence) + " has an unknown kind " + std::to_string(d.kind());
    }
    for (auto& op : end_ops()) ops.push_back(op);
    run_stream_batch(ops, incoming_, "staged transfer (from a hidden peer)", rank_);
  } catch (const std::exception& e) {
    problem = e.what();
    refused_[from] = true;
    try {  // the channel and the initiator's wait still move on
      auto end = end_ops();
      run_stream_batch(end, incoming_, "staged transfer (from a hidden peer, after an error)", rank_);
    } catch (const std::exception& again) {
      problem += "; then: " + std::string(again.what()) + " (the initiator's wait will time out)";
    }
  }
  if (!problem.empty()) log(LogLevel::Error, what + ": " + problem);
  // Counted once per transfer, at its end: for the writer (its put or the request of its get),
  // or, for an answer to this rank's own get, here.
  const bool ends = d.kind() == Descriptor::kGet || d.last();
  if (ends && refused_[from]) {
    refused_[from] = false;
    if (d.kind() == Descriptor::kChunk && d.window == StagedRequest::kAddress) {
      std::lock_guard<std::mutex> lock(m_);
      if (error_.empty()) error_ = "a staged get from rank " + std::to_string(writer) + " was refused there or here (see the logs)";
    } else {
      __atomic_add_fetch(control_.failed(from), 1, __ATOMIC_RELEASE);
    }
  }
}

// Under windows_m_: this rank's window `window` at `offset`, checked to hold `rows` rows of `width` bytes
// `pitch` apart; kAddress: `offset` is an address of this process. Null (and why) if not.
void* StagingAgent::resolve(std::uint64_t window, std::uint64_t offset, std::size_t width, std::size_t rows,
                            std::size_t pitch, std::string* problem) {
  if (window == StagedRequest::kAddress) return reinterpret_cast<void*>(offset);
  const auto it = windows_.find(window);
  if (it == windows_.end()) {
    *problem = "window #" + std::to_string(window) + " is not (or no longer) allocated here; nothing was written";
    return nullptr;
  }
  const std::size_t bytes = it->second.second;
  const std::uint64_t last = rows == 0 ? 0 : (rows - 1) * static_cast<std::uint64_t>(pitch) + width;
  if (offset > bytes || last > bytes - offset) {
    *problem = "bytes " + std::to_string(offset) + " .. " + std::to_string(offset + last) + " are outside window #" +
               std::to_string(window) + " (" + std::to_string(bytes) + " bytes here); nothing was written";
    return nullptr;
  }
  return it->second.first + offset;
}

}  // namespace meshmem::detail
