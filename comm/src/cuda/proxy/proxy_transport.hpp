// ProxyTransport: device windows of ranks on other nodes, moved by each rank's proxy thread
// (TransferProxy, transfer_proxy.hpp); what the nccl and mpi-device transports share. They
// differ only in their ProxyWire (proxy_wire.hpp) and in how they connect. A put's stream
// passes it only once its data is at the target. Requests, headers, ordering, capture and
// limits: docs/transports/nccl.md and docs/transports/mpi-device.md.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bootstrap.hpp"
#include "transport.hpp"
#include "cuda/runtime/block_pool.hpp"
#include "cuda/proxy/proxy_wire.hpp"
#include "cuda/runtime/gpu_device.hpp"

namespace meshmem::detail {

class TransferProxy;
template <class Owner>
struct HandoffBoard;
struct GraphWords;
struct ProxyRequest;

class ProxyTransport : public Transport {
 public:
  ~ProxyTransport() override;
  bool serves(Memory memory) const override { return memory == Memory::Device && device_ != nullptr; }
  Reach reach(int rank, Memory memory) const override;
  std::unique_ptr<WindowAttachment> attach(WindowState& win, const std::vector<bool>& routed,
                                           const std::string& what) override;
  void put(const WindowState& win, int target, std::size_t offset, const void* src, std::size_t bytes,
           const SignalUpdate& signal, Stream stream) override;
  // The rows go packed, as one transfer (unpacked at the target by its proxy's stream).
  void put_strided(const WindowState& win, int target, std::size_t dst_offset, std::size_t dst_pitch, const void* src,
                   std::size_t src_pitch, std::size_t width, std::size_t height, Stream stream) override;
  void get(void* dst, const WindowState& win, int target, std::size_t offset, std::size_t bytes,
           Stream stream) override;
  // The caller's stream waits for each transfer's end: nothing to enqueue. Raises what the
  // proxy knows failed, as the next transfer would.
  void quiet(Stream) override;
  void settle() noexcept override;
  void stop() noexcept override;

 protected:
  // `name` is the transport's ("nccl"), for messages. Ranks of this node get no route.
  ProxyTransport(const CommContext& ctx, const char* name);
  // Needs MPI_THREAD_MULTIPLE (agreed: every rank raises alike); `role` says what for.
  void require_thread_multiple(const std::string& role) const;
  // Starts the proxy thread over `control` (headers) with `wire` and the peers' streams, and
  // stops it at MPI_Finalize at the latest. Collective where connect() is.
  void start_proxy(MpiComm control, std::map<int, PeerStreams> streams, std::unique_ptr<ProxyWire> wire);
  std::string what(const char* op, int target) const;

  CommContext ctx_;
  GpuDevice* device_;
  const char* name_;
  std::vector<std::string> no_route_;  // by rank: why not ("" where it reaches)
  std::shared_ptr<TransferProxy> proxy_;

 private:
  // Raises, once, a transfer that failed since the last call (`where` begins the message).
  void raise_earlier_failure(const std::string& where);
  // Hands one transfer to the proxy; the caller's stream waits for its end. Under capture,
  // a doorbell kernel hands it over on every replay (capture_transfer).
  void transfer(ProxyRequest r, Stream stream, const char* name);
  void capture_transfer(ProxyRequest r, cudaGraph_t graph, cudaStream_t stream, const char* name, GraphWords& words);
  static int stop_on_finalize(MPI_Comm, int, void* transport, void*);

  std::shared_ptr<HandoffBoard<TransferProxy>> board_;  // shared with captured graphs
  int finalize_keyval_;
};

}  // namespace meshmem::detail
