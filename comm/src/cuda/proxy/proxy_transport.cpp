#define MESHMEM_DEFINING_GPU_PART
#include "cuda/proxy/proxy_transport.hpp"

#include <mpi.h>

#include <utility>

#include "backoff.hpp"
#include "log.hpp"
#include "topology.hpp"
#include "cuda/agent/captured_handoff.hpp"
#include "cuda/agent/stream_handoff.hpp"
#include "cuda/proxy/transfer_proxy.hpp"
#include "cuda/runtime/event_pool.hpp"
#include "cuda/runtime/gpu_queues.hpp"
#include "cuda/runtime/kernels.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

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
  return agent_reach(memory, device_ != nullptr, no_route_[rank]);
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

void ProxyTransport::raise_earlier_failure(const std::string& where) { raise_kept_error(*proxy_, where); }

void ProxyTransport::quiet(Stream) {
  if (proxy_) raise_earlier_failure(std::string(name_) + " transport on rank " + std::to_string(ctx_.topo.rank));
}

void ProxyTransport::transfer(ProxyRequest r, Stream stream, const char* name) {
  if (!proxy_) throw Error(ErrorCode::Internal, what(name, r.peer) + ": the transport is not connected");
  raise_earlier_failure(what(name, r.peer));
  const auto s = static_cast<cudaStream_t>(stream);
  const StreamCapture capture = capture_of(s, what(name, r.peer));
  const bool capturing = capture.active;
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
      capture_transfer(r, capture.graph, s, name, words);
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
