// The first steps of a host-agent transport's stream-ordered call (stream_handoff.hpp).
#include "cuda/agent/stream_handoff.hpp"

#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

StreamCapture capture_of(cudaStream_t stream, const std::string& what) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaGraph_t graph = nullptr;
  ipc::check_cuda(cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph), "cudaStreamGetCaptureInfo", what);
  StreamCapture capture;
  capture.active = status == cudaStreamCaptureStatusActive;
  if (capture.active) capture.graph = graph;
  return capture;
}

Reach agent_reach(Memory memory, bool device, const std::string& no_route) {
  if (memory != Memory::Device) return Reach::no("device windows only");
  if (!device) return Reach::no("device windows are unavailable");
  if (!no_route.empty()) return Reach::no(no_route);
  return Reach::yes();
}

}  // namespace meshmem::detail
