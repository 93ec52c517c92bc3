// The GPU part: device windows in CUDA VMM memory shared between the ranks of a node,
// stream-ordered signals, and the stream-ordered barrier.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>

#include "../bootstrap.hpp"
#include "../device_backend.hpp"
#include "../fd_exchange.hpp"
#include "../log.hpp"
#include "../node_meeting.hpp"
#include "../topology.hpp"
#include "kernels.hpp"
#include "stream_barrier_proxy.hpp"
#include "meshmem/ipc/cuda_driver.hpp"
#include "meshmem/ipc/ipc_event.hpp"
#include "meshmem/ipc/vmm.hpp"
#include "transport_ipc.hpp"

namespace meshmem::detail {

namespace {

struct CudaFree {
  void operator()(void* p) const noexcept {
    if (p != nullptr) (void)cudaFree(p);
  }
};
using DevicePtr = std::unique_ptr<void, CudaFree>;

class OwnedStream {
 public:
  OwnedStream() {
    ipc::check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags",
                    "meshmem::Comm (device setup)");
  }
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  ~OwnedStream() {
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

class DeviceWindowMemory final : public WindowMemory {
 public:
  ~DeviceWindowMemory() override {
    // Work of this device may still use the mappings: let it finish before unmapping.
    (void)cudaDeviceSynchronize();
  }
  ipc::VmmAllocation mine;
  std::vector<ipc::PeerMapping> peers;  // by rank; empty where not mapped
  DevicePtr table;                      // device copy of WindowState::peer
};

class CudaDeviceBackend final : public DeviceBackend {
 public:
  CudaDeviceBackend(const DeviceContext& ctx, int device);

  void create_window(WindowState& state, const std::string& what) override;
  Transport* route(int target, std::string* why) const override;
  void wait_until(const WindowState& sig, std::size_t index, Cmp cmp, std::uint64_t value,
                  Stream stream) override;
  void barrier(Stream stream) override;
  void signal_and_wait(const WindowState& sig, const std::vector<int>& send_to, const std::vector<int>& wait_for,
                       std::uint64_t value, Stream stream) override;
  std::unique_ptr<DeviceCopyPlan> make_copy_plan(const std::vector<DeviceCopy>& copies) override;
  std::string describe() const override { return description_; }

 private:
  void probe_peers();
  void setup_barrier();
  std::string where(const char* call) const { return std::string(call) + " on rank " + std::to_string(ctx_.topo.rank); }

  DeviceContext ctx_;
  int device_;
  std::string description_;
  std::string bus_id_;
  bool shared_gpu_ = false;
  Options::Barrier barrier_kind_ = Options::Barrier::Flag;       // resolved from Auto
  Options::StreamWait wait_kind_ = Options::StreamWait::Memop;   // resolved from Auto
  std::size_t granularity_ = 0;
  unsigned wait_flags_ = 0;  // extra flags of stream waits (flush of remote writes)
  OwnedStream setup_stream_;
  IpcTransport ipc_;
  std::vector<std::string> no_route_;  // by rank: why it cannot be reached ("" = it can)

  // barrier(stream)
  bool node_barrier_ = false;  // every rank on this node and mapped: no host involvement
  std::uint64_t epoch_ = 0;
  WindowState flags_;          // MESHMEM_BARRIER=flag|kernel: one word per rank, symmetric
  std::vector<CUstreamBatchMemOpParams> barrier_ops_;  // flag: writes to peers, then waits
  static constexpr int kEventRing = 4;
  std::vector<ipc::IpcEvent> events_;                     // MESHMEM_BARRIER=event
  std::vector<std::vector<ipc::PeerEvent>> peer_events_;  // [slot][rank]
  bool meet_first_ = false;                               // auto, event: host meeting first
  std::unique_ptr<NodeMeeting> meeting_;
  std::vector<bool> peer_busy_;                           // at the last meeting: whose stream had work
  std::unique_ptr<StreamBarrierProxy> proxy_;  // ranks span nodes or unmapped GPUs
};

CudaDeviceBackend::CudaDeviceBackend(const DeviceContext& ctx, int device)
    : ctx_(ctx), device_(device), ipc_(ctx.options.sm_copy_max, ctx.options.fused_signal_max, ctx.topo.rank) {
  const std::string what = "meshmem::Comm (device setup)";
  agreed_step(ctx_.boot, what, [&] {
    ipc::check_cuda(cudaSetDevice(device_), "cudaSetDevice", what);
    cudaDeviceProp prop{};
    ipc::check_cuda(cudaGetDeviceProperties(&prop, device_), "cudaGetDeviceProperties", what);
    char bus[32] = {};
    ipc::check_cuda(cudaDeviceGetPCIBusId(bus, sizeof(bus), device_), "cudaDeviceGetPCIBusId", what);
    description_ = "device " + std::to_string(device_) + " (" + prop.name + ", " + bus + ")";
    bus_id_ = bus;
    granularity_ = ipc::vmm_granularity(device_);
    CUdevice dev = 0;
    ipc::check_cu(ipc::cuda_driver().cuDeviceGet(&dev, device_), "cuDeviceGet", what);
    int flush = 0;
    ipc::check_cu(ipc::cuda_driver().cuDeviceGetAttribute(&flush, CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES, dev),
                  "cuDeviceGetAttribute", what);
    wait_flags_ = flush ? CU_STREAM_WAIT_VALUE_FLUSH : 0;
  });
  // Granularities are powers of two: the largest is a multiple of all, so every rank
  // rounds a window to the same size.
  granularity_ = ctx_.boot.allreduce_max(granularity_, what);
  // Which node peers share this rank's GPU (same PCI bus id): polling kernels would hold a
  // time-sliced GPU from the very ranks they wait for, so the Auto choices avoid them then.
  struct BusId {
    char text[32];
  } mine{};
  std::snprintf(mine.text, sizeof(mine.text), "%s", bus_id_.c_str());
  std::vector<BusId> all(static_cast<std::size_t>(ctx_.topo.size));
  ctx_.boot.allgather(&mine, all.data(), sizeof(BusId), what);
  bool shared = false;
  for (int r : ctx_.topo.node_ranks)
    shared = shared || (r != ctx_.topo.rank && std::strncmp(all[r].text, mine.text, sizeof(mine.text)) == 0);
  shared_gpu_ = shared;
  const bool any_shared = ctx_.boot.allreduce_max(shared ? 1 : 0, what) != 0;
  // auto: a host meeting first, where idle streams need nothing more (measured 3.6 us for
  // barrier + sync against 12 us for any barrier the GPU takes part in, on 4 x H200), then,
  // if any stream has work, the kernel barrier (fastest behind work), or stream memory
  // operations where ranks share a GPU (a polling kernel would hold a time-sliced GPU from
  // the very ranks it waits for).
  barrier_kind_ = ctx_.options.barrier;
  meet_first_ = barrier_kind_ == Options::Barrier::Auto || barrier_kind_ == Options::Barrier::Event;
  if (barrier_kind_ == Options::Barrier::Auto) barrier_kind_ = any_shared ? Options::Barrier::Flag : Options::Barrier::Kernel;
  wait_kind_ = ctx_.options.stream_wait;
  if (wait_kind_ == Options::StreamWait::Auto) wait_kind_ = shared ? Options::StreamWait::Memop : Options::StreamWait::Kernel;
  probe_peers();
  setup_barrier();
  const std::string node_kind = std::string(meet_first_ && barrier_kind_ != Options::Barrier::Event ? "host meeting, then " : "") +
                                (barrier_kind_ == Options::Barrier::Flag     ? "flag"
                                 : barrier_kind_ == Options::Barrier::Kernel ? "kernel"
                                                                             : "event");
  description_ += std::string(", barrier ") +
                  (node_barrier_ ? node_kind : "through a proxy thread over MPI (ranks span nodes or unmapped GPUs)") +
                  ", stream waits " + (wait_kind_ == Options::StreamWait::Kernel ? "kernel" : "memop") +
                  (shared_gpu_ ? " (GPU shared with other ranks)" : "");
}

void CudaDeviceBackend::probe_peers() {
  const std::string what = "meshmem::Comm (device peer probe)";
  const Topology& topo = ctx_.topo;
  no_route_.assign(static_cast<std::size_t>(topo.size), std::string());
  for (int r = 0; r < topo.size; ++r)
    if (!topo.same_node(r))
      no_route_[r] = "rank " + std::to_string(r) + " is on node " + std::to_string(topo.node_of[r]) +
                     " and this rank on node " + std::to_string(topo.node()) +
                     "; device windows across nodes need the NCCL/MPI transport, which is not "
                     "implemented yet";
  // Map one granule of every node peer: where that fails (no peer access between the two
  // GPUs, or the driver refuses), the pair has no device route, and says why.
  ipc::VmmAllocation probe;
  ipc::UniqueFd fd;
  agreed_step(ctx_.boot, what, [&] {
    probe = ipc::VmmAllocation::create(granularity_, device_);
    fd = probe.export_fd();
  });
  std::vector<ipc::UniqueFd> received = ctx_.fds.exchange(fd.get(), what);
  for (int r : topo.node_ranks) {
    if (r == topo.rank) continue;
    try {
      ipc::PeerMapping m = ipc::PeerMapping::import(received[r].get(), granularity_, device_);
    } catch (const Error& e) {
      no_route_[r] = "the GPU memory of rank " + std::to_string(r) + " cannot be mapped for " +
                     description_ + " (no peer access between the GPUs?): " + e.what() +
                     "; the staged transport for such pairs is not implemented yet";
      log(LogLevel::Warn, "no device route to rank " + std::to_string(r) + ": " + no_route_[r]);
    }
  }
}

void CudaDeviceBackend::setup_barrier() {
  const std::string what = "meshmem::Comm (barrier setup)";
  const Topology& topo = ctx_.topo;
  bool all_mapped = topo.node_count == 1;
  for (const auto& why : no_route_) all_mapped = all_mapped && why.empty();
  node_barrier_ = ctx_.boot.allreduce_max(all_mapped ? 0 : 1, what) == 0;
  if (!node_barrier_) {
    log(LogLevel::Info, "barrier(stream): ranks span nodes or unmapped GPUs; a proxy thread meets them over MPI "
                        "once the stream reaches the barrier");
    proxy_ = std::make_unique<StreamBarrierProxy>(ctx_.boot.comm(), ctx_.boot.timeout(), what);
    return;
  }
  if (meet_first_) meeting_ = std::make_unique<NodeMeeting>(ctx_.boot, ctx_.fds, topo, what);
  if (barrier_kind_ != Options::Barrier::Event) {
    flags_.bytes = static_cast<std::size_t>(topo.size) * sizeof(std::uint64_t);
    flags_.memory = Memory::Device;
    create_window(flags_, what);
    // Flag barrier: tell every peer this rank arrived (its word `rank` in the peer's
    // flags), then wait for every peer's word here. Flags only grow: nothing is reset.
    // Each write carries the default memory barrier: earlier puts land before any flag.
    // (cuStreamBatchMemOp refuses CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER: measured on H200.)
    for (int r = 0; r < topo.size; ++r) {
      if (r == topo.rank) continue;
      CUstreamBatchMemOpParams op{};
      op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
      op.writeValue.address = reinterpret_cast<CUdeviceptr>(static_cast<std::uint64_t*>(flags_.peer[r]) + topo.rank);
      op.writeValue.flags = 0;
      barrier_ops_.push_back(op);
    }
    for (int r = 0; r < topo.size; ++r) {
      if (r == topo.rank) continue;
      CUstreamBatchMemOpParams op{};
      op.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
      op.waitValue.address = reinterpret_cast<CUdeviceptr>(static_cast<std::uint64_t*>(flags_.local) + r);
      op.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ | wait_flags_;
      barrier_ops_.push_back(op);
    }
    return;
  }
  std::vector<cudaIpcEventHandle_t> mine(kEventRing);
  agreed_step(ctx_.boot, what, [&] {
    for (int k = 0; k < kEventRing; ++k) {
      events_.push_back(ipc::IpcEvent::create());
      mine[k] = events_.back().handle();
    }
  });
  std::vector<cudaIpcEventHandle_t> all(static_cast<std::size_t>(kEventRing) * topo.size);
  ctx_.boot.allgather(mine.data(), all.data(), sizeof(cudaIpcEventHandle_t) * kEventRing, what);
  peer_events_.resize(kEventRing);
  for (auto& ring : peer_events_) ring.resize(static_cast<std::size_t>(topo.size));
  agreed_step(ctx_.boot, what, [&] {
    for (int k = 0; k < kEventRing; ++k)
      for (int r = 0; r < topo.size; ++r)
        if (r != topo.rank) peer_events_[k][r] = ipc::PeerEvent::open(all[static_cast<std::size_t>(r) * kEventRing + k]);
  });
}

void CudaDeviceBackend::create_window(WindowState& state, const std::string& what) {
  const Topology& topo = ctx_.topo;
  const std::size_t bytes = ipc::vmm_round(state.bytes, granularity_);
  // Where the time of an alloc goes, at MESHMEM_LOG_LEVEL=debug.
  const bool timed = log_enabled(LogLevel::Debug);
  auto t0 = std::chrono::steady_clock::now();
  std::string phases;
  auto phase = [&](const char* name) {
    if (!timed) return;
    const auto now = std::chrono::steady_clock::now();
    char buf[64];
    std::snprintf(buf, sizeof(buf), " %s %.2f ms", name, std::chrono::duration<double, std::milli>(now - t0).count());
    phases += buf;
    t0 = now;
  };
  auto memory = std::make_unique<DeviceWindowMemory>();
  ipc::UniqueFd fd;
  agreed_step(ctx_.boot, what, [&] {
    memory->mine = ipc::VmmAllocation::create(bytes, device_);
    phase("create+map");
    // Zeroed (signals start at 0) and complete before any peer can write into it.
    ipc::check_cuda(cudaMemsetAsync(memory->mine.data(), 0, bytes, setup_stream_.get()), "cudaMemsetAsync", what);
    ipc::check_cuda(cudaStreamSynchronize(setup_stream_.get()), "cudaStreamSynchronize", what);
    phase("zero");
    fd = memory->mine.export_fd();
  });
  phase("export+agree");
  std::vector<ipc::UniqueFd> received = ctx_.fds.exchange(fd.get(), what);
  phase("fd-exchange");
  state.local = memory->mine.data();
  state.peer.assign(static_cast<std::size_t>(topo.size), nullptr);
  state.peer[topo.rank] = state.local;
  memory->peers.resize(static_cast<std::size_t>(topo.size));
  agreed_step(ctx_.boot, what, [&] {
    for (int r : topo.node_ranks) {
      if (r == topo.rank || !no_route_[r].empty()) continue;
      memory->peers[r] = ipc::PeerMapping::import(received[r].get(), bytes, device_);
      state.peer[r] = memory->peers[r].data();
    }
    phase("import+map-peers");
    void* table = nullptr;
    const std::size_t table_bytes = state.peer.size() * sizeof(void*);
    ipc::check_cuda(cudaMalloc(&table, table_bytes), "cudaMalloc", what);
    memory->table.reset(table);
    ipc::check_cuda(cudaMemcpy(table, state.peer.data(), table_bytes, cudaMemcpyHostToDevice), "cudaMemcpy", what);
  });
  phase("table+agree");
  if (timed) log(LogLevel::Debug, what + ": " + std::to_string(bytes) + " bytes:" + phases);
  state.device_peer_table = memory->table.get();
  state.storage = std::move(memory);
}

Transport* CudaDeviceBackend::route(int target, std::string* why) const {
  if (no_route_[target].empty()) return const_cast<IpcTransport*>(&ipc_);
  if (why) *why = no_route_[target];
  return nullptr;
}

void CudaDeviceBackend::wait_until(const WindowState& sig, std::size_t index, Cmp cmp, std::uint64_t value,
                                   Stream stream) {
  auto* word = static_cast<std::uint64_t*>(sig.local) + index;
  const auto addr = reinterpret_cast<CUdeviceptr>(word);
  // The stream's front end waits for GE / EQ (and GT as GE value+1); the other comparisons
  // (and MESHMEM_STREAM_WAIT=kernel) use a polling kernel.
  const bool memop = wait_kind_ == Options::StreamWait::Memop;
  CUresult rc = CUDA_SUCCESS;
  if (memop && (cmp == Cmp::GE || (cmp == Cmp::GT && value != UINT64_MAX))) {
    rc = ipc::cuda_driver().cuStreamWaitValue64(stream, addr, cmp == Cmp::GT ? value + 1 : value,
                                                CU_STREAM_WAIT_VALUE_GEQ | wait_flags_);
  } else if (memop && cmp == Cmp::EQ) {
    rc = ipc::cuda_driver().cuStreamWaitValue64(stream, addr, value, CU_STREAM_WAIT_VALUE_EQ | wait_flags_);
  } else {
    const cudaError_t k = cuda::launch_wait(word, cmp, value, stream);
    if (k != cudaSuccess) ipc::check_cuda(k, "wait kernel launch", where("comm.wait_until"));
  }
  if (rc != CUDA_SUCCESS) ipc::check_cu(rc, "cuStreamWaitValue64", where("comm.wait_until"));
}

void CudaDeviceBackend::barrier(Stream stream) {
  const Topology& topo = ctx_.topo;
  if (!node_barrier_) {
    proxy_->enqueue(stream, where("comm.barrier(stream)"));
    return;
  }
  ++epoch_;
  if (topo.size == 1) return;
  // The call's name for messages, built only when one is raised (this is a hot path).
  auto what = [&] { return where("comm.barrier(stream)"); };
  const int slot = static_cast<int>(epoch_ % kEventRing);
  if (meet_first_) {
    // A rank whose stream is idle has its earlier work complete: the meeting itself orders
    // that work before every peer's later work. Only the work of busy streams needs the GPU.
    const cudaError_t idle = cudaStreamQuery(stream);
    if (idle == cudaErrorNotReady) {
      if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();  // not an error
    } else if (idle != cudaSuccess) {
      ipc::check_cuda(idle, "cudaStreamQuery", what());
    }
    const bool busy = idle == cudaErrorNotReady;
    // Events are recorded before the meeting, so that no peer can wait on this slot
    // before it marks this barrier. The ring: a peer cannot re-record slot k before this
    // rank has issued its waits on it (that needs this rank at a later meeting).
    if (busy && barrier_kind_ == Options::Barrier::Event) {
      const cudaError_t rc = cudaEventRecord(events_[slot].get(), stream);
      if (rc != cudaSuccess) ipc::check_cuda(rc, "cudaEventRecord", what());
    }
    meeting_->meet(busy, peer_busy_, "comm.barrier(stream)");
    if (barrier_kind_ == Options::Barrier::Event) {
      for (int r : topo.node_ranks) {
        if (r == topo.rank || !peer_busy_[r]) continue;
        const cudaError_t rc = cudaStreamWaitEvent(stream, peer_events_[slot][r].get(), 0);
        if (rc != cudaSuccess) ipc::check_cuda(rc, "cudaStreamWaitEvent", what());
      }
      return;
    }
    // Every rank saw the same notes: either all skip the GPU part or all take part (the
    // flags of ranks that skip it fall behind; waits compare with >=, so nothing is reset).
    if (std::none_of(topo.node_ranks.begin(), topo.node_ranks.end(), [&](int r) { return peer_busy_[r]; })) return;
  }
  switch (barrier_kind_) {
    case Options::Barrier::Flag: {
      for (auto& op : barrier_ops_) op.writeValue.value64 = epoch_;  // waitValue.value64 aliases it
      // The driver takes at most 256 operations a call; the parts stay in order on the stream.
      for (std::size_t i = 0; i < barrier_ops_.size(); i += 256) {
        const unsigned count = static_cast<unsigned>(std::min<std::size_t>(256, barrier_ops_.size() - i));
        const CUresult rc = ipc::cuda_driver().cuStreamBatchMemOp(stream, count, barrier_ops_.data() + i, 0);
        if (rc != CUDA_SUCCESS) ipc::check_cu(rc, "cuStreamBatchMemOp", what());
      }
      return;
    }
    case Options::Barrier::Auto:  // resolved in the constructor
    case Options::Barrier::Kernel: {
      const cudaError_t rc = cuda::launch_barrier(static_cast<std::uint64_t* const*>(flags_.device_peer_table),
                                                  static_cast<std::uint64_t*>(flags_.local), topo.rank, topo.size, epoch_, stream);
      if (rc != cudaSuccess) ipc::check_cuda(rc, "barrier kernel launch", what());
      return;
    }
    case Options::Barrier::Event:  // met above: events always come with a meeting
      return;
  }
}

class KernelCopyPlan final : public DeviceCopyPlan {
 public:
  KernelCopyPlan(const std::vector<DeviceCopy>& copies, int rank) : count_(static_cast<int>(copies.size())), rank_(rank) {
    std::vector<cuda::Copy2D> table;
    for (const DeviceCopy& c : copies) {
      table.push_back({static_cast<char*>(c.dst), static_cast<const char*>(c.src), c.width, c.height, c.src_pitch, c.dst_pitch});
      largest_ = std::max<std::uint64_t>(largest_, c.width * c.height);
    }
    if (table.empty()) return;
    void* p = nullptr;
    const std::string what = "halo copy plan on rank " + std::to_string(rank_);
    ipc::check_cuda(cudaMalloc(&p, table.size() * sizeof(cuda::Copy2D)), "cudaMalloc", what);
    table_.reset(p);
    ipc::check_cuda(cudaMemcpy(p, table.data(), table.size() * sizeof(cuda::Copy2D), cudaMemcpyHostToDevice), "cudaMemcpy", what);
  }
  void run(Stream stream) override {
    const cudaError_t rc = cuda::launch_copies(static_cast<const cuda::Copy2D*>(table_.get()), count_, largest_, stream);
    if (rc != cudaSuccess) ipc::check_cuda(rc, "halo copy kernel launch", "HaloExchange::exchange on rank " + std::to_string(rank_));
  }

 private:
  DevicePtr table_;
  int count_;
  int rank_;
  std::uint64_t largest_ = 0;
};

std::unique_ptr<DeviceCopyPlan> CudaDeviceBackend::make_copy_plan(const std::vector<DeviceCopy>& copies) {
  return std::make_unique<KernelCopyPlan>(copies, ctx_.topo.rank);
}

void CudaDeviceBackend::signal_and_wait(const WindowState& sig, const std::vector<int>& send_to,
                                        const std::vector<int>& wait_for, std::uint64_t value, Stream stream) {
  const int me = ctx_.topo.rank;
  std::vector<CUstreamBatchMemOpParams> ops;
  ops.reserve(send_to.size() + wait_for.size());
  for (int r : send_to) {
    CUstreamBatchMemOpParams op{};
    op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
    op.writeValue.address = reinterpret_cast<CUdeviceptr>(static_cast<std::uint64_t*>(sig.peer[r]) + me);
    op.writeValue.value64 = value;
    op.writeValue.flags = 0;  // memory barrier first: the puts before it land first
    ops.push_back(op);
  }
  for (int r : wait_for) {
    CUstreamBatchMemOpParams op{};
    op.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
    op.waitValue.address = reinterpret_cast<CUdeviceptr>(static_cast<std::uint64_t*>(sig.local) + r);
    op.waitValue.value64 = value;
    op.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ | wait_flags_;
    ops.push_back(op);
  }
  for (std::size_t i = 0; i < ops.size(); i += 256) {
    const unsigned count = static_cast<unsigned>(std::min<std::size_t>(256, ops.size() - i));
    const CUresult rc = ipc::cuda_driver().cuStreamBatchMemOp(stream, count, ops.data() + i, 0);
    if (rc != CUDA_SUCCESS) ipc::check_cu(rc, "cuStreamBatchMemOp", where("HaloExchange::exchange"));
  }
}

}  // namespace

bool device_runtime_available(std::string* why) {
  auto fail = [&](const std::string& text) {
    if (why) *why = text;
    return false;
  };
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess) {
    (void)cudaGetLastError();
    return fail(std::string("no usable CUDA device: cudaGetDeviceCount: ") + cudaGetErrorString(rc) +
                (rc == cudaErrorInsufficientDriver ? " (no NVIDIA driver is loaded, or it is older than CUDA " +
                                                         std::to_string(CUDART_VERSION / 1000) + ")"
                                                   : ""));
  }
  if (count == 0) return fail("no CUDA device is visible");
  try {
    const auto& drv = ipc::cuda_driver();
    int device = 0;
    ipc::check_cuda(cudaGetDevice(&device), "cudaGetDevice", "device check");
    CUdevice dev = 0;
    ipc::check_cu(drv.cuDeviceGet(&dev, device), "cuDeviceGet", "device check");
    int vmm = 0, fd = 0;
    ipc::check_cu(drv.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev), "cuDeviceGetAttribute", "device check");
    ipc::check_cu(drv.cuDeviceGetAttribute(&fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev), "cuDeviceGetAttribute", "device check");
    if (!vmm) return fail("device " + std::to_string(device) + " does not support CUDA virtual memory management");
    if (!fd) return fail("device " + std::to_string(device) + " cannot export memory as POSIX file descriptors");
  } catch (const Error& e) {
    return fail(e.what());
  }
  return true;
}

int set_device_modulo(int ordinal) {
  if (!device_runtime_available(nullptr)) return -1;
  int count = 0;
  ipc::check_cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount", "select_local_device");
  const int device = ordinal % count;
  ipc::check_cuda(cudaSetDevice(device), "cudaSetDevice", "select_local_device");
  return device;
}

std::unique_ptr<DeviceBackend> make_device_backend(const DeviceContext& ctx, std::string* why) {
  const std::string what = "meshmem::Comm (device check)";
  std::string mine_why;
  const bool ok = device_runtime_available(&mine_why);
  int device = -1;
  if (ok) (void)cudaGetDevice(&device);
  // Device windows exist on all ranks or on none: the first rank that cannot says why.
  const std::int32_t flag = ok ? 1 : 0;
  std::vector<std::int32_t> all(static_cast<std::size_t>(ctx.topo.size));
  ctx.boot.allgather(&flag, all.data(), sizeof(flag), what);
  const auto first = std::find(all.begin(), all.end(), 0);
  if (first != all.end()) {
    const int speaker = static_cast<int>(first - all.begin());
    std::uint64_t len = ctx.topo.rank == speaker ? mine_why.size() : 0;
    ctx.boot.broadcast(&len, sizeof(len), speaker, what);
    std::string text(len, '\0');
    if (ctx.topo.rank == speaker) text = mine_why;
    if (len > 0) ctx.boot.broadcast(text.data(), len, speaker, what);
    *why = "rank " + std::to_string(speaker) + ": " + text;
    return nullptr;
  }
  return std::make_unique<CudaDeviceBackend>(ctx, device);
}

}  // namespace meshmem::detail
