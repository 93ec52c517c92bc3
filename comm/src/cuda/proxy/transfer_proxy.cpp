#define MESHMEM_DEFINING_GPU_PART
#include "cuda/proxy/transfer_proxy.hpp"

#include <mpi.h>

#include <cstring>
#include <condition_variable>
#include <deque>
#include <list>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include "backoff.hpp"
#include "fault.hpp"
#include "helper_cpus.hpp"
#include "log.hpp"
#include "strided_rows.hpp"
#include "topology.hpp"
#include "cuda/agent/captured_handoff.hpp"
#include "cuda/runtime/device_sync.hpp"
#include "cuda/runtime/event_pool.hpp"
#include "cuda/runtime/gpu_queues.hpp"
#include "cuda/runtime/kernels.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

namespace {

constexpr int kTagMessage = 1;
constexpr std::size_t kDoneWords = 65536;  // transfers in flight per rank

enum class MessageKind : std::uint32_t { Put = 1, GetRequest, GetData, Ack, Refused };

// A header between two proxies (over MPI, 80 bytes). `id` numbers the initiator's transfers
// to that peer. A strided put (width > 0) sends its rows packed: `bytes` / `width` rows of
// `width` bytes, which land `pitch` apart from `offset`.
struct Message {
  MessageKind kind;
  std::uint32_t flags;  // bit 0: has a signal; bits 8..15: its SignalOp
  std::uint64_t id;
  std::uint64_t window, offset, bytes;
  std::uint64_t signal_window, signal_index, value;
  std::uint64_t pitch = 0, width = 0;
};
static_assert(sizeof(Message) == 80, "one header is 80 bytes");

// The bytes a put's rows span in the target's window, or false if its shape is malformed
// (a strided put's rows are whole, not wider than their pitch, and the span fits 64 bits).
bool put_span(const Message& m, std::uint64_t* span) {
  if (m.width == 0) {
    *span = m.bytes;
    return true;
  }
  if (m.bytes == 0 || m.bytes % m.width != 0 || m.pitch < m.width) return false;
  return rows_end(0, m.width, m.bytes / m.width, m.pitch, span);
}


}  // namespace

// One transfer, as the caller hands it to the proxy.
struct ProxyRequest {
  bool is_get = false;
  int peer = -1;
  cudaEvent_t ready = nullptr;  // recorded on the caller's stream: the source (or dst) is ready
  cudaStream_t stream = nullptr;  // that stream: its transfers become ready in order
  const void* src = nullptr;    // put: here
  void* dst = nullptr;          // get: here
  std::size_t bytes = 0;
  std::uint64_t window = 0, offset = 0;  // the peer's window
  // A strided put (width > 0): `bytes` / `width` rows of `width` bytes, `src_pitch` apart
  // here (packed into device memory before the transfer) and `dst_pitch` apart there.
  std::size_t width = 0, src_pitch = 0, dst_pitch = 0;
  bool has_signal = false;
  std::uint64_t signal_window = 0, signal_index = 0, value = 0;
  SignalOp op = SignalOp::Set;
  std::size_t word = 0;  // its done word reaches `ticket` at its end
  std::uint64_t ticket = 0;
  // An eager put's device copy of its source (pageable, or strided rows packed): freed by the
  // proxy in its out-stream's order once the wire has read it. The caller cannot free it on
  // its own stream: its cudaFreeAsync returns at once, and a wire's later copy from memory
  // freed that way is refused (cudaErrorInvalidValue, seen on the mpi-device wire).
  void* bounce = nullptr;
  std::chrono::steady_clock::time_point started{};  // when the proxy started it (the watchdog's clock)
};

// The proxy thread of a rank and what it owns: the wire and the streams per peer, the
// headers' MPI communicator, the done words.
class TransferProxy {
 public:
  // With `watchdog` (the callers' streams wait without a timeout of their own: memop waits),
  // a transfer that does not end within `timeout` is ended here, with an error.
  // `captured`: where replays of captured transfers ring (CapturedHandoff), polled by the thread.
  TransferProxy(const char* name, MpiComm control, std::map<int, PeerStreams> streams, std::unique_ptr<ProxyWire> wire,
                int rank, int device, std::chrono::milliseconds timeout, bool watchdog, FaultPlan faults,
                std::shared_ptr<HandoffBoard<TransferProxy>> captured)
      : captured_(std::move(captured)),
        name_(name),
        control_(std::move(control)),
        streams_(std::move(streams)),
        wire_(std::move(wire)),
        rank_(rank),
        device_(device),
        timeout_(timeout),
        watchdog_(watchdog && timeout.count() > 0),
        faults_(std::move(faults)) {
    const std::string what = "meshmem::Comm (" + std::string(name_) + " transport) on rank " + std::to_string(rank);
    words_memory_ = take_block(BlockMemory::MappedHost, device, kDoneWords * sizeof(std::uint64_t), what);  // zeroed
    words_ = static_cast<std::uint64_t*>(words_memory_.get());
    for (std::size_t i = kDoneWords; i-- > 0;) free_words_.push_back(i);
    thread_ = std::thread([this] { run(); });
    place_helper_thread(thread_, "transfer proxy");  // off a caller bound to one core (helper_cpus.hpp)
  }
  TransferProxy(const TransferProxy&) = delete;
  TransferProxy& operator=(const TransferProxy&) = delete;
  ~TransferProxy() { stop(false); }

  // Stops the thread, then the wire; with `abort` (transfers still in flight) the wire waits
  // for nothing (NCCL's destroy would wait for them: its communicators are aborted).
  void stop(bool abort) noexcept {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    if (thread_.joinable()) thread_.join();
    if (wire_) wire_->stop(abort);
  }

  std::uint64_t* word(std::size_t i) const { return words_ + i; }
  const char* name() const { return name_; }

  // Events for the callers to record (callers' threads).
  EventPool& events() { return events_; }

  // A done word; with all in use (that many transfers in flight) waits for one, bounded.
  std::size_t take_word(const std::string& what) {
    std::unique_lock<std::mutex> lock(m_);
    const auto has = [&] { return !free_words_.empty(); };
    if (timeout_.count() == 0)
      cv_.wait(lock, has);
    else if (!cv_.wait_for(lock, timeout_, has))
      throw Error(ErrorCode::Timeout, what + ": all " + std::to_string(kDoneWords) +
                                          " transfers of this rank are in flight and none ended within MESHMEM_TIMEOUT");
    const std::size_t w = free_words_.back();
    free_words_.pop_back();
    return w;
  }
  void release_word(std::size_t w) {
    std::lock_guard<std::mutex> lock(m_);
    free_words_.push_back(w);
    cv_.notify_all();
  }
  // A done word that a CUDA graph holds for its life (a transfer's end does not free it);
  // false when all are in use.
  bool try_take_graph_word(std::size_t* w) {
    std::lock_guard<std::mutex> lock(m_);
    if (free_words_.empty()) return false;
    *w = free_words_.back();
    free_words_.pop_back();
    graph_words_[*w] = GraphWord{};
    return true;
  }
  // The graph is gone; a transfer of it still in flight (its wait gave up) frees the word
  // when it ends.
  void release_graph_word(std::size_t w) {
    std::lock_guard<std::mutex> lock(m_);
    const auto graph = graph_words_.find(w);
    if (graph == graph_words_.end()) return;
    if (graph->second.in_flight > 0) {
      graph->second.released = true;
      return;
    }
    graph_words_.erase(graph);
    free_words_.push_back(w);
    cv_.notify_all();
  }

  // Queues a transfer; returns the ticket its done word reaches at its end.
  std::uint64_t submit(ProxyRequest r) {
    std::lock_guard<std::mutex> lock(m_);
    r.ticket = ++submitted_;
    const auto graph = graph_words_.find(r.word);
    if (graph != graph_words_.end()) ++graph->second.in_flight;
    queue_.push_back(r);
    return r.ticket;
  }

  void add_window(std::uint64_t id, void* local, std::size_t bytes) {
    std::lock_guard<std::mutex> lock(windows_m_);
    windows_[id] = {static_cast<char*>(local), bytes};
  }
  // Nothing more is enqueued into the window; returns once what was has ended (bounded):
  // what the wire still holds (it may read or write the window later), then the streams.
  bool remove_window(std::uint64_t id) {
    {
      std::lock_guard<std::mutex> lock(windows_m_);
      windows_.erase(id);
    }
    const Deadline deadline(timeout_);
    Backoff backoff;
    while (wire_->pending() > 0 && !deadline.expired()) backoff.pause();
    return wire_->pending() == 0 && wait_streams();
  }

  // Waits until every transfer handed over ended (bounded by MESHMEM_TIMEOUT); false if not.
  bool drain() {
    const Deadline deadline(timeout_);
    Backoff backoff;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(m_);
        if (ended_ >= submitted_) return true;
        if (stop_) return false;
      }
      if (deadline.expired()) return false;
      backoff.pause();
    }
  }

  // The first error noted since the last call ("" if none), and its code.
  std::string take_error(ErrorCode* code) {
    std::lock_guard<std::mutex> lock(m_);
    std::string e;
    e.swap(error_);
    *code = error_code_;
    return e;
  }

 private:
  struct Incoming {  // work enqueued on a peer's in-stream, ended in order
    cudaEvent_t done = nullptr;  // recorded after the work (null until it is enqueued)
    bool settled = false;        // enqueued (or failed to be: then refused, without an event)
    std::function<void()> deferred;  // a byte-less one's settling, run in its turn
    bool dropped = false;            // bytes nobody waits for (taken off the wire only)
    std::chrono::steady_clock::time_point started{};  // this rank's get: when it started
    bool ended = false;              // this rank's get, ended by the watchdog (its bytes may land later)
    bool is_put = true;   // a peer's put: acknowledge `id` (Refused if `refused`)
    std::uint64_t id = 0;
    bool refused = false;
    std::size_t word = 0;  // this rank's get: its done word and ticket
    std::uint64_t ticket = 0;
  };
  struct Outgoing {  // a header in flight
    Message message;
    MPI_Request request = MPI_REQUEST_NULL;
  };

  std::string where() const { return std::string(name_) + " transport on rank " + std::to_string(rank_); }

  // Records the first error; transfers still end (their streams go on), and the caller's
  // next call raises it.
  void note_error(const std::string& e, ErrorCode code = ErrorCode::Cuda) {
    log(LogLevel::Error, e);
    std::lock_guard<std::mutex> lock(m_);
    if (!error_.empty()) return;
    error_ = e;
    error_code_ = code;
  }

  // Under m_ from the store on: a graph that ends meanwhile must not free the word twice.
  void end(std::size_t w, std::uint64_t ticket) {
    std::lock_guard<std::mutex> lock(m_);
    __atomic_store_n(words_ + w, ticket, __ATOMIC_RELEASE);
    const auto graph = graph_words_.find(w);
    if (graph == graph_words_.end()) {
      free_words_.push_back(w);
    } else if (--graph->second.in_flight == 0 && graph->second.released) {
      graph_words_.erase(graph);  // its graph is gone and this was its last transfer
      free_words_.push_back(w);
    }
    ++ended_;
    cv_.notify_all();
  }

  bool wait_streams() {
    std::vector<cudaEvent_t> marks;
    bool ok = true;
    for (auto& [peer, streams] : streams_) {
      for (cudaStream_t s : {streams.in->get(), streams.out->get()}) {
        cudaEvent_t e = nullptr;
        if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess || cudaEventRecord(e, s) != cudaSuccess) {
          (void)cudaGetLastError();
          if (e != nullptr) (void)cudaEventDestroy(e);
          ok = false;
          continue;
        }
        marks.push_back(e);
      }
    }
    const Deadline deadline(timeout_);
    Backoff backoff;
    for (cudaEvent_t e : marks) {
      cudaError_t rc;
      while ((rc = cudaEventQuery(e)) == cudaErrorNotReady && !deadline.expired()) backoff.pause();
      if (rc != cudaSuccess) ok = false;
      (void)cudaEventDestroy(e);
    }
    return ok;
  }

  void send_header(int peer, const Message& m) {
    outgoing_.push_back(Outgoing{m, MPI_REQUEST_NULL});
    Outgoing& o = outgoing_.back();
    const int rc = MPI_Isend(&o.message, sizeof(Message), MPI_BYTE, peer, kTagMessage, control_.get(), &o.request);
    if (rc != MPI_SUCCESS) {
      outgoing_.pop_back();
      throw Error(ErrorCode::Mpi, where() + ": MPI_Isend of a header to rank " + std::to_string(peer) +
                                      " failed (code " + std::to_string(rc) + ")");
    }
  }

  // Where [offset, offset + bytes) of window `id` is here; null (and why) if nowhere. Under
  // windows_m_ (held until the copy into it is enqueued).
  char* resolve(std::uint64_t id, std::uint64_t offset, std::uint64_t bytes, std::string* problem) {
    const auto it = windows_.find(id);
    if (it == windows_.end()) {
      *problem = "window #" + std::to_string(id) + " is not (or no longer) allocated here";
      return nullptr;
    }
    if (offset > it->second.second || bytes > it->second.second - offset) {
      *problem = "bytes [" + std::to_string(offset) + ", " + std::to_string(offset + bytes) + ") are outside window #" +
                 std::to_string(id) + " (" + std::to_string(it->second.second) + " bytes)";
      return nullptr;
    }
    return it->second.first + offset;
  }

  void release_bounce(const ProxyRequest& r) noexcept {
    if (r.bounce == nullptr) return;
    const cudaError_t rc = cudaFreeAsync(r.bounce, streams_.at(r.peer).out->get());
    if (rc != cudaSuccess) log(LogLevel::Error, where() + ": cudaFreeAsync of a bounce buffer failed: " + cudaGetErrorString(rc));
  }

  void start(ProxyRequest r) {
    PeerStreams& streams = streams_.at(r.peer);
    const std::uint64_t id = next_id_[r.peer]++;
    r.started = std::chrono::steady_clock::now();
    if (r.is_get) {
      gets_[r.peer][id] = r;
      send_header(r.peer, Message{MessageKind::GetRequest, 0, id, r.window, r.offset, r.bytes, 0, 0, 0});
      return;
    }
    const std::uint32_t flags = r.has_signal ? (1u | (static_cast<std::uint32_t>(r.op) << 8)) : 0u;
    puts_[r.peer][id] = PutInFlight{r.word, r.ticket, r.started};
    send_header(r.peer, Message{MessageKind::Put, flags, id, r.window, r.offset, r.bytes, r.signal_window,
                                r.signal_index, r.value, r.dst_pitch, r.width});
    if (r.bytes > 0) {
      try {
        wire_->send(r.peer, r.src, r.bytes, streams.out->get(), [this, r] { release_bounce(r); },
                    where() + " to rank " + std::to_string(r.peer));
      } catch (...) {
        puts_[r.peer].erase(id);  // ended by the caller of start(); its acknowledgement never comes
        throw;
      }
    }
  }

  // Enqueues the receive of `bytes` from `peer` into `into`, then `then` and the record of
  // `in`'s done event on the peer's in-stream (at once or later: ProxyWire::recv). `in` is
  // queued now, so that the peer's transfers end in order; a failure of `then` ends it
  // refused, without an event.
  void receive(int peer, void* into, std::size_t bytes, Incoming in, std::function<void()> then, const std::string& from) {
    cudaStream_t s = streams_.at(peer).in->get();
    std::deque<Incoming>& list = incoming_[peer];
    const bool behind = std::any_of(list.begin(), list.end(), [](const Incoming& e) { return !e.settled; });
    list.push_back(in);
    Incoming* entry = &list.back();  // a deque keeps it in place until it is popped (finished)
    // A failure of `then` still records the event, so that the answer waits for what was
    // enqueued before (the bytes may still be landing).
    auto finish = [this, entry, s, then = std::move(then), from] {
      try {
        if (then) then();
      } catch (const std::exception& e) {
        note_error(e.what());
        entry->refused = true;
      }
      try {
        cudaEvent_t done = events_.take(from);
        const cudaError_t rc = cudaEventRecord(done, s);
        if (rc != cudaSuccess) {
          events_.give_back(done);
          ipc::check_cuda(rc, "cudaEventRecord", from);
        }
        entry->done = done;
      } catch (const std::exception& e) {
        note_error(e.what());
        entry->refused = true;
      }
      entry->settled = true;
    };
    if (bytes == 0) {
      // No bytes (a signal alone): behind a transfer from this peer still on the wire it waits
      // for its turn, so that a signal never lands before data sent ahead of it.
      if (!behind) return finish();
      entry->deferred = std::move(finish);
      return;
    }
    try {
      wire_->recv(peer, into, bytes, s, [this, peer, finish = std::move(finish)] {
        finish();
        run_deferred(peer);
      }, from);
    } catch (...) {
      entry->refused = true;
      entry->settled = true;
      throw;
    }
  }

  // Settles the peer's byte-less transfers whose turn came (every one before them settled).
  void run_deferred(int peer) {
    for (Incoming& e : incoming_[peer]) {
      if (e.settled) continue;
      if (!e.deferred) return;
      std::function<void()> f = std::move(e.deferred);
      e.deferred = nullptr;
      f();
    }
  }

  // Takes `bytes` from the peer's wire into scratch memory and drops them: the peer sent them,
  // so the wire must take them, or every later transfer from it would meet the wrong bytes.
  void drop(int peer, std::size_t bytes, Incoming in, const std::string& from) {
    cudaStream_t s = streams_.at(peer).in->get();
    void* scratch = nullptr;
    ipc::check_cuda(cudaMallocAsync(&scratch, bytes, s), "cudaMallocAsync (dropped bytes)", from);
    in.refused = true;
    receive(peer, scratch, bytes, in, [scratch, s, from] {
      ipc::check_cuda(cudaFreeAsync(scratch, s), "cudaFreeAsync", from);
    }, from);
  }

  // A peer's header.
  void handle(int peer, const Message& m) {
    const auto found = streams_.find(peer);
    if (found == streams_.end()) {
      note_error(where() + ": a header from rank " + std::to_string(peer) + ", which this rank does not reach through " +
                 name_);
      return;
    }
    PeerStreams& streams = found->second;
    const std::string from = where() + ", from rank " + std::to_string(peer);
    switch (m.kind) {
      case MessageKind::Put: {
        std::lock_guard<std::mutex> lock(windows_m_);
        std::string problem;
        std::uint64_t span = 0;
        char* dst = nullptr;
        if (put_span(m, &span))
          dst = resolve(m.window, m.offset, span, &problem);
        else
          problem = "a strided put of " + std::to_string(m.bytes) + " bytes in rows of " + std::to_string(m.width) +
                    ", " + std::to_string(m.pitch) + " apart, is malformed";
        std::uint64_t* signal = nullptr;
        if (dst != nullptr && (m.flags & 1u))
          signal = reinterpret_cast<std::uint64_t*>(
              resolve(m.signal_window, m.signal_index * sizeof(std::uint64_t), sizeof(std::uint64_t), &problem));
        const bool refused = dst == nullptr || ((m.flags & 1u) && signal == nullptr);
        cudaStream_t s = streams.in->get();
        // The data must be received wherever it goes, or every later transfer of the pair
        // would stall behind this one: refused data lands in scratch memory. A strided put's
        // packed rows land there too, then go to their places.
        const bool packed = m.bytes > 0 && (refused || m.width > 0);
        void* into = dst;
        if (packed) ipc::check_cuda(cudaMallocAsync(&into, m.bytes, s), "cudaMallocAsync (packed or refused put)", from);
        if (refused) note_error(from + ": a put was refused: " + problem);
        Incoming in;
        in.is_put = true;
        in.id = m.id;
        in.refused = refused;
        // What follows the bytes on the in-stream: unpacking, the scratch memory's release,
        // the signal (the window stays while the wire holds this: remove_window).
        auto then = [=] {
          if (!refused && m.width > 0)
            ipc::check_cuda(cudaMemcpy2DAsync(dst, m.pitch, into, m.width, m.width, m.bytes / m.width,
                                              cudaMemcpyDeviceToDevice, s),
                            "cudaMemcpy2DAsync (unpacking a strided put)", from);
          if (packed) ipc::check_cuda(cudaFreeAsync(into, s), "cudaFreeAsync", from);
          if (!refused && signal != nullptr)
            ipc::check_cuda(cuda::launch_copy(nullptr, nullptr, 0, signal, m.value,
                                              static_cast<SignalOp>((m.flags >> 8) & 0xff), s, false),
                            "signal kernel launch", from);
        };
        receive(peer, into, m.bytes, in, then, from);
        return;
      }
      case MessageKind::GetRequest: {
        std::lock_guard<std::mutex> lock(windows_m_);
        std::string problem;
        const char* src = resolve(m.window, m.offset, m.bytes, &problem);
        if (src == nullptr) {
          note_error(from + ": a get was refused: " + problem);
          send_header(peer, Message{MessageKind::Refused, 1, m.id, 0, 0, 0, 0, 0, 0});
          return;
        }
        send_header(peer, Message{MessageKind::GetData, 0, m.id, 0, 0, m.bytes, 0, 0, 0});
        if (m.bytes > 0) wire_->send(peer, src, m.bytes, streams.out->get(), nullptr, from);
        return;
      }
      case MessageKind::GetData: {
        const auto it = gets_[peer].find(m.id);
        if (it == gets_[peer].end()) {
          note_error(from + ": data for get #" + std::to_string(m.id) + ", which is not in flight");
          if (m.bytes > 0) {
            Incoming in;
            in.is_put = false;
            in.dropped = true;
            drop(peer, m.bytes, in, from);
          }
          return;
        }
        const ProxyRequest r = it->second;
        gets_[peer].erase(it);
        Incoming in;
        in.is_put = false;
        in.word = r.word;
        in.ticket = r.ticket;
        in.started = r.started;
        receive(peer, r.dst, m.bytes, in, nullptr, from);
        return;
      }
      case MessageKind::Ack:
      case MessageKind::Refused: {
        if (m.flags & 1u) {  // the answer to a get
          const auto it = gets_[peer].find(m.id);
          if (it == gets_[peer].end()) break;
          const ProxyRequest r = it->second;
          gets_[peer].erase(it);
          note_error(where() + ": a get of " + std::to_string(r.bytes) + " bytes from rank " + std::to_string(peer) +
                     " was refused there (see its log)");
          end(r.word, r.ticket);
          return;
        }
        const auto it = puts_[peer].find(m.id);
        if (it == puts_[peer].end()) {
          if (abandoned_puts_[peer].erase(m.id) > 0) return;  // the watchdog ended it already
          break;
        }
        const PutInFlight p = it->second;
        puts_[peer].erase(it);
        if (m.kind == MessageKind::Refused)
          note_error(where() + ": a put to rank " + std::to_string(peer) + " was refused there (see its log)");
        end(p.word, p.ticket);
        return;
      }
    }
    note_error(from + ": an unexpected header (kind " + std::to_string(static_cast<unsigned>(m.kind)) + ", id " +
               std::to_string(m.id) + ")");
  }

  // Ends the puts and gets (whose answer has not come) that outlived the timeout: the
  // callers' streams wait without a timeout of their own (memop waits). A put's late
  // acknowledgement is then ignored; a get's late bytes are taken off the wire and dropped.
  void watch() {
    const auto now = std::chrono::steady_clock::now();
    if (now < next_watch_) return;
    next_watch_ = now + std::chrono::milliseconds(50);
    const auto late = [&](std::chrono::steady_clock::time_point t) { return now - t > timeout_; };
    // Built for a late transfer only: this runs every 50 ms.
    const auto after = [&] {
      return " did not end within " + describe_timeout(timeout_) +
             "; its stream was released (its data may be incomplete)" + gpu_queue_hint();
    };
    for (auto& [peer, list] : puts_)
      for (auto it = list.begin(); it != list.end();) {
        if (!late(it->second.started)) {
          ++it;
          continue;
        }
        note_error(where() + ": a put to rank " + std::to_string(peer) + after(), ErrorCode::Timeout);
        end(it->second.word, it->second.ticket);
        abandoned_puts_[peer].insert(it->first);
        it = list.erase(it);
      }
    for (auto& [peer, list] : gets_)
      for (auto it = list.begin(); it != list.end();) {
        if (!late(it->second.started)) {
          ++it;
          continue;
        }
        note_error(where() + ": a get of " + std::to_string(it->second.bytes) + " bytes from rank " +
                       std::to_string(peer) + after(),
                   ErrorCode::Timeout);
        end(it->second.word, it->second.ticket);
        it = list.erase(it);
      }
    // Gets whose answer came but whose bytes are still on the wire (a peer that died midway):
    // ended the same way; the entry stays until the wire gives it up.
    for (auto& [peer, list] : incoming_)
      for (Incoming& in : list) {
        if (in.is_put || in.dropped || in.ended || in.settled || !late(in.started)) continue;
        note_error(where() + ": a get from rank " + std::to_string(peer) + after(), ErrorCode::Timeout);
        end(in.word, in.ticket);
        in.ended = true;
      }
  }

  // Work that ended on the in-streams, in order per peer.
  bool finish_incoming() {
    bool any = false;
    for (auto& [peer, list] : incoming_) {
      while (!list.empty()) {
        if (!list.front().settled) break;  // its bytes are still on the wire
        const cudaError_t rc = list.front().done != nullptr ? cudaEventQuery(list.front().done) : cudaSuccess;
        if (rc == cudaErrorNotReady) break;
        Incoming in = list.front();
        list.pop_front();
        if (in.done != nullptr) events_.give_back(in.done);
        any = true;
        if (rc != cudaSuccess)
          note_error(where() + ": a transfer with rank " + std::to_string(peer) + " failed on the GPU: " +
                     cudaGetErrorString(rc));
        if (in.dropped) continue;
        if (in.is_put)
          send_header(peer, Message{in.refused || rc != cudaSuccess ? MessageKind::Refused : MessageKind::Ack, 0, in.id,
                                    0, 0, 0, 0, 0, 0});
        else if (!in.ended)
          end(in.word, in.ticket);
      }
    }
    return any;
  }

  void run() {
    tighten_timer_slack();
    // Its cudaEventQuery of a copy was refused while the application captured a graph in
    // global mode (seen: mpi-device, "the wire failed"), and the transport stopped for good.
    relax_capture_mode_of_this_thread();
    if (cudaSetDevice(device_) != cudaSuccess) {
      note_error(where() + ": cudaSetDevice failed in the proxy thread");
      return;
    }
    Message in_message{};
    MPI_Request in_request = MPI_REQUEST_NULL;
    auto post = [&] {
      return MPI_Irecv(&in_message, sizeof(Message), MPI_BYTE, MPI_ANY_SOURCE, kTagMessage, control_.get(), &in_request);
    };
    if (post() != MPI_SUCCESS) {
      note_error(where() + ": MPI_Irecv of headers failed");
      return;
    }
    ReadyQueue<ProxyRequest> waiting;
    Backoff backoff(std::chrono::microseconds(200));
    for (;;) {
      // Outside m_: a replay's hand-off submits (which takes it).
      bool busy = captured_ != nullptr && captured_->poll();
      {
        std::lock_guard<std::mutex> lock(m_);
        if (stop_) break;
        while (!queue_.empty()) {
          waiting.push(queue_.front());
          queue_.pop_front();
        }
      }
      try {
        // Transfers whose source is ready, each stream's in its order (ReadyQueue: only the
        // oldest waiting transfer of each stream is asked).
        if (waiting.take_ready([](const ProxyRequest& r) { return cudaEventQuery(r.ready); },
                               [&](const ProxyRequest& r, cudaError_t rc) {
              if (r.ready) events_.give_back(r.ready);
              if (rc != cudaSuccess) {
                note_error(where() + ": the stream of a transfer to rank " + std::to_string(r.peer) + " failed: " +
                           cudaGetErrorString(rc));
                release_bounce(r);
                end(r.word, r.ticket);
                return;
              }
              try {
                start(r);
              } catch (const std::exception& e) {
                note_error(e.what());
                release_bounce(r);  // start() hands it over only with the wire's send
                end(r.word, r.ticket);
              }
            }))
          busy = true;
        for (;;) {
          int flag = 0;
          MPI_Status status;
          if (MPI_Test(&in_request, &flag, &status) != MPI_SUCCESS) throw Error(ErrorCode::Mpi, where() + ": MPI_Test failed");
          if (!flag) break;
          busy = true;
          const Message m = in_message;
          if (post() != MPI_SUCCESS) throw Error(ErrorCode::Mpi, where() + ": MPI_Irecv of headers failed");
          faults_.hit(FaultPoint::ProxyHeader);
          try {
            handle(status.MPI_SOURCE, m);
          } catch (const Error& e) {
            note_error(e.what());
          }
        }
        if (!wire_failed_) {
          try {
            busy = wire_->progress() || busy;
          } catch (const std::exception& e) {
            // The wire cannot go on (a CUDA or MPI call failed): its transfers never end, and
            // their callers' waits time out; every later call on the Comm raises this.
            wire_failed_ = true;
            note_error(where() + ": the wire failed; no transfer with a peer of this transport ends from now on: " +
                       e.what());
          }
        }
        busy = finish_incoming() || busy;
        if (watchdog_) watch();
        for (auto it = outgoing_.begin(); it != outgoing_.end();) {
          int flag = 0;
          MPI_Test(&it->request, &flag, MPI_STATUS_IGNORE);
          it = flag ? outgoing_.erase(it) : std::next(it);
        }
      } catch (const std::exception& e) {
        note_error(e.what());
      }
      if (busy)
        backoff.reset();
      else
        backoff.pause();
    }
    // Stopping: every rank settled first, so what is left belongs to a broken job.
    MPI_Cancel(&in_request);
    MPI_Wait(&in_request, MPI_STATUS_IGNORE);
    for (Outgoing& o : outgoing_) {
      int flag = 0;
      MPI_Test(&o.request, &flag, MPI_STATUS_IGNORE);
      if (!flag) MPI_Request_free(&o.request);  // completes (or not) without us
    }
    waiting.take_all([&](ProxyRequest& r) {
      if (r.ready) events_.give_back(r.ready);
      release_bounce(r);
    });
  }

  std::shared_ptr<HandoffBoard<TransferProxy>> captured_;
  const char* name_;
  MpiComm control_;
  std::map<int, PeerStreams> streams_;
  std::unique_ptr<ProxyWire> wire_;
  int rank_;
  int device_;
  std::chrono::milliseconds timeout_;
  bool watchdog_;  // ends transfers that outlive timeout_ (the callers' streams cannot time out)
  FaultPlan faults_;
  PooledBlock words_memory_;  // mapped host memory: the done words
  std::uint64_t* words_ = nullptr;

  // The proxy thread's own.
  std::map<int, std::uint64_t> next_id_;
  struct PutInFlight {
    std::size_t word;
    std::uint64_t ticket;
    std::chrono::steady_clock::time_point started;
  };
  std::map<int, std::map<std::uint64_t, PutInFlight>> puts_;  // by peer, id
  std::map<int, std::set<std::uint64_t>> abandoned_puts_;     // ended by the watchdog, acknowledgement not yet in
  std::map<int, std::map<std::uint64_t, ProxyRequest>> gets_;
  std::map<int, std::deque<Incoming>> incoming_;
  bool wire_failed_ = false;
  std::chrono::steady_clock::time_point next_watch_{};
  std::list<Outgoing> outgoing_;

  std::mutex windows_m_;
  std::map<std::uint64_t, std::pair<char*, std::size_t>> windows_;

  EventPool events_;
  std::mutex m_;  // queue, counters, words, error, stop
  std::condition_variable cv_;
  std::deque<ProxyRequest> queue_;
  std::vector<std::size_t> free_words_;
  struct GraphWord {
    unsigned in_flight = 0;  // its transfers submitted and not ended
    bool released = false;   // its graph is gone
  };
  std::map<std::size_t, GraphWord> graph_words_;  // held by captured transfers
  std::uint64_t submitted_ = 0;
  std::uint64_t ended_ = 0;
  std::string error_;
  ErrorCode error_code_ = ErrorCode::Cuda;
  bool stop_ = false;
  std::thread thread_;
};

namespace {

// A window as a landing place for peers' transfers; keeps the proxy (the window may be
// released after the Comm).
class ProxyAttachment final : public WindowAttachment {
 public:
  ProxyAttachment(std::shared_ptr<TransferProxy> p, std::uint64_t id) : proxy(std::move(p)), window(id) {}
  ~ProxyAttachment() override {
    if (!proxy->remove_window(window))
      log(LogLevel::Error, std::string(proxy->name()) + " transport: transfers into or out of window #" +
                               std::to_string(window) +
                               " still running when it was freed (a peer that stopped?)");
  }
  std::shared_ptr<TransferProxy> proxy;
  std::uint64_t window;
};

}  // namespace

// A captured transfer's done word, given back to the proxy unless kept (then the graph's user
// object gives it back when the graph is gone).
struct GraphWords {
  explicit GraphWords(TransferProxy* p) : proxy(p) {}
  GraphWords(const GraphWords&) = delete;
  GraphWords& operator=(const GraphWords&) = delete;
  ~GraphWords() {
    if (proxy != nullptr && has_done) proxy->release_graph_word(done);
  }
  bool take() {
    has_done = proxy->try_take_graph_word(&done);
    return has_done;
  }
  void kept() { proxy = nullptr; }
  TransferProxy* proxy;
  std::size_t done = 0;
  bool has_done = false;
};

namespace {

// How a captured transfer runs on every replay (CapturedHandoff): the request, with its done
// word (a graph word: a transfer still in flight when its graph is destroyed keeps it until it
// ends), goes to the proxy.
struct ProxyHandoff {
  using Owner = TransferProxy;
  struct Request {
    ProxyRequest transfer;  // its done word set
  };
  static std::uint64_t submit(TransferProxy& proxy, const Request& r) { return proxy.submit(r.transfer); }
  static void release(TransferProxy& proxy, const Request& r) { proxy.release_graph_word(r.transfer.word); }
};

}  // namespace

ProxyTransport::ProxyTransport(const CommContext& ctx, const char* name)
    : ctx_(ctx),
      device_(gpu_device_of(ctx.device)),
      name_(name),
      board_(std::make_shared<HandoffBoard<TransferProxy>>()),
      finalize_keyval_(MPI_KEYVAL_INVALID) {
  const Topology& topo = ctx_.topo;
  no_route_.assign(static_cast<std::size_t>(topo.size), std::string());
  for (int r = 0; r < topo.size; ++r)
    if (topo.same_node(r)) no_route_[r] = "rank " + std::to_string(r) + " is on this node (ipc or staged reach it)";
}

void ProxyTransport::require_thread_multiple(const std::string& role) const {
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  ctx_.boot.agree(provided >= MPI_THREAD_MULTIPLE, ErrorCode::Unsupported,
                  "the " + std::string(name_) + " transport " + role +
                      " in a proxy thread that talks MPI and needs MPI_THREAD_MULTIPLE, but MPI was initialised "
                      "with thread level " + std::to_string(provided) +
                      "; call MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...)",
                  "meshmem::Comm");
}

int ProxyTransport::stop_on_finalize(MPI_Comm, int, void* transport, void*) {
  static_cast<ProxyTransport*>(transport)->stop();
  return MPI_SUCCESS;
}

void ProxyTransport::start_proxy(MpiComm control, std::map<int, PeerStreams> streams, std::unique_ptr<ProxyWire> wire) {
  const std::string crowded = note_transport_streams(ctx_.topo.rank, name_, 2 * static_cast<int>(streams.size()));
  if (!crowded.empty()) log(LogLevel::Warn, crowded);
  const std::size_t doorbells = HandoffBoard<TransferProxy>::bytes_for(kTransferDoorbells);
  board_->set_doorbells(
      doorbell_memory(device_->device(), doorbells, "meshmem::Comm (" + std::string(name_) + " transport)"), doorbells);
  proxy_ = std::make_shared<TransferProxy>(name_, std::move(control), std::move(streams), std::move(wire),
                                           ctx_.topo.rank, device_->device(), ctx_.options.timeout,
                                           !device_->waits_with_kernel(), ctx_.faults, board_);
  board_->open(proxy_.get());
  // At MPI_Finalize at the latest the thread stops (it talks MPI).
  const std::string what = "meshmem::Comm (" + std::string(name_) + " transport)";
  check_mpi(MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, stop_on_finalize, &finalize_keyval_, nullptr),
            "MPI_Comm_create_keyval", what);
  check_mpi(MPI_Comm_set_attr(MPI_COMM_SELF, finalize_keyval_, this), "MPI_Comm_set_attr", what);
}

ProxyTransport::~ProxyTransport() {
  stop();
  board_->close(cuda::HandoffClosed::Retired);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && finalize_keyval_ != MPI_KEYVAL_INVALID) {
    MPI_Comm_delete_attr(MPI_COMM_SELF, finalize_keyval_);
    MPI_Comm_free_keyval(&finalize_keyval_);
  }
}

void ProxyTransport::stop() noexcept {
  if (!proxy_) return;
  board_->close(cuda::HandoffClosed::Stopped);  // MPI_Finalize, or ~Comm
  // Transfers still in flight (a broken job): the wire waits for nothing.
  const bool idle = proxy_->drain();
  proxy_->stop(!idle);
}

void ProxyTransport::settle() noexcept {
  if (proxy_ && !proxy_->drain())
    log(LogLevel::Error, "~Comm: " + std::string(name_) + " transfers of rank " + std::to_string(ctx_.topo.rank) +
                             " did not end within MESHMEM_TIMEOUT; the ranks part anyway");
}

Reach ProxyTransport::reach(int rank, Memory memory) const {
  if (memory != Memory::Device) return Reach::no("device windows only");
  if (device_ == nullptr) return Reach::no("device windows are unavailable");
  if (!no_route_[rank].empty()) return Reach::no(no_route_[rank]);
  return Reach::yes();
}

std::string ProxyTransport::what(const char* op, int target) const {
  return std::string(op) + " on rank " + std::to_string(ctx_.topo.rank) + " to rank " + std::to_string(target) +
         " (" + name_ + " transport)";
}


std::unique_ptr<WindowAttachment> ProxyTransport::attach(WindowState& win, const std::vector<bool>&, const std::string&) {
  if (!proxy_) return nullptr;
  proxy_->add_window(win.id, win.local, win.bytes);
  return std::make_unique<ProxyAttachment>(proxy_, win.id);
}

void ProxyTransport::put(const WindowState& win, int target, std::size_t offset, const void* src, std::size_t bytes,
                        const SignalUpdate& signal, Stream stream) {
  ProxyRequest r;
  r.peer = target;
  r.src = src;
  r.bytes = bytes;
  r.window = win.id;
  r.offset = offset;
  if (signal.sig != nullptr) {
    r.has_signal = true;
    r.signal_window = signal.sig->id;
    r.signal_index = signal.index;
    r.value = signal.value;
    r.op = signal.op;
  }
  transfer(r, stream, bytes == 0 && signal.sig != nullptr ? "comm.signal" : "comm.put");
}

void ProxyTransport::put_strided(const WindowState& win, int target, std::size_t dst_offset, std::size_t dst_pitch,
                                const void* src, std::size_t src_pitch, std::size_t width, std::size_t height,
                                Stream stream) {
  if (width == 0 || height == 0) return;
  if (height == 1 || (src_pitch == width && dst_pitch == width)) {
    put(win, target, dst_offset, src, width * height, SignalUpdate{}, stream);
    return;
  }
  ProxyRequest r;
  r.peer = target;
  r.src = src;
  r.bytes = width * height;
  r.window = win.id;
  r.offset = dst_offset;
  r.width = width;
  r.src_pitch = src_pitch;
  r.dst_pitch = dst_pitch;
  transfer(r, stream, "comm.put_strided");
}

void ProxyTransport::get(void* dst, const WindowState& win, int target, std::size_t offset, std::size_t bytes,
                        Stream stream) {
  ProxyRequest r;
  r.is_get = true;
  r.peer = target;
  r.dst = dst;
  r.bytes = bytes;
  r.window = win.id;
  r.offset = offset;
  transfer(r, stream, "comm.get");
}

namespace {
// Whether `p` is plain (pageable) host memory, which the wires do not read or write.
bool pageable(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  return a.type == cudaMemoryTypeUnregistered;
}
}  // namespace

void ProxyTransport::raise_earlier_failure(const std::string& where) {
  ErrorCode code = ErrorCode::Cuda;
  const std::string error = proxy_->take_error(&code);
  if (!error.empty()) throw Error(code, where + ": an earlier transfer failed: " + error);
}

void ProxyTransport::quiet(Stream) {
  if (proxy_) raise_earlier_failure(std::string(name_) + " transport on rank " + std::to_string(ctx_.topo.rank));
}

void ProxyTransport::transfer(ProxyRequest r, Stream stream, const char* name) {
  if (!proxy_) throw Error(ErrorCode::Internal, what(name, r.peer) + ": the transport is not connected");
  raise_earlier_failure(what(name, r.peer));
  const auto s = static_cast<cudaStream_t>(stream);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaGraph_t graph = nullptr;
  ipc::check_cuda(cudaStreamGetCaptureInfo(s, &status, nullptr, &graph), "cudaStreamGetCaptureInfo", what(name, r.peer));
  const bool capturing = status == cudaStreamCaptureStatusActive;
  if (capturing && r.bytes > 0 && (r.is_get ? pageable(r.dst) : pageable(r.src)))
    throw Error(ErrorCode::Unsupported, what(name, r.peer) +
                                            ": pageable host memory cannot be captured into a CUDA graph here (it would "
                                            "need a host copy on every replay); use device or pinned memory; nothing "
                                            "was added to the capture");
  // Under capture the graph's done word is taken before anything is captured, so that a
  // shortage leaves the capture untouched.
  GraphWords words(capturing ? proxy_.get() : nullptr);
  if (capturing && !words.take())
    throw Error(ErrorCode::Unsupported, what(name, r.peer) + ": all " + std::to_string(kDoneWords) +
                                            " done words of this rank are held by transfers in flight or captured "
                                            "into CUDA graphs that still exist; nothing was added to the capture");
  // Pageable host memory, and a strided put's rows, go through device memory of the stream's
  // own (stream-ordered allocation): copied (packed) in before a put, out after a get, freed
  // after the transfer's end.
  void* bounce = nullptr;
  void* user_dst = nullptr;
  if (r.bytes > 0 && (r.is_get ? pageable(r.dst) : r.width > 0 || pageable(r.src))) {
    ipc::check_cuda(cudaMallocAsync(&bounce, r.bytes, s), "cudaMallocAsync (bounce buffer)", what(name, r.peer));
    if (r.is_get) {
      user_dst = r.dst;
      r.dst = bounce;
    } else {
      const cudaError_t c =
          r.width > 0
              ? cudaMemcpy2DAsync(bounce, r.width, r.src, r.src_pitch, r.width, r.bytes / r.width, cudaMemcpyDefault, s)
              : cudaMemcpyAsync(bounce, r.src, r.bytes, cudaMemcpyHostToDevice, s);
      if (c != cudaSuccess) {
        (void)cudaFreeAsync(bounce, s);
        ipc::check_cuda(c, r.width > 0 ? "cudaMemcpy2DAsync (packing a strided put)" : "cudaMemcpyAsync (pageable source)",
                        what(name, r.peer));
      }
      r.src = bounce;
    }
  }
  if (capturing) {
    try {
      capture_transfer(r, graph, s, name, words);
    } catch (...) {
      if (bounce != nullptr) (void)cudaFreeAsync(bounce, s);
      throw;
    }
    if (bounce != nullptr) ipc::check_cuda(cudaFreeAsync(bounce, s), "cudaFreeAsync", what(name, r.peer));
    return;
  }
  try {
    r.word = proxy_->take_word(what(name, r.peer));
  } catch (...) {
    if (bounce != nullptr) (void)cudaFreeAsync(bounce, s);
    throw;
  }
  r.ready = proxy_->events().take(what(name, r.peer));
  r.stream = s;
  const cudaError_t rc = cudaEventRecord(r.ready, s);
  if (rc != cudaSuccess) {
    proxy_->events().give_back(r.ready);
    proxy_->release_word(r.word);
    if (bounce != nullptr) (void)cudaFreeAsync(bounce, s);
    ipc::check_cuda(rc, "cudaEventRecord", what(name, r.peer));
  }
  if (!r.is_get) r.bounce = bounce;  // from here the proxy frees it
  std::uint64_t* done = proxy_->word(r.word);
  const std::uint64_t ticket = proxy_->submit(r);
  device_->wait_for_ticket(done, ticket, r.peer, s, true, what(name, r.peer));  // the watchdog ends it
  if (bounce == nullptr || r.bounce != nullptr) return;  // a put's: the proxy frees it
  if (user_dst != nullptr)
    ipc::check_cuda(cudaMemcpyAsync(user_dst, bounce, r.bytes, cudaMemcpyDeviceToHost, s),
                    "cudaMemcpyAsync (pageable destination)", what(name, r.peer));
  ipc::check_cuda(cudaFreeAsync(bounce, s), "cudaFreeAsync", what(name, r.peer));
}

// Under capture the graph gets a kernel that rings the request's doorbell on every replay
// (once the caller's earlier work is done, so no ready event is needed) and waits for the
// ticket the proxy answers with (CapturedHandoff).
void ProxyTransport::capture_transfer(ProxyRequest r, cudaGraph_t graph, cudaStream_t stream, const char* name,
                                     GraphWords& words) {
  ProxyHandoff::Request captured;
  captured.transfer = r;
  captured.transfer.word = words.done;
  captured.transfer.ready = nullptr;
  captured.transfer.stream = nullptr;
  words.kept();  // CapturedHandoff gives it back from here on
  const TicketWait wait =
      TicketWait::on(*device_, proxy_->word(captured.transfer.word), cuda::FaultKind::Transfer, r.peer);
  CapturedHandoff<ProxyHandoff>::capture(board_, std::move(captured), wait, graph, stream, what(name, r.peer));
}


}  // namespace meshmem::detail
