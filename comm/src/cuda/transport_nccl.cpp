#define MESHMEM_DEFINING_GPU_PART
#include "transport_nccl.hpp"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "../backoff.hpp"
#include "../bootstrap.hpp"
#include "../fault.hpp"
#include "../gpu_part.hpp"
#include "../knobs.hpp"
#include "../log.hpp"
#include "../strided_rows.hpp"
#include "../topology.hpp"
#include "captured_handoff.hpp"
#include "device_runtime.hpp"
#include "event_pool.hpp"
#include "kernels.hpp"
#include "meshmem/error.hpp"
#include "nccl_library.hpp"

namespace meshmem::detail {

namespace {

std::string parse_path(const char* name, const std::string& raw) {
  if (raw.empty()) bad_knob_value(name, raw, "a library name or path");
  return raw;
}
std::string print_path(const std::string& p) { return p; }
const TuningKnob<std::string> kNcclLibrary{
    "nccl", "MESHMEM_NCCL_LIBRARY", "libnccl.so.2", parse_path, print_path,
    "nccl transport (device windows of ranks on other nodes): the NCCL library to load at run time (a name the "
    "dynamic linker finds, or a path)",
    false};

constexpr int kTagMessage = 1;
constexpr int kTagInit = 2;
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

// The NCCL_HOSTID that meshmem set in this process ("" if none): one per process, set once,
// as NCCL (2.23 on) reads the variable once per process. Each process is then a host of its
// own for NCCL, whatever grouping a Comm simulates (ranks of one simulated node never pair
// over NCCL here). A value that is not meshmem's is the user's, and kept.
std::mutex host_id_m;
std::string host_id_set;

bool user_set_host_id() {
  std::lock_guard<std::mutex> lock(host_id_m);
  const char* v = std::getenv("NCCL_HOSTID");
  return v != nullptr && v != host_id_set;
}

std::string process_host_id() {
  char name[256] = {};
  (void)gethostname(name, sizeof(name) - 1);
  return std::string(name) + "/meshmem-simulated-pid-" + std::to_string(getpid());
}

// Before NCCL's first communicator in this process reads it (setenv is not safe beside other
// threads' getenv: it runs once, on the thread that makes the Comm).
void set_host_id(const std::string& id) {
  std::lock_guard<std::mutex> lock(host_id_m);
  if (host_id_set == id) return;
  host_id_set = id;
  setenv("NCCL_HOSTID", id.c_str(), 1);
}

// Waits until no communicator of `comms` (nonblocking; [2i] to peers[i], [2i+1] from it) has
// work in progress, bounded by `deadline`. Raises NCCL's error, or Timeout naming the peers
// whose communicators are still busy (the caller aborts them).
void wait_for_nccl(const NcclLibrary& lib, const std::vector<NcclCommHandle>& comms, const std::vector<int>& peers,
                   const Deadline& deadline, const char* step, const std::string& what) {
  Backoff backoff;
  for (;;) {
    std::vector<int> busy;
    for (std::size_t i = 0; i < comms.size(); ++i) {
      int state = 0;
      lib.check(lib.comm_get_async_error(comms[i], &state), "ncclCommGetAsyncError", what);
      const int peer = peers[i / 2];
      if (state == NcclLibrary::kInProgress) {
        if (busy.empty() || busy.back() != peer) busy.push_back(peer);
      } else if (state != 0) {
        lib.check(state, ("NCCL's " + std::string(step) + " with rank " + std::to_string(peer)).c_str(), what);
      }
    }
    if (busy.empty()) return;
    // The communicators of one group end together: one late or dead peer holds up the others.
    if (deadline.expired())
      throw Error(ErrorCode::Timeout, what + ": NCCL's " + step + " with rank(s) " + rank_list(busy) +
                                          " did not end within " + describe_timeout(deadline.timeout()) +
                                          (busy.size() > 1 ? " (made in one group: one late or dead rank among them "
                                                             "holds up all)"
                                                           : "") +
                                          "; its communicators are aborted");
    backoff.pause();
  }
}

int stop_on_finalize(MPI_Comm, int, void* transport, void*) {
  static_cast<NcclTransport*>(transport)->stop();
  return MPI_SUCCESS;
}

}  // namespace

// One transfer, as the caller hands it to the proxy.
struct NcclRequest {
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
};

// The proxy thread of a rank and what it owns: the NCCL communicators and streams per peer,
// the headers' MPI communicator, the done words.
class NcclProxy {
 public:
  struct Pair {
    NcclComm out;  // this rank sends to the peer (this rank is 0, the peer 1)
    NcclComm in;   // the peer sends here (the peer is 0, this rank 1)
    // The nonblocking communicators that `out` and `in` were split from (they share their
    // resources): made and connected under MESHMEM_TIMEOUT (see connect()).
    NcclComm out_root, in_root;
    std::unique_ptr<OwnedStream> out_stream, in_stream;
  };
  NcclProxy(const NcclLibrary* lib, MpiComm control, std::map<int, Pair> pairs, int rank, int device,
            std::chrono::milliseconds timeout)
      : lib_(lib), control_(std::move(control)), pairs_(std::move(pairs)), rank_(rank), device_(device), timeout_(timeout) {
    const std::string what = "meshmem::Comm (nccl transport) on rank " + std::to_string(rank);
    void* p = nullptr;
    ipc::check_cuda(cudaHostAlloc(&p, kDoneWords * sizeof(std::uint64_t), cudaHostAllocMapped | cudaHostAllocPortable),
                    "cudaHostAlloc (done words)", what);
    words_ = static_cast<std::uint64_t*>(p);
    std::memset(words_, 0, kDoneWords * sizeof(std::uint64_t));
    for (std::size_t i = kDoneWords; i-- > 0;) free_words_.push_back(i);
    thread_ = std::thread([this] { run(); });
  }
  NcclProxy(const NcclProxy&) = delete;
  NcclProxy& operator=(const NcclProxy&) = delete;
  ~NcclProxy() {
    stop(false);
    if (words_ != nullptr) (void)cudaFreeHost(words_);
  }

  // Stops the thread; with `abort` (transfers still in flight) the communicators are aborted
  // instead of destroyed, as NCCL's destroy would wait for them.
  void stop(bool abort) noexcept {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    if (thread_.joinable()) thread_.join();
    for (auto& [peer, pair] : pairs_) {
      pair.out.reset(abort);
      pair.in.reset(abort);
      pair.out_root.reset(abort);
      pair.in_root.reset(abort);
    }
  }

  std::uint64_t* word(std::size_t i) const { return words_ + i; }

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
  std::uint64_t submit(NcclRequest r) {
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
  // Nothing more is enqueued into the window; returns once what was has ended (bounded).
  bool remove_window(std::uint64_t id) {
    {
      std::lock_guard<std::mutex> lock(windows_m_);
      windows_.erase(id);
    }
    return wait_streams();
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

  std::string take_error() {
    std::lock_guard<std::mutex> lock(m_);
    std::string e;
    e.swap(error_);
    return e;
  }

 private:
  struct Incoming {  // work enqueued on a peer's in-stream, ended in order
    cudaEvent_t done = nullptr;
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

  std::string where() const { return "nccl transport on rank " + std::to_string(rank_); }

  // Records the first error; transfers still end (their streams go on), and the caller's
  // next call raises it.
  void note_error(const std::string& e) {
    log(LogLevel::Error, e);
    std::lock_guard<std::mutex> lock(m_);
    if (error_.empty()) error_ = e;
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
    for (auto& [peer, pair] : pairs_) {
      for (cudaStream_t s : {pair.in_stream->get(), pair.out_stream->get()}) {
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

  void start(const NcclRequest& r) {
    Pair& pair = pairs_.at(r.peer);
    const std::uint64_t id = next_id_[r.peer]++;
    if (r.is_get) {
      gets_[r.peer][id] = r;
      send_header(r.peer, Message{MessageKind::GetRequest, 0, id, r.window, r.offset, r.bytes, 0, 0, 0});
      return;
    }
    const std::uint32_t flags = r.has_signal ? (1u | (static_cast<std::uint32_t>(r.op) << 8)) : 0u;
    puts_[r.peer][id] = {r.word, r.ticket};
    send_header(r.peer, Message{MessageKind::Put, flags, id, r.window, r.offset, r.bytes, r.signal_window,
                                r.signal_index, r.value, r.dst_pitch, r.width});
    if (r.bytes > 0) {
      const int rc = lib_->send(r.src, r.bytes, NcclLibrary::kInt8, 1, pair.out.get(), pair.out_stream->get());
      if (rc != 0) {
        puts_[r.peer].erase(id);  // ended by the caller of start(); its acknowledgement never comes
        lib_->check(rc, "ncclSend", where() + " to rank " + std::to_string(r.peer));
      }
    }
  }

  // A peer's header.
  void handle(int peer, const Message& m) {
    const auto found = pairs_.find(peer);
    if (found == pairs_.end()) {
      note_error(where() + ": a header from rank " + std::to_string(peer) + ", which this rank does not reach through nccl");
      return;
    }
    Pair& pair = found->second;
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
        cudaStream_t s = pair.in_stream->get();
        if (m.bytes > 0) {
          // The data must be received wherever it goes, or every later transfer of the pair
          // would stall behind this one: refused data lands in scratch memory.
          // A strided put's packed rows land there too, then go to their places.
          const bool packed = refused || m.width > 0;
          void* into = dst;
          if (packed) ipc::check_cuda(cudaMallocAsync(&into, m.bytes, s), "cudaMallocAsync (packed or refused put)", from);
          lib_->check(lib_->recv(into, m.bytes, NcclLibrary::kInt8, 0, pair.in.get(), s), "ncclRecv", from);
          if (!refused && m.width > 0)
            ipc::check_cuda(cudaMemcpy2DAsync(dst, m.pitch, into, m.width, m.width, m.bytes / m.width,
                                              cudaMemcpyDeviceToDevice, s),
                            "cudaMemcpy2DAsync (unpacking a strided put)", from);
          if (packed) ipc::check_cuda(cudaFreeAsync(into, s), "cudaFreeAsync", from);
        }
        if (!refused && signal != nullptr)
          ipc::check_cuda(cuda::launch_copy(nullptr, nullptr, 0, signal, m.value,
                                            static_cast<SignalOp>((m.flags >> 8) & 0xff), s, false),
                          "signal kernel launch", from);
        if (refused) note_error(from + ": a put was refused: " + problem);
        Incoming in;
        in.is_put = true;
        in.id = m.id;
        in.refused = refused;
        in.done = events_.take(from);
        ipc::check_cuda(cudaEventRecord(in.done, s), "cudaEventRecord", from);
        incoming_[peer].push_back(in);
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
        if (m.bytes > 0)
          lib_->check(lib_->send(src, m.bytes, NcclLibrary::kInt8, 1, pair.out.get(), pair.out_stream->get()), "ncclSend",
                      from);
        return;
      }
      case MessageKind::GetData: {
        const auto it = gets_[peer].find(m.id);
        if (it == gets_[peer].end()) {
          note_error(from + ": data for get #" + std::to_string(m.id) + ", which is not in flight");
          return;
        }
        const NcclRequest r = it->second;
        gets_[peer].erase(it);
        cudaStream_t s = pair.in_stream->get();
        if (m.bytes > 0)
          lib_->check(lib_->recv(r.dst, m.bytes, NcclLibrary::kInt8, 0, pair.in.get(), s), "ncclRecv", from);
        Incoming in;
        in.is_put = false;
        in.word = r.word;
        in.ticket = r.ticket;
        in.done = events_.take(from);
        ipc::check_cuda(cudaEventRecord(in.done, s), "cudaEventRecord", from);
        incoming_[peer].push_back(in);
        return;
      }
      case MessageKind::Ack:
      case MessageKind::Refused: {
        if (m.flags & 1u) {  // the answer to a get
          const auto it = gets_[peer].find(m.id);
          if (it == gets_[peer].end()) break;
          const NcclRequest r = it->second;
          gets_[peer].erase(it);
          note_error(where() + ": a get of " + std::to_string(r.bytes) + " bytes from rank " + std::to_string(peer) +
                     " was refused there (see its log)");
          end(r.word, r.ticket);
          return;
        }
        const auto it = puts_[peer].find(m.id);
        if (it == puts_[peer].end()) break;
        const auto [w, ticket] = it->second;
        puts_[peer].erase(it);
        if (m.kind == MessageKind::Refused)
          note_error(where() + ": a put to rank " + std::to_string(peer) + " was refused there (see its log)");
        end(w, ticket);
        return;
      }
    }
    note_error(from + ": an unexpected header (kind " + std::to_string(static_cast<unsigned>(m.kind)) + ", id " +
               std::to_string(m.id) + ")");
  }

  // Work that ended on the in-streams, in order per peer.
  bool finish_incoming() {
    bool any = false;
    for (auto& [peer, list] : incoming_) {
      while (!list.empty()) {
        const cudaError_t rc = cudaEventQuery(list.front().done);
        if (rc == cudaErrorNotReady) break;
        Incoming in = list.front();
        list.pop_front();
        events_.give_back(in.done);
        any = true;
        if (rc != cudaSuccess)
          note_error(where() + ": a transfer with rank " + std::to_string(peer) + " failed on the GPU: " +
                     cudaGetErrorString(rc));
        if (in.is_put)
          send_header(peer, Message{in.refused || rc != cudaSuccess ? MessageKind::Refused : MessageKind::Ack, 0, in.id,
                                    0, 0, 0, 0, 0, 0});
        else
          end(in.word, in.ticket);
      }
    }
    return any;
  }

  void run() {
    tighten_timer_slack();
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
    std::list<NcclRequest> waiting;
    Backoff backoff(std::chrono::microseconds(200));
    for (;;) {
      bool busy = false;
      {
        std::lock_guard<std::mutex> lock(m_);
        if (stop_) break;
        while (!queue_.empty()) {
          waiting.push_back(queue_.front());
          queue_.pop_front();
        }
      }
      try {
        // Transfers whose source is ready, in the order they became so; only the oldest
        // waiting transfer of each stream is asked.
        StreamsBehind behind;
        for (auto it = waiting.begin(); it != waiting.end();) {
          if (it->ready && behind.contains(it->stream)) {
            ++it;
            continue;
          }
          const cudaError_t rc = it->ready ? cudaEventQuery(it->ready) : cudaSuccess;
          if (rc == cudaErrorNotReady) {
            behind.add(it->stream);
            ++it;
            continue;
          }
          const NcclRequest r = *it;
          it = waiting.erase(it);
          if (r.ready) events_.give_back(r.ready);
          busy = true;
          if (rc != cudaSuccess) {
            note_error(where() + ": the stream of a transfer to rank " + std::to_string(r.peer) + " failed: " +
                       cudaGetErrorString(rc));
            end(r.word, r.ticket);
            continue;
          }
          try {
            start(r);
          } catch (const Error& e) {
            note_error(e.what());
            end(r.word, r.ticket);
          }
        }
        for (;;) {
          int flag = 0;
          MPI_Status status;
          if (MPI_Test(&in_request, &flag, &status) != MPI_SUCCESS) throw Error(ErrorCode::Mpi, where() + ": MPI_Test failed");
          if (!flag) break;
          busy = true;
          const Message m = in_message;
          if (post() != MPI_SUCCESS) throw Error(ErrorCode::Mpi, where() + ": MPI_Irecv of headers failed");
          try {
            handle(status.MPI_SOURCE, m);
          } catch (const Error& e) {
            note_error(e.what());
          }
        }
        busy = finish_incoming() || busy;
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
    for (NcclRequest& r : waiting)
      if (r.ready) events_.give_back(r.ready);
  }

  const NcclLibrary* lib_;
  MpiComm control_;
  std::map<int, Pair> pairs_;
  int rank_;
  int device_;
  std::chrono::milliseconds timeout_;
  std::uint64_t* words_ = nullptr;

  // The proxy thread's own.
  std::map<int, std::uint64_t> next_id_;
  std::map<int, std::map<std::uint64_t, std::pair<std::size_t, std::uint64_t>>> puts_;  // id -> (word, ticket)
  std::map<int, std::map<std::uint64_t, NcclRequest>> gets_;
  std::map<int, std::deque<Incoming>> incoming_;
  std::list<Outgoing> outgoing_;

  std::mutex windows_m_;
  std::map<std::uint64_t, std::pair<char*, std::size_t>> windows_;

  EventPool events_;
  std::mutex m_;  // queue, counters, words, error, stop
  std::condition_variable cv_;
  std::deque<NcclRequest> queue_;
  std::vector<std::size_t> free_words_;
  struct GraphWord {
    unsigned in_flight = 0;  // its transfers submitted and not ended
    bool released = false;   // its graph is gone
  };
  std::map<std::size_t, GraphWord> graph_words_;  // held by captured transfers
  std::uint64_t submitted_ = 0;
  std::uint64_t ended_ = 0;
  std::string error_;
  bool stop_ = false;
  std::thread thread_;
};

namespace {

// A window as a landing place for peers' transfers; keeps the proxy (the window may be
// released after the Comm).
class NcclAttachment final : public WindowAttachment {
 public:
  NcclAttachment(std::shared_ptr<NcclProxy> p, std::uint64_t id) : proxy(std::move(p)), window(id) {}
  ~NcclAttachment() override {
    if (!proxy->remove_window(window))
      log(LogLevel::Error, "nccl transport: transfers into or out of window #" + std::to_string(window) +
                               " still running when it was freed (a peer that stopped?)");
  }
  std::shared_ptr<NcclProxy> proxy;
  std::uint64_t window;
};

}  // namespace

std::unique_ptr<Transport> make_nccl_transport(const CommContext& ctx) { return std::make_unique<NcclTransport>(ctx); }

// A captured transfer's done word and ticket word, given back to the proxy unless kept (then
// the graph's user object gives them back when the graph is gone).
struct GraphWords {
  explicit GraphWords(NcclProxy* p) : proxy(p) {}
  GraphWords(const GraphWords&) = delete;
  GraphWords& operator=(const GraphWords&) = delete;
  ~GraphWords() {
    if (proxy == nullptr) return;
    if (has_done) proxy->release_graph_word(done);
    if (has_ticket) proxy->release_graph_word(ticket);
  }
  bool take() {
    has_done = proxy->try_take_graph_word(&done);
    has_ticket = has_done && proxy->try_take_graph_word(&ticket);
    return has_ticket;
  }
  void kept() { proxy = nullptr; }
  NcclProxy* proxy;
  std::size_t done = 0, ticket = 0;
  bool has_done = false, has_ticket = false;
};

namespace {

// How a captured nccl transfer runs on every replay (CapturedHandoff): the request, with its
// done word and ticket word (graph words: a transfer still in flight when its graph is
// destroyed keeps its word until it ends), goes to the proxy.
struct NcclHandoff {
  using Owner = NcclProxy;
  struct Request {
    NcclRequest transfer;  // its done word set
    std::size_t ticket_word = 0;
  };
  static std::uint64_t submit(NcclProxy& proxy, const Request& r) { return proxy.submit(r.transfer); }
  static void release(NcclProxy& proxy, const Request& r) {
    proxy.release_graph_word(r.transfer.word);
    proxy.release_graph_word(r.ticket_word);
  }
};

}  // namespace

NcclTransport::NcclTransport(const CommContext& ctx)
    : ctx_(ctx),
      device_(static_cast<CudaDeviceRuntime*>(ctx.device)),
      board_(std::make_shared<HandoffBoard<NcclProxy>>()),
      finalize_keyval_(MPI_KEYVAL_INVALID) {
  const Topology& topo = ctx_.topo;
  no_route_.assign(static_cast<std::size_t>(topo.size), std::string());
  for (int r = 0; r < topo.size; ++r)
    if (topo.same_node(r)) no_route_[r] = "rank " + std::to_string(r) + " is on this node (ipc or staged reach it)";
  // Every rank decides the same way (node_count and device availability are agreed), so the
  // gathering below is collective or skipped everywhere.
  if (device_ == nullptr || topo.node_count == 1) return;
  std::string why;
  lib_ = NcclLibrary::get(kNcclLibrary.get(ctx.options), &why);
  // Nodes simulated on one machine are hosts of their own for NCCL too: NCCL tells hosts apart
  // by NCCL_HOSTID (else hostname and boot id) and refuses two ranks of one host on one GPU in
  // a communicator, so each process gets an id of its own. Ranks of different simulated nodes
  // that share a GPU then pair up as ranks of different real nodes do (over NCCL's network
  // transport). A user's own NCCL_HOSTID is kept; such pairs then have no route.
  bool simulated_here = false;
  for (int r = 0; r < topo.size; ++r)
    simulated_here = simulated_here || (!topo.same_node(r) && topo.host_of[r] == topo.host_of[topo.rank]);
  if (lib_ != nullptr && simulated_here && !user_set_host_id()) host_id_ = process_host_id();
  // Bit 0: NCCL loaded; bit 1: this process has an NCCL host id of its own.
  const std::int32_t mine = (lib_ != nullptr ? 1 : 0) | (host_id_.empty() ? 0 : 2);
  std::vector<std::int32_t> all(static_cast<std::size_t>(topo.size));
  ctx_.boot.allgather(&mine, all.data(), sizeof(mine), "meshmem::Comm (nccl transport)");
  const std::vector<std::string>& bus = device_->bus_ids();
  for (int r = 0; r < topo.size; ++r) {
    if (topo.same_node(r)) continue;
    if (lib_ == nullptr)
      no_route_[r] = "NCCL is not loaded here: " + why;
    else if ((all[r] & 1) == 0)
      no_route_[r] = "rank " + std::to_string(r) + " could not load NCCL (its log says why)";
    else if (topo.host_of[r] == topo.host_of[topo.rank] && bus[r] == bus[topo.rank] &&
             (host_id_.empty() || (all[r] & 2) == 0))
      no_route_[r] = "rank " + std::to_string(r) + " uses this rank's GPU " + bus[r] +
                     " (nodes simulated on one machine) and NCCL_HOSTID is set by the user, so NCCL sees one "
                     "host and puts one rank per GPU in a communicator";
  }
}

NcclTransport::~NcclTransport() {
  stop();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && finalize_keyval_ != MPI_KEYVAL_INVALID) {
    MPI_Comm_delete_attr(MPI_COMM_SELF, finalize_keyval_);
    MPI_Comm_free_keyval(&finalize_keyval_);
  }
}

void NcclTransport::stop() noexcept {
  if (!proxy_) return;
  board_->set(nullptr);
  // Transfers still in flight (a broken job): NCCL's destroy would wait for them.
  const bool idle = proxy_->drain();
  proxy_->stop(!idle);
}

void NcclTransport::settle() noexcept {
  if (proxy_ && !proxy_->drain())
    log(LogLevel::Error, "~Comm: nccl transfers of rank " + std::to_string(ctx_.topo.rank) +
                             " did not end within MESHMEM_TIMEOUT; the ranks part anyway");
}

Reach NcclTransport::reach(int rank, Memory memory) const {
  if (memory != Memory::Device) return Reach::no("device windows only");
  if (device_ == nullptr) return Reach::no("device windows are unavailable");
  if (!no_route_[rank].empty()) return Reach::no(no_route_[rank]);
  return Reach::yes();
}

std::string NcclTransport::what(const char* op, int target) const {
  return std::string(op) + " on rank " + std::to_string(ctx_.topo.rank) + " to rank " + std::to_string(target) +
         " (nccl transport)";
}

void NcclTransport::connect(const std::vector<bool>& routed) {
  const std::string what = "meshmem::Comm (nccl transport) on rank " + std::to_string(ctx_.topo.rank);
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  ctx_.boot.agree(provided >= MPI_THREAD_MULTIPLE, ErrorCode::Unsupported,
                  "the nccl transport turns requests into NCCL transfers in a proxy thread that talks MPI and "
                  "needs MPI_THREAD_MULTIPLE, but MPI was initialised with thread level " +
                      std::to_string(provided) + "; call MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...)",
                  "meshmem::Comm");
  MpiComm control = MpiComm::dup(ctx_.boot.comm(), what, ctx_.options.timeout);
  std::vector<int> peers;
  for (int r = 0; r < ctx_.topo.size; ++r)
    if (routed[r]) peers.push_back(r);
  // Ranks of other simulated nodes on this machine are reached as ranks of other real nodes
  // are: through NCCL's network transport, not its peer-to-peer or shared-memory ones (with
  // NCCL's P2P transport between two such communicators per pair the 2 x H200 runs hung at
  // the first transfers; not understood yet). Set before NCCL's first initialisation reads
  // them; a user's own values are kept.
  bool same_machine = false;
  for (int r : peers) same_machine = same_machine || ctx_.topo.host_of[r] == ctx_.topo.host_of[ctx_.topo.rank];
  if (same_machine) {
    for (const char* var : {"NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE"})
      if (std::getenv(var) == nullptr) setenv(var, "1", 0);
    log(LogLevel::Info, "nccl transport: peers on simulated nodes of this machine: NCCL_P2P_DISABLE and "
                        "NCCL_SHM_DISABLE set (unless given), so NCCL reaches them over its network transport");
  }
  if (!host_id_.empty()) set_host_id(host_id_);  // before this Comm's NCCL communicators are made
  if (!peers.empty()) (void)cuda::preload_kernels();  // see the lazy-loading note of transport_staged.hpp
  std::map<int, NcclProxy::Pair> pairs;
  DevicePtr scratch;
  agreed_step(ctx_.boot, "meshmem::Comm (nccl transport)", [&] {
    if (peers.empty()) return;  // some other ranks use nccl, this one does not
    // The sender of each direction makes its unique id and gives it to the receiver.
    std::vector<NcclUniqueId> out_ids(peers.size()), in_ids(peers.size());
    std::vector<MPI_Request> requests;
    for (std::size_t i = 0; i < peers.size(); ++i) {
      lib_->check(lib_->get_unique_id(&out_ids[i]), "ncclGetUniqueId", what);
      requests.emplace_back();
      check_mpi(MPI_Isend(&out_ids[i], sizeof(NcclUniqueId), MPI_BYTE, peers[i], kTagInit, control.get(), &requests.back()),
                "MPI_Isend (NCCL id)", what);
      requests.emplace_back();
      check_mpi(MPI_Irecv(&in_ids[i], sizeof(NcclUniqueId), MPI_BYTE, peers[i], kTagInit, control.get(), &requests.back()),
                "MPI_Irecv (NCCL id)", what);
    }
    for (MPI_Request& q : requests)
      if (!ctx_.boot.wait(&q, what + ": NCCL ids"))
        throw Error(ErrorCode::Timeout, what + ": a peer's NCCL id did not come within MESHMEM_TIMEOUT");
    ctx_.faults.hit(FaultPoint::NcclConnect);
    // Bounded by MESHMEM_TIMEOUT, where NCCL's own initialisation would wait for a late or
    // dead peer forever: each direction's communicator is first made nonblocking (NCCL makes
    // it in the background; aborted when the time is up) and connected (a byte each way,
    // grouped, so that no later ncclSend waits on the host for a peer's side of a
    // connection), then split into a blocking one that shares its resources and connections.
    // Transfers go through the blocking ones: on a nonblocking communicator every ncclSend
    // would start a thread of NCCL's (about 50 us here).
    const Deadline deadline(ctx_.options.timeout);
    std::vector<NcclCommHandle> handles(2 * peers.size(), nullptr);  // [2i]: to peers[i], [2i+1]: from it
    // The split's children: NCCL writes them when its split job ends, also after a failure
    // or an abort of their parents, so this outlives that abort.
    std::vector<NcclCommHandle> children(handles.size(), nullptr);
    std::vector<NcclComm> roots;
    roots.reserve(handles.size());
    // Until the pairs hold them, every communicator made here is aborted on the way out (a
    // destroy would wait for work of a peer that may never come): the roots first, which
    // ends their split job, then the children it made.
    struct AbortOnExit {
      const NcclLibrary* lib;
      std::vector<NcclComm>& roots;
      std::vector<NcclCommHandle>& children;
      bool kept = false;
      ~AbortOnExit() {
        if (kept) return;
        for (NcclComm& c : roots) c.reset(true);
        for (NcclCommHandle& h : children)
          if (h != nullptr) NcclComm(lib, std::exchange(h, nullptr)).reset(true);
      }
    } abort_on_exit{lib_, roots, children};
    // A call that fails inside a group still ends the group (NCCL keeps it per thread).
    int failed_rc = 0;
    const char* failed_call = nullptr;
    const auto note = [&](int rc, const char* call) {
      if (rc != 0 && rc != NcclLibrary::kInProgress && failed_call == nullptr) failed_rc = rc, failed_call = call;
    };
    const auto end_group = [&](const char* call) {
      const int rc = lib_->group_end();
      if (failed_call != nullptr) lib_->check(failed_rc, failed_call, what);
      if (rc != NcclLibrary::kInProgress) lib_->check(rc, call, what);
    };
    NcclConfig nonblocking = NcclConfig::make(false, true);
    lib_->check(lib_->group_start(), "ncclGroupStart", what);
    for (std::size_t i = 0; i < peers.size(); ++i) {
      const int a = lib_->comm_init_rank_config(&handles[2 * i], 2, out_ids[i], 0, &nonblocking);
      const int b = lib_->comm_init_rank_config(&handles[2 * i + 1], 2, in_ids[i], 1, &nonblocking);
      for (NcclCommHandle h : {handles[2 * i], handles[2 * i + 1]})
        if (h != nullptr) roots.emplace_back(lib_, h);
      note(a, "ncclCommInitRankConfig (to the peer)");
      note(b, "ncclCommInitRankConfig (from the peer)");
    }
    end_group("ncclGroupEnd (communicator initialisation)");
    wait_for_nccl(*lib_, handles, peers, deadline, "initialisation", what);
    void* bytes = nullptr;
    ipc::check_cuda(cudaMalloc(&bytes, 2 * std::max<std::size_t>(1, peers.size())), "cudaMalloc", what);
    scratch.reset(bytes);
    for (int peer : peers) {
      NcclProxy::Pair& p = pairs[peer];
      p.out_stream = std::make_unique<OwnedStream>(what);
      p.in_stream = std::make_unique<OwnedStream>(what);
    }
    lib_->check(lib_->group_start(), "ncclGroupStart", what);
    for (std::size_t i = 0; i < peers.size(); ++i) {
      NcclProxy::Pair& p = pairs[peers[i]];
      note(lib_->send(static_cast<char*>(bytes) + 2 * i, 1, NcclLibrary::kInt8, 1, handles[2 * i], p.out_stream->get()),
           "ncclSend (connection)");
      note(lib_->recv(static_cast<char*>(bytes) + 2 * i + 1, 1, NcclLibrary::kInt8, 0, handles[2 * i + 1],
                      p.in_stream->get()),
           "ncclRecv (connection)");
    }
    end_group("ncclGroupEnd (connections)");
    wait_for_nccl(*lib_, handles, peers, deadline, "connection", what);
    for (std::size_t i = 0; i < peers.size(); ++i) {
      NcclProxy::Pair& p = pairs[peers[i]];
      for (cudaStream_t st : {p.out_stream->get(), p.in_stream->get()}) {
        Backoff backoff;
        cudaError_t q;
        while ((q = cudaStreamQuery(st)) == cudaErrorNotReady && !deadline.expired()) backoff.pause();
        if (q == cudaErrorNotReady)
          throw Error(ErrorCode::Timeout, what + ": NCCL's first transfer with rank " + std::to_string(peers[i]) +
                                              " did not end within " + describe_timeout(deadline.timeout()) +
                                              "; its communicators are aborted");
        ipc::check_cuda(q, "cudaStreamQuery (connection)", what);
      }
    }
    NcclConfig blocking = NcclConfig::make(true, false);
    lib_->check(lib_->group_start(), "ncclGroupStart", what);
    for (std::size_t i = 0; i < handles.size(); ++i)
      note(lib_->comm_split(handles[i], 0, static_cast<int>(i % 2), &children[i], &blocking), "ncclCommSplit");
    end_group("ncclGroupEnd (split)");
    wait_for_nccl(*lib_, handles, peers, deadline, "split into blocking communicators", what);
    for (std::size_t i = 0; i < handles.size(); ++i)
      if (children[i] == nullptr)
        throw Error(ErrorCode::Internal, what + ": ncclCommSplit ended without a communicator (with rank " +
                                             std::to_string(peers[i / 2]) + ")");
    for (std::size_t i = 0; i < peers.size(); ++i) {
      NcclProxy::Pair& p = pairs[peers[i]];
      p.out = NcclComm(lib_, children[2 * i]);
      p.in = NcclComm(lib_, children[2 * i + 1]);
      p.out_root = std::move(roots[2 * i]);
      p.in_root = std::move(roots[2 * i + 1]);
    }
    abort_on_exit.kept = true;  // the pairs own every communicator now
    proxy_ = std::make_shared<NcclProxy>(lib_, std::move(control), std::move(pairs), ctx_.topo.rank, device_->device(),
                                         ctx_.options.timeout);
    board_->set(proxy_.get());
  });
  check_mpi(MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, stop_on_finalize, &finalize_keyval_, nullptr),
            "MPI_Comm_create_keyval", what);
  check_mpi(MPI_Comm_set_attr(MPI_COMM_SELF, finalize_keyval_, this), "MPI_Comm_set_attr", what);
  if (proxy_)
    log(LogLevel::Info, "nccl transport: NCCL " + lib_->version_text() + " (" + lib_->path + "), " +
                          std::to_string(peers.size()) + " peers, two communicators each");
}

std::unique_ptr<WindowAttachment> NcclTransport::attach(WindowState& win, const std::vector<bool>&, const std::string&) {
  if (!proxy_) return nullptr;
  proxy_->add_window(win.id, win.local, win.bytes);
  return std::make_unique<NcclAttachment>(proxy_, win.id);
}

void NcclTransport::put(const WindowState& win, int target, std::size_t offset, const void* src, std::size_t bytes,
                        const SignalUpdate& signal, Stream stream) {
  NcclRequest r;
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

void NcclTransport::put_strided(const WindowState& win, int target, std::size_t dst_offset, std::size_t dst_pitch,
                                const void* src, std::size_t src_pitch, std::size_t width, std::size_t height,
                                Stream stream) {
  if (width == 0 || height == 0) return;
  if (height == 1 || (src_pitch == width && dst_pitch == width)) {
    put(win, target, dst_offset, src, width * height, SignalUpdate{}, stream);
    return;
  }
  NcclRequest r;
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

void NcclTransport::get(void* dst, const WindowState& win, int target, std::size_t offset, std::size_t bytes,
                        Stream stream) {
  NcclRequest r;
  r.is_get = true;
  r.peer = target;
  r.dst = dst;
  r.bytes = bytes;
  r.window = win.id;
  r.offset = offset;
  transfer(r, stream, "comm.get");
}

namespace {
// Whether `p` is plain (pageable) host memory, which NCCL cannot read or write.
bool pageable(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  return a.type == cudaMemoryTypeUnregistered;
}
}  // namespace

void NcclTransport::transfer(NcclRequest r, Stream stream, const char* name) {
  if (!proxy_) throw Error(ErrorCode::Internal, what(name, r.peer) + ": the transport is not connected");
  const std::string error = proxy_->take_error();
  if (!error.empty()) throw Error(ErrorCode::Cuda, what(name, r.peer) + ": an earlier transfer failed: " + error);
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
  // Under capture the graph's two words are taken before anything is captured, so that a
  // shortage leaves the capture untouched.
  GraphWords words(capturing ? proxy_.get() : nullptr);
  if (capturing && !words.take())
    throw Error(ErrorCode::Unsupported, what(name, r.peer) + ": all " + std::to_string(kDoneWords) +
                                            " done words of this rank are held by nccl transfers in flight or captured "
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
    ipc::check_cuda(rc, "cudaEventRecord", what(name, r.peer));
  }
  const std::uint64_t* done = proxy_->word(r.word);
  const std::uint64_t ticket = proxy_->submit(r);
  const cudaError_t k = cuda::launch_ticket_wait(done, ticket, nullptr, cuda::FaultKind::Transfer, r.peer,
                                                 device_->wait_limit(), s, device_->early_launch());
  if (k != cudaSuccess) ipc::check_cuda(k, "transfer wait kernel launch", what(name, r.peer));
  if (bounce == nullptr) return;
  if (user_dst != nullptr)
    ipc::check_cuda(cudaMemcpyAsync(user_dst, bounce, r.bytes, cudaMemcpyDeviceToHost, s),
                    "cudaMemcpyAsync (pageable destination)", what(name, r.peer));
  ipc::check_cuda(cudaFreeAsync(bounce, s), "cudaFreeAsync", what(name, r.peer));
}

// Under capture the graph gets a host node that hands the request to the proxy on every
// replay (it runs once the caller's earlier work is done, so no ready event is needed), then
// the wait kernel for the ticket that node got (CapturedHandoff).
void NcclTransport::capture_transfer(NcclRequest r, cudaGraph_t graph, cudaStream_t stream, const char* name,
                                     GraphWords& words) {
  NcclHandoff::Request captured;
  captured.transfer = r;
  captured.transfer.word = words.done;
  captured.transfer.ready = nullptr;
  captured.transfer.stream = nullptr;
  captured.ticket_word = words.ticket;
  words.kept();  // CapturedHandoff gives them back from here on
  TicketWait wait;
  wait.done = proxy_->word(captured.transfer.word);
  wait.ticket_at = proxy_->word(captured.ticket_word);
  wait.fault = cuda::FaultKind::Transfer;
  wait.peer = r.peer;
  wait.limit = device_->wait_limit();
  wait.early = device_->early_launch();
  CapturedHandoff<NcclHandoff>::capture(board_, std::move(captured), wait, graph, stream, what(name, r.peer));
}

std::string NcclTransport::describe() const {
  if (!lib_) return "";
  const std::string host = host_id_.empty() ? "" : ", NCCL_HOSTID " + host_id_;
  return "NCCL " + lib_->version_text() + " (" + lib_->path + ")" + host + (proxy_ ? "" : ", not connected");
}

}  // namespace meshmem::detail
