#include "event_pool.hpp"

#include <algorithm>

#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

EventPool::~EventPool() {
  for (cudaEvent_t e : spare_) (void)cudaEventDestroy(e);
}

cudaEvent_t EventPool::take(const std::string& what) {
  {
    std::lock_guard<std::mutex> lock(m_);
    if (!spare_.empty()) {
      cudaEvent_t e = spare_.back();
      spare_.pop_back();
      return e;
    }
  }
  cudaEvent_t e = nullptr;
  ipc::check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags", what);
  return e;
}

void EventPool::give_back(cudaEvent_t e) {
  std::lock_guard<std::mutex> lock(m_);
  spare_.push_back(e);
}

bool StreamsBehind::contains(cudaStream_t s) const {
  return std::find(streams_.begin(), streams_.end(), s) != streams_.end();
}

void StreamsBehind::add(cudaStream_t s) {
  if (s != cudaStreamPerThread && !contains(s)) streams_.push_back(s);
}

}  // namespace meshmem::detail
