// IpcTransport: device windows of peers on this node, mapped here through CUDA VMM (the
// peer's allocation exported as a POSIX descriptor, passed by FdExchange, imported and
// mapped). Puts and gets are stream-ordered copies through the mapped pointer: a copy
// kernel up to MESHMEM_IPC_SM_COPY_MAX bytes (lower latency), the copy engine above it (full
// bandwidth). Signals follow their data on the same stream: one fused kernel for small
// put_signals, else the copy then a stream write (Set) or a one-thread kernel (Add).
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "transport.hpp"
#include "meshmem/ipc/vmm.hpp"

namespace meshmem::detail {

class GpuDevice;

class IpcTransport final : public Transport {
 public:
  // Collective: maps one granule of every node peer, to learn which it can map.
  explicit IpcTransport(const CommContext& ctx);
  TransportKind kind() const override { return TransportKind::Ipc; }
  Capabilities capabilities() const override { return Capabilities{true, true, true, true}; }
  bool serves(Memory memory) const override { return memory == Memory::Device && device_ != nullptr; }
  Reach reach(int rank, Memory memory) const override;
  std::unique_ptr<WindowAttachment> attach(WindowState& win, const std::vector<bool>& routed,
                                           const std::string& what) override;
  void put(const WindowState& win, int target, std::size_t offset, const void* src,
           std::size_t bytes, const SignalUpdate& signal, Stream stream) override;
  void get(void* dst, const WindowState& win, int target, std::size_t offset, std::size_t bytes,
           Stream stream) override;
  void put_strided(const WindowState& win, int target, std::size_t dst_offset, std::size_t dst_pitch,
                   const void* src, std::size_t src_pitch, std::size_t width, std::size_t height,
                   Stream stream) override;
  // A put is complete at its target once its stream passed it (copies and copy kernels
  // finish before the stream moves on): nothing to add.
  void quiet(Stream) override {}

 private:
  void probe_peers();
  void verify_peers(const ipc::VmmAllocation& probe, const std::vector<ipc::PeerMapping>& mapped, bool corrupt,
                    const std::string& staged_hint);
  void probe_atomics(const std::vector<std::string>& bus);  // bus ids by rank
  bool use_sm(const void* local, std::size_t bytes, std::size_t max) const;
  // Error context, built only when a call failed (puts are a hot path).
  std::string what(const char* op, int target) const;

  CommContext ctx_;
  GpuDevice* device_;  // null where device windows are unavailable
  std::size_t sm_copy_max_;
  std::size_t fused_signal_max_;
  std::vector<std::string> no_route_;  // by rank: why it cannot be reached ("" = it can)
  std::vector<std::string> no_atomics_;  // by rank: why signal Add is refused ("" = native atomics)
};

// Whether kernels of the current device can dereference `p` (device, managed, or mapped
// pinned host memory).
bool device_accessible(const void* p);

}  // namespace meshmem::detail
