// The device side of a Comm, seen from the CUDA-free core: device window memory, the
// stream-ordered waits on this rank's signal words, and barrier(stream). The GPU part
// implements it (comm/src/cuda/device_runtime.cpp); how peers are reached is the
// transports' business (transport.hpp), not this one's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "meshmem/types.hpp"
#include "transport.hpp"
#include "window_state.hpp"

namespace meshmem::detail {

class RouteTable;

// A 2-D copy between device-accessible pointers (a peer's mapped window included).
struct DeviceCopy {
  void* dst;
  const void* src;
  std::size_t width, height, src_pitch, dst_pitch;
};

// One halo exchange on the device, prepared once: its copies, the signal stores into the
// neighbours' mapped words and the waits on this rank's words, in one kernel launch whose
// exchange number lives on the GPU (right on every graph replay).
struct DeviceHaloSpec {
  std::vector<DeviceCopy> copies;
  std::vector<std::uint64_t*> stores;        // neighbours' words for this rank, mapped here
  std::vector<const std::uint64_t*> waits;   // this rank's words ...
  std::vector<int> wait_ranks;               // ... and who writes each
  std::uint64_t signals_window = 0;          // id, for error messages
  // Distinct neighbours whose halos a transport carries (their windows are not mapped here).
  std::size_t transport_neighbours = 0;
};
class DeviceHaloPlan {
 public:
  virtual ~DeviceHaloPlan() = default;
  // Orders this exchange on `stream` after the previous one, whichever stream that ran on.
  // Called before anything of the exchange is issued: its transfers through transports too,
  // or an exchange on one stream could deliver (and count) ahead of one on another.
  virtual void begin(Stream stream, bool capturing, const char* call) = 0;
  // Runs the exchange's copies (or none: `copy` false), signals and waits on `stream`.
  virtual void run(Stream stream, bool copy, bool capturing, const char* call) = 0;
  // The number the exchange about to run will have, where the host knows it (the plan was
  // never captured and is not being captured); 0 where it does not (graph replays count on
  // the GPU alone).
  virtual std::uint64_t next_exchange(bool capturing) const = 0;
  // An exchange failed after part of it may have been issued (a neighbour's signal may have
  // gone out, a word counted twice on a retry): begin() refuses every later exchange.
  virtual void fail(const std::string& why) = 0;
  // The stream for the exchange's transfers to its k-th transport neighbour, asked for in
  // order from k = 0: `stream` itself, unless the plan has lanes (MESHMEM_HALO_SENDS=concurrent:
  // one fewer than those neighbours). Then lane 0 is `stream` and lane k > 0
  // is one of the plan's streams, which starts after `stream`'s work before the exchange's
  // first lane was asked for (a transfer's stream waits for its end, so one stream would send
  // to the neighbours one after the other). join() makes `stream` wait for every lane used
  // since the last join (none: it does nothing); it tries them all and raises the first failure.
  // Under capture the lanes fork from and join the capture; a lane still held by another
  // capture is not used (its neighbour goes on `stream`).
  virtual Stream lane(Stream stream, std::size_t k, const char* call) = 0;
  virtual void join(Stream stream, const char* call) = 0;
};

// barrier(stream): one variant, chosen when the Comm is made (MESHMEM_BARRIER).
class StreamBarrier {
 public:
  virtual ~StreamBarrier() = default;
  // Collective, stream-ordered: once `stream` passes it, every rank's stream reached its
  // barrier, and their earlier work is complete. A variant that cannot be captured raises
  // Error(Unsupported) before it touches a capturing stream.
  virtual void arrive(Stream stream, bool capturing) = 0;
  virtual std::string describe() const = 0;
};

// What the barrier may use besides the Comm's context.
struct BarrierContext {
  const RouteTable& routes;
  std::vector<const Transport*> connected;  // the Comm's transports, in the order tried
  // Collective: a zeroed device signals window of `bytes`, attached like any window.
  std::function<std::shared_ptr<WindowState>(std::size_t bytes)> alloc_signals;
};

// What DeviceRuntime::enter found, for leave() and the call.
struct DeviceEntry {
  int previous = -1;       // the caller's current device, restored by leave()
  bool capturing = false;  // the stream is being captured into a CUDA graph
};

class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;
  virtual int device() const = 0;
  // "device 0 (NVIDIA H200, 0000:18:00.0), ..." for logs and Comm::device_info.
  virtual std::string describe() const = 0;

  // Local, before the allocation's first agreed step: where windows freed earlier still wait
  // for the device's work and `bytes` do not fit in the device's free memory, waits for
  // them, at most half of MESHMEM_TIMEOUT (the peers wait in that step with the whole).
  virtual void make_room(std::size_t bytes, const char* call) {
    (void)bytes;
    (void)call;
  }
  // Local (the Comm agrees on the outcome): this rank's part of a device window
  // (state.local, state.peer[rank], state.storage), zeroed before any peer can write into it.
  virtual void create_local(WindowState& state, const std::string& what) = 0;
  // Local, after the transports attached the window: its peer table on the device (view()).
  virtual void publish(WindowState& state, const std::string& what) = 0;

  // Every call that touches the GPU starts here (DeviceScope): raises a device wait's
  // timeout (Error(Timeout)), makes the Comm's device current, rejects a stream of another
  // device (Error(InvalidArgument) naming both) and, with `capture`, tells whether the
  // stream is being captured.
  virtual DeviceEntry enter(Stream stream, bool capture, const char* call) = 0;
  virtual void leave(const DeviceEntry& entry) noexcept = 0;

  // Stream-ordered wait on this rank's words index .. index+count-1; with `then`, the same
  // operation sets them to it once the wait is over.
  virtual void wait_until(const WindowState& sig, std::size_t index, std::size_t count, Cmp cmp,
                          std::uint64_t value, std::optional<std::uint64_t> then, Stream stream,
                          const char* call) = 0;
  // This rank's signal word now (a copy from the GPU on a stream of the runtime's own).
  virtual std::uint64_t read_word(const WindowState& sig, std::size_t index) = 0;
  // Sets this rank's words index .. index+count-1 to `value` now (host-blocking).
  virtual void write_words(const WindowState& sig, std::size_t index, std::size_t count, std::uint64_t value,
                           const char* call) = 0;
  virtual std::unique_ptr<DeviceHaloPlan> make_halo_plan(const DeviceHaloSpec& spec) = 0;
  // Frees the memory of a device window once the device's work issued before has ended,
  // without waiting for work still running (window_releaser.hpp). Raises Error(Timeout) where
  // work before an earlier free has not ended MESHMEM_TIMEOUT after it (once; this window is
  // freed all the same), or where the device had to be synchronised and that took longer;
  // Error(Unsupported) at once where a graph capture is open on the device (its memory goes
  // at the next free, an allocation that needs it, or ~Comm). The state is empty afterwards
  // either way.
  virtual void retire(WindowState& state, const char* call) = 0;
  // retire() of several windows (none: only the wait), then one bounded wait for every
  // release still pending, earlier frees' too (the transports stop next); logs instead of
  // raising, makes its device current itself, and runs with a device fault pending.
  virtual void retire_all(const std::vector<WindowState*>& states, const char* call) noexcept = 0;
  // Collective: the barrier(stream) variant of this Comm.
  virtual std::unique_ptr<StreamBarrier> make_barrier(const CommContext& ctx, const BarrierContext& bctx) = 0;
  // The Comm routes `route` ("rank 3 through nccl") through a transport whose data moves on
  // streams of this process (Capabilities::own_streams), which a waiting stream of the caller
  // can hold back where they share a GPU queue: warns where the process has few queues.
  virtual void note_own_stream_route(const std::string& route) { (void)route; }
  // ~Comm, before its barrier and transports go: from here on the Comm issues no more work.
  virtual void tearing_down() noexcept {}
};

}  // namespace meshmem::detail

namespace meshmem::detail {
// enter() ... leave() for one API call.
class DeviceScope {
 public:
  DeviceScope(DeviceRuntime& runtime, Stream stream, bool capture, const char* call)
      : runtime_(runtime), entry_(runtime.enter(stream, capture, call)) {}
  ~DeviceScope() { runtime_.leave(entry_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  bool capturing() const { return entry_.capturing; }

 private:
  DeviceRuntime& runtime_;
  DeviceEntry entry_;
};
}  // namespace meshmem::detail
