#include "cuda/runtime/event_pool.hpp"

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

}  // namespace meshmem::detail
