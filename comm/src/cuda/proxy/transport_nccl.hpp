// NcclTransport: device windows of ranks on other nodes through NCCL (libnccl loaded at run
// time, nccl_library.hpp), a ProxyTransport whose wire is ncclSend / ncclRecv, one
// communicator per ordered pair (no send/receive deadlock), connected within MESHMEM_TIMEOUT.
// Why, and its limits: docs/transports/nccl.md.
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
