// CUDA IPC events: an interprocess event recorded by one process, waited on by others.
#pragma once

#include <cuda_runtime_api.h>

#include <utility>

namespace meshmem::ipc {

// An event this process records; its handle goes to the peers (over MPI).
class IpcEvent {
 public:
  IpcEvent() = default;
  static IpcEvent create();
  IpcEvent(IpcEvent&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
  IpcEvent& operator=(IpcEvent&& o) noexcept;
  ~IpcEvent();
  cudaEvent_t get() const { return event_; }
  cudaIpcEventHandle_t handle() const;

 private:
  cudaEvent_t event_ = nullptr;
};

// A peer's event opened from its handle.
class PeerEvent {
 public:
  PeerEvent() = default;
  static PeerEvent open(const cudaIpcEventHandle_t& handle);
  PeerEvent(PeerEvent&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
  PeerEvent& operator=(PeerEvent&& o) noexcept;
  ~PeerEvent();
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

}  // namespace meshmem::ipc
