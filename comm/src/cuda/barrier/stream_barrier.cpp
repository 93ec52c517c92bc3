#include "cuda/barrier/stream_barrier.hpp"

#include <algorithm>
#include <map>

#include "backoff.hpp"
#include "bootstrap.hpp"
#include "fd_exchange.hpp"
#include "knobs.hpp"
#include "log.hpp"
#include "node_meeting.hpp"
#include "topology.hpp"
#include "transport_registry.hpp"
#include "cuda/agent/stream_handoff.hpp"
#include "cuda/runtime/cuda_owners.hpp"
#include "cuda/runtime/gpu_device.hpp"
#include "cuda/runtime/stream_ops.hpp"
#include "cuda/runtime/kernels.hpp"
#include "cuda/barrier/barrier_resources.hpp"
#include "cuda/barrier/leader_all_reduce.hpp"
#include "meshmem/error.hpp"
#include "cuda/barrier/stream_barrier_knobs.hpp"
#include "meshmem/ipc/cuda_driver.hpp"
#include "meshmem/ipc/ipc_event.hpp"
#include "cuda/barrier/stream_barrier_proxy.hpp"

namespace meshmem::detail {

namespace {

// What the barrier may use of the transport `t` (null: nothing, or no route).
const BarrierResources* resources_of(const Transport* t) { return t == nullptr ? nullptr : t->barrier_resources(); }
// `t` keeps the node flags of the ranks routed through it (the staging pool).
const BarrierResources* node_flags_keeper(const Transport* t) {
  const BarrierResources* res = resources_of(t);
  return res != nullptr && res->keeps_node_flags() ? res : nullptr;
}

// MESHMEM_BARRIER and MESHMEM_BARRIER_ACROSS_NODES: stream_barrier_knobs.hpp.

std::string where(const Topology& topo) { return "comm.barrier(stream) on rank " + std::to_string(topo.rank); }

// Raised before a variant that cannot be captured touches a capturing stream.
[[noreturn]] void refuse_capture(const Topology& topo, const char* variant, const char* why) {
  throw Error(ErrorCode::Unsupported, where(topo) + ": the barrier(stream) variant " + variant +
                                          " cannot be captured into a CUDA graph (" + why +
                                          "); use MESHMEM_BARRIER=auto, kernel or meeting for graphs");
}

// One rank: every barrier is complete as soon as it is called.
class SingleRankBarrier final : public StreamBarrier {
 public:
  void arrive(Stream, bool) override {}
  std::string describe() const override { return "none needed (one rank)"; }
};

// A proxy thread meets the ranks over MPI once the stream reaches the barrier.
class ProxyBarrier final : public StreamBarrier {
 public:
  ProxyBarrier(const CommContext& ctx, const std::string& what, GpuDevice& device)
      : topo_(ctx.topo),
        proxy_(ctx.boot.comm(), device.device(), ctx.boot.timeout(), what,
               [&device](const std::string& failure) { device.report_barrier_failure(failure); },
               device) {}
  void arrive(Stream stream, bool capturing) override {
    const auto s = static_cast<cudaStream_t>(stream);
    if (!capturing) return proxy_.enqueue(s, where(topo_));
    proxy_.capture(s, capture_of(s, where(topo_)).graph, where(topo_));
  }
  std::string describe() const override {
    return "through a proxy thread over MPI (ranks span nodes or unmapped GPUs)";
  }

 private:
  const Topology& topo_;
  StreamBarrierProxy proxy_;
};

// Flag words, one per rank, in a device signals window every node peer maps: a rank
// stores the barrier's number into its word of every peer, then waits until every peer's
// word here reaches it. Flags only grow: nothing is reset.
class FlagWords {
 public:
  FlagWords(const Topology& topo, const BarrierContext& bctx) : FlagWords(topo, alloc_flags(topo, bctx)) {}
  FlagWords(const Topology& topo, std::shared_ptr<WindowState> window) : topo_(topo), window_(std::move(window)) {}
  explicit FlagWords(const Topology& topo) : topo_(topo) {}  // the flags live elsewhere
  // Collective over the Comm. A word per rank, then the hierarchical barrier's mark that this
  // node's leader gave up its all-reduce (KernelBarrier::mark_leaders_failed).
  static std::shared_ptr<WindowState> alloc_flags(const Topology& topo, const BarrierContext& bctx) {
    return bctx.alloc_signals((static_cast<std::size_t>(topo.size) + 1) * sizeof(std::uint64_t));
  }
  std::uint64_t next() { return ++epoch_; }

 protected:
  const Topology& topo_;
  std::shared_ptr<WindowState> window_;
  std::uint64_t epoch_ = 0;
};

class FlagBarrier final : public StreamBarrier, FlagWords {
 public:
  FlagBarrier(const Topology& topo, const BarrierContext& bctx, unsigned wait_flags)
      : FlagWords(topo, bctx), sequence_("barrier(stream) setup") {
    // Each write carries the default memory barrier: earlier puts land before any flag.
    // (cuStreamBatchMemOp refuses CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER: measured on H200.)
    for (int r = 0; r < topo.size; ++r)
      if (r != topo.rank) ops_.push_back(stream_write_op(static_cast<std::uint64_t*>(window_->peer[r]) + topo.rank, 0));
    for (int r = 0; r < topo.size; ++r)
      if (r != topo.rank)
        ops_.push_back(stream_wait_op(static_cast<std::uint64_t*>(window_->local) + r, 0, CU_STREAM_WAIT_VALUE_GEQ | wait_flags));
  }
  void arrive(Stream stream, bool capturing) override {
    if (capturing) refuse_capture(topo_, "flag", "its barrier numbers are fixed when it is enqueued");
    const std::uint64_t epoch = next();
    for (auto& op : ops_) op.writeValue.value64 = epoch;  // waitValue.value64 aliases it
    sequence_.before(stream, false, "comm.barrier(stream)", topo_.rank);
    run_stream_batch(ops_, stream, "comm.barrier(stream)", topo_.rank);
    sequence_.after(stream, false, "comm.barrier(stream)", topo_.rank);
  }
  std::string describe() const override { return "flag"; }

 private:
  std::vector<CUstreamBatchMemOpParams> ops_;  // writes to peers, then waits
  StreamSequence sequence_;
};

// The barrier number lives in device memory and is advanced by the kernel: a graph replay
// takes the next one.
// The barrier kernel over flag words: by default in a device signals window that every node
// peer maps (FlagWords); where some node peers are not mapped (staged transport), in the
// node's staging pool (pinned host memory that every GPU of the node reaches).
class KernelBarrier final : public StreamBarrier, FlagWords {
 public:
  KernelBarrier(const Topology& topo, const BarrierContext& bctx, const GpuDevice& device)
      : KernelBarrier(topo, alloc_flags(topo, bctx), device) {}
  // Flags in `window` (alloc_flags).
  KernelBarrier(const Topology& topo, std::shared_ptr<WindowState> window, const GpuDevice& device)
      : FlagWords(topo, std::move(window)), limit_(device.wait_limit()), early_(device.early_launch()),
        device_(device.device()), sequence_("barrier(stream) setup") {
    peer_flags_ = static_cast<std::uint64_t* const*>(window_->device_peer_table);
    my_flags_ = static_cast<std::uint64_t*>(window_->local);
    for (int r : topo.node_ranks)
      if (r != topo.rank) peer_marks_.push_back(static_cast<std::uint64_t*>(window_->peer[r]) + topo.size);
    make_counter();
  }
  // A rank alone on its node (the hierarchical barrier's node part): no flags, a counter only.
  KernelBarrier(const Topology& topo, const GpuDevice& device)
      : FlagWords(topo), limit_(device.wait_limit()), early_(device.early_launch()), device_(device.device()),
        sequence_("barrier(stream) setup") {
    peer_flags_ = device_array(table_, std::vector<std::uint64_t*>(static_cast<std::size_t>(topo.size), nullptr), where(topo));
    make_counter();
  }
  KernelBarrier(const Topology& topo, const BarrierResources& pool, const GpuDevice& device)
      : FlagWords(topo), limit_(device.wait_limit()), early_(device.early_launch()), device_(device.device()),
        sequence_("barrier(stream) setup") {
    std::vector<std::uint64_t*> table(static_cast<std::size_t>(topo.size), nullptr);
    for (int r : topo.node_ranks) table[r] = pool.node_flags(r);
    for (int r : topo.node_ranks)
      if (r != topo.rank) peer_marks_.push_back(pool.node_flags(r) + topo.size);
    peer_flags_ = device_array(table_, table, where(topo));
    my_flags_ = pool.node_flags(topo.rank);
    make_counter();
  }
  void arrive(Stream stream, bool capturing) override {
    const char* call = "comm.barrier(stream)";
    sequence_.before(stream, capturing, call, topo_.rank);
    const cudaError_t rc =
        cuda::launch_barrier(peer_flags_, my_flags_, static_cast<std::uint64_t*>(counter_.get()), topo_.rank,
                             topo_.size, passed_, leaders_failed_, fault_, limit_, stream, early_);
    if (rc != cudaSuccess) ipc::check_cuda(rc, "barrier kernel launch", where(topo_));
    sequence_.after(stream, capturing, call, topo_.rank);
  }
  std::string describe() const override {
    return window_ ? "kernel" : my_flags_ ? "kernel (flags in the staging pool)" : "kernel (alone on its node)";
  }
  // The node part of the hierarchical barrier: each kernel stores its number into `passed`
  // (pinned host memory; null on ranks that do not lead their node), and a timed-out wait
  // reports itself as such.
  void as_node_part(std::uint64_t* passed) {
    passed_ = passed;
    fault_ = cuda::FaultKind::NodeBarrier;
    // A rank that does not lead its node reads its leader's mark (none where it is alone).
    if (passed == nullptr && my_flags_ != nullptr) leaders_failed_ = my_flags_ + topo_.size;
  }
  // On a node leader that gives up an all-reduce among the leaders, before its stream goes on
  // past it: marks every node peer's word, so that their node kernel after the all-reduce
  // reports the failure instead of passing as if the other nodes had come. The writes run on
  // a stream of this object's and are waited for (bounded: a GPU that does not run them
  // leaves the peers unmarked, and says so).
  void mark_leaders_failed() {
    if (peer_marks_.empty()) return;
    const std::string what = where(topo_) + " (marking the node peers: the leaders' all-reduce was given up)";
    try {
      CurrentDevice current(device_);
      if (!mark_stream_) mark_stream_ = std::make_unique<OwnedStream>(what);
      std::vector<CUstreamBatchMemOpParams> ops;
      for (std::uint64_t* word : peer_marks_) ops.push_back(stream_write_op(word, static_cast<std::uint64_t>(topo_.rank) + 1));
      run_stream_batch(ops, mark_stream_->get(), "barrier(stream) across nodes", topo_.rank);
      if (!stream_ends_by(mark_stream_->get(), Deadline(std::chrono::milliseconds(2000)), "cudaStreamQuery", what))
        throw Error(ErrorCode::Timeout, what + ": the writes did not run within 2 s");
    } catch (const std::exception& e) {
      log(LogLevel::Error, std::string(e.what()) + "; the node's other ranks may pass this barrier unaware");
    }
  }

 private:
  void make_counter() { device_array(counter_, std::vector<std::uint64_t>(1, 0), where(topo_)); }
  cuda::WaitLimit limit_;
  bool early_;
  int device_;
  StreamSequence sequence_;
  PooledBlock counter_, table_;
  std::vector<std::uint64_t*> peer_marks_;  // the node peers' leaders_failed words (device addresses)
  const std::uint64_t* leaders_failed_ = nullptr;  // this rank's, read by its node kernels
  std::unique_ptr<OwnedStream> mark_stream_;
  std::uint64_t* const* peer_flags_ = nullptr;
  std::uint64_t* my_flags_ = nullptr;
  std::uint64_t* passed_ = nullptr;
  cuda::FaultKind fault_ = cuda::FaultKind::Barrier;
};

// Across nodes, all on the stream: the node's ranks meet in the barrier kernel (flags only
// between node peers), the node leaders all-reduce one word through NCCL (LeaderAllReduce),
// and the node's ranks meet again, so that the others go on only after their leader's
// all-reduce. Capturable: the kernels take their numbers on the GPU, and NCCL's all-reduce
// is captured as NCCL captures it.
class HierarchicalBarrier final : public StreamBarrier {
 public:
  HierarchicalBarrier(const Topology& topo, std::unique_ptr<KernelBarrier> node, std::unique_ptr<LeaderAllReduce> leaders)
      : topo_(topo), node_(std::move(node)), leaders_(std::move(leaders)) {
    node_->as_node_part(leaders_->passed_word());  // the leader's watchdog sees where its stream is
    // Destroyed before node_ (declared after it): the watchdog never outlives the node part.
    leaders_->before_giving_up([node = node_.get()] { node->mark_leaders_failed(); });
  }
  void arrive(Stream stream, bool capturing) override {
    const bool leader = leaders_->leader();
    // The limit first, on every rank alike; the count once nothing more may raise before the
    // barrier is enqueued.
    int* captured = capturing ? captured_count(stream) : nullptr;
    if (leader) leaders_->raise_failure(where(topo_));  // before anything is enqueued
    if (captured != nullptr) ++*captured;
    node_->arrive(stream, capturing);
    if (leader) {
      try {
        leaders_->enqueue(static_cast<cudaStream_t>(stream), capturing, where(topo_));
      } catch (...) {
        // The node kernels stay paired (the node peers' second kernel is matched, and the
        // numbers keep their parity); the all-reduce failed, and the error says so.
        node_->arrive(stream, capturing);
        throw;
      }
    }
    node_->arrive(stream, capturing);
  }
  std::string describe() const override {
    return "hierarchical: node " + node_->describe() + ", then " + leaders_->describe() + ", then node again";
  }

  // Barriers of this kind one capture may hold (a graph made of several captures, or child
  // graphs, is not counted as one). NCCL captures its all-reduce with a host node
  // (its proxy's), one chain of them per graph; cudaGraphLaunch of a graph whose chained host
  // nodes wait behind device work returns only once they ran (from about 32, 1 x H100, CUDA
  // 13.0: studies/queue_lab chain), and meanwhile holds the nccl proxy's NCCL calls, which the
  // graph's nccl transfers wait for: 32 such barriers among 96 nccl puts stalled every replay
  // until MESHMEM_TIMEOUT. 16 chained host nodes launched at once there. Every rank counts
  // (leaders or not), so every rank refuses the same barrier.
  static constexpr int kCapturedPerGraph = 16;

 private:
  // The count of captured barriers of the capture on `stream`; at kCapturedPerGraph raises
  // Unsupported before anything is added to it.
  int* captured_count(Stream stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    ipc::check_cuda(cudaStreamGetCaptureInfo(static_cast<cudaStream_t>(stream), &status, &id), "cudaStreamGetCaptureInfo",
                    where(topo_));
    // Capture ids only grow: the oldest captures have ended long ago.
    if (captured_.size() >= 64 && captured_.find(id) == captured_.end()) captured_.erase(captured_.begin());
    int& count = captured_[id];  // (a std::map: the reference stays valid)
    if (count >= kCapturedPerGraph)
      throw Error(ErrorCode::Unsupported,
                  where(topo_) + ": barrier(stream) across nodes: this capture already holds " +
                      std::to_string(kCapturedPerGraph) +
                      " hierarchical barriers (NCCL's all-reduce), the most one graph may hold: their chain of "
                      "NCCL host nodes would make cudaGraphLaunch hold meshmem's nccl transfers until "
                      "MESHMEM_TIMEOUT (README \"CUDA Graphs\"); nothing was added to the capture. Split the "
                      "graph, or set MESHMEM_BARRIER_ACROSS_NODES=proxy (its barriers are doorbells, any number)");
    return &count;
  }

  const Topology& topo_;
  std::unique_ptr<KernelBarrier> node_;
  std::unique_ptr<LeaderAllReduce> leaders_;
  std::map<unsigned long long, int> captured_;  // barriers per capture id (the last 64 captures)
};

// Whether `stream` has work not yet complete.
bool stream_busy(Stream stream, const Topology& topo) {
  const cudaError_t idle = cudaStreamQuery(stream);
  if (idle == cudaErrorNotReady) {
    if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();  // not an error
    return true;
  }
  if (idle != cudaSuccess) ipc::check_cuda(idle, "cudaStreamQuery", where(topo));
  return false;
}

// A host meeting through shared memory first. A rank whose stream is idle has its earlier
// work complete: the meeting itself orders that work before every peer's later work. Only
// when some stream had work do the ranks run a GPU barrier, and every rank chooses the same
// one from the same notes: `captured` (the kernel) when any rank captures a graph, else
// `eager` (the flag barrier where ranks share a GPU: a polling kernel would hold the
// time-sliced GPU from the very ranks it waits for).
class MeetingFirstBarrier final : public StreamBarrier {
 public:
  MeetingFirstBarrier(const CommContext& ctx, std::unique_ptr<StreamBarrier> captured,
                      std::unique_ptr<StreamBarrier> eager, const std::string& what)
      : topo_(ctx.topo), meeting_(ctx.boot, ctx.fds, ctx.topo, what), captured_(std::move(captured)),
        eager_(std::move(eager)) {}
  void arrive(Stream stream, bool capturing) override {
    // Under capture the meeting happens once, now, and the graph holds the GPU barrier,
    // which every replay runs.
    const unsigned note = (capturing ? kCapturing : 0) | (capturing || stream_busy(stream, topo_) ? kBusy : 0);
    meeting_.meet(note, notes_, "comm.barrier(stream)");
    unsigned all = 0;
    for (int r : topo_.node_ranks) all |= notes_[r];
    if ((all & kBusy) == 0) return;
    StreamBarrier& gpu = (all & kCapturing) != 0 || !eager_ ? *captured_ : *eager_;
    gpu.arrive(stream, capturing);
  }
  std::string describe() const override {
    return "host meeting, then " + (eager_ ? eager_->describe() + " (" + captured_->describe() + " in graphs)" : captured_->describe());
  }

 private:
  static constexpr unsigned kBusy = 1, kCapturing = 2;
  const Topology& topo_;
  NodeMeeting meeting_;
  std::unique_ptr<StreamBarrier> captured_;
  std::unique_ptr<StreamBarrier> eager_;  // null: captured_ always
  std::vector<unsigned> notes_;           // at the last meeting
};

// A host meeting, with IPC events of the busy streams: each busy rank records its event
// before the meeting, and every rank's stream waits on the busy peers' events after it.
class EventBarrier final : public StreamBarrier {
 public:
  EventBarrier(const CommContext& ctx, const std::string& what)
      : topo_(ctx.topo), meeting_(ctx.boot, ctx.fds, ctx.topo, what) {
    std::vector<cudaIpcEventHandle_t> mine(kRing);
    agreed_step(ctx.boot, what, [&] {
      for (int k = 0; k < kRing; ++k) {
        events_.push_back(ipc::IpcEvent::create());
        mine[k] = events_.back().handle();
      }
    });
    std::vector<cudaIpcEventHandle_t> all(static_cast<std::size_t>(kRing) * topo_.size);
    ctx.boot.allgather(mine.data(), all.data(), sizeof(cudaIpcEventHandle_t) * kRing, what);
    peer_events_.resize(kRing);
    for (auto& ring : peer_events_) ring.resize(static_cast<std::size_t>(topo_.size));
    agreed_step(ctx.boot, what, [&] {
      for (int k = 0; k < kRing; ++k)
        for (int r = 0; r < topo_.size; ++r)
          if (r != topo_.rank) peer_events_[k][r] = ipc::PeerEvent::open(all[static_cast<std::size_t>(r) * kRing + k]);
    });
  }
  void arrive(Stream stream, bool capturing) override {
    if (capturing) refuse_capture(topo_, "event", "it meets the ranks on the host and records IPC events eagerly");
    const int slot = static_cast<int>(++epoch_ % kRing);
    const bool busy = stream_busy(stream, topo_);
    // Events are recorded before the meeting, so that no peer can wait on this slot before
    // it marks this barrier. The ring: a peer cannot re-record slot k before this rank has
    // issued its waits on it (that needs this rank at a later meeting).
    if (busy) {
      const cudaError_t rc = cudaEventRecord(events_[slot].get(), stream);
      if (rc != cudaSuccess) ipc::check_cuda(rc, "cudaEventRecord", where(topo_));
    }
    meeting_.meet(busy ? 1 : 0, busy_, "comm.barrier(stream)");
    for (int r : topo_.node_ranks) {
      if (r == topo_.rank || !busy_[r]) continue;
      const cudaError_t rc = cudaStreamWaitEvent(stream, peer_events_[slot][r].get(), 0);
      if (rc != cudaSuccess) ipc::check_cuda(rc, "cudaStreamWaitEvent", where(topo_));
    }
  }
  std::string describe() const override { return "event"; }

 private:
  static constexpr int kRing = 4;
  const Topology& topo_;
  NodeMeeting meeting_;
  std::uint64_t epoch_ = 0;
  std::vector<ipc::IpcEvent> events_;
  std::vector<std::vector<ipc::PeerEvent>> peer_events_;  // [slot][rank]
  std::vector<unsigned> busy_;  // at the last meeting: whose stream had work
};

// The hierarchical barrier where ranks span nodes, if MESHMEM_BARRIER_ACROSS_NODES and the
// routes allow it (agreed by every rank); null for the proxy barrier.
std::unique_ptr<StreamBarrier> make_hierarchical_barrier(const CommContext& ctx, const BarrierContext& bctx,
                                                         GpuDevice& device) {
  const std::string what = "meshmem::Comm (barrier setup)";
  const Topology& topo = ctx.topo;
  const AcrossNodes asked = kAcrossNodes.get(ctx.options);
  // Why this rank cannot take part ("" if it can). Its node part: flags mapped between the
  // node's ranks, flags in the staging pool (some node peer is staged), or none (alone).
  std::string why;
  const BarrierResources* staged = nullptr;
  bool mapped = false;
  for (int r = 0; r < topo.size && why.empty(); ++r) {
    if (r == topo.rank) continue;
    const Transport* t = bctx.routes.find(r, Memory::Device);
    const std::string peer = "rank " + std::to_string(r);
    if (!topo.same_node(r)) {
      const BarrierResources* res = resources_of(t);
      if (res == nullptr || !res->reaches_nodes_over_nccl())
        why = peer + " is on another node and reached " +
              (t ? "through " + std::string(to_string(t->kind())) : std::string("by no device route")) + ", not nccl";
      else if (res->nccl_library() == nullptr)
        why = "the nccl transport is not connected here";
    } else if (const BarrierResources* keeper = node_flags_keeper(t)) {
      staged = keeper;
    } else if (t != nullptr && t->capabilities().mapped) {
      mapped = true;
    } else {
      why = peer + " is on this node and its GPU memory is neither mapped nor staged";
    }
  }
  if (why.empty() && staged != nullptr && mapped) why = "some of this node's ranks are mapped here and others staged";
  if (why.empty() && staged != nullptr && !staged->has_node_flags()) why = "the staged transport has no pool here";
  // The leaders meet through NCCL: without a connected nccl transport there is none to use
  // (one node whose ranks reach no peer across nodes, say).
  const NcclLibrary* lib = nullptr;
  for (const Transport* t : bctx.connected)
    if (const BarrierResources* res = resources_of(t); res != nullptr && res->reaches_nodes_over_nccl())
      lib = res->nccl_library();
  if (why.empty() && lib == nullptr) why = "no nccl transport is connected here";
  // A GPU that ranks share is time-sliced between them: NCCL's all-reduce kernel spins on it
  // and holds it from the very ranks it waits for (1 x H100, two simulated nodes: 4.7 ms per
  // all-reduce against 48 us for the proxy's meeting, bench/results/2026-11-24-*-cross-host-*).
  // Ranks of other nodes count too: simulated nodes of one machine, or containers of one
  // machine given the same GPU (GpuDevice finds the GPU by its UUID).
  const bool time_sliced = device.gpu_shared_in_comm();
  if (why.empty() && asked == AcrossNodes::Auto && time_sliced)
    why = "this rank's GPU is shared with other ranks (time-sliced: NCCL's all-reduce kernel would hold it from the "
          "ranks it waits for; MESHMEM_BARRIER_ACROSS_NODES=nccl uses it all the same)";
  if (asked == AcrossNodes::Proxy) why = "MESHMEM_BARRIER_ACROSS_NODES=proxy";
  if (!ctx.boot.allreduce_max(why.empty() ? 0 : 1, what)) {
    // Every rank takes part. The mapped flags are a window of the whole Comm: made by every
    // rank where some rank uses them.
    std::shared_ptr<WindowState> flags;
    if (ctx.boot.allreduce_max(mapped ? 1 : 0, what)) flags = FlagWords::alloc_flags(topo, bctx);
    auto node = mapped    ? std::make_unique<KernelBarrier>(topo, flags, device)
                : staged  ? std::make_unique<KernelBarrier>(topo, *staged, device)
                          : std::make_unique<KernelBarrier>(topo, device);
    auto leaders = std::make_unique<LeaderAllReduce>(
        ctx, lib, [&device](const std::string& failure) { device.report_barrier_failure(failure); });
    log(LogLevel::Info, "barrier(stream) across nodes: hierarchical (node kernel, the leaders' NCCL all-reduce, node "
                        "kernel)");
    return std::make_unique<HierarchicalBarrier>(topo, std::move(node), std::move(leaders));
  }
  if (why.empty()) why = "another rank cannot take part (MESHMEM_LOG_LEVEL=info there says why)";
  if (asked == AcrossNodes::Nccl)
    throw Error(ErrorCode::Unsupported, where(topo) + ": MESHMEM_BARRIER_ACROSS_NODES=nccl cannot be used: " + why);
  if (asked == AcrossNodes::Auto)
    log(LogLevel::Info, "barrier(stream) across nodes: not hierarchical over NCCL on rank " + std::to_string(topo.rank) +
                            ": " + why);
  return nullptr;
}

}  // namespace

std::unique_ptr<StreamBarrier> make_stream_barrier(const CommContext& ctx, const BarrierContext& bctx,
                                                   GpuDevice& device) {
  const std::string what = "meshmem::Comm (barrier setup)";
  const Topology& topo = ctx.topo;
  // One rank meets no one, whatever its routes (it may have no device route at all).
  if (topo.size == 1) return std::make_unique<SingleRankBarrier>();
  // The node variants need every rank on this node and reached through a transport that
  // maps its device windows here; where some are staged instead, the kernel barrier's flags
  // live in the staging pool. Otherwise the proxy meets the ranks over MPI.
  bool all_mapped = topo.node_count == 1;
  const BarrierResources* staged = nullptr;
  for (int r = 0; r < topo.size && all_mapped; ++r) {
    const Transport* t = bctx.routes.find(r, Memory::Device);
    if (const BarrierResources* keeper = node_flags_keeper(t)) {
      staged = keeper;
      continue;
    }
    all_mapped = t != nullptr && t->capabilities().mapped;
  }
  const std::uint64_t verdict = ctx.boot.allreduce_max(!all_mapped ? 2 : staged != nullptr ? 1 : 0, what);
  if (verdict == 2) {
    if (auto across = make_hierarchical_barrier(ctx, bctx, device)) return across;
    log(LogLevel::Info, "barrier(stream): ranks span nodes or unmapped GPUs; a proxy thread meets them over MPI "
                        "once the stream reaches the barrier");
    return std::make_unique<ProxyBarrier>(ctx, what, device);
  }
  if (verdict == 1) {
    // Every rank routes some peer through `staged` (its pool is collective): flags there.
    for (const Transport* t : bctx.connected)
      if (staged == nullptr) staged = node_flags_keeper(t);
    if (staged == nullptr || !staged->has_node_flags())
      throw Error(ErrorCode::Internal, what + ": the staged transport's pool is missing on rank " + std::to_string(topo.rank));
    if (kBarrier.get(ctx.options) != BarrierKind::Auto && kBarrier.get(ctx.options) != BarrierKind::Kernel)
      log(LogLevel::Info, "barrier(stream): MESHMEM_BARRIER=" + print_named<kBarrierKinds>(kBarrier.get(ctx.options)) +
                              " needs every node peer mapped; some are staged: the kernel barrier over the staging "
                              "pool is used");
    auto kernel = std::make_unique<KernelBarrier>(topo, *staged, device);
    // As for mapped peers: ranks sharing a GPU meet on the host first unless `kernel` is asked for.
    if (device.any_shared_gpu() && kBarrier.get(ctx.options) != BarrierKind::Kernel)
      return std::make_unique<MeetingFirstBarrier>(ctx, std::move(kernel), nullptr, what);
    return kernel;
  }
  switch (kBarrier.get(ctx.options)) {
    case BarrierKind::Flag: return std::make_unique<FlagBarrier>(topo, bctx, device.wait_flags());
    case BarrierKind::Event: return std::make_unique<EventBarrier>(ctx, what);
    case BarrierKind::Meeting:
      return std::make_unique<MeetingFirstBarrier>(ctx, std::make_unique<KernelBarrier>(topo, bctx, device), nullptr, what);
    case BarrierKind::Auto:
      if (device.any_shared_gpu())
        return std::make_unique<MeetingFirstBarrier>(ctx, std::make_unique<KernelBarrier>(topo, bctx, device),
                                                     std::make_unique<FlagBarrier>(topo, bctx, device.wait_flags()), what);
      break;
    case BarrierKind::Kernel: break;
  }
  return std::make_unique<KernelBarrier>(topo, bctx, device);
}

}  // namespace meshmem::detail
