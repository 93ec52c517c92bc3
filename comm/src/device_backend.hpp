// The GPU part, seen from the CUDA-free core. The core calls make_device_backend(); the
// library links one of its two definitions: comm/src/cuda/ (CUDA VMM windows, IPC events)
// or comm/src/device_none.cpp (builds without CUDA).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "meshmem/config.hpp"
#include "transport.hpp"

namespace meshmem::detail {

class Bootstrap;
class FdExchange;
struct Topology;

struct DeviceContext {
  Bootstrap& boot;
  const Topology& topo;
  FdExchange& fds;
  const Options& options;
};

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

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  // Collective: this rank's part, its descriptor passed to the node peers, their parts
  // mapped where peer access allows. Fills local, peer, storage and device_peer_table.
  virtual void create_window(WindowState& state, const std::string& what) = 0;
  // Transport to `target` for device windows, or nullptr and the reason in *why.
  virtual Transport* route(int target, std::string* why) const = 0;
  // Stream-ordered wait on this rank's signal word.
  virtual void wait_until(const WindowState& sig, std::size_t index, Cmp cmp, std::uint64_t value,
                          Stream stream) = 0;
  // Collective, stream-ordered: the host does not wait.
  virtual void barrier(Stream stream) = 0;
  // Stream-ordered: sets word `rank` of each `send_to` rank's signals to `value` (after the
  // stream's earlier puts), then waits until this rank's word r >= value for each r of
  // `wait_for`. One driver call for the whole neighbourhood.
  virtual void signal_and_wait(const WindowState& sig, const std::vector<int>& send_to,
                               const std::vector<int>& wait_for, std::uint64_t value, Stream stream) = 0;
  // The copies of a halo exchange, for one launch per exchange instead of one copy each.
  virtual std::unique_ptr<DeviceCopyPlan> make_copy_plan(const std::vector<DeviceCopy>& copies) = 0;
  virtual std::string describe() const = 0;
};

// Collective over the Comm. Null where this build has no GPU part or a rank has no usable
// CUDA device; *why then says which rank and why.
std::unique_ptr<DeviceBackend> make_device_backend(const DeviceContext& ctx, std::string* why);

// Whether this process can use a CUDA device (no collective; for default_memory()).
bool device_runtime_available(std::string* why);

// Makes `ordinal` modulo the visible devices current; returns it, or -1 without devices.
int set_device_modulo(int ordinal);

}  // namespace meshmem::detail
