#include "cuda/runtime/cuda_owners.hpp"

#include "backoff.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

CurrentDevice::CurrentDevice(int device) {
  (void)cudaGetDevice(&previous_);
  if (previous_ != device) (void)cudaSetDevice(device);
}

CurrentDevice::~CurrentDevice() {
  int now = -1;
  (void)cudaGetDevice(&now);
  if (previous_ >= 0 && now != previous_) (void)cudaSetDevice(previous_);
}

bool stream_ends_by(cudaStream_t stream, const Deadline& deadline, const char* call, const std::string& what) {
  Backoff backoff;
  cudaError_t q;
  while ((q = cudaStreamQuery(stream)) == cudaErrorNotReady && !deadline.expired()) backoff.pause();
  if (q == cudaErrorNotReady) return false;
  ipc::check_cuda(q, call, what);
  return true;
}

StreamMarks::~StreamMarks() {
  for (auto& [event, device] : events_) {
    CurrentDevice current(device);
    (void)cudaEventDestroy(event);
  }
}

void StreamMarks::add(cudaStream_t stream, int device) {
  CurrentDevice current(device);
  cudaEvent_t e = nullptr;
  if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess || cudaEventRecord(e, stream) != cudaSuccess) {
    (void)cudaGetLastError();
    if (e != nullptr) (void)cudaEventDestroy(e);
    // A failed context refuses events too, and its work is over; a stream with nothing
    // queued has nothing to wait for.
    const cudaError_t state = cudaStreamQuery(stream);
    (void)cudaGetLastError();
    if (state == cudaErrorNotReady) all_marked_ = false;
    return;
  }
  events_.emplace_back(e, device);
}

bool StreamMarks::ended_by(const Deadline& deadline) {
  Backoff backoff;
  bool ended = all_marked_;
  for (auto& [event, device] : events_) {
    CurrentDevice current(device);
    while (cudaEventQuery(event) == cudaErrorNotReady) {
      if (deadline.expired()) {
        (void)cudaGetLastError();
        return false;
      }
      backoff.pause();
    }
    (void)cudaGetLastError();  // an error of the device's: its work is over either way
  }
  return ended;
}

OwnedStream::OwnedStream(const std::string& what) {
  ipc::check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", what);
}

OwnedStream::~OwnedStream() {
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}

OwnedEvent::OwnedEvent(const std::string& what) {
  ipc::check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags", what);
}

OwnedEvent::~OwnedEvent() {
  if (event_ != nullptr) (void)cudaEventDestroy(event_);
}

}  // namespace meshmem::detail
