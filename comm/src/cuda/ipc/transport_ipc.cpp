#define MESHMEM_DEFINING_GPU_PART
#include "cuda/ipc/transport_ipc.hpp"

#include <algorithm>
#include <cstring>
#include <string>

#include "bootstrap.hpp"
#include "fd_exchange.hpp"
#include "gpu_part.hpp"
#include "knobs.hpp"
#include "log.hpp"
#include "topology.hpp"
#include "cuda/runtime/cuda_owners.hpp"
#include "cuda/runtime/gpu_device.hpp"
#include "cuda/runtime/stream_ops.hpp"
#include "cuda/runtime/device_window.hpp"
#include "cuda/runtime/kernels.hpp"
#include "meshmem/error.hpp"
#include "cuda/ipc/transport_ipc_knobs.hpp"
#include "meshmem/ipc/cuda_driver.hpp"
#include "meshmem/ipc/vmm.hpp"

namespace meshmem::detail {

namespace {

// The ipc knobs: transport_ipc_knobs.hpp.

// The node peers' parts of one device window, mapped here.
// Released by the device runtime's WindowReleaser once the GPU's earlier work is done.
class IpcAttachment final : public WindowAttachment {
 public:
  std::vector<ipc::PeerMapping> peers;  // by rank; empty where not mapped
};

}  // namespace

std::unique_ptr<Transport> make_ipc_transport(const CommContext& ctx) { return std::make_unique<IpcTransport>(ctx); }

IpcTransport::IpcTransport(const CommContext& ctx)
    : ctx_(ctx),
      device_(gpu_device_of(ctx.device)),
      sm_copy_max_(kSmCopyMax.get(ctx.options)),
      fused_signal_max_(kFusedSignalMax.get(ctx.options)) {
  const Topology& topo = ctx_.topo;
  no_route_.assign(static_cast<std::size_t>(topo.size), std::string());
  for (int r = 0; r < topo.size; ++r)
    if (!topo.same_node(r))
      no_route_[r] = "rank " + std::to_string(r) + " is on node " + std::to_string(topo.node_of[r]) +
                     ", this rank on node " + std::to_string(topo.node()) +
                     " (device windows across nodes go through the nccl or mpi-device transport)";
  if (device_ != nullptr) probe_peers();
}

// Maps one granule of every node peer: where that fails (no peer access between the two
// GPUs, or the driver refuses), the pair is not reached, and says why.
void IpcTransport::probe_peers() {
  const std::string what = "meshmem::Comm (ipc peer probe)";
  const Topology& topo = ctx_.topo;
  const std::size_t granule = device_->granularity();
  ipc::VmmAllocation probe;
  ipc::UniqueFd fd;
  agreed_step(ctx_.boot, what, [&] {
    probe = ipc::VmmAllocation::create(granule, device_->device());
    fd = probe.export_fd();
    // Zeroed, so that a write-and-verify pattern that never arrives is not found in memory
    // an earlier probe of this process left behind.
    CurrentDevice current(device_->device());
    ipc::check_cuda(cudaMemset(probe.data(), 0, granule), "cudaMemset (ipc probe)", what);
    ipc::check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (ipc probe)", what);
  });
  std::vector<ipc::UniqueFd> received = ctx_.fds.exchange(fd.get(), what);
  const std::vector<std::string>& bus = device_->bus_ids();
  probe_atomics(bus);
  const std::string& mine = bus[topo.rank];
  const bool off = kPeerAccess.get(ctx_.options) == AutoOff::Off;
  const std::string staged_hint = " (the staged transport carries such pairs through pinned host memory where "
                                  "MESHMEM_TRANSPORTS lists it, as by default)";
  agreed_step(ctx_.boot, what, [&] {  // a failing driver query fails every rank alike
  for (int r : topo.node_ranks) {
    if (r == topo.rank || bus[r] == mine) continue;
    int peer_device = -1, can = 1;
    if (off) {
      no_route_[r] = "MESHMEM_IPC_PEER_ACCESS=off: rank " + std::to_string(r) + "'s GPU (" + bus[r] +
                     ") is another GPU than this rank's (" + mine + ")" + staged_hint;
    } else if (cudaDeviceGetByPCIBusId(&peer_device, bus[r].c_str()) != cudaSuccess) {
      (void)cudaGetLastError();  // hidden (isolation): the probe mapping below decides
    } else if (peer_device != device_->device()) {
      ipc::check_cuda(cudaDeviceCanAccessPeer(&can, device_->device(), peer_device), "cudaDeviceCanAccessPeer", what);
      if (!can)
        no_route_[r] = "the driver reports no peer access from GPU " + mine + " to rank " + std::to_string(r) +
                       "'s GPU " + bus[r] + " (cudaDeviceCanAccessPeer = 0)" + staged_hint;
    }
  }
  });
  std::vector<ipc::PeerMapping> mapped(static_cast<std::size_t>(topo.size));
  for (int r : topo.node_ranks) {
    if (r == topo.rank || !no_route_[r].empty()) continue;
    try {
      mapped[r] = ipc::PeerMapping::import(received[r].get(), granule, device_->device());
    } catch (const Error& e) {
      no_route_[r] = "the GPU memory of rank " + std::to_string(r) + " cannot be mapped for " + device_->describe() +
                     " (no peer access between the GPUs?): " + e.what() + staged_hint;
      log(LogLevel::Warn, "ipc transport: no route to rank " + std::to_string(r) + ": " + no_route_[r]);
    }
  }
  const PeerVerify verify = peer_verify(ctx_.options);
  if (verify != PeerVerify::Off) verify_peers(probe, mapped, verify == PeerVerify::Corrupt, staged_hint);
}

namespace {
// Where writer w's pattern goes in a probe granule, and what it is (differs per writer and
// target, so that a write landing in the wrong place is caught too).
constexpr std::size_t kVerifyBytes = 4096;
std::vector<std::uint64_t> verify_pattern(int writer, int target) {
  std::vector<std::uint64_t> p(kVerifyBytes / sizeof(std::uint64_t));
  std::uint64_t x = 0x9e3779b97f4a7c15ull * (static_cast<std::uint64_t>(writer) + 1) ^
                    (static_cast<std::uint64_t>(target) + 1) * 0xbf58476d1ce4e5b9ull;
  for (auto& w : p) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    w = x;
  }
  return p;
}
}  // namespace

// Write-and-verify: each rank copies a pattern into its slot (its place among the node's
// ranks) of every mapped peer's probe granule and reads it back through the mapping; then
// each rank checks in its own memory which writers' patterns arrived. A pair is reached in
// either direction only where all four held (a driver can grant peer access that drops or
// corrupts writes); the two ranks of a pair decide alike. Collective over the Comm: each
// rank contributes what it saw of its node (at most one granule's worth of slots).
void IpcTransport::verify_peers(const ipc::VmmAllocation& probe, const std::vector<ipc::PeerMapping>& mapped,
                                bool corrupt, const std::string& staged_hint) {
  const std::string what = "meshmem::Comm (ipc write-and-verify)";
  const Topology& topo = ctx_.topo;
  const std::size_t slots = device_->granularity() / kVerifyBytes;
  const std::size_t local = topo.node_index(topo.rank);
  // [0, slots): written through the mapping to that node rank and read back intact; [slots,
  // 2 slots): that node rank's pattern arrived here.
  std::vector<char> seen(2 * slots, 0);
  std::vector<std::string> failure(static_cast<std::size_t>(topo.size));
  agreed_step(ctx_.boot, what, [&] {
    CurrentDevice current(device_->device());
    if (local >= slots) return;
    for (int r : topo.node_ranks) {
      if (mapped[r].data() == nullptr || topo.node_index(r) >= slots) continue;
      auto pattern = verify_pattern(topo.rank, r);
      if (corrupt) pattern[pattern.size() / 2] ^= 1;
      char* at = static_cast<char*>(mapped[r].data()) + local * kVerifyBytes;
      std::vector<std::uint64_t> back(pattern.size(), 0);
      cudaError_t rc = cudaMemcpy(at, pattern.data(), kVerifyBytes, cudaMemcpyHostToDevice);
      if (rc == cudaSuccess) rc = cudaMemcpy(back.data(), at, kVerifyBytes, cudaMemcpyDeviceToHost);
      if (rc != cudaSuccess) {
        (void)cudaGetLastError();
        failure[r] = std::string("a copy through the mapping failed: ") + cudaGetErrorString(rc);
        continue;
      }
      seen[topo.node_index(r)] = back == pattern ? 1 : 0;
    }
  });
  ctx_.boot.arrive(what);  // every write is done (synchronous copies) before anyone looks
  agreed_step(ctx_.boot, what, [&] {
    CurrentDevice current(device_->device());
    const std::size_t n = std::min(slots, topo.node_ranks.size());
    std::vector<std::uint64_t> mine(n * kVerifyBytes / sizeof(std::uint64_t));
    ipc::check_cuda(cudaMemcpy(mine.data(), probe.data(), mine.size() * sizeof(std::uint64_t), cudaMemcpyDeviceToHost),
                    "cudaMemcpy (this rank's probe)", what);
    const std::size_t words = kVerifyBytes / sizeof(std::uint64_t);
    for (int w : topo.node_ranks) {
      const std::size_t i = topo.node_index(w);
      if (i >= n) continue;
      const auto want = verify_pattern(w, topo.rank);
      seen[slots + i] = std::equal(want.begin(), want.end(), mine.begin() + static_cast<std::ptrdiff_t>(i * words)) ? 1 : 0;
    }
  });
  std::vector<char> all(static_cast<std::size_t>(topo.size) * seen.size());
  ctx_.boot.allgather(seen.data(), all.data(), seen.size(), what);
  auto at = [&](int rank, std::size_t i) { return all[static_cast<std::size_t>(rank) * seen.size() + i] == 1; };
  for (int r : topo.node_ranks) {
    if (r == topo.rank || mapped[r].data() == nullptr) continue;
    const std::size_t them = topo.node_index(r);
    if (local >= slots || them >= slots) {
      log(LogLevel::Info, "ipc transport: more node ranks than write-and-verify slots; the pair with rank " +
                              std::to_string(r) + " is not checked");
      continue;
    }
    const bool to_them = at(topo.rank, them) && at(r, slots + local);
    const bool to_me = at(r, local) && at(topo.rank, slots + them);
    if (to_them && to_me) continue;
    no_route_[r] = "peer access between this rank's GPU and rank " + std::to_string(r) +
                   "'s is granted but broken: a pattern written " + (to_them ? "by rank " + std::to_string(r) + " into this rank" : "by this rank into rank " + std::to_string(r)) +
                   " through the mapping " + (failure[r].empty() ? "did not arrive intact" : failure[r]) +
                   " (write-and-verify when the Comm was made; MESHMEM_IPC_PEER_VERIFY)" + staged_hint;
    log(LogLevel::Warn, "ipc transport: no route to rank " + std::to_string(r) + ": " + no_route_[r]);
  }
}

// Which node peers' GPUs this GPU reaches with native atomics (the same GPU always does).
void IpcTransport::probe_atomics(const std::vector<std::string>& bus) {
  const std::string what = "meshmem::Comm (ipc peer atomics)";
  const Topology& topo = ctx_.topo;
  const std::string& mine = bus[topo.rank];
  const bool off = kPeerAtomics.get(ctx_.options) == AutoOff::Off;
  no_atomics_.assign(static_cast<std::size_t>(topo.size), std::string());
  for (int r : topo.node_ranks) {
    if (r == topo.rank || bus[r] == mine) continue;
    if (off) {
      no_atomics_[r] = "MESHMEM_IPC_PEER_ATOMICS=off";
      continue;
    }
    int peer_device = -1;
    if (cudaDeviceGetByPCIBusId(&peer_device, bus[r].c_str()) != cudaSuccess) {
      (void)cudaGetLastError();
      log(LogLevel::Info, "ipc transport: rank " + std::to_string(r) + "'s GPU (" + bus[r] +
                              ") is hidden from this process: native peer atomics cannot be checked; signal Add to it "
                              "assumes them");
      continue;
    }
    int native = 0;
    ipc::check_cuda(cudaDeviceGetP2PAttribute(&native, cudaDevP2PAttrNativeAtomicSupported, device_->device(), peer_device),
                    "cudaDeviceGetP2PAttribute(NativeAtomicSupported)", what);
    if (!native)
      no_atomics_[r] = "the driver reports no native atomics from GPU " + mine + " to GPU " + bus[r] +
                       " (CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED = 0)";
  }
}

Reach IpcTransport::reach(int rank, Memory memory) const {
  if (memory != Memory::Device) return Reach::no("device windows only");
  if (device_ == nullptr) return Reach::no("device windows are unavailable");
  if (!no_route_[rank].empty()) return Reach::no(no_route_[rank]);
  return Reach::yes();
}

std::unique_ptr<WindowAttachment> IpcTransport::attach(WindowState& win, const std::vector<bool>& routed,
                                                       const std::string& what) {
  const Topology& topo = ctx_.topo;
  const auto& memory = static_cast<const DeviceWindowMemory&>(*win.storage);
  std::vector<ipc::UniqueFd> received = exchange_part_fds(ctx_, win, what);
  auto attachment = std::make_unique<IpcAttachment>();
  attachment->peers.resize(static_cast<std::size_t>(topo.size));
  agreed_step(ctx_.boot, what, [&] {
    for (int r : topo.node_ranks) {
      if (r == topo.rank || !routed[r]) continue;
      attachment->peers[r] = ipc::PeerMapping::import(received[r].get(), memory.bytes, device_->device());
      win.peer[r] = attachment->peers[r].data();
    }
  });
  return attachment;
}

bool device_accessible(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error of an unknown pointer
    return false;
  }
  switch (attr.type) {
    case cudaMemoryTypeDevice:
    case cudaMemoryTypeManaged: return true;
    case cudaMemoryTypeHost: return attr.devicePointer == p;
    default: return false;
  }
}

bool IpcTransport::use_sm(const void* local, std::size_t bytes, std::size_t max) const {
  return bytes <= max && device_accessible(local);
}

std::string IpcTransport::what(const char* op, int target) const {
  return std::string("ipc ") + op + " between rank " + std::to_string(ctx_.topo.rank) + " and rank " + std::to_string(target);
}

void IpcTransport::put(const WindowState& win, int target, std::size_t offset, const void* src,
                       std::size_t bytes, const SignalUpdate& signal, Stream stream) {
  char* dst = static_cast<char*>(win.peer[target]) + offset;
  std::uint64_t* word = nullptr;
  if (signal.sig != nullptr) word = static_cast<std::uint64_t*>(signal.sig->peer[target]) + signal.index;
  // Refused before anything is enqueued: a remote atomic add could lose updates.
  if (word != nullptr && signal.op == SignalOp::Add && !no_atomics_[target].empty())
    throw Error(ErrorCode::Unsupported, what("signal Add", target) + ": " + no_atomics_[target] +
                                            ", so a remote atomic add could lose updates; use SignalOp::Set (for "
                                            "example one word per sender)");

  // Small put_signal: one kernel copies, then signals (no second stream operation). An Add
  // without data also needs the kernel; a Set without data is one stream write below.
  if (word != nullptr && ((bytes == 0 && signal.op == SignalOp::Add) || (bytes > 0 && use_sm(src, bytes, fused_signal_max_)))) {
    const cudaError_t rc = cuda::launch_copy(dst, src, bytes, word, signal.value, signal.op, stream, device_->early_launch());
    if (rc != cudaSuccess) ipc::check_cuda(rc, "copy+signal kernel launch", what("put_signal", target));
    return;
  }
  if (bytes > 0) {
    const bool sm = use_sm(src, bytes, sm_copy_max_);
    const cudaError_t rc = sm ? cuda::launch_copy(dst, src, bytes, nullptr, 0, SignalOp::Set, stream, device_->early_launch())
                              : cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream);
    if (rc != cudaSuccess) ipc::check_cuda(rc, sm ? "copy kernel launch" : "cudaMemcpyAsync", what("put", target));
  }
  if (word == nullptr) return;
  if (signal.op == SignalOp::Set) {
    // The default flags put a memory barrier before the write: the copy lands first.
    const CUresult rc = ipc::cuda_driver().cuStreamWriteValue64(stream, reinterpret_cast<CUdeviceptr>(word), signal.value, 0);
    if (rc != CUDA_SUCCESS) ipc::check_cu(rc, "cuStreamWriteValue64", what("put_signal", target));
  } else {
    const cudaError_t rc = cuda::launch_copy(nullptr, nullptr, 0, word, signal.value, signal.op, stream, device_->early_launch());
    if (rc != cudaSuccess) ipc::check_cuda(rc, "signal kernel launch", what("put_signal", target));
  }
}

void IpcTransport::put_strided(const WindowState& win, int target, std::size_t dst_offset, std::size_t dst_pitch,
                               const void* src, std::size_t src_pitch, std::size_t width, std::size_t height,
                               Stream stream) {
  if (width == 0 || height == 0) return;
  char* dst = static_cast<char*>(win.peer[target]) + dst_offset;
  // One copy-engine operation for the whole strided region (a column of a grid, say).
  const cudaError_t rc = cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, cudaMemcpyDefault, stream);
  if (rc != cudaSuccess) ipc::check_cuda(rc, "cudaMemcpy2DAsync", what("strided put", target));
}

void IpcTransport::get(void* dst, const WindowState& win, int target, std::size_t offset,
                       std::size_t bytes, Stream stream) {
  if (bytes == 0) return;
  const char* src = static_cast<const char*>(win.peer[target]) + offset;
  const bool sm = use_sm(dst, bytes, sm_copy_max_);
  const cudaError_t rc = sm ? cuda::launch_copy(dst, src, bytes, nullptr, 0, SignalOp::Set, stream, device_->early_launch())
                            : cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream);
  if (rc != cudaSuccess) ipc::check_cuda(rc, sm ? "copy kernel launch" : "cudaMemcpyAsync", what("get", target));
}

}  // namespace meshmem::detail
