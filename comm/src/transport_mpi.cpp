#include "transport_mpi.hpp"

#include <algorithm>
#include <climits>
#include <cstring>

#include "backoff.hpp"
#include "fault.hpp"
#include "helper_cpus.hpp"
#include "knobs.hpp"
#include "log.hpp"
#include "meshmem/error.hpp"
#include "topology.hpp"

namespace meshmem::detail {

namespace {

constexpr int kTagRequest = 1;  // a Request header (with a small put's bytes after it), on requests_
constexpr int kTagRevoke = 2;   // an int: the tag of a put whose origin gave up, on requests_
// Put payloads (on requests_), get data and flush answers (on replies_) carry the tag their
// header names, unique per call from here up to MPI_TAG_UB (wrapping after about 10^9 calls).
constexpr int kFirstCallTag = 16;
constexpr std::chrono::milliseconds kCancelGrace{200};  // for a cancelled request to end

// MPI counts are ints: large transfers go as several messages of at most this many bytes.
constexpr std::size_t kMaxMessage = std::size_t{1} << 30;
// A put of up to this many bytes travels in its request message, after the header: one
// message instead of two, and the target applies it without a second receive. Within Open
// MPI's smallest eager limit (4 KiB, shared memory) with the header.
constexpr std::size_t kInlinePut = 1024;

enum class RequestType : std::uint32_t { Put = 1, Get = 2, Flush = 3 };

int chunk_count(std::size_t bytes) {
  return static_cast<int>((bytes + kMaxMessage - 1) / kMaxMessage);
}
int chunk_bytes(std::size_t bytes, int chunk) {
  return static_cast<int>(std::min(kMaxMessage, bytes - static_cast<std::size_t>(chunk) * kMaxMessage));
}

std::chrono::microseconds parse_idle_sleep(const char* name, const std::string& raw) {
  return parse_micros(name, raw, std::chrono::milliseconds(100));
}
// Measured with bench/host_bench (host_get_idle, host_idle_cpu) on the 2-core VM, where a
// thread's wake-up costs about 25 us of CPU time: each halving of the sleep doubles the CPU time
// of an idle rank. bench/results/2026-11-23-ci-2core-idle-sweep-71bc903.txt and the sweep in 71bc903's
// message: a median of 15 waits spread over [0, sleep] differs by tens of percent between runs.
const TuningKnob<std::chrono::microseconds> kIdleSleep{
    Tier::Tuning, "mpi", "MESHMEM_MPI_IDLE_SLEEP", Backoff::kLongest, parse_idle_sleep, print_micros,
    "mpi transport: the longest sleep of an idle rank between two polls for peers' requests (`250us`, `2ms`; `0`: "
    "never sleeps)",
    "The longest sleep between two polls for peers' requests, of the progress thread and of a host "
    "wait that serves them meanwhile (`wait_until`, a get's or quiet's wait), reached once nothing came for 200 ms "
    "(sleeps of 20, 100 and 300 us before); a request to such a rank waits for its next poll. Shorter answers the "
    "first request after an idle spell sooner and costs more CPU time while idle; measured on a 2-core VM, two runs "
    "(8-byte get after 1 s idle, median; CPU time of an idle rank, of one core): `1ms` 0.5-0.6 ms, 2.5-3 %; `500us` "
    "0.17-0.37 ms, 4.3-5.2 %; `250us` 0.12-0.20 ms, 6.6-9.1 %; `100us` 0.1 ms, 18-20 % (busy: 1 us; MPI's own "
    "request/reply after the same idle time, its target polling in MPI_Recv: 0.03 ms). `0`: never sleeps, yields "
    "(0.03 ms; a core per rank, for ranks with a core to spare); at most `100ms`"};

int stop_on_finalize(MPI_Comm, int, void* transport, void*) {
  static_cast<MpiTransport*>(transport)->stop();
  return MPI_SUCCESS;
}

}  // namespace

struct MpiTransport::Request {
  RequestType type;
  std::uint32_t signal_op;  // SignalOp, when has_signal
  std::uint32_t has_signal;
  std::int32_t tag;  // of the payload (put) or the answer (get, flush)
  std::uint64_t window;
  std::uint64_t offset;
  std::uint64_t bytes;
  std::uint64_t signal_window;
  std::uint64_t signal_index;
  std::uint64_t signal_value;

  // A put of up to kInlinePut bytes carries them in its own message, after this header.
  bool carries_bytes() const { return type == RequestType::Put && bytes <= kInlinePut; }
};

// A request's data in flight with its origin: a put's data received straight into the window
// (or drained where it matches none), a get's answer, a flush's answer.
struct MpiTransport::Transfer {
  explicit Transfer(const Request& r, std::chrono::milliseconds timeout) : req(r), deadline(timeout) {}
  Request req;
  const char* call = "";  // what its requests are, for messages
  std::vector<MPI_Request> reqs;
  std::shared_ptr<void> keep;  // memory its requests use besides a window (a sink, zeros)
  std::size_t done = 0;        // requests complete
  Deadline deadline;           // restarted whenever one completes
};

std::unique_ptr<Transport> make_mpi_transport(const CommContext& ctx) { return std::make_unique<MpiTransport>(ctx); }

MpiTransport::MpiTransport(const CommContext& ctx)
    : ctx_(ctx), timeout_(ctx.options.timeout), idle_sleep_(kIdleSleep.get(ctx.options)), given_up_(ctx.topo.rank) {}

namespace {
// Whether [a, a + bytes) and [b, b + bytes) share a byte.
bool overlaps(const void* a, const void* b, std::size_t bytes) {
  const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return bytes > 0 && x < y + bytes && y < x + bytes;
}
}  // namespace

Reach MpiTransport::reach(int, Memory memory) const {
  if (memory != Memory::Host) return Reach::no("host windows only (device windows of other nodes: nccl, mpi-device)");
  return Reach::yes();
}

void MpiTransport::connect(const std::vector<bool>&) {
  const char* what = "meshmem::Comm (mpi transport)";
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  ctx_.boot.agree(provided >= MPI_THREAD_MULTIPLE, ErrorCode::Unsupported,
                  "the mpi transport serves one-sided requests from a progress thread and needs "
                  "MPI_THREAD_MULTIPLE, but MPI was initialised with thread level " +
                      std::to_string(provided) + "; call MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...)",
                  "meshmem::Comm");
  // Bounded like every wait of the construction: a rank that comes after its partners gave up
  // raises Timeout instead of waiting for them for ever.
  requests_ = MpiComm::dup(ctx_.boot.comm(), what, timeout_);
  replies_ = MpiComm::dup(ctx_.boot.comm(), what, timeout_);
  int size = 0;
  check_mpi(MPI_Comm_rank(requests_.get(), &rank_), "MPI_Comm_rank", what);
  check_mpi(MPI_Comm_size(requests_.get(), &size), "MPI_Comm_size", what);
  unflushed_.assign(static_cast<std::size_t>(size), 0);
  failed_.assign(static_cast<std::size_t>(size), std::string());
  in_flight_.resize(static_cast<std::size_t>(size));
  queued_.resize(static_cast<std::size_t>(size));
  void* ub = nullptr;
  int has_ub = 0;
  check_mpi(MPI_Comm_get_attr(requests_.get(), MPI_TAG_UB, &ub, &has_ub), "MPI_Comm_get_attr(MPI_TAG_UB)", what);
  if (has_ub && ub != nullptr) tag_limit_ = std::min(*static_cast<int*>(ub), 1 << 30);
  check_mpi(MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, stop_on_finalize, &finalize_keyval_, nullptr),
            "MPI_Comm_create_keyval", what);
  check_mpi(MPI_Comm_set_attr(MPI_COMM_SELF, finalize_keyval_, this), "MPI_Comm_set_attr", what);
  progress_ = std::thread([this] { serve(); });
  place_helper_thread(progress_, "MPI progress");  // off a caller bound to one core (helper_cpus.hpp)
}

namespace {
class MpiRegistration final : public WindowAttachment {
 public:
  MpiRegistration(MpiTransport& t, std::uint64_t id) : t_(t), id_(id) {}
  ~MpiRegistration() override {
    if (!released_) t_.unregister_window(id_, nullptr);
  }
  void releasing(const std::shared_ptr<WindowMemory>& memory) override {
    released_ = true;
    t_.unregister_window(id_, memory);
  }

 private:
  MpiTransport& t_;
  std::uint64_t id_;
  bool released_ = false;
};
}  // namespace

std::unique_ptr<WindowAttachment> MpiTransport::attach(WindowState& win, const std::vector<bool>&, const std::string&) {
  register_window(win);
  return std::make_unique<MpiRegistration>(*this, win.id);
}

MpiTransport::~MpiTransport() {
  stop();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) {
    for (int o : busy_)
      if (in_flight_[o]) give_up(o, "a transfer with rank " + std::to_string(o) + " was still under way at teardown", false);
    given_up_.sweep();
  }
  // Requests MPI may still complete keep their memory for the life of the process (~GivenUpRequests).
  if (!finalized && finalize_keyval_ != MPI_KEYVAL_INVALID) {
    MPI_Comm_delete_attr(MPI_COMM_SELF, finalize_keyval_);
    MPI_Comm_free_keyval(&finalize_keyval_);
  }
}

void MpiTransport::stop() noexcept {
  stop_ = true;
  if (progress_.joinable()) progress_.join();
}

void MpiTransport::register_window(const WindowState& win) {
  std::lock_guard<std::mutex> lock(regions_mutex_);
  regions_[win.id] = Region{static_cast<char*>(win.local), win.bytes};
}

void MpiTransport::unregister_window(std::uint64_t id, const std::shared_ptr<WindowMemory>& memory) {
  {
    std::lock_guard<std::mutex> lock(regions_mutex_);
    regions_.erase(id);
  }
  // After MPI_Finalize (a window alive at the end of main) no MPI call may be made, and MPI
  // touches no buffer any more: nothing to give up.
  int finalized = 0;
  if (MPI_Finalized(&finalized) != MPI_SUCCESS || finalized) return;
  // A put still coming into the window, or a get's answer still going out of it (an origin
  // stalled or dead mid-transfer), is given up before its memory goes.
  // A get's answer whose data has reached its origin may not have been seen complete here
  // yet: it is given a moment first. Neither case fails the peer (its later calls go on).
  std::lock_guard<std::mutex> serving(serving_);
  for (int o : busy_) {
    if (!in_flight_[o] || in_flight_[o]->req.type == RequestType::Flush || in_flight_[o]->req.window != id) continue;
    Deadline grace(kCancelGrace);
    Backoff backoff;
    while (!settle(o) && !grace.expired()) backoff.pause();
    if (in_flight_[o])
      give_up(o,
              std::string(in_flight_[o]->req.type == RequestType::Put ? "a put from" : "a get's answer to") + " rank " +
                  std::to_string(o) + " was still under way when window #" + std::to_string(id) + " was freed",
              false);
  }
  // Requests given up on now or earlier that MPI may still complete keep the window's memory
  // until they end (sweep): a late write must not land in memory given back or reused.
  if (!memory) return;
  const std::size_t held = given_up_.hold_window(id, memory);
  if (held > 0)
    log(LogLevel::Warn, "mpi transport on rank " + std::to_string(rank_) + ": window #" + std::to_string(id) +
                            " is freed while " + std::to_string(held) +
                            " MPI request(s) given up on may still use it; its memory is kept until they end");
}

void MpiTransport::wait(MPI_Request* req, const char* call, int peer, const std::string& what, bool serve) {
  Deadline deadline(timeout_);
  Backoff backoff(idle_sleep_);
  ServingWait serving(serve ? this : nullptr);
  for (;;) {
    int done = 0;
    check_mpi(MPI_Test(req, &done, MPI_STATUS_IGNORE), call, what);
    if (done) return;
    if (serve && serve_one()) {
      backoff.reset();
      continue;
    }
    if (deadline.expired()) {
      const std::string msg = what + ": " + call + " with rank " + std::to_string(peer) +
                              " did not complete within " + describe_timeout(timeout_) +
                              " (is rank " + std::to_string(peer) + " alive?)";
      log(LogLevel::Error, msg);
      {
        std::lock_guard<std::mutex> lock(failed_mutex_);
        if (failed_[static_cast<std::size_t>(peer)].empty()) failed_[static_cast<std::size_t>(peer)] = msg;
      }
      throw Error(ErrorCode::Timeout, msg);
    }
    backoff.pause();
  }
}

namespace {
// The error of a call that gave up, with what it means for the caller's memory.
[[noreturn]] void rethrow_with(const Error& e, const std::string& memory) {
  throw Error(e.code(), std::string(e.message()) + "; " + memory);
}
}  // namespace

void MpiTransport::put(const WindowState& win, int target, std::size_t offset, const void* src,
                       std::size_t bytes, const SignalUpdate& signal, Stream) {
  const std::string what = "mpi transport put to rank " + std::to_string(target) + " on rank " +
                           std::to_string(rank_);
  check_peer(target, what);
  auto header = std::make_shared<Request>();
  Request& req = *header;
  req.type = RequestType::Put;
  req.window = win.id;
  req.offset = offset;
  req.bytes = bytes;
  req.tag = next_tag();
  if (signal.sig != nullptr) {
    req.has_signal = 1;
    req.signal_op = static_cast<std::uint32_t>(signal.op);
    req.signal_window = signal.sig->id;
    req.signal_index = signal.index;
    req.signal_value = signal.value;
  }
  if (req.carries_bytes()) {
    put_inline(req, target, src, what);
    return;
  }
  // A put to this rank's own window from a source that overlaps the destination: MPI's send
  // and receive buffers must not overlap, so the bytes go from a copy.
  std::shared_ptr<std::vector<char>> copy;
  if (target == rank_ && overlaps(src, static_cast<const char*>(win.local) + offset, bytes)) {
    copy = std::make_shared<std::vector<char>>(static_cast<const char*>(src), static_cast<const char*>(src) + bytes);
    src = copy->data();
  }
  std::vector<MPI_Request> r(1, MPI_REQUEST_NULL);
  try {
    check_mpi(MPI_Isend(header.get(), sizeof(req), MPI_BYTE, target, kTagRequest, requests_.get(), &r[0]),
              "MPI_Isend", what);
    wait(&r[0], "MPI_Isend", target, what);
  } catch (const Error& e) {
    abandon(r, header);
    rethrow_with(e, "nothing of this put was applied");
  }
  ctx_.faults.hit(FaultPoint::MpiPutAfterHeader);
  // MPI keeps messages between one pair on one communicator in order, so the payload
  // follows its header; the target's progress thread receives it straight into the window.
  for (int c = 0; c < chunk_count(bytes); ++c) {
    const char* from = static_cast<const char*>(src) + static_cast<std::size_t>(c) * kMaxMessage;
    try {
      check_mpi(MPI_Isend(from, chunk_bytes(bytes, c), MPI_BYTE, target, req.tag, requests_.get(), &r[0]),
                "MPI_Isend", what);
      wait(&r[0], "MPI_Isend", target, what);
    } catch (const Error& e) {
      int sent = 0;
      const int kept = abandon(r, copy, &sent);
      // The target drops a put its origin revoked if it sees the revocation before it posts
      // the receive of the data (it was stopped meanwhile: the usual case). Data that has left,
      // or that MPI could not take back, may still reach a receive the target had posted.
      revoke(target, req.tag);
      rethrow_with(e, kept > 0 ? "MPI could not cancel the send: the source may still be read (do not reuse it), and "
                                 "the target may still apply this put with what it reads"
                      : sent > 0 ? "its data left meanwhile: the target may still apply this put; the source is no "
                                   "longer read"
                                 : "the rest of its data was not sent: the target drops this put (bytes it received "
                                   "before may be written); the source is no longer read");
    }
  }
  unflushed_[target] = 1;
}

// Tells `target` that the put with payload tag `tag` is given up: its progress thread drops the
// put if the revocation is there when it serves the put's request (take_revocations).
void MpiTransport::revoke(int target, int tag) {
  auto revoked = std::make_shared<std::int32_t>(tag);
  MPI_Request r = MPI_REQUEST_NULL;
  if (MPI_Isend(revoked.get(), 1, MPI_INT32_T, target, kTagRevoke, requests_.get(), &r) == MPI_SUCCESS)
    given_up_.keep_until_done(r, revoked);
}

// A small put: header and bytes in one message (a copy, so the source is free at once and
// may overlap the destination).
void MpiTransport::put_inline(const Request& req, int target, const void* src, const std::string& what) {
  auto message = std::make_shared<std::vector<char>>(sizeof(Request) + req.bytes);
  std::memcpy(message->data(), &req, sizeof(req));
  if (req.bytes > 0) std::memcpy(message->data() + sizeof(Request), src, req.bytes);
  std::vector<MPI_Request> r(1, MPI_REQUEST_NULL);
  try {
    check_mpi(MPI_Isend(message->data(), static_cast<int>(message->size()), MPI_BYTE, target, kTagRequest,
                        requests_.get(), &r[0]),
              "MPI_Isend", what);
    wait(&r[0], "MPI_Isend", target, what);
  } catch (const Error& e) {
    int sent = 0;
    const int kept = abandon(r, message, &sent);
    if (kept == 0 && sent == 0) rethrow_with(e, "nothing of this put was applied; the source is no longer read");
    // The target drops it if it sees the revocation before the request.
    revoke(target, req.tag);
    rethrow_with(e, "its request, with its bytes, was not taken back: the target may still apply this put; the "
                    "source is no longer read");
  }
  unflushed_[target] = 1;
}

void MpiTransport::get(void* dst, const WindowState& win, int target, std::size_t offset,
                       std::size_t bytes, Stream) {
  const std::string what = "mpi transport get from rank " + std::to_string(target) + " on rank " +
                           std::to_string(rank_);
  check_peer(target, what);
  const int chunks = chunk_count(bytes);
  std::vector<MPI_Request> recvs(static_cast<std::size_t>(chunks), MPI_REQUEST_NULL);
  // A get from this rank's own window into a buffer that overlaps it: received into a copy
  // (MPI's buffers must not overlap), moved into dst at the end.
  std::shared_ptr<std::vector<char>> copy;
  void* const caller_dst = dst;
  if (target == rank_ && overlaps(dst, static_cast<const char*>(win.local) + offset, bytes)) {
    copy = std::make_shared<std::vector<char>>(bytes);
    dst = copy->data();
  }
  auto header = std::make_shared<Request>();
  Request& req = *header;
  req.type = RequestType::Get;
  req.window = win.id;
  req.offset = offset;
  req.bytes = bytes;
  req.tag = next_tag();
  std::vector<MPI_Request> send(1, MPI_REQUEST_NULL);
  try {
    // Receives are posted before the request goes out, so the data lands straight in dst.
    for (int c = 0; c < chunks; ++c) {
      char* to = static_cast<char*>(dst) + static_cast<std::size_t>(c) * kMaxMessage;
      check_mpi(MPI_Irecv(to, chunk_bytes(bytes, c), MPI_BYTE, target, req.tag, replies_.get(), &recvs[c]),
                "MPI_Irecv", what);
    }
    check_mpi(MPI_Isend(header.get(), sizeof(req), MPI_BYTE, target, kTagRequest, requests_.get(), &send[0]),
              "MPI_Isend", what);
    wait(&send[0], "MPI_Isend", target, what);
    for (auto& recv : recvs) wait(&recv, "MPI_Irecv", target, what, true);
  } catch (const Error& e) {
    abandon(send, header);
    const int kept = abandon(recvs, copy);
    given_up_.drop_later(replies_.get(), target, req.tag);
    rethrow_with(e, kept == 0 ? "nothing will be written into the destination after this error"
                              : std::to_string(kept) + " receive(s) into the destination could not be cancelled: "
                                "MPI may still write those bytes of it");
  }
  if (copy) std::memcpy(caller_dst, copy->data(), bytes);
}

void MpiTransport::quiet(Stream) {
  // A flush is served after every earlier request of this origin (MPI ordering), so its
  // answer means they are all applied.
  std::vector<int> targets;
  for (std::size_t t = 0; t < unflushed_.size(); ++t)
    if (unflushed_[t]) targets.push_back(static_cast<int>(t));
  if (targets.empty()) return;  // the usual case on one node: nothing allocated, nothing built
  const std::string what = "mpi transport quiet on rank " + std::to_string(rank_);
  for (int t : targets) check_peer(t, what);
  // Answers and headers live as long as their requests may (a call that gives up keeps them).
  struct Flush {
    std::vector<std::uint64_t> answers;
    std::vector<Request> headers;
  };
  auto flush = std::make_shared<Flush>();
  flush->answers.resize(targets.size());
  flush->headers.resize(targets.size());
  std::vector<MPI_Request> acks(targets.size(), MPI_REQUEST_NULL);
  std::vector<MPI_Request> sends(targets.size(), MPI_REQUEST_NULL);
  std::size_t i = 0;
  try {
    for (i = 0; i < targets.size(); ++i) {
      Request& req = flush->headers[i];
      req.type = RequestType::Flush;
      req.tag = next_tag();
      check_mpi(MPI_Irecv(&flush->answers[i], 1, MPI_UINT64_T, targets[i], req.tag, replies_.get(), &acks[i]),
                "MPI_Irecv", what);
      check_mpi(MPI_Isend(&req, sizeof(req), MPI_BYTE, targets[i], kTagRequest, requests_.get(), &sends[i]),
                "MPI_Isend", what);
    }
    for (i = 0; i < targets.size(); ++i) {
      wait(&sends[i], "MPI_Isend (flush)", targets[i], what);
      wait(&acks[i], "MPI_Irecv (flush answer)", targets[i], what, true);
      unflushed_[targets[i]] = 0;
    }
  } catch (const Error&) {
    abandon(sends, flush);
    abandon(acks, flush);
    for (std::size_t k = 0; k < targets.size(); ++k) given_up_.drop_later(replies_.get(), targets[k], flush->headers[k].tag);
    throw;
  }
}

int MpiTransport::next_tag() {
  const auto span = static_cast<std::uint64_t>(tag_limit_ - kFirstCallTag + 1);
  return kFirstCallTag + static_cast<int>(next_tag_.fetch_add(1, std::memory_order_relaxed) % span);
}

void MpiTransport::check_peer(int peer, const std::string& what) const {
  std::lock_guard<std::mutex> lock(failed_mutex_);
  const std::string& first = failed_[static_cast<std::size_t>(peer)];
  if (!first.empty())
    throw Error(ErrorCode::Timeout, what + ": an earlier call with rank " + std::to_string(peer) +
                                        " timed out, so this Comm no longer waits for it (first error: " + first + ")");
}

int MpiTransport::abandon(std::vector<MPI_Request>& reqs, const std::shared_ptr<void>& keep, int* completed) {
  int kept = 0;
  for (MPI_Request& r : reqs) {
    if (r == MPI_REQUEST_NULL) continue;
    (void)MPI_Cancel(&r);
    // A cancelled request ends locally (cancelled, or complete if it had been matched and its
    // data was here): give it a moment, then keep it.
    Deadline grace(kCancelGrace);
    Backoff backoff;
    int done = 0;
    MPI_Status status;
    while (MPI_Test(&r, &done, &status) == MPI_SUCCESS && !done && !grace.expired()) backoff.pause();
    if (done) {
      int cancelled = 0;
      if (completed != nullptr && MPI_Test_cancelled(&status, &cancelled) == MPI_SUCCESS && !cancelled) ++*completed;
      continue;
    }
    given_up_.keep_until_done(r, keep);
    r = MPI_REQUEST_NULL;
    ++kept;
  }
  return kept;
}

MpiTransport::Region MpiTransport::find(std::uint64_t id, std::size_t offset, std::size_t bytes,
                                        int source) const {
  std::lock_guard<std::mutex> lock(regions_mutex_);
  auto it = regions_.find(id);
  // The origin checked the bounds already; a miss here means the ranks disagree on the
  // windows (a collective call out of order), which is logged and the data dropped.
  if (it == regions_.end() || offset > it->second.bytes || bytes > it->second.bytes - offset) {
    log(LogLevel::Error, "progress thread: request from rank " + std::to_string(source) +
                             " for window #" + std::to_string(id) + " [" + std::to_string(offset) +
                             ", +" + std::to_string(bytes) + ") matches no window here; dropped");
    return Region{nullptr, 0};
  }
  return Region{it->second.base + offset, bytes};
}

// Revocations of puts whose origin gave up, received so far (the progress thread).
void MpiTransport::take_revocations() {
  for (;;) {
    int found = 0;
    MPI_Message message = MPI_MESSAGE_NULL;
    MPI_Status status;
    if (MPI_Improbe(MPI_ANY_SOURCE, kTagRevoke, requests_.get(), &found, &message, &status) != MPI_SUCCESS || !found)
      return;
    std::int32_t tag = 0;
    if (MPI_Mrecv(&tag, 1, MPI_INT32_T, &message, MPI_STATUS_IGNORE) == MPI_SUCCESS)
      revoked_.insert({status.MPI_SOURCE, tag});
  }
}

void MpiTransport::apply_signal_of(const Request& req, int source) {
  if (!req.has_signal) return;
  const Region word = find(req.signal_window, req.signal_index * sizeof(std::uint64_t), sizeof(std::uint64_t), source);
  if (word.base != nullptr)
    apply_signal(reinterpret_cast<std::uint64_t*>(word.base), req.signal_value, static_cast<SignalOp>(req.signal_op));
}

// Serves one request. Its payload or answer goes with the tag the header names, as a transfer
// that later passes test (an origin stopped or dead in the middle of a put must not hold this
// thread: the put is dropped after the timeout, and anything it still sends with that tag too).
void MpiTransport::handle(const Request& req, const char* payload, int source) {
  const std::string what = "progress thread of rank " + std::to_string(rank_);
  auto t = std::make_unique<Transfer>(req, timeout_);
  const auto count = static_cast<std::size_t>(chunk_count(req.bytes));
  switch (req.type) {
    case RequestType::Put: {
      ctx_.faults.hit(FaultPoint::MpiServePut);
      take_revocations();
      if (revoked_.erase({source, req.tag}) > 0) {
        if (!req.carries_bytes()) given_up_.drop_later(requests_.get(), source, req.tag);  // its data, if any was sent, is dropped
        log(LogLevel::Warn, what + ": a put from rank " + std::to_string(source) +
                                " was revoked by its origin (it timed out there); dropped");
        return;
      }
      const Region dst = find(req.window, req.offset, req.bytes, source);
      if (req.carries_bytes()) {
        if (dst.base != nullptr && req.bytes > 0) std::memcpy(dst.base, payload, req.bytes);
        apply_signal_of(req, source);
        return;
      }
      t->call = "MPI_Irecv (put data)";
      std::shared_ptr<std::vector<char>> sink;  // drains the payload of a request that matches no window
      if (dst.base == nullptr && req.bytes > 0)
        t->keep = sink = std::make_shared<std::vector<char>>(std::min<std::size_t>(req.bytes, kMaxMessage));
      t->reqs.assign(count, MPI_REQUEST_NULL);
      in_flight_[source] = std::move(t);
      for (std::size_t c = 0; c < count; ++c) {
        char* to = dst.base ? dst.base + c * kMaxMessage : sink->data();
        const int rc = MPI_Irecv(to, chunk_bytes(req.bytes, static_cast<int>(c)), MPI_BYTE, source, req.tag,
                                 requests_.get(), &in_flight_[source]->reqs[c]);
        if (rc != MPI_SUCCESS) return give_up(source, "MPI_Irecv failed (error " + std::to_string(rc) + ")");
      }
      break;
    }
    case RequestType::Get: {
      ctx_.faults.hit(FaultPoint::MpiServeGet);
      const Region src = find(req.window, req.offset, req.bytes, source);
      t->call = "MPI_Isend (get data)";
      std::shared_ptr<std::vector<char>> zeros;
      if (src.base == nullptr && req.bytes > 0)
        t->keep = zeros = std::make_shared<std::vector<char>>(std::min<std::size_t>(req.bytes, kMaxMessage));
      t->reqs.assign(count, MPI_REQUEST_NULL);
      in_flight_[source] = std::move(t);
      for (std::size_t c = 0; c < count; ++c) {
        const char* from = src.base ? src.base + c * kMaxMessage : zeros->data();
        const int rc = MPI_Isend(from, chunk_bytes(req.bytes, static_cast<int>(c)), MPI_BYTE, source, req.tag,
                                 replies_.get(), &in_flight_[source]->reqs[c]);
        if (rc != MPI_SUCCESS) return give_up(source, "MPI_Isend failed (error " + std::to_string(rc) + ")");
      }
      break;
    }
    case RequestType::Flush: {
      ctx_.faults.hit(FaultPoint::MpiServeFlush);
      static const std::uint64_t kAck = 1;  // lives as long as any send of it may
      t->call = "MPI_Isend (flush answer)";
      t->reqs.assign(1, MPI_REQUEST_NULL);
      in_flight_[source] = std::move(t);
      const int rc = MPI_Isend(&kAck, 1, MPI_UINT64_T, source, req.tag, replies_.get(), &in_flight_[source]->reqs[0]);
      if (rc != MPI_SUCCESS) return give_up(source, "MPI_Isend failed (error " + std::to_string(rc) + ")");
      break;
    }
    default:
      log(LogLevel::Error, what + ": unknown request type " + std::to_string(static_cast<unsigned>(req.type)) +
                               " from rank " + std::to_string(source));
      return;
  }
  if (std::find(busy_.begin(), busy_.end(), source) == busy_.end()) busy_.push_back(source);
  settle(source);  // small answers are often done at once
}

void MpiTransport::take(const char* message, std::size_t bytes, int source) {
  if (in_flight_[source] || !queued_[source].empty()) {
    queued_[source].emplace_back(message, message + bytes);
    if (std::find(busy_.begin(), busy_.end(), source) == busy_.end()) busy_.push_back(source);
    return;
  }
  Request req;
  std::memcpy(&req, message, sizeof(req));
  handle(req, message + sizeof(Request), source);
}

bool MpiTransport::settle(int source) {
  Transfer* t = in_flight_[source].get();
  if (t == nullptr) return true;
  std::vector<int> indices(t->reqs.size());
  int ended = 0;
  const int rc = MPI_Testsome(static_cast<int>(t->reqs.size()), t->reqs.data(), &ended, indices.data(),
                              MPI_STATUSES_IGNORE);
  if (rc != MPI_SUCCESS) {
    char text[MPI_MAX_ERROR_STRING] = {};
    int len = 0;
    MPI_Error_string(rc, text, &len);
    give_up(source, std::string("MPI_Testsome failed: ") + std::string(text, static_cast<std::size_t>(len)));
    return true;
  }
  if (ended != MPI_UNDEFINED && ended > 0) {
    t->done += static_cast<std::size_t>(ended);
    t->deadline = Deadline(timeout_);
  }
  if (ended == MPI_UNDEFINED || t->done >= t->reqs.size()) {
    if (t->req.type == RequestType::Put) apply_signal_of(t->req, source);
    in_flight_[source].reset();
    return true;
  }
  if (!t->deadline.expired()) return false;
  give_up(source, std::string(t->call) + " with rank " + std::to_string(source) + " did not complete within " +
                      describe_timeout(timeout_) + " (is rank " + std::to_string(source) + " alive?)");
  return true;
}

void MpiTransport::give_up(int source, const std::string& why, bool peer_failed) {
  std::unique_ptr<Transfer> t = std::move(in_flight_[source]);
  // A put's data or a get's answer uses the window's memory (unless it matched no window: a
  // sink, or zeros, which `keep` holds).
  const std::uint64_t window = t->req.type == RequestType::Flush || t->keep ? GivenUpRequests::kNoWindow : t->req.window;
  const bool uncancelled = ctx_.faults.hit(FaultPoint::MpiCancel);  // MESHMEM_FAULT ...:mpi.cancel:fail
  int kept = 0;
  for (MPI_Request& r : t->reqs) {
    if (r == MPI_REQUEST_NULL) continue;
    // No grace here, unlike abandon(): the other origins must not wait for this one. A receive
    // not yet matched ends at once; one that cannot be cancelled keeps its memory until it ends.
    if (!uncancelled) {
      (void)MPI_Cancel(&r);
      int done = 0;
      if (MPI_Test(&r, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done) continue;
    }
    given_up_.keep_until_done(r, t->keep, window);
    ++kept;
  }
  const bool put = t->req.type == RequestType::Put;
  given_up_.drop_later(put ? requests_.get() : replies_.get(), source, t->req.tag);
  const std::string msg = "progress thread of rank " + std::to_string(rank_) + ": " + why;
  if (peer_failed) {
    std::lock_guard<std::mutex> lock(failed_mutex_);
    if (failed_[static_cast<std::size_t>(source)].empty()) failed_[static_cast<std::size_t>(source)] = msg;
  }
  log(LogLevel::Error,
      msg + (put ? "; the put is dropped (its signal is not raised" +
                       std::string(kept ? "; MPI may still write its bytes into the window)" : ")")
                 : "; the rest of this answer is not sent"));
}

bool MpiTransport::advance() {
  bool ended = false;
  for (std::size_t i = 0; i < busy_.size();) {
    const int o = busy_[i];
    if (in_flight_[o] && !settle(o)) {
      ++i;
      continue;
    }
    ended = true;
    while (!in_flight_[o] && !queued_[o].empty()) {
      const std::vector<char> message = std::move(queued_[o].front());
      queued_[o].pop_front();
      Request req;
      std::memcpy(&req, message.data(), sizeof(req));
      handle(req, message.data() + sizeof(Request), o);
    }
    if (in_flight_[o]) {
      ++i;
    } else {
      busy_.erase(busy_.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  return ended;
}

bool MpiTransport::serve_one() {
  std::unique_lock<std::mutex> lock(serving_, std::try_to_lock);
  if (!lock.owns_lock() || stop_.load(std::memory_order_acquire)) return false;
  if (given_up_.pending()) given_up_.sweep();
  const bool ended = !busy_.empty() && advance();
  const std::string what = "serving requests on rank " + std::to_string(rank_);
  int found = 0;
  MPI_Message message = MPI_MESSAGE_NULL;
  MPI_Status status;
  check_mpi(MPI_Improbe(MPI_ANY_SOURCE, kTagRequest, requests_.get(), &found, &message, &status), "MPI_Improbe", what);
  // Open MPI's probe matches first and makes progress after, when nothing matched: a header
  // that came while no thread of this process was in MPI is matched only by the next probe,
  // which after a backoff sleep came a whole sleep later (a request to a rank idle for a second
  // waited 1 to 2 ms). A second probe finds it. (Back to back, host_bench measured no cost.)
  if (!found)
    check_mpi(MPI_Improbe(MPI_ANY_SOURCE, kTagRequest, requests_.get(), &found, &message, &status), "MPI_Improbe",
              what);
  if (!found) return ended;
  int count = 0;
  check_mpi(MPI_Get_count(&status, MPI_BYTE, &count), "MPI_Get_count", what);
  if (count < static_cast<int>(sizeof(Request)) || count > static_cast<int>(sizeof(Request) + kInlinePut)) {
    (void)MPI_Mrecv(nullptr, 0, MPI_BYTE, &message, MPI_STATUS_IGNORE);
    throw Error(ErrorCode::Internal, what + ": a request of " + std::to_string(count) + " bytes from rank " +
                                         std::to_string(status.MPI_SOURCE) + " (expected " +
                                         std::to_string(sizeof(Request)) + " to " +
                                         std::to_string(sizeof(Request) + kInlinePut) + ")");
  }
  inbox_.resize(sizeof(Request) + kInlinePut);
  check_mpi(MPI_Mrecv(inbox_.data(), count, MPI_BYTE, &message, &status), "MPI_Mrecv", what);
  Request req;
  std::memcpy(&req, inbox_.data(), sizeof(req));
  const std::size_t carried = req.carries_bytes() ? req.bytes : 0;
  if (static_cast<std::size_t>(count) != sizeof(Request) + carried)
    throw Error(ErrorCode::Internal, what + ": a request from rank " + std::to_string(status.MPI_SOURCE) + " carries " +
                                         std::to_string(count - static_cast<int>(sizeof(Request))) +
                                         " bytes after its header, expected " + std::to_string(carried));
  take(inbox_.data(), static_cast<std::size_t>(count), status.MPI_SOURCE);
  return true;
}

void MpiTransport::serve() {
  tighten_timer_slack();
  Backoff backoff(idle_sleep_);
  while (!stop_.load(std::memory_order_acquire)) {
    if (waiting_servers_.load(std::memory_order_acquire) > 0) {
      backoff.pause();
      continue;
    }
    bool served = false;
    try {
      served = serve_one();
    } catch (const std::exception& e) {
      // Nobody can catch an exception of this thread; the origin's wait times out and
      // names this rank.
      log(LogLevel::Error, std::string("progress thread: ") + e.what() + "; stopping");
      return;
    }
    if (served)
      backoff.reset();
    else
      backoff.pause();
  }
}

}  // namespace meshmem::detail
