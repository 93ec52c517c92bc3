// ProxyWire: how a transfer proxy's bytes go from one rank's GPU to a peer's (ncclSend /
// ncclRecv, or MPI through host staging), and the proxy thread's two streams per peer.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "cuda/runtime/cuda_owners.hpp"

namespace meshmem::detail {

// How bytes of device memory go from one rank's GPU to a peer's, in the order sent per
// direction. Called from the proxy thread only.
class ProxyWire {
 public:
  virtual ~ProxyWire() = default;
  // Sends `bytes` at `src` (device memory, ready once `stream`'s earlier work has run) to
  // `peer`; `src` stays valid until the peer acknowledged it (a put) or the wire is idle.
  // `after_read` (may be empty) runs once every read of `src` is enqueued on `stream`.
  virtual void send(int peer, const void* src, std::size_t bytes, cudaStream_t stream, std::function<void()> after_read,
                    const std::string& what) = 0;
  // Receives the next `bytes` that `peer` sends into `dst` (device memory) in `stream`'s
  // order, then calls `then`, which enqueues what follows on `stream`: at once where the
  // receive is itself stream-ordered, else once the bytes are on their way into `dst`.
  virtual void recv(int peer, void* dst, std::size_t bytes, cudaStream_t stream, std::function<void()> then,
                    const std::string& what) = 0;
  // Moves transfers in progress on (the proxy thread's loop); true if anything moved.
  virtual bool progress() { return false; }
  // Sends and receives handed over and not yet enqueued on their streams (any thread).
  virtual std::size_t pending() const { return 0; }
  // Stops: with `abort` (transfers still in flight, a broken job) nothing is waited for.
  virtual void stop(bool abort) noexcept = 0;
};

// One stream per direction with a peer (the proxy thread's).
struct PeerStreams {
  std::unique_ptr<OwnedStream> out;  // sends to the peer
  std::unique_ptr<OwnedStream> in;   // receives from it
};

}  // namespace meshmem::detail
