// Owners of CUDA runtime objects the GPU part makes for itself (streams, ordering events) and
// the scoped current device: destroyed or restored with the object.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace meshmem::detail {

class Deadline;

// Sets `device` current for the life of the object (the staged transport drives several GPUs).
class CurrentDevice {
 public:
  explicit CurrentDevice(int device);
  ~CurrentDevice();
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  int previous_ = -1;
};

// Whether every piece of work on `stream` ended before `deadline` (polled with a backoff); a
// CUDA error of the stream raises Error(Cuda) naming `call`.
bool stream_ends_by(cudaStream_t stream, const Deadline& deadline, const char* call, const std::string& what);

class OwnedStream {
 public:
  explicit OwnedStream(const std::string& what);
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  ~OwnedStream();
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// An event for ordering only (no timing), destroyed with the object.
class OwnedEvent {
 public:
  explicit OwnedEvent(const std::string& what);
  OwnedEvent(const OwnedEvent&) = delete;
  OwnedEvent& operator=(const OwnedEvent&) = delete;
  ~OwnedEvent();
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

}  // namespace meshmem::detail
