// RelaxedCaptureMode: relaxed stream-capture mode for one scope of the user's thread.
#pragma once

#include <cuda_runtime_api.h>

namespace meshmem::detail {

// For a scope that only queries (events, pointer attributes) on the user's thread: such a
// query may count as an unsafe call while this thread or another captures in global mode,
// which would fail it and invalidate that capture. (relax_capture_mode_of_this_thread,
// device_sync.hpp, is the permanent form for meshmem's own threads.)
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() noexcept { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCaptureMode() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

}  // namespace meshmem::detail
