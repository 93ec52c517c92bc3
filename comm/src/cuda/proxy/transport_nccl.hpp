// NcclTransport: device windows of ranks on other nodes, through NCCL (libnccl loaded at run
// time, nccl_library.hpp), a ProxyTransport (transfer_proxy.hpp: requests, headers, ordering,
// graph capture) whose wire is ncclSend / ncclRecv.
//
// NCCL 2.28 has no host-initiated one-sided operation (ncclPutSignal is 2.29), so each rank's
// proxy thread turns a request into a matching ncclSend / ncclRecv pair on its stream per
// direction.
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
// Ranks of one machine in different simulated nodes, even sharing a GPU, pair up because each
// process is a host of its own for NCCL (NCCL_HOSTID set per process unless the user set it;
// then no route reaches same-GPU pairs); they reach each other over NCCL's network
// transport (NCCL_P2P_DISABLE / NCCL_SHM_DISABLE set in the process unless given).
//
// Connect is bounded by MESHMEM_TIMEOUT (NCCL's own initialisation would wait for a late or
// dead peer forever): the communicators are made and connected nonblocking (aborted at the
// timeout), then split into blocking ones that share their resources, which the transfers
// use (a nonblocking communicator starts a thread for every ncclSend). Needs NCCL 2.18.
// The split children reuse the roots' connections through NCCL's shared resources; a later
// NCCL that stopped sharing them would connect again at the first transfer (blocking, not
// bounded), with the same results.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

#include "cuda/barrier/barrier_resources.hpp"
#include "cuda/proxy/proxy_transport.hpp"

namespace meshmem::detail {

class NcclLibrary;

class NcclTransport final : public ProxyTransport, private BarrierResources {
 public:
  // Collective when the Comm spans several nodes: loads NCCL and learns which ranks could.
  explicit NcclTransport(const CommContext& ctx);
  TransportKind kind() const override { return TransportKind::Nccl; }
  Capabilities capabilities() const override { return Capabilities{true, false, true, true, true}; }
  // Collective: an MPI communicator for the headers, two NCCL communicators per routed peer,
  // their connections, then the proxy thread.
  void connect(const std::vector<bool>& routed) override;
  std::string describe() const override;
  // The leaders' all-reduce of barrier(stream) across nodes uses its library.
  const BarrierResources* barrier_resources() const override { return this; }

 private:
  bool reaches_nodes_over_nccl() const override { return true; }
  const NcclLibrary* nccl_library() const override { return proxy_ ? lib_ : nullptr; }
  const NcclLibrary* lib_ = nullptr;
  std::string host_id_;  // NCCL_HOSTID this process sets, under simulated nodes ("" where none)
};

}  // namespace meshmem::detail
