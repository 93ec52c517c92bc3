// The time limit of a halo exchange whose neighbour waits are stream memory operations
// (cuStreamWaitValue64, where ranks share a GPU: a waiting kernel would hold the time-sliced
// GPU from the neighbours it waits for). Such a wait cannot give up by itself, so a thread
// of the exchange plan watches each exchange: an event before its waits (they began) and one
// after (they passed). An exchange whose waits began more than MESHMEM_TIMEOUT ago and have
// not passed gets the Halo fault in the Comm's fault record, naming the first neighbour whose
// word is short (the Comm's next call raises it, as after a waiting kernel's timeout), and
// its stream is released by writing the awaited exchange number into the short words. The
// thread starts with the plan's first such exchange and sleeps while none is listed.
// A released exchange's words were written by the watch, not by its late neighbour, whose
// halos may still land later: the plan is then failed for good (released()). Exchanges
// already enqueued behind the released one are not: they go on with what lands, and only the
// recorded fault says so (docs/errors.md: the stream's data is not to be trusted after a
// timeout).
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cuda/runtime/kernels.hpp"

namespace meshmem::detail {

class HaloWatch {
 public:
  // `words[i]`: this rank's signal word (device memory) written by neighbour `ranks[i]`;
  // `fault`: the Comm's fault record (pinned, one address for host and device).
  HaloWatch(int device, std::chrono::milliseconds limit, cuda::DeviceFault* fault, std::uint64_t window,
            std::vector<const std::uint64_t*> words, std::vector<int> ranks, std::string what);
  // Waits until the exchanges still listed have passed or been released (each within its
  // limit): a release touches the signal words, which the owner gives back after this.
  ~HaloWatch();
  HaloWatch(const HaloWatch&) = delete;
  HaloWatch& operator=(const HaloWatch&) = delete;

  // Before exchange `epoch`'s waits are enqueued on `stream`, and after.
  void began(cudaStream_t stream);
  void enqueued(cudaStream_t stream, std::uint64_t epoch);
  // "" while no exchange was released; else what happened (the exchange and the neighbour).
  std::string released() const;

 private:
  struct Shared;
  std::shared_ptr<Shared> shared_;
  cudaEvent_t began_ = nullptr;  // taken by began(), listed by enqueued()
};

}  // namespace meshmem::detail
