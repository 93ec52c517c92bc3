// ShmTransport: peers on this node whose host windows are mapped here (memfd). Puts and
// gets are memcpy through the mapping; signals are atomics on the mapped word.
#pragma once

#include "transport.hpp"

namespace meshmem::detail {

class ShmTransport final : public Transport {
 public:
  TransportKind kind() const override { return TransportKind::Shm; }
  void put(const WindowState& win, int target, std::size_t offset, const void* src,
           std::size_t bytes, const SignalUpdate& signal, Stream stream) override;
  void get(void* dst, const WindowState& win, int target, std::size_t offset,
           std::size_t bytes, Stream stream) override;
  void quiet() override;
};

}  // namespace meshmem::detail
