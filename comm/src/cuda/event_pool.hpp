// Events that mark when a caller's stream reached a transfer (its source or destination is
// ready), for a proxy thread that starts the transfer then: the staging agent, the NCCL proxy.
// Reused rather than created per transfer (an event creation costs microseconds); every
// event the pool made is destroyed with it.
#pragma once

#include <cuda_runtime_api.h>

#include <mutex>
#include <string>
#include <vector>

namespace meshmem::detail {

class EventPool {
 public:
  EventPool() = default;
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;
  ~EventPool();

  // A spare event, or a new one (on the current device: each pool serves one device); `what`
  // names the caller in errors.
  cudaEvent_t take(const std::string& what);
  void give_back(cudaEvent_t e);

 private:
  std::mutex m_;
  std::vector<cudaEvent_t> spare_;
};

// Streams whose oldest waiting transfer is not ready, found in one scan of a list of waiting
// transfers kept in submission order. Events of one stream complete in that stream's order,
// so a transfer behind one that is not ready cannot be ready either and is not queried: a
// caller that runs far ahead of its GPU hands over thousands of transfers, and querying each
// on every poll cost the staged Jacobi 2.6 x its time per iteration.
class StreamsBehind {
 public:
  bool contains(cudaStream_t s) const;
  // The per-thread default stream is one handle for as many streams as there are threads:
  // never marked.
  void add(cudaStream_t s);

 private:
  std::vector<cudaStream_t> streams_;
};

}  // namespace meshmem::detail
