// MpiDeviceTransport (`mpi-device`): device windows of ranks on other nodes where NCCL is
// absent or left out of MESHMEM_TRANSPORTS. The same proxy threads, headers, ordering and
// graph capture as the nccl transport (ProxyTransport, transfer_proxy.hpp); only the wire
// differs: the bytes go as MPI messages through pinned host memory.
//
// The wire (MpiWire) cuts each transfer into chunks of kChunk bytes. The sender copies a chunk
// into a free send slot on the proxy's stream to that peer (cudaMemcpyAsync device to host),
// and once the copy ran posts MPI_Isend; the slot is free again when the send completed. The
// receiver posts MPI_Irecv into free receive slots in the order the headers came, and when a
// chunk arrived copies it to its place on the proxy's stream from that peer (host to device),
// so copies on both GPUs overlap the network with up to kSlots chunks in flight each way.
// Chunks go in header order per direction (one tag, one communicator: MPI does not overtake),
// so both sides agree on every chunk's size without a word more. There are kSlots send slots
// and max(kSlots, peers) receive slots, and a receive slot is always left for each peer that
// holds none: a sent chunk holds its slot until the receiver posts its receive, and were one
// peer to take every receive slot, senders of different ranks could wait for each other in a
// cycle. A transfer of no bytes (a signal alone) waits for its turn behind the bytes of
// earlier transfers from the same peer (TransferProxy::receive).
//
// The proxy thread drives all of it (MPI_Test, cudaEventQuery): the caller's thread never
// waits, and nothing here needs a CUDA-aware MPI.
//
// Limits of this version: the pinned slots are this process's own (kSlots x kChunk each way),
// not the node's staging pool, and stay mapped until the process ends (for the next Comm:
// RegisteredSlots in the .cpp says why); device pointers are never given to MPI, even where
// the MPI library could take them (MPIX_Query_cuda_support); no barrier(stream) of its own (the
// cross-node proxy barrier serves every route).
#pragma once

#include <string>
#include <vector>

#include "cuda/proxy/proxy_transport.hpp"

namespace meshmem::detail {

class MpiDeviceTransport final : public ProxyTransport {
 public:
  explicit MpiDeviceTransport(const CommContext& ctx);
  TransportKind kind() const override { return TransportKind::MpiDevice; }
  Capabilities capabilities() const override { return Capabilities{true, false, true, true, true}; }
  // Collective: MPI communicators for the headers and the data, the pinned slots, then the
  // proxy thread.
  void connect(const std::vector<bool>& routed) override;
  std::string describe() const override;

  static constexpr std::size_t kChunk = std::size_t{4} << 20;
  static constexpr int kSlots = 8;  // per direction
};

}  // namespace meshmem::detail
