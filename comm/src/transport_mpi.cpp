#include "transport_mpi.hpp"

#include <algorithm>
#include <climits>
#include <cstring>

#include "backoff.hpp"
#include "log.hpp"

namespace meshmem::detail {

namespace {

constexpr int kTagRequest = 1;   // a Request header, on requests_
constexpr int kTagPayload = 2;   // put data following a header, on requests_
constexpr int kTagGetData = 3;   // get data, on replies_
constexpr int kTagFlushAck = 4;  // flush answer, on replies_

// MPI counts are ints: large transfers go as several messages of at most this many bytes.
constexpr std::size_t kMaxMessage = std::size_t{1} << 30;

enum class RequestType : std::uint32_t { Put = 1, Get = 2, Flush = 3 };

int chunk_count(std::size_t bytes) {
  return static_cast<int>((bytes + kMaxMessage - 1) / kMaxMessage);
}
int chunk_bytes(std::size_t bytes, int chunk) {
  return static_cast<int>(std::min(kMaxMessage, bytes - static_cast<std::size_t>(chunk) * kMaxMessage));
}

int stop_on_finalize(MPI_Comm, int, void* transport, void*) {
  static_cast<MpiTransport*>(transport)->stop();
  return MPI_SUCCESS;
}

}  // namespace

struct MpiTransport::Request {
  RequestType type;
  std::uint32_t signal_op;  // SignalOp, when has_signal
  std::uint32_t has_signal;
  std::uint32_t reserved;
  std::uint64_t window;
  std::uint64_t offset;
  std::uint64_t bytes;
  std::uint64_t signal_window;
  std::uint64_t signal_index;
  std::uint64_t signal_value;
};

std::unique_ptr<Transport> make_mpi_transport(const CommContext& ctx) { return std::make_unique<MpiTransport>(ctx); }

MpiTransport::MpiTransport(const CommContext& ctx) : ctx_(ctx), timeout_(ctx.options.timeout) {}

namespace {
// Whether [a, a + bytes) and [b, b + bytes) share a byte.
bool overlaps(const void* a, const void* b, std::size_t bytes) {
  const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return bytes > 0 && x < y + bytes && y < x + bytes;
}
}  // namespace

Reach MpiTransport::reach(int, Memory memory) const {
  if (memory != Memory::Host) return Reach::no("device windows over MPI are not implemented yet");
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
  requests_ = MpiComm::dup(ctx_.boot.comm(), what);
  replies_ = MpiComm::dup(ctx_.boot.comm(), what);
  int size = 0;
  check_mpi(MPI_Comm_rank(requests_.get(), &rank_), "MPI_Comm_rank", what);
  check_mpi(MPI_Comm_size(requests_.get(), &size), "MPI_Comm_size", what);
  unflushed_.assign(static_cast<std::size_t>(size), 0);
  check_mpi(MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, stop_on_finalize, &finalize_keyval_, nullptr),
            "MPI_Comm_create_keyval", what);
  check_mpi(MPI_Comm_set_attr(MPI_COMM_SELF, finalize_keyval_, this), "MPI_Comm_set_attr", what);
  progress_ = std::thread([this] { serve(); });
}

namespace {
class MpiRegistration final : public WindowAttachment {
 public:
  MpiRegistration(MpiTransport& t, std::uint64_t id) : t_(t), id_(id) {}
  ~MpiRegistration() override { t_.unregister_window(id_); }

 private:
  MpiTransport& t_;
  std::uint64_t id_;
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

void MpiTransport::unregister_window(std::uint64_t id) {
  std::lock_guard<std::mutex> lock(regions_mutex_);
  regions_.erase(id);
}

void MpiTransport::wait(MPI_Request* req, const char* call, int peer, const std::string& what, bool serve) {
  Deadline deadline(timeout_);
  Backoff backoff;
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
      throw Error(ErrorCode::Timeout, msg);
    }
    backoff.pause();
  }
}

void MpiTransport::put(const WindowState& win, int target, std::size_t offset, const void* src,
                       std::size_t bytes, const SignalUpdate& signal, Stream) {
  const std::string what = "mpi transport put to rank " + std::to_string(target) + " on rank " +
                           std::to_string(rank_);
  Request req{};
  req.type = RequestType::Put;
  req.window = win.id;
  req.offset = offset;
  req.bytes = bytes;
  if (signal.sig != nullptr) {
    req.has_signal = 1;
    req.signal_op = static_cast<std::uint32_t>(signal.op);
    req.signal_window = signal.sig->id;
    req.signal_index = signal.index;
    req.signal_value = signal.value;
  }
  // A put to this rank's own window from a source that overlaps the destination: MPI's send
  // and receive buffers must not overlap, so the bytes go from a copy.
  std::vector<char> copy;
  if (target == rank_ && overlaps(src, static_cast<const char*>(win.local) + offset, bytes)) {
    copy.assign(static_cast<const char*>(src), static_cast<const char*>(src) + bytes);
    src = copy.data();
  }
  MPI_Request r = MPI_REQUEST_NULL;
  check_mpi(MPI_Isend(&req, sizeof(req), MPI_BYTE, target, kTagRequest, requests_.get(), &r),
            "MPI_Isend", what);
  wait(&r, "MPI_Isend", target, what);
  // MPI keeps messages between one pair on one communicator in order, so the payload
  // follows its header; the target's progress thread receives it straight into the window.
  for (int c = 0; c < chunk_count(bytes); ++c) {
    const char* from = static_cast<const char*>(src) + static_cast<std::size_t>(c) * kMaxMessage;
    check_mpi(MPI_Isend(from, chunk_bytes(bytes, c), MPI_BYTE, target, kTagPayload, requests_.get(), &r),
              "MPI_Isend", what);
    wait(&r, "MPI_Isend", target, what);
  }
  unflushed_[target] = 1;
}

void MpiTransport::get(void* dst, const WindowState& win, int target, std::size_t offset,
                       std::size_t bytes, Stream) {
  const std::string what = "mpi transport get from rank " + std::to_string(target) + " on rank " +
                           std::to_string(rank_);
  const int chunks = chunk_count(bytes);
  std::vector<MPI_Request> recvs(static_cast<std::size_t>(chunks), MPI_REQUEST_NULL);
  // A get from this rank's own window into a buffer that overlaps it: received into a copy
  // (MPI's buffers must not overlap), moved into dst at the end.
  std::vector<char> copy;
  void* const caller_dst = dst;
  if (target == rank_ && overlaps(dst, static_cast<const char*>(win.local) + offset, bytes)) {
    copy.resize(bytes);
    dst = copy.data();
  }
  // Receives are posted before the request goes out, so the data lands straight in dst.
  for (int c = 0; c < chunks; ++c) {
    char* to = static_cast<char*>(dst) + static_cast<std::size_t>(c) * kMaxMessage;
    check_mpi(MPI_Irecv(to, chunk_bytes(bytes, c), MPI_BYTE, target, kTagGetData, replies_.get(), &recvs[c]),
              "MPI_Irecv", what);
  }
  Request req{};
  req.type = RequestType::Get;
  req.window = win.id;
  req.offset = offset;
  req.bytes = bytes;
  MPI_Request r = MPI_REQUEST_NULL;
  check_mpi(MPI_Isend(&req, sizeof(req), MPI_BYTE, target, kTagRequest, requests_.get(), &r),
            "MPI_Isend", what);
  wait(&r, "MPI_Isend", target, what);
  for (auto& recv : recvs) wait(&recv, "MPI_Irecv", target, what, true);
  if (!copy.empty()) std::memcpy(caller_dst, copy.data(), bytes);
}

void MpiTransport::quiet(Stream) {
  // A flush is served after every earlier request of this origin (MPI ordering), so its
  // answer means they are all applied.
  std::vector<int> targets;
  for (std::size_t t = 0; t < unflushed_.size(); ++t)
    if (unflushed_[t]) targets.push_back(static_cast<int>(t));
  if (targets.empty()) return;  // the usual case on one node: nothing allocated, nothing built
  const std::string what = "mpi transport quiet on rank " + std::to_string(rank_);
  std::vector<MPI_Request> acks(targets.size(), MPI_REQUEST_NULL);
  std::vector<std::uint64_t> ack_values(targets.size());
  std::vector<MPI_Request> sends(targets.size(), MPI_REQUEST_NULL);
  Request req{};
  req.type = RequestType::Flush;
  for (std::size_t i = 0; i < targets.size(); ++i) {
    check_mpi(MPI_Irecv(&ack_values[i], 1, MPI_UINT64_T, targets[i], kTagFlushAck, replies_.get(), &acks[i]),
              "MPI_Irecv", what);
    check_mpi(MPI_Isend(&req, sizeof(req), MPI_BYTE, targets[i], kTagRequest, requests_.get(), &sends[i]),
              "MPI_Isend", what);
  }
  for (std::size_t i = 0; i < targets.size(); ++i) {
    wait(&sends[i], "MPI_Isend (flush)", targets[i], what);
    wait(&acks[i], "MPI_Irecv (flush answer)", targets[i], what, true);
    unflushed_[targets[i]] = 0;
  }
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

void MpiTransport::handle(const Request& req, int source) {
  const std::string what = "progress thread of rank " + std::to_string(rank_);
  switch (req.type) {
    case RequestType::Put: {
      const Region dst = find(req.window, req.offset, req.bytes, source);
      std::vector<char> sink;  // drains the payload of a request that matches no window
      if (dst.base == nullptr && req.bytes > 0) sink.resize(std::min<std::size_t>(req.bytes, kMaxMessage));
      for (int c = 0; c < chunk_count(req.bytes); ++c) {
        char* to = dst.base ? dst.base + static_cast<std::size_t>(c) * kMaxMessage : sink.data();
        check_mpi(MPI_Recv(to, chunk_bytes(req.bytes, c), MPI_BYTE, source, kTagPayload,
                           requests_.get(), MPI_STATUS_IGNORE),
                  "MPI_Recv", what);
      }
      if (req.has_signal) {
        const Region word = find(req.signal_window, req.signal_index * sizeof(std::uint64_t),
                                 sizeof(std::uint64_t), source);
        if (word.base != nullptr)
          apply_signal(reinterpret_cast<std::uint64_t*>(word.base), req.signal_value,
                       static_cast<SignalOp>(req.signal_op));
      }
      break;
    }
    case RequestType::Get: {
      const Region src = find(req.window, req.offset, req.bytes, source);
      std::vector<char> zeros;
      if (src.base == nullptr && req.bytes > 0) zeros.resize(std::min<std::size_t>(req.bytes, kMaxMessage));
      for (int c = 0; c < chunk_count(req.bytes); ++c) {
        const char* from = src.base ? src.base + static_cast<std::size_t>(c) * kMaxMessage : zeros.data();
        check_mpi(MPI_Send(from, chunk_bytes(req.bytes, c), MPI_BYTE, source, kTagGetData,
                           replies_.get()),
                  "MPI_Send", what);
      }
      break;
    }
    case RequestType::Flush: {
      const std::uint64_t ack = 1;
      check_mpi(MPI_Send(&ack, 1, MPI_UINT64_T, source, kTagFlushAck, replies_.get()), "MPI_Send",
                what);
      break;
    }
    default:
      log(LogLevel::Error, what + ": unknown request type " +
                               std::to_string(static_cast<unsigned>(req.type)) + " from rank " +
                               std::to_string(source));
  }
}

bool MpiTransport::serve_one() {
  std::unique_lock<std::mutex> lock(serving_, std::try_to_lock);
  if (!lock.owns_lock() || stop_.load(std::memory_order_acquire)) return false;
  const std::string what = "serving requests on rank " + std::to_string(rank_);
  int found = 0;
  MPI_Message message = MPI_MESSAGE_NULL;
  MPI_Status status;
  check_mpi(MPI_Improbe(MPI_ANY_SOURCE, kTagRequest, requests_.get(), &found, &message, &status), "MPI_Improbe", what);
  if (!found) return false;
  Request req{};
  check_mpi(MPI_Mrecv(&req, sizeof(req), MPI_BYTE, &message, &status), "MPI_Mrecv", what);
  handle(req, status.MPI_SOURCE);
  return true;
}

void MpiTransport::serve() {
  tighten_timer_slack();
  Backoff backoff;
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
