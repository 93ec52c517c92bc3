// ProxyTransport: device windows of ranks on other nodes, moved by each rank's proxy thread.
// What the nccl and mpi-device transports share; they differ only in their ProxyWire (how
// bytes go from one GPU to another) and in how they connect.
//
// A put is a request that the initiator's proxy thread (TransferProxy, transfer_proxy.hpp)
// turns into a header over MPI and a send of its bytes over the wire:
//   initiator: records a ready event on the caller's stream, takes a done word (pinned host
//     memory) and enqueues a wait for it on the stream, hands the request to its proxy, returns.
//   initiator's proxy, once the source is ready: sends a header over MPI (window id, offset,
//     bytes, signal) and the bytes over the wire, on its stream for that peer.
//   target's proxy, on the header: receives the bytes into its window, then the signal (a
//     release store after the data, on the same stream), and once both ran answers with an
//     acknowledgement; the initiator's proxy then writes the done word and the caller's
//     stream goes on. A get is a request the target's proxy answers with a header and a send
//     from its window; the initiator's proxy receives into the destination.
// So the target makes no call, signals land after their data, and a put's stream passes it
// only once the data is at the target (quiet has nothing to add).
//
// Each peer has two streams here, one per direction, so that a receive never waits behind a
// send to the same peer (with one stream, two ranks sending to each other could each wait
// for the other's receive).
//
// Order: the proxy starts transfers in the order their sources become ready (it polls each
// one's ready event), never in call order, so a stream that waits (for a peer's signal) holds
// no other stream's transfer back. Per direction the data arrives in header order (MPI does
// not overtake between two ranks on one communicator and tag), and each wire keeps that order.
//
// A strided put (halo columns) is packed into device memory on the caller's stream, goes as
// one transfer, and is unpacked by the target's proxy stream into its rows. Pageable host
// memory goes through a stream-ordered device bounce buffer.
//
// Under graph capture a kernel rings each transfer's doorbell on every replay, the proxy
// thread (which polls them) takes the transfer up, and the kernel waits for the ticket it
// answered with (CapturedHandoff; pageable memory is refused there).
//
// Limits: a transfer costs one MPI round trip for its acknowledgement and puts to one peer
// run one after another; past 16 peers on other nodes the two streams per peer outnumber
// CUDA's 32 GPU queues and share them (a transfer may then wait behind another stream's;
// warned at start, gpu_queues.hpp); two instantiations of one captured graph running at once
// share their transfers' words (their waits can stall until the timeout); an application kernel
// launched for the first time while a transfer is in flight stalls it until MESHMEM_TIMEOUT
// under CUDA's lazy loading, as on the staged route (meshmem asks for eager loading at start:
// module_loading.hpp).
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
