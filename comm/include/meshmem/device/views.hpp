// Plain-data views of a window and of signals, passed by value to kernels. Host code makes
// them with Window::view() / Signals::view(); device code uses them with the helpers of
// meshmem/device/device.cuh. No CUDA headers needed here.
#pragma once

#include <cstddef>
#include <cstdint>

namespace meshmem::device {

struct WindowView {
  void* const* peers = nullptr;  // device array: rank -> that rank's part mapped here, or null
  std::size_t bytes = 0;         // size of every rank's part
  int rank = 0;
  int size = 0;
};

struct SignalsView {
  std::uint64_t* const* peers = nullptr;  // device array: rank -> its signal words, or null
  std::size_t count = 0;
  int rank = 0;
  int size = 0;
};

}  // namespace meshmem::device
