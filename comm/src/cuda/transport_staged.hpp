// StagedTransport: device windows of node peers whose GPU this GPU cannot access (no peer
// access: PCIe without P2P, IOMMU/ACS, or forced with MESHMEM_TRANSPORTS=staged,...).
// Data goes through this rank's region of the node's staging pool (staging_pool.hpp) in
// chunks: device-to-host on the source GPU's copy engine, host-to-device on the target GPU's,
// double-buffered over MESHMEM_STAGING_SLOTS slots so that the two run at once.
//
// Who drives it: a staging agent (a thread of this rank) enqueues the chunks on streams of
// its own, one per GPU, on the source and the target GPU (the target's window is mapped here
// for the target's GPU: no peer access is needed for that). The caller's thread only records
// an event, enqueues one wait on its stream and hands the request over, so a put returns in
// microseconds whatever its size (the chunks of a 1 GiB put are hundreds of driver calls).
// The caller's stream then waits on the GPU until the agent's last copy (and the signal)
// landed: a word in the pool that the agent's stream writes, polled by a one-thread kernel
// that times out like every device wait. Transfers of this rank run one after another.
//
// Limits (this version): the target's GPU must be visible to this process (under per-rank
// CUDA_VISIBLE_DEVICES isolation the pair is not reached and says why); calls during a CUDA
// graph capture raise Error(Unsupported) before touching the capture (the agent enqueues
// later, outside the capture).
//
// Open defect: transfers queued back to back without a host synchronisation between them
// (signals in a loop, put_signal + ack rounds) never finish their first transfer on the GPU
// machines (the done word stays 0; tests Staged.SignalNeverAhead*, Staged.SignalAdd*), while
// single and synchronised transfers up to 1 GiB are correct. Hence experimental: not in the
// default MESHMEM_TRANSPORTS order. Probable cause (found by reading, not yet confirmed on a
// GPU): CUDA's lazy loading. The first launch of a kernel (the agent's signal-Add kernel, a
// test's own kernel) loads it and may synchronise the context, which waits for a polling
// transfer/signal wait that needs the agent (or the peer's agent) to make progress. meshmem now
// preloads its kernels on every GPU it uses (cuda::preload_kernels); application kernels
// launched for the first time while a staged wait is in flight remain a risk
// (CUDA_MODULE_LOADING=EAGER avoids it).
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

#include "../transport.hpp"

namespace meshmem::detail {

class CudaDeviceRuntime;
class StagingAgent;
class StagingPool;

class StagedTransport final : public Transport {
 public:
  // Collective: learns which node peers' GPUs this process sees (PCI bus ids).
  explicit StagedTransport(const CommContext& ctx);
  ~StagedTransport() override;
  TransportKind kind() const override { return TransportKind::Staged; }
  Capabilities capabilities() const override { return Capabilities{true, false, true, false}; }
  bool serves(Memory memory) const override { return memory == Memory::Device && device_ != nullptr; }
  Reach reach(int rank, Memory memory) const override;
  // Collective: makes the node's staging pool and starts the agent.
  void connect(const std::vector<bool>& routed) override;
  std::unique_ptr<WindowAttachment> attach(WindowState& win, const std::vector<bool>& routed,
                                           const std::string& what) override;
  void put(const WindowState& win, int target, std::size_t offset, const void* src, std::size_t bytes,
           const SignalUpdate& signal, Stream stream) override;
  void get(void* dst, const WindowState& win, int target, std::size_t offset, std::size_t bytes,
           Stream stream) override;
  // The caller's stream waits for each transfer's end: nothing to add.
  void quiet(Stream) override {}
  void stop() noexcept override;

  // Waits until every transfer handed to the agent has finished on the GPUs (bounded by
  // MESHMEM_TIMEOUT; false if not). A window's peer mappings go only after this.
  bool drain() noexcept;

 private:
  std::string what(const char* op, int target) const;
  void refuse_capture(Stream stream, const char* op, int target) const;
  void* mapped_part(const WindowState& win, int rank, const char* op) const;
  // Hands one transfer to the agent; the caller's stream waits for its end.
  void transfer(void* dst, int dst_device, const void* src, int src_device, std::size_t bytes, std::uint64_t* signal,
                std::uint64_t value, SignalOp op, int peer, Stream stream, const char* name);

  CommContext ctx_;
  CudaDeviceRuntime* device_;       // null where device windows are unavailable
  std::vector<int> peer_device_;    // by rank: its GPU as this process numbers it, -1 if hidden
  std::vector<std::string> no_route_;
  std::size_t chunk_;
  int slots_;
  std::unique_ptr<StagingPool> pool_;
  std::unique_ptr<StagingAgent> agent_;
};

}  // namespace meshmem::detail
