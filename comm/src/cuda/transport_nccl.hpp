// NcclTransport: device windows of ranks on other nodes, through NCCL (libnccl loaded at run
// time, nccl_library.hpp).
//
// NCCL 2.28 has no host-initiated one-sided operation (ncclPutSignal is 2.29), so a put is a
// request that each rank's proxy thread (NcclProxy, transport_nccl.cpp) turns into a matching
// ncclSend / ncclRecv pair:
//   initiator: records a ready event on the caller's stream, takes a done word (pinned host
//     memory) and enqueues a wait for it on the stream, hands the request to its proxy, returns.
//   initiator's proxy, once the source is ready: sends a header over MPI (window id, offset,
//     bytes, signal) and enqueues ncclSend on its stream for that peer.
//   target's proxy, on the header: enqueues ncclRecv into its window, then the signal (a
//     release store after the data, on the same stream), and once both ran answers with an
//     acknowledgement; the initiator's proxy then writes the done word and the caller's
//     stream goes on. A get is a request the target's proxy answers with a header and
//     ncclSend from its window; the initiator's proxy receives into the destination.
// So the target makes no call, signals land after their data, and a put's stream passes it
// only once the data is at the target (quiet has nothing to add).
//
// Why one NCCL communicator per ordered pair (two ranks, one direction each): NCCL runs a
// communicator's operations in order on the GPU, and a receive blocks until its send comes.
// With one stream for everything, A's receive of B's data can sit behind A's send to B while
// B's receive sits behind B's send to A: a deadlock that an order of headers alone cannot
// avoid (three ranks form such cycles even with rendezvous). With a communicator and a stream
// per direction, each stream depends only on the peer's proxy thread posting the matching
// receive, which never waits on a GPU. The connections are made at connect (one grouped
// exchange of a byte with every peer), so that no later ncclSend blocks its proxy on the host
// waiting for the peer's side of a connection.
//
// Order: the proxy starts transfers in the order their sources become ready (it polls each
// one's ready event), never in call order, so a stream that waits (for a peer's signal) holds
// no other stream's transfer back. Per direction the data arrives in header order (MPI does
// not overtake between two ranks on one communicator and tag).
//
// A strided put (halo columns) is packed into device memory on the caller's stream, goes as
// one transfer, and is unpacked by the target's proxy stream into its rows.
//
// Under graph capture a host node hands each transfer to the proxy on every replay, and the
// captured wait kernel reads the ticket it got (as on the staged route; pageable memory is
// refused there).
//
// Ranks of one machine in different simulated nodes, even sharing a GPU, pair up because each
// process is a host of its own for NCCL (NCCL_HOSTID set per process unless the user set it;
// then no route reaches same-GPU pairs); they reach each other over NCCL's network
// transport (NCCL_P2P_DISABLE / NCCL_SHM_DISABLE set in the process unless given).
//
// Limits of this version: a transfer costs one MPI round trip for its acknowledgement and
// puts on one stream run one after another; two instantiations of one captured graph
// running at once share their transfers' words (their waits can stall until the timeout);
// an application kernel launched for the first time while a transfer is in flight stalls
// until MESHMEM_TIMEOUT under CUDA's lazy loading, as on the staged route (seen in
// BarrierTenThousandRounds; CUDA_MODULE_LOADING=EAGER avoids it).
//
// Connect is bounded by MESHMEM_TIMEOUT (NCCL's own initialisation would wait for a late or
// dead peer forever): the communicators are made and connected nonblocking (aborted at the
// timeout), then split into blocking ones that share their resources, which the transfers
// use (a nonblocking communicator starts a thread for every ncclSend). Needs NCCL 2.18.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

#include "../transport.hpp"

namespace meshmem::detail {

class CudaDeviceRuntime;
class NcclLibrary;
class NcclProxy;
template <class Owner>
struct HandoffBoard;
struct GraphWords;
struct NcclRequest;

class NcclTransport final : public Transport {
 public:
  // Collective when the Comm spans several nodes: loads NCCL and learns which ranks could.
  explicit NcclTransport(const CommContext& ctx);
  ~NcclTransport() override;
  TransportKind kind() const override { return TransportKind::Nccl; }
  Capabilities capabilities() const override { return Capabilities{true, false, true, true}; }
  bool serves(Memory memory) const override { return memory == Memory::Device && device_ != nullptr; }
  Reach reach(int rank, Memory memory) const override;
  // Collective: an MPI communicator for the headers, two NCCL communicators per routed peer,
  // their connections, then the proxy thread.
  void connect(const std::vector<bool>& routed) override;
  std::unique_ptr<WindowAttachment> attach(WindowState& win, const std::vector<bool>& routed,
                                           const std::string& what) override;
  void put(const WindowState& win, int target, std::size_t offset, const void* src, std::size_t bytes,
           const SignalUpdate& signal, Stream stream) override;
  // The rows go packed, as one transfer (unpacked at the target by its proxy's stream).
  void put_strided(const WindowState& win, int target, std::size_t dst_offset, std::size_t dst_pitch, const void* src,
                   std::size_t src_pitch, std::size_t width, std::size_t height, Stream stream) override;
  void get(void* dst, const WindowState& win, int target, std::size_t offset, std::size_t bytes,
           Stream stream) override;
  // The caller's stream waits for each transfer's end: nothing to add.
  void quiet(Stream) override {}
  std::string describe() const override;
  void settle() noexcept override;
  void stop() noexcept override;

 private:
  std::string what(const char* op, int target) const;
  // Hands one transfer to the proxy; the caller's stream waits for its end. Under capture,
  // a host node hands it over on every replay (capture_transfer).
  void transfer(NcclRequest r, Stream stream, const char* name);
  void capture_transfer(NcclRequest r, cudaGraph_t graph, cudaStream_t stream, const char* name, GraphWords& words);

  CommContext ctx_;
  CudaDeviceRuntime* device_;
  const NcclLibrary* lib_ = nullptr;
  std::vector<std::string> no_route_;  // by rank: why not ("" where it reaches)
  std::string host_id_;  // NCCL_HOSTID this process sets, under simulated nodes ("" where none)
  std::shared_ptr<NcclProxy> proxy_;
  std::shared_ptr<HandoffBoard<NcclProxy>> board_;  // shared with captured graphs
  int finalize_keyval_;
};

}  // namespace meshmem::detail
