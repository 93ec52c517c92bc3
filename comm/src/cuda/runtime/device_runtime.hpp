// CudaDeviceRuntime: the device side of a Comm on one CUDA device (DeviceRuntime of
// device_interface.hpp), the GPU part's composition root: it owns the GpuDevice the
// transports and the barrier use, makes device window memory, stream waits on this rank's
// signal words, the halo plans and the barrier(stream) variant, and releases windows.
#pragma once

#include <cuda.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "device_interface.hpp"
#include "transport.hpp"
#include "cuda/proxy/nccl_library.hpp"
#include "cuda/runtime/cuda_owners.hpp"
#include "cuda/runtime/device_sync.hpp"
#include "cuda/runtime/gpu_device.hpp"
#include "cuda/runtime/window_releaser.hpp"

namespace meshmem::detail {

class CudaDeviceRuntime final : public DeviceRuntime {
 public:
  // Collective over the Comm.
  CudaDeviceRuntime(const CommContext& ctx, int device);

  int device() const override { return gpu_.device(); }
  std::string describe() const override;
  void make_room(std::size_t bytes, const char* call) override;
  void create_local(WindowState& state, const std::string& what) override;
  void publish(WindowState& state, const std::string& what) override;
  DeviceEntry enter(Stream stream, bool capture, const char* call) override;
  void leave(const DeviceEntry& entry) noexcept override;
  void wait_until(const WindowState& sig, std::size_t index, std::size_t count, Cmp cmp, std::uint64_t value,
                  std::optional<std::uint64_t> then, Stream stream, const char* call) override;
  std::uint64_t read_word(const WindowState& sig, std::size_t index) override;
  void write_words(const WindowState& sig, std::size_t index, std::size_t count, std::uint64_t value,
                   const char* call) override;
  std::unique_ptr<DeviceHaloPlan> make_halo_plan(const DeviceHaloSpec& spec) override;
  void retire(WindowState& state, const char* call) override;
  void retire_all(const std::vector<WindowState*>& states, const char* call) noexcept override;
  std::unique_ptr<StreamBarrier> make_barrier(const CommContext& ctx, const BarrierContext& bctx) override;
  void note_own_stream_route(const std::string& route) override;
  void tearing_down() noexcept override { live_.reset(); }

  GpuDevice& gpu() { return gpu_; }

 private:
  std::string where(const char* call) const { return std::string(call) + " on rank " + std::to_string(rank_); }
  static std::string device_of(CUcontext context);

  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  bool halo_sends_at_once_;
  OwnedStream setup_stream_;
  std::optional<LiveCommMark> live_;  // NCCL destroys that run while this Comm lives warn
  WindowReleaser releaser_;  // before gpu_: its last release frees the fault record's memory
  GpuDevice gpu_;
};

}  // namespace meshmem::detail
