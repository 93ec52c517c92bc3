// The internal transport interface and its lifecycle. The Comm makes the transports of the
// table (transport_registry.hpp) that MESHMEM_TRANSPORTS allows, asks each which ranks it
// reaches, routes every (rank, memory kind) to the first that reaches it, connects the
// transports some rank uses and drops the others. Per window it attaches every connected
// transport that serves the window's memory kind, and detaches them when the window is freed
// (the attachment's destructor). Arguments are validated before a transport sees them.
//
//   make (collective) -> reach(rank, memory) -> connect (collective, if used anywhere)
//     -> attach / detach per window (collective) -> put / get / quiet / progress -> stop
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "meshmem/config.hpp"
#include "meshmem/types.hpp"
#include "window_state.hpp"

namespace meshmem::detail {

class BarrierResources;  // the GPU part's (cuda/barrier/barrier_resources.hpp)
class Bootstrap;
class DeviceRuntime;
class FaultPlan;
class FdExchange;
struct Topology;

// What a transport may use while it is made, connected and attached.
struct CommContext {
  Bootstrap& boot;
  const Topology& topo;
  FdExchange& fds;
  const Options& options;
  DeviceRuntime* device;  // null where device windows are unavailable
  const FaultPlan& faults;  // MESHMEM_FAULT: this rank's injected faults (tests)
};

// Whether a transport reaches a rank: yes, or why not (the Comm lists every transport's
// reason when none reaches a rank).
struct Reach {
  bool ok = false;
  std::string why;
  static Reach yes() { return Reach{true, {}}; }
  static Reach no(std::string why) { return Reach{false, std::move(why)}; }
};

struct Capabilities {
  bool stream_ordered = false;  // operations are enqueued on the caller's stream
  bool mapped = false;          // attached windows' peer pointers (WindowState::peer) are plain
                                // loads and stores: kernels and stream memory operations may
                                // write through them (device views, halo copy kernels)
  bool signal_add = true;       // SignalOp::Add is supported
  bool capturable = false;      // put / get / signals can be captured into a CUDA graph and
                                // are correct on every replay (stream work, host nodes included)
  bool own_streams = false;     // streams of this process (an agent's, a proxy thread's) move the
                                // data after the caller's stream waits for it, so they must not
                                // share its GPU queue (cuda/gpu_queues.hpp)
};

// Where a signal update goes: word `index` of a signals window.
struct SignalUpdate {
  const WindowState* sig = nullptr;  // null: no signal
  std::size_t index = 0;
  std::uint64_t value = 0;
  SignalOp op = SignalOp::Set;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual TransportKind kind() const = 0;
  virtual Capabilities capabilities() const = 0;
  // Windows of which memory kind it attaches (the same answer on every rank).
  virtual bool serves(Memory memory) const = 0;
  // Whether it reaches `rank` for windows of `memory`. Local: the facts it needs were
  // gathered when it was made.
  virtual Reach reach(int rank, Memory memory) const = 0;

  // Collective over every rank, called when any rank routes a pair through this transport;
  // `routed[r]`: whether this rank does for rank r (either memory kind).
  virtual void connect(const std::vector<bool>& routed) { (void)routed; }
  // Collective over every rank, for each window of a memory kind it serves: makes this
  // rank's part of `win` reachable for peers and the peers' parts in `routed` reachable here
  // (filling win.peer where it maps them). What it keeps per window lives in the returned
  // attachment, whose destructor detaches (nullptr: nothing to keep).
  virtual std::unique_ptr<WindowAttachment> attach(WindowState& win, const std::vector<bool>& routed,
                                                   const std::string& what) = 0;

  // Copies `bytes` into target's part of `win`, then applies `signal` (if any) so that a
  // reader who sees the signal sees the data. Host transports (null stream) return when
  // `src` may be reused; stream-ordered transports enqueue on `stream`.
  virtual void put(const WindowState& win, int target, std::size_t offset, const void* src,
                   std::size_t bytes, const SignalUpdate& signal, Stream stream) = 0;
  // Copies from target's part of `win`; complete on return (host) or when `stream` passes.
  virtual void get(void* dst, const WindowState& win, int target, std::size_t offset,
                   std::size_t bytes, Stream stream) = 0;
  // `height` rows of `width` bytes, `src_pitch` / `dst_pitch` apart (no signal). The
  // default puts row by row.
  virtual void put_strided(const WindowState& win, int target, std::size_t dst_offset, std::size_t dst_pitch,
                           const void* src, std::size_t src_pitch, std::size_t width, std::size_t height,
                           Stream stream) {
    for (std::size_t row = 0; row < height; ++row)
      put(win, target, dst_offset + row * dst_pitch, static_cast<const char*>(src) + row * src_pitch, width,
          SignalUpdate{}, stream);
  }
  // Every put and signal issued through this transport (on `stream`, where stream-ordered)
  // is complete at its target.
  virtual void quiet(Stream stream) = 0;
  // Waits on the host (bounded by MESHMEM_TIMEOUT) until every put this rank issued, on any
  // stream, is complete at its target (Window::free, the host barrier, ~Comm). Only for
  // transports whose streams pass a put before it landed (the staged transport with
  // MESHMEM_STAGED_COMPLETION=source); `call` names the caller in errors.
  virtual void complete_on_host(const char* call) { (void)call; }

  // Serves at most one pending request of a peer; true if it did. Threads that wait for a
  // peer call it (the awaited data may be in such a request).
  virtual bool progress() { return false; }
  // The longest such a waiting thread may sleep between two progress() calls (a peer's request
  // waits for the next one); none: the transport serves nothing there.
  virtual std::optional<std::chrono::microseconds> progress_sleep() const { return std::nullopt; }
  // A thread of this rank starts / stops waiting and calling progress() itself: a
  // transport with a progress thread lets it stand aside meanwhile.
  virtual void waiter_begins() {}
  virtual void waiter_ends() {}
  // What barrier(stream) may use of it (node flag words, an NCCL library); null: nothing.
  virtual const BarrierResources* barrier_resources() const { return nullptr; }
  // What it holds that a user may want to see (Comm::device_info, meshmem-info); "" for nothing.
  virtual std::string describe() const { return ""; }
  // Before the ranks part at ~Comm: lets this rank's transfers in flight end (bounded), so
  // that no peer stops serving them first.
  virtual void settle() noexcept {}
  // Stops background activity (threads); called once, after every window was detached.
  virtual void stop() noexcept {}
};

// Applies a signal update to a word of local or mapped memory, with release ordering so
// that the data written before it is visible to whoever acquires the new value.
inline void apply_signal(std::uint64_t* word, std::uint64_t value, SignalOp op) {
  if (op == SignalOp::Set)
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
  else
    __atomic_fetch_add(word, value, __ATOMIC_RELEASE);
}

}  // namespace meshmem::detail
