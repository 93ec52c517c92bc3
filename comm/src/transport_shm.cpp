#include "transport_shm.hpp"

#include <atomic>
#include <cstring>

namespace meshmem::detail {

void ShmTransport::put(const WindowState& win, int target, std::size_t offset, const void* src,
                       std::size_t bytes, const SignalUpdate& signal, Stream) {
  if (bytes > 0) std::memcpy(static_cast<char*>(win.peer[target]) + offset, src, bytes);
  if (signal.sig != nullptr) {
    auto* words = static_cast<std::uint64_t*>(signal.sig->peer[target]);
    apply_signal(words + signal.index, signal.value, signal.op);
  }
}

void ShmTransport::get(void* dst, const WindowState& win, int target, std::size_t offset,
                       std::size_t bytes, Stream) {
  if (bytes > 0) std::memcpy(dst, static_cast<const char*>(win.peer[target]) + offset, bytes);
}

void ShmTransport::quiet() {
  // Stores through the mapping are complete once issued; order them before what follows.
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

}  // namespace meshmem::detail
