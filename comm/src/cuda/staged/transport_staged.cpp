#define MESHMEM_DEFINING_GPU_PART
#include "cuda/staged/transport_staged.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <mutex>
#include <optional>

#include "backoff.hpp"
#include "bootstrap.hpp"
#include "fd_exchange.hpp"
#include "gpu_part.hpp"
#include "knobs.hpp"
#include "log.hpp"
#include "piece_cursor.hpp"
#include "topology.hpp"
#include "cuda/runtime/cuda_owners.hpp"
#include "cuda/runtime/gpu_device.hpp"
#include "cuda/runtime/stream_ops.hpp"
#include "cuda/runtime/device_window.hpp"
#include "cuda/agent/captured_handoff.hpp"
#include "cuda/agent/stream_handoff.hpp"
#include "cuda/runtime/kernels.hpp"
#include "cuda/runtime/relaxed_capture_mode.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"
#include "meshmem/ipc/vmm.hpp"
#include "cuda/staged/staging_agent.hpp"
#include "cuda/staged/staging_pool.hpp"
#include "cuda/staged/transport_staged_knobs.hpp"

namespace meshmem::detail {

namespace {

// The knobs (chunk, slots and those below) are declared in transport_staged_knobs.hpp.

// PieceCursor's ramp, off by default. Why it exists: a transfer's pipeline fills with its first
// piece's device-to-host copy and drains with its last piece's host-to-device copy; with 4 MiB
// pieces both ends cost about 150 us of a 64 MiB put (pipeline_lab on 4 x H200: 0.895 x
// min(d2h, h2d) at best). Why off: on 1 x H200 (2 ranks sharing it; bench/results/2026-11-29-
// nvidia-h200-staged-first-piece-c3f85f6.txt) 256 KiB first pieces took a 4 MiB put from 174 to
// 150 us but not the 64 MiB one (0.814 -> 0.802-0.812: each small piece pays the agents' hand-
// over, which its copy no longer hides), and they cost source completion and two streams their
// overlap (64 MiB 0.859 -> 0.814; 0.865 -> 0.816-0.823): more pieces hold the same slots. With
// one GPU per rank (the x4 case the ramp is for) it is not measured yet.
// MESHMEM_STAGED_FIRST_PIECE (transport_staged_knobs.hpp).

// MESHMEM_STAGED_TRACE (transport_staged_knobs.hpp).

// Small puts to hidden peers whose slot the caller's stream fills. Why: on 4 x H200 (Jacobi
// 4096^2, 4 ranks, aa3e264's trace) the writer's agent spent 4-7 us from a source seen ready
// to its posted count (a copy and a stream write enqueued, the lane's latency) out of 25 us
// from source to reader; the kernel the put enqueues anyway (the wait for its end) can copy
// the bytes first. Measured on 2 x H200, one GPU per rank (f077928): Jacobi 4096^2 71.5-74.2
// us per iteration on against 73.6-77.0 off (MPI 81.3-83.7), a 4 KiB put 19.3 us against
// 26.7. Not where ranks share a GPU: there the kernel waits for its process's time slice,
// where a copy engine does not (1 x H200, 2 ranks, 76fa6ef: 323-329 us on against 298-302
// off). Hence `auto`. Rows copied bytewise are left to the copy engine (fills_slot).
// MESHMEM_STAGED_STREAM_FILL (transport_staged_knobs.hpp).

// When a staged put's stream goes on. `source` is the put of OpenSHMEM and NVSHMEM (docs/semantics.md "Completion":
// "a put's source may be reused once its stream has passed the put"; quiet completes it at
// its target); `target`, the default, the stronger one every other route of meshmem gives.
// Why `source` exists: a stream that waits for each put's landing runs them one after the
// other, each pipeline filling and draining (studies/pipeline_lab --transfers 4, 64 MiB x 4,
// 4 MiB chunks, 1 x H200: 0.847 x min(d2h, h2d) one after the other, 0.879 overlapped).
// MESHMEM_STAGED_COMPLETION (transport_staged_knobs.hpp).

// Who drives the target GPU of a pair whose GPUs are both visible here. Measured on 2 x H200
// (Jacobi 4096^2, 2 ranks, staged forced): the initiator's context driving the target GPU
// took 4.77 ms per iteration, the target's own agent 0.37 ms: work of another process on a
// GPU busy with its own process's kernels waits for the driver's time slice.
// MESHMEM_STAGED_CHANNELS (transport_staged_knobs.hpp).

// The node peers' parts of one device window, each mapped here for that peer's GPU (peers
// whose GPU is hidden from this process: none; their agents copy into it), and the window as
// a landing place for hidden peers' chunks. It keeps the agent: its release may run on the
// window releaser's thread after the Comm is gone.
class StagedAttachment final : public WindowAttachment {
 public:
  StagedAttachment(std::shared_ptr<StagingAgent> a, std::shared_ptr<StreamPath> p, std::uint64_t id)
      : agent(std::move(a)), stream_path(std::move(p)), window(id) {}
  // This rank's transfers handed over up to the free: later ones cannot name the window.
  void freed() override { freed_at = agent->last_ticket(); }
  ~StagedAttachment() override {
    // Hidden peers' chunks (and answers to their gets) stop being enqueued for this window,
    // then no queued or running copy of this rank's transfers before the free may touch a
    // mapping or the window once it is gone.
    agent->remove_window(window);
    const bool agent_drained = agent->drain_through(freed_at.value_or(agent->last_ticket()));
    if (!agent_drained || (stream_path && !stream_path->drain()))
      log(LogLevel::Error, "staged transport: transfers still running when a window was freed; its mappings of "
                           "peers' memory are released anyway");
  }
  std::shared_ptr<StagingAgent> agent;
  std::shared_ptr<StreamPath> stream_path;
  std::uint64_t window;
  std::optional<std::uint64_t> freed_at;  // the agent's last ticket at the free
  std::vector<ipc::PeerMapping> parts;  // by rank
};

// How a captured staged transfer runs on every replay (CapturedHandoff): the request, with
// its done word, goes to the agent.
struct StagedHandoff {
  using Owner = StagingAgent;
  struct Request {
    StagedRequest transfer;  // its done word set
    mutable std::uint64_t last_ticket = 0;  // of the last replay handed over (under the board's lock)
  };
  static std::uint64_t submit(StagingAgent& agent, const Request& r) {
    r.last_ticket = agent.submit(r.transfer);
    return r.last_ticket;
  }
  static void release(StagingAgent& agent, const Request& r) {
    agent.release_captured_word(r.transfer.word, r.transfer.done, r.last_ticket);
  }
};

}  // namespace

std::unique_ptr<Transport> make_staged_transport(const CommContext& ctx) {
  return std::make_unique<StagedTransport>(ctx);
}

namespace {
// Where ranks share a GPU (stream waits are memops), a put to a hidden peer waits with a
// stream memory wait if its reader copies a chunk of less than this, or copies rows: the
// driver runs host-to-device copies that small on the compute engine, which a polling kernel
// of the writer's process holds for its time slice (studies/timeslice_lab, 1 x H200: copies of
// 24 KiB and less waited 2.05 ms, 28 KiB and more none; a 4 KiB staged put took 2.39 ms). The
// others keep the kernel, faster there (Jacobi 4096^2, halos of 32,752 bytes, 2 ranks on
// 1 x H200: 296-312 us per iteration with the kernel, 388-392 with a memory wait).
constexpr std::size_t kCopyEngineBytes = std::size_t(28) << 10;
bool reader_copy_may_wait_for_a_time_slice(const StagedRequest& r, std::size_t chunk, std::size_t first_piece) {
  if (r.width == 0 || r.rows == 0) return false;  // a signal alone: nothing copied
  if (r.rows > 1) return true;                    // 2D copies: not measured
  if (r.width < kCopyEngineBytes) return true;
  if (PieceCursor(r.width, 1, chunk, first_piece).ramps()) return false;  // no piece under 64 KiB
  const std::size_t last = r.width % chunk;  // the last chunk
  return last != 0 && last < kCopyEngineBytes;
}

// MESHMEM_STAGED_STREAM_FILL resolved: `auto` is `on` where this rank's stream waits are kernels
// (its GPU is its own).
bool fills_by_stream(StreamFill fill, const GpuDevice* device) {
  return fill == StreamFill::On || (fill == StreamFill::Auto && device != nullptr && device->waits_with_kernel());
}
}  // namespace

StagedTransport::StagedTransport(const CommContext& ctx)
    : ctx_(ctx),
      device_(gpu_device_of(ctx.device)),
      chunk_(kStagingChunk.get(ctx.options)),
      first_piece_(kStagingFirstPiece.get(ctx.options)),
      slots_(static_cast<int>(kStagingSlots.get(ctx.options))),
      stream_fill_(fills_by_stream(kStagingStreamFill.get(ctx.options), device_)),
      source_completion_(kStagedCompletion.get(ctx.options) == Completion::Source) {
  const Topology& topo = ctx_.topo;
  no_route_.assign(static_cast<std::size_t>(topo.size), std::string());
  peer_device_.assign(static_cast<std::size_t>(topo.size), -1);
  seen_device_.assign(static_cast<std::size_t>(topo.size), -1);
  for (int r = 0; r < topo.size; ++r)
    if (!topo.same_node(r))
      no_route_[r] = "rank " + std::to_string(r) + " is on another node (staging is through the node's pinned memory)";
  if (device_ == nullptr) return;
  const std::vector<std::string>& bus = device_->bus_ids();
  for (int r : topo.node_ranks) {
    int d = -1;
    if (cudaDeviceGetByPCIBusId(&d, bus[r].c_str()) != cudaSuccess) {
      (void)cudaGetLastError();
      d = -1;  // hidden (CUDA_VISIBLE_DEVICES isolation): that rank's agent copies onto its GPU
    }
    seen_device_[r] = d;
  }
}

StagedTransport::~StagedTransport() {
  stop();
  if (board_) board_->close(cuda::HandoffClosed::Retired);
}

void StagedTransport::stop() noexcept {
  if (board_) board_->close(cuda::HandoffClosed::Stopped);
  if (agent_) agent_->stop();
}

void StagedTransport::settle() noexcept {
  if (!drain())
    log(LogLevel::Error, "~Comm: staged transfers of rank " + std::to_string(ctx_.topo.rank) +
                             " did not end within MESHMEM_TIMEOUT; the ranks part anyway");
}

Reach StagedTransport::reach(int rank, Memory memory) const {
  return agent_reach(memory, device_ != nullptr, no_route_[rank]);
}

void StagedTransport::connect(const std::vector<bool>& routed) {
  const std::string what = "meshmem::Comm (staged transport)";
  const Topology& topo = ctx_.topo;
  // A pair goes through a channel when either side cannot see the other's GPU (under uneven
  // isolation one side alone would drive copies the other never polls for): agreed here.
  constexpr std::size_t kMaxNodeRanks = 2048;
  struct HiddenBits {
    std::uint8_t bits[kMaxNodeRanks / 8];
  } mine{};
  if (topo.node_ranks.size() > kMaxNodeRanks)
    throw Error(ErrorCode::Unsupported, what + ": more than " + std::to_string(kMaxNodeRanks) + " ranks on a node");
  for (std::size_t i = 0; i < topo.node_ranks.size(); ++i)
    if (seen_device_[topo.node_ranks[i]] < 0) mine.bits[i / 8] |= static_cast<std::uint8_t>(1u << (i % 8));
  std::vector<HiddenBits> all(static_cast<std::size_t>(topo.size));
  ctx_.boot.allgather(&mine, all.data(), sizeof(HiddenBits), what);
  const std::size_t me = topo.node_index(topo.rank);
  const bool channels_always = kStagingChannels.get(ctx_.options) == Channels::Always;
  for (int r : topo.node_ranks) {
    if (all[r].bits[me / 8] & (1u << (me % 8))) seen_device_[r] = -1;
    // `always`: the peer's agent drives its GPU, through the channel.
    peer_device_[r] = (channels_always && r != topo.rank) ? -1 : seen_device_[r];
  }
  std::vector<int> devices{device_->device()};
  for (int r = 0; r < topo.size; ++r)
    if (routed[r] && peer_device_[r] >= 0 && std::find(devices.begin(), devices.end(), peer_device_[r]) == devices.end())
      devices.push_back(peer_device_[r]);
  // Every node peer whose GPU is hidden here may send chunks, routed here or not: the agent
  // polls the channels of all of them.
  std::vector<bool> hidden(static_cast<std::size_t>(topo.size), false);
  for (int r : topo.node_ranks)
    if (r != topo.rank && peer_device_[r] < 0) hidden[r] = true;
  // Slots first (2 MiB aligned), then the stream-filled slots (FillSlots), then the control
  // words (ControlWords).
  const std::size_t slots_bytes = chunk_ * static_cast<std::size_t>(slots_);
  auto pool =
      std::make_unique<StagingPool>(ctx_.boot, topo, ctx_.fds, slots_bytes + FillSlots::kBytes + ControlWords::kBytes, device_->device(), devices, what);
  const std::string layout = pool->describe();
  board_ = std::make_shared<HandoffBoard<StagingAgent>>();
  agreed_step(ctx_.boot, what, [&] {
    const std::size_t doorbells = HandoffBoard<StagingAgent>::bytes_for(kTransferDoorbells);
    board_->set_doorbells(doorbell_memory(device_->device(), doorbells, what), doorbells);
    StagingAgent::Setup setup;
    setup.captured = board_;
    setup.pool = std::move(pool);
    setup.devices = devices;
    setup.chunk = chunk_;
    setup.first_piece = first_piece_;
    setup.slots = slots_;
    setup.rank = topo.rank;
    setup.ranks = topo.size;
    setup.node_ranks = topo.node_ranks;
    setup.hidden = hidden;
    setup.pids = topo.pid_of;
    setup.faults = ctx_.faults;
    setup.timeout = ctx_.options.timeout;
    setup.trace_prefix = kTraceStaged.get(ctx_.options);
    agent_ = std::make_shared<StagingAgent>(std::move(setup));
  });
  board_->open(agent_.get());
  const std::size_t stream_path_bytes = kStagedStreamPath.get(ctx_.options);
  StreamPath::Setup path;
  for (int r = 0; r < topo.size; ++r)
    if (routed[r] && r != topo.rank && seen_device_[r] >= 0) path.peer_devices.push_back(seen_device_[r]);
  if (stream_path_bytes > 0 && !path.peer_devices.empty()) {
    path.device = device_->device();
    path.slot_bytes = stream_path_bytes;
    path.split = kStagedStreamPathSplit.get(ctx_.options) == StreamPathSplit::On;
    path.rank = topo.rank;
    path.timeout = ctx_.options.timeout;
    stream_path_ = std::make_shared<StreamPath>(path);
  }
  log(LogLevel::Info, "staged transport: pool " + layout + "; " + std::to_string(slots_) + " slots of " +
                          std::to_string(chunk_) + " bytes per rank");
}

std::unique_ptr<WindowAttachment> StagedTransport::attach(WindowState& win, const std::vector<bool>& routed,
                                                          const std::string& what) {
  const Topology& topo = ctx_.topo;
  const auto& memory = static_cast<const DeviceWindowMemory&>(*win.storage);
  std::vector<ipc::UniqueFd> received = exchange_part_fds(ctx_, win, what);
  auto attachment = std::make_unique<StagedAttachment>(agent_, stream_path_, win.id);
  attachment->parts.resize(static_cast<std::size_t>(topo.size));
  agent_->add_window(win.id, win.local, win.bytes);
  agreed_step(ctx_.boot, what, [&] {
    for (int r : topo.node_ranks) {
      if (!routed[r]) continue;
      if (r == topo.rank) continue;  // this rank's own part: win.local
      // Hidden (or left to that rank's agent, with no stream path): that rank's agent copies into its part.
      const int device = peer_device_[r] >= 0 ? peer_device_[r] : stream_path_ ? seen_device_[r] : -1;
      if (device < 0) continue;
      CurrentDevice current(device);
      attachment->parts[r] = ipc::PeerMapping::import(received[r].get(), memory.bytes, device);
    }
  });
  return attachment;
}

std::string StagedTransport::what(const char* op, int target) const {
  return std::string("staged ") + op + " between rank " + std::to_string(ctx_.topo.rank) + " and rank " +
         std::to_string(target);
}

void* StagedTransport::mapped_part(const WindowState& win, int rank, const char* op) const {
  if (rank == ctx_.topo.rank) return win.local;
  for (const auto& a : win.attachments)
    if (const auto* s = dynamic_cast<const StagedAttachment*>(a.get()))
      if (void* p = s->parts[static_cast<std::size_t>(rank)].data()) return p;
  throw Error(ErrorCode::Internal, what(op, rank) + ": window #" + std::to_string(win.id) + " is not attached here");
}

void StagedTransport::raise_earlier_failure(const std::string& where) { raise_kept_error(*agent_, where); }

void StagedTransport::quiet(Stream stream) {
  if (!agent_) return;
  raise_earlier_failure("staged transport on rank " + std::to_string(ctx_.topo.rank));
  if (source_completion_) wait_for_landing(static_cast<cudaStream_t>(stream), -1, "quiet");
}

StagedTransport::StreamKey StagedTransport::key_of(cudaStream_t stream) {
  if (stream == cudaStreamLegacy) stream = nullptr;
  return {stream, stream == cudaStreamPerThread ? std::this_thread::get_id() : std::thread::id()};
}

namespace {
bool landed(const std::uint64_t* done, std::uint64_t ticket) { return __atomic_load_n(done, __ATOMIC_ACQUIRE) >= ticket; }
}  // namespace

// Under unlanded_m_: drops from `list` the puts that landed, and those in `also`.
void StagedTransport::forget(std::vector<Unlanded>& list, const std::vector<Unlanded>& also) {
  list.erase(std::remove_if(list.begin(), list.end(),
                            [&](const Unlanded& e) {
                              if (landed(e.done, e.ticket)) return true;
                              for (const Unlanded& a : also)
                                if (a.done == e.done && a.ticket == e.ticket) return true;
                              return false;
                            }),
             list.end());
}

void StagedTransport::wait_for_landing(cudaStream_t stream, int peer, const char* call) {
  std::vector<Unlanded> waits;
  const StreamKey key = key_of(stream);
  {
    std::lock_guard<std::mutex> lock(unlanded_m_);
    const auto it = unlanded_.find(key);
    if (it == unlanded_.end()) return;
    for (const Unlanded& e : it->second)
      if (!landed(e.done, e.ticket) && (peer < 0 || e.peer == peer)) waits.push_back(e);
  }
  if (waits.empty()) return;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (stream != nullptr && stream != cudaStreamLegacy)
    ipc::check_cuda(cudaStreamIsCapturing(stream, &status), "cudaStreamIsCapturing", what(call, peer));
  // The legacy stream is the current device's: this Comm's (a null stream comes here without
  // the call's device scope).
  CurrentDevice current(device_->device());
  // Tickets only grow on a word: a wait for one whose word was lent again meanwhile passes.
  for (const Unlanded& e : waits)
    device_->wait_for_ticket(e.done, e.ticket, e.peer, stream, e.ends_at_timeout, what(call, e.peer), nullptr, 0,
                             true);
  // Enqueued: the stream waits for them now. Not under capture: the graph's waits run only
  // when it does, so the stream's own puts stay to be waited for.
  if (status == cudaStreamCaptureStatusActive) return;
  std::lock_guard<std::mutex> lock(unlanded_m_);
  const auto it = unlanded_.find(key);
  if (it == unlanded_.end()) return;
  forget(it->second, waits);
  if (it->second.empty()) unlanded_.erase(it);
}

// Only puts whose source was read (their stream passed them): one whose stream has not come
// to it yet is no more waited for here than with target completion, where nothing waits for it.
// After a timeout, what is left is given up (the error says so): no later quiet waits for it.
void StagedTransport::complete_on_host(const char* call) {
  if (!agent_ || !source_completion_) return;
  std::vector<Unlanded> read;
  {
    std::lock_guard<std::mutex> lock(unlanded_m_);
    for (const auto& [key, list] : unlanded_)
      for (const Unlanded& e : list)
        if (landed(e.done, e.ticket - 1)) read.push_back(e);
  }
  const auto timeout = ctx_.options.timeout;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  Backoff backoff;
  std::string late;
  for (const Unlanded& e : read) {
    while (!landed(e.done, e.ticket)) {
      if (timeout.count() != 0 && std::chrono::steady_clock::now() > deadline) {
        late = "a staged put to rank " + std::to_string(e.peer) + " (transfer " + std::to_string(e.ticket) +
               ", source completion) did not land within " + describe_timeout(timeout);
        break;
      }
      backoff.pause();
    }
    if (!late.empty()) break;
  }
  // Those that did not land are marked given up (cuda::kTransferGivenUp), as a wait kernel
  // that times out marks its transfer: their reader drops what of them comes later. A
  // compare-and-swap: an end that lands meanwhile stands.
  if (!late.empty())
    for (const Unlanded& e : read) {
      std::uint64_t seen = __atomic_load_n(e.done, __ATOMIC_ACQUIRE);
      while (seen < e.ticket && !__atomic_compare_exchange_n(e.done, &seen, e.ticket | cuda::kTransferGivenUp, true,
                                                             __ATOMIC_RELEASE, __ATOMIC_ACQUIRE)) {
      }
    }
  {
    std::lock_guard<std::mutex> lock(unlanded_m_);
    const std::vector<Unlanded> none;
    const std::vector<Unlanded>& given_up = late.empty() ? none : read;
    for (auto it = unlanded_.begin(); it != unlanded_.end();) {
      forget(it->second, given_up);
      it = it->second.empty() ? unlanded_.erase(it) : std::next(it);
    }
  }
  if (!late.empty())
    throw Error(ErrorCode::Timeout, std::string(call) + " on rank " + std::to_string(ctx_.topo.rank) + ": " + late);
  raise_earlier_failure(std::string(call) + " on rank " + std::to_string(ctx_.topo.rank));
}

void StagedTransport::transfer(StagedRequest r, int peer, Stream stream, const char* name) {
  raise_earlier_failure(what(name, peer));
  const auto s = static_cast<cudaStream_t>(stream);
  const StreamCapture capture = capture_of(s, what(name, peer));
  if (capture.active) {
    capture_transfer(r, capture.graph, peer, s, name);
    return;
  }
  std::uint64_t* ready = agent_->lend_word(r, what(name, peer));
  r.stream = s;
  std::uint64_t* done = r.done;
  const bool visible = r.route == StagedRequest::Route::Visible;
  std::uint64_t ticket = 0;
  const bool stream_fills = fills_slot(r, s);  // outside the lock: a driver call
  try {
    std::unique_lock<std::mutex> order = agent_->hand_over();
    // A stream-filled put: the kernel fills the slot, then sets the ready word and waits as below.
    if (stream_fills && agent_->submit_filled(r, s, &ticket, [&](char* slot, std::uint64_t* retired,
                                                                    const StagingAgent::FillUse& before, std::uint64_t t) {
          const cuda::SlotFill fill{slot,        static_cast<const char*>(r.src), r.width, r.rows, r.src_pitch,
                                    before.done, before.ticket, before.peer, retired,        ready, done, t, peer};
          const cudaError_t k = cuda::launch_slot_fill(fill, device_->wait_limit(), s, device_->early_launch());
          if (k != cudaSuccess) ipc::check_cuda(k, "staged slot fill kernel launch", what(name, peer));
        }))
      return;
    r.ends_at_timeout = r.route == StagedRequest::Route::ToHidden && !device_->waits_with_kernel() &&
                        reader_copy_may_wait_for_a_time_slice(r, chunk_, first_piece_);
    r.source_complete = source_completion_ && r.route == StagedRequest::Route::ToHidden && r.width > 0 && r.rows > 0;
    ticket = agent_->submit(r);
    // The wait sets the ready word first (on the GPU, once the stream's earlier work is done).
    // The agent ends a visible transfer that stalls, and a put to a hidden peer whose stream
    // waits with a memory wait that the peer has not ended in time (end_overdue); the wait
    // kernel's own timeout ends the others. With source completion the stream waits for the
    // source read (ticket - 1), its landing is left to quiet. A wait kernel that gives up
    // marks the done word so, and the hidden peer's agent drops what of it comes later.
    device_->wait_for_ticket(done, ticket, peer, s, visible || r.ends_at_timeout, what(name, peer), ready,
                             r.source_complete ? ticket - 1 : ticket, !visible);
    if (r.source_complete) {
      // The wait is enqueued: nothing may reach the catch below (it would withdraw a transfer
      // that its stream will still mark ready).
      try {
        std::lock_guard<std::mutex> lock(unlanded_m_);
        std::vector<Unlanded>& list = unlanded_[key_of(s)];
        forget(list, {});
        list.push_back(Unlanded{done, ticket, peer, r.ends_at_timeout});
      } catch (const std::exception& e) {
        log(LogLevel::Error, what(name, peer) + ": transfer " + std::to_string(ticket) +
                                 " could not be recorded for quiet (" + e.what() + "); its landing is not waited for");
      }
    }
  } catch (...) {
    if (ticket != 0)
      agent_->withdraw(ticket, ready);  // nothing will say its source is ready: it ends unstarted
    else
      agent_->release_word(r.word);
    throw;
  }
}

// Whether the caller's stream fills the slot of this transfer itself (MESHMEM_STAGED_STREAM_FILL):
// a small put to a hidden peer from memory of this rank's GPU, on a stream of one thread.
bool StagedTransport::fills_slot(const StagedRequest& r, cudaStream_t stream) const {
  if (!stream_fill_ || r.route != StagedRequest::Route::ToHidden || stream == cudaStreamPerThread) return false;
  if (r.width == 0 || r.rows == 0 || r.width * r.rows > FillSlots::kSlotBytes) return false;
  // Rows that the kernel would copy in accesses of less than 4 bytes go through the copy
  // engine: bytewise, one block takes 8-13 us for 32-64 KiB where 4- to 16-byte accesses are at
  // the launch floor (studies/fill_lab, 1 x H200). The slot is 16-aligned and its rows packed, so
  // row r is 4-aligned to its source when the source is and pitch - width is a multiple of 4.
  if (((reinterpret_cast<std::uintptr_t>(r.src) | (r.rows > 1 ? r.src_pitch - r.width : 0)) & 3) != 0) return false;
  RelaxedCaptureMode relaxed;  // another thread may capture in global mode meanwhile
  cudaPointerAttributes attributes{};
  const bool known = cudaPointerGetAttributes(&attributes, r.src) == cudaSuccess;
  (void)cudaGetLastError();
  return known && attributes.type == cudaMemoryTypeDevice && attributes.device == device_->device();
}

// Under capture the graph gets a kernel that rings the request's doorbell on every replay
// (once the caller's earlier work is done, so no ready event is needed) and waits for the
// ticket the agent answers with (CapturedHandoff).
void StagedTransport::capture_transfer(const StagedRequest& r, cudaGraph_t graph, int peer, cudaStream_t stream,
                                       const char* name) {
  const auto all_in_use = [&] {
    return Error(ErrorCode::Unsupported, what(name, peer) + ": all " + std::to_string(agent_->word_count()) +
                                             " done words of this rank are held by staged transfers waiting, running "
                                             "or captured into CUDA graphs that still exist; nothing was enqueued");
  };
  StagedHandoff::Request captured;
  captured.transfer = r;
  if (!agent_->try_hold_word(captured.transfer)) throw all_in_use();
  const TicketWait wait = TicketWait::on(*device_, captured.transfer.done, cuda::FaultKind::Transfer, peer);
  CapturedHandoff<StagedHandoff>::capture(board_, std::move(captured), wait, graph, stream, what(name, peer));
  agent_->captured_added();
}

StagedRequest StagedTransport::request(void* dst, int dst_device, const void* src, int src_device, std::size_t width,
                                       std::size_t rows, std::size_t dst_pitch, std::size_t src_pitch) const {
  StagedRequest r;
  r.dst = dst;
  r.dst_device = dst_device;
  r.src = src;
  r.src_device = src_device;
  r.width = width;
  r.rows = rows;
  r.dst_pitch = dst_pitch;
  r.src_pitch = src_pitch;
  return r;
}

// The stream path: a transfer small enough, with a rank whose GPU this process sees, outside
// capture. Why: through the agents a 4 KiB put took 23 us on 1 x H200 (two host threads between
// its copies), as stream work 6.4 us (studies/stream_path_lab). Why not larger: one transfer's
// two copies run one after the other there (4 MiB: 25.6 GB/s against the agents' pipeline).
// Memory of the caller's that the driver does not know (pageable) goes through the agents: a
// copy from or to it would hold the calling thread.
bool StagedTransport::by_stream_path(int peer, std::size_t bytes, const void* mine, cudaStream_t stream) const {
  if (!stream_path_ || seen_device_[peer] < 0 || bytes > stream_path_->max_bytes()) return false;
  // Not capturing nor invalidated by a capture (the agents' path handles or refuses those as
  // before), asked before any other CUDA call: under a global-mode capture the queries below
  // count as unsafe and would invalidate it.
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (status != cudaStreamCaptureStatusNone) return false;
  // A stream of this rank's GPU (the null stream: its own), from device memory or registered
  // host memory; another thread may capture in global mode meanwhile.
  RelaxedCaptureMode relaxed;
  CurrentDevice current(device_->device());
  int stream_device = -1;
  if (cudaStreamGetDevice(stream, &stream_device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (stream_device != device_->device()) return false;
  if (bytes == 0) return true;
  cudaPointerAttributes attributes{};
  const bool known = cudaPointerGetAttributes(&attributes, mine) == cudaSuccess;
  (void)cudaGetLastError();
  return known && attributes.type != cudaMemoryTypeUnregistered;
}

bool StagedTransport::stream_path_transfer(const StreamPath::Transfer& t, int peer, cudaStream_t stream,
                                           const char* name) {
  raise_earlier_failure(what(name, peer));
  // Earlier puts of this stream to that rank that have not landed (source completion) land
  // first: a signal comes after them, a get reads what they wrote.
  if (source_completion_) wait_for_landing(stream, peer, name);
  return stream_path_->run(t, stream, what(name, peer));  // each of its steps sets the GPU it drives
}

void StagedTransport::put(const WindowState& win, int target, std::size_t offset, const void* src, std::size_t bytes,
                          const SignalUpdate& signal, Stream stream) {
  if (bytes == 0 && signal.sig == nullptr) return;
  const char* name = signal.sig != nullptr ? "put_signal" : "put";
  if (by_stream_path(target, bytes, src, static_cast<cudaStream_t>(stream))) {
    StreamPath::Transfer t;
    t.dst = static_cast<char*>(mapped_part(win, target, name)) + offset;
    t.src = src;
    t.width = t.dst_pitch = t.src_pitch = bytes;
    t.peer_device = seen_device_[target];
    if (signal.sig != nullptr) t.signal = static_cast<std::uint64_t*>(mapped_part(*signal.sig, target, name)) + signal.index;
    t.value = signal.value;
    t.op = signal.op;
    if (stream_path_transfer(t, target, static_cast<cudaStream_t>(stream), name)) return;
  }
  StagedRequest r;
  if (peer_device_[target] < 0) {
    r = hidden_request(StagedRequest::Route::ToHidden, target, win, offset, bytes, 1, bytes, bytes);
    r.src = src;
    if (signal.sig != nullptr) {
      r.signal_window = signal.sig->id;
      r.signal_index = signal.index;
    }
  } else {
    char* dst = static_cast<char*>(mapped_part(win, target, "put")) + offset;
    r = request(dst, peer_device_[target], src, device_->device(), bytes, 1, bytes, bytes);
    if (signal.sig != nullptr) r.signal = static_cast<std::uint64_t*>(mapped_part(*signal.sig, target, name)) + signal.index;
  }
  r.peer = target;
  r.value = signal.value;
  r.op = signal.op;
  transfer(r, target, stream, name);
}

void StagedTransport::put_strided(const WindowState& win, int target, std::size_t dst_offset, std::size_t dst_pitch,
                                  const void* src, std::size_t src_pitch, std::size_t width, std::size_t height,
                                  Stream stream) {
  if (width == 0 || height == 0) return;
  if (by_stream_path(target, width * height, src, static_cast<cudaStream_t>(stream))) {
    StreamPath::Transfer t;
    t.dst = static_cast<char*>(mapped_part(win, target, "put")) + dst_offset;
    t.src = src;
    t.width = width;
    t.rows = height;
    t.dst_pitch = dst_pitch;
    t.src_pitch = src_pitch;
    t.peer_device = seen_device_[target];
    if (stream_path_transfer(t, target, static_cast<cudaStream_t>(stream), "put (strided)")) return;
  }
  StagedRequest r;
  if (peer_device_[target] < 0) {
    r = hidden_request(StagedRequest::Route::ToHidden, target, win, dst_offset, width, height, dst_pitch, src_pitch);
    r.src = src;
  } else {
    char* dst = static_cast<char*>(mapped_part(win, target, "put")) + dst_offset;
    r = request(dst, peer_device_[target], src, device_->device(), width, height, dst_pitch, src_pitch);
  }
  r.peer = target;
  transfer(r, target, stream, "put (strided)");
}

void StagedTransport::get(void* dst, const WindowState& win, int target, std::size_t offset, std::size_t bytes,
                          Stream stream) {
  if (bytes == 0) return;
  if (by_stream_path(target, bytes, dst, static_cast<cudaStream_t>(stream))) {
    StreamPath::Transfer t;
    t.kind = StreamPath::Transfer::Kind::Get;
    t.dst = dst;
    t.src = static_cast<const char*>(mapped_part(win, target, "get")) + offset;
    t.width = t.dst_pitch = t.src_pitch = bytes;
    t.peer_device = seen_device_[target];
    if (stream_path_transfer(t, target, static_cast<cudaStream_t>(stream), "get")) return;
  }
  StagedRequest r;
  if (peer_device_[target] < 0) {
    r = hidden_request(StagedRequest::Route::FromHidden, target, win, offset, bytes, 1, bytes, bytes);
    r.dst = dst;
  } else {
    const char* src = static_cast<const char*>(mapped_part(win, target, "get")) + offset;
    r = request(dst, device_->device(), src, peer_device_[target], bytes, 1, bytes, bytes);
  }
  r.peer = target;
  // The stream's puts to that rank land first: the get reads what they wrote.
  if (source_completion_ && agent_) wait_for_landing(static_cast<cudaStream_t>(stream), target, "get");
  transfer(r, target, stream, "get");
}

// A transfer with a peer whose GPU this process cannot see: named by window id and offset
// (the peer's agent finds its part), this rank's side an address on its GPU.
StagedRequest StagedTransport::hidden_request(StagedRequest::Route route, int target, const WindowState& win,
                                              std::size_t offset, std::size_t width, std::size_t rows,
                                              std::size_t dst_pitch, std::size_t src_pitch) const {
  StagedRequest r;
  r.route = route;
  r.peer = target;
  r.window = win.id;
  r.offset = offset;
  r.width = width;
  r.rows = rows;
  r.dst_pitch = dst_pitch;
  r.src_pitch = src_pitch;
  r.src_device = r.dst_device = device_->device();
  return r;
}

bool StagedTransport::drain() noexcept {
  const bool agent = agent_ ? agent_->drain() : true;
  return (stream_path_ ? stream_path_->drain() : true) && agent;
}

std::uint64_t* StagedTransport::node_flags(int rank) const { return agent_->barrier_flags(rank); }

std::string StagedTransport::describe() const {
  if (!agent_) return {};
  const std::string held = agent_->held_report();
  return "staging pool " + agent_->pool().describe() + ", " + std::to_string(slots_) + " slots of " +
         std::to_string(chunk_) + " bytes per rank" + (stream_path_ ? "; " + stream_path_->describe() : "") +
         (held.empty() ? "" : "; held back: " + held);
}

}  // namespace meshmem::detail
