// The device side of a Comm, seen from the CUDA-free core: device window memory, the
// stream-ordered waits on this rank's signal words, and barrier(stream). The GPU part
// implements it (comm/src/cuda/device_runtime.cpp); how peers are reached is the
// transports' business (transport.hpp), not this one's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "meshmem/types.hpp"
#include "transport.hpp"

namespace meshmem::detail {

class RouteTable;

// A 2-D copy between device-accessible pointers (a peer's mapped window included).
struct DeviceCopy {
  void* dst;
  const void* src;
  std::size_t width, height, src_pitch, dst_pitch;
};

// Copies prepared once (their table lives on the device) and run with one kernel launch.
class DeviceCopyPlan {
 public:
  virtual ~DeviceCopyPlan() = default;
  virtual void run(Stream stream) = 0;
};

// barrier(stream): one variant, chosen when the Comm is made (MESHMEM_BARRIER).
class StreamBarrier {
 public:
  virtual ~StreamBarrier() = default;
  // Collective, stream-ordered: once `stream` passes it, every rank's stream reached its
  // barrier, and their earlier work is complete.
  virtual void arrive(Stream stream) = 0;
  virtual std::string describe() const = 0;
};

// What the barrier may use besides the Comm's context.
struct BarrierContext {
  const RouteTable& routes;
  // Collective: a zeroed device signals window of `bytes`, attached like any window.
  std::function<std::shared_ptr<WindowState>(std::size_t bytes)> alloc_signals;
};

class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;
  virtual int device() const = 0;
  // "device 0 (NVIDIA H200, 0000:18:00.0), ..." for logs and Comm::device_info.
  virtual std::string describe() const = 0;

  // Local (the Comm agrees on the outcome): this rank's part of a device window
  // (state.local, state.peer[rank], state.storage), zeroed before any peer can write into it.
  virtual void create_local(WindowState& state, const std::string& what) = 0;
  // Local, after the transports attached the window: its peer table on the device (view()).
  virtual void publish(WindowState& state, const std::string& what) = 0;

  // Stream-ordered wait on this rank's signal word.
  virtual void wait_until(const WindowState& sig, std::size_t index, Cmp cmp, std::uint64_t value,
                          Stream stream) = 0;
  // Stream-ordered, one driver call for a neighbourhood: stores `value` into each word of
  // `stores` (device-accessible: peers' signal words mapped here) after the stream's
  // earlier work, then waits until each word of `waits` (this rank's) is >= value.
  virtual void store_and_wait(const std::vector<std::uint64_t*>& stores, const std::vector<const std::uint64_t*>& waits,
                              std::uint64_t value, Stream stream, const char* call) = 0;
  // The copies of a halo exchange, for one launch per exchange instead of one copy each.
  virtual std::unique_ptr<DeviceCopyPlan> make_copy_plan(const std::vector<DeviceCopy>& copies) = 0;
  // Collective: the barrier(stream) variant of this Comm.
  virtual std::unique_ptr<StreamBarrier> make_barrier(const CommContext& ctx, const BarrierContext& bctx) = 0;
};

}  // namespace meshmem::detail
