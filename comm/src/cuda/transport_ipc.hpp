// IpcTransport: device windows of peers on this node, mapped here through CUDA VMM. Puts
// and gets are stream-ordered copies through the mapped pointer: a copy kernel up to
// MESHMEM_SM_COPY_MAX bytes (lower latency), the copy engine above it (full bandwidth).
// Signals follow their data on the same stream: one fused kernel for small put_signals,
// else the copy then a stream write (Set) or a one-thread kernel (Add).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "../transport.hpp"

namespace meshmem::detail {

class IpcTransport final : public Transport {
 public:
  IpcTransport(std::size_t sm_copy_max, std::size_t fused_signal_max, int rank)
      : sm_copy_max_(sm_copy_max), fused_signal_max_(fused_signal_max), rank_(rank) {}
  TransportKind kind() const override { return TransportKind::Ipc; }
  void put(const WindowState& win, int target, std::size_t offset, const void* src,
           std::size_t bytes, const SignalUpdate& signal, Stream stream) override;
  void get(void* dst, const WindowState& win, int target, std::size_t offset, std::size_t bytes,
           Stream stream) override;
  void put_strided(const WindowState& win, int target, std::size_t dst_offset, std::size_t dst_pitch,
                   const void* src, std::size_t src_pitch, std::size_t width, std::size_t height,
                   Stream stream) override;
  void quiet() override {}  // completion is stream order

 private:
  bool use_sm(const void* local, std::size_t bytes, std::size_t max) const;
  // Error context, built only when a call failed (puts are a hot path).
  std::string what(const char* op, int target) const;
  std::size_t sm_copy_max_;
  std::size_t fused_signal_max_;
  int rank_;
};

// Whether kernels of the current device can dereference `p` (device, managed, or mapped
// pinned host memory).
bool device_accessible(const void* p);

}  // namespace meshmem::detail
