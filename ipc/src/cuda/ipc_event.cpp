#include "meshmem/ipc/ipc_event.hpp"

#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::ipc {

IpcEvent IpcEvent::create() {
  IpcEvent e;
  check_cuda(cudaEventCreateWithFlags(&e.event_, cudaEventDisableTiming | cudaEventInterprocess),
             "cudaEventCreateWithFlags(cudaEventInterprocess)", "IPC event");
  return e;
}

IpcEvent& IpcEvent::operator=(IpcEvent&& o) noexcept {
  if (this != &o) {
    IpcEvent old;
    old.event_ = std::exchange(event_, std::exchange(o.event_, nullptr));
  }
  return *this;
}

IpcEvent::~IpcEvent() {
  if (event_ != nullptr) (void)cudaEventDestroy(event_);
}

cudaIpcEventHandle_t IpcEvent::handle() const {
  cudaIpcEventHandle_t h{};
  check_cuda(cudaIpcGetEventHandle(&h, event_), "cudaIpcGetEventHandle", "IPC event");
  return h;
}

PeerEvent PeerEvent::open(const cudaIpcEventHandle_t& handle) {
  PeerEvent e;
  check_cuda(cudaIpcOpenEventHandle(&e.event_, handle), "cudaIpcOpenEventHandle", "peer IPC event");
  return e;
}

PeerEvent& PeerEvent::operator=(PeerEvent&& o) noexcept {
  if (this != &o) {
    PeerEvent old;
    old.event_ = std::exchange(event_, std::exchange(o.event_, nullptr));
  }
  return *this;
}

PeerEvent::~PeerEvent() {
  if (event_ != nullptr) (void)cudaEventDestroy(event_);
}

}  // namespace meshmem::ipc
