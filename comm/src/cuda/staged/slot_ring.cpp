#include "cuda/staged/slot_ring.hpp"

#include <map>

namespace meshmem::detail {

SlotRing::SlotRing(const StagingSite& site) : site_(site), use_(static_cast<std::size_t>(site.nslots)) {}

bool SlotRing::take(bool on_host, std::size_t* s) {
  const std::size_t n = use_.size();
  for (std::size_t k = 0; k < n; ++k) {
    const std::size_t i = (next_ + k) % n;
    const Use& use = use_[i];
    bool usable = true;
    if (use.reader >= 0) {
      usable = site_.consumed_by(use.reader) >= use.sequence;
    } else if (use.event != nullptr && on_host) {
      const cudaError_t rc = cudaEventQuery(use.event);
      usable = rc != cudaErrorNotReady;
      if (rc != cudaSuccess && rc != cudaErrorNotReady) (void)cudaGetLastError();
    }
    if (usable) {
      *s = i;
      next_ = (i + 1) % n;
      return true;
    }
  }
  return false;
}

std::size_t SlotRing::take_back_from(int reader, const std::vector<cudaEvent_t>& own, cudaStream_t lane) {
  std::size_t held = 0;
  for (std::size_t s = 0; s < use_.size(); ++s) {
    if (use_[s].reader != reader) continue;
    if (site_.consumed_by(reader) < use_[s].sequence) ++held;
    // After this rank's own copy into it: recorded now (a last piece's copy has no event of
    // its own), behind every copy of the lane so far.
    if (cudaEventRecord(own[s], lane) != cudaSuccess) (void)cudaGetLastError();  // the lane failed
    use_[s] = Use{own[s], -1, 0};
  }
  return held;
}

std::string SlotRing::holders() const {
  std::map<int, int> held;
  for (const Use& use : use_)
    if (use.reader >= 0 && site_.consumed_by(use.reader) < use.sequence) ++held[use.reader];
  if (held.empty()) return "no hidden peer holds a slot of this rank";
  std::string s;
  for (const auto& [reader, count] : held)
    s += (s.empty() ? "" : ", ") + std::to_string(count) + " slot(s) not yet taken by rank " + std::to_string(reader);
  return s;
}

}  // namespace meshmem::detail
