// SlotRing: whose turn each of this rank's staging slots is, shared by the agent's two users
// of slots (the visible path and the channel writer): what last used a slot (the copy out of
// it, an event, or a hidden reader that has not yet consumed the descriptor naming it), and
// the next one in turn. It runs on the agent's thread only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/staged/staging_site.hpp"

namespace meshmem::detail {

class SlotRing {
 public:
  explicit SlotRing(const StagingSite& site);

  // A slot that may be written now, the next in turn first: one a hidden reader consumed (as
  // the host sees), or one whose last copy out was a visible transfer's (its event: waited for
  // on the GPU, or, `on_host`, seen done). False if none.
  bool take(bool on_host, std::size_t* s);
  char* address(std::size_t s) const { return site_.slots + s * site_.chunk; }
  // The event a copy into slot s waits for on the GPU (null: none).
  cudaEvent_t last_copy_out(std::size_t s) const { return use_[s].event; }
  // Slot s is held by a copy: free once `event` is done (on the GPU's side).
  void held_by_copy(std::size_t s, cudaEvent_t event) { use_[s] = Use{event, -1, 0}; }
  // Slot s is named by descriptor `sequence` of the channel to `reader`: free once it consumed that.
  void posted_to(std::size_t s, int reader, std::uint64_t sequence) { use_[s] = Use{nullptr, reader, sequence}; }
  // `reader`'s process ended: its slots are held by the copies into them only, each behind
  // `own` (recorded now on `lane`, the copies' lane). Returns how many it had not consumed.
  std::size_t take_back_from(int reader, const std::vector<cudaEvent_t>& own, cudaStream_t lane);
  // Which hidden readers hold slots, for a timeout's message.
  std::string holders() const;

 private:
  struct Use {
    cudaEvent_t event = nullptr;
    int reader = -1;
    std::uint64_t sequence = 0;
  };
  const StagingSite& site_;
  std::vector<Use> use_;
  std::size_t next_ = 0;
};

}  // namespace meshmem::detail
