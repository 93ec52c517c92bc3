// Owners of CUDA runtime objects the GPU part makes for itself (streams, ordering events) and
// the scoped current device: destroyed or restored with the object.
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <utility>
#include <vector>

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

// Events recorded on streams, each with its stream's device current: whether the work each
// stream held when it was marked has ended, whatever is enqueued after. Owns the events.
class StreamMarks {
 public:
  StreamMarks() = default;
  StreamMarks(const StreamMarks&) = delete;
  StreamMarks& operator=(const StreamMarks&) = delete;
  ~StreamMarks();
  // Marks the work on `stream` so far; where no event can be made or recorded, ended_by says
  // no, unless the stream holds no work or its context has failed (its work is over).
  void add(cudaStream_t stream, int device);
  // Whether every marked piece of work ended before `deadline` (polled with a backoff; each
  // event is waited for, an unmarked stream or a deadline that passed makes it false).
  bool ended_by(const Deadline& deadline);

 private:
  std::vector<std::pair<cudaEvent_t, int>> events_;  // with the device to make current
  bool all_marked_ = true;
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
