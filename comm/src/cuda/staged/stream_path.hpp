// StreamPath: small staged transfers between two GPUs that this process both sees, enqueued by
// the calling thread as stream work only (MESHMEM_STAGED_STREAM_PATH): the device-to-host copy
// into a pinned slot of this process, the host-to-device copy out of it, and the signal, with
// no host thread between them. Where the peer's GPU is this rank's own (ranks sharing a GPU)
// every step runs on the caller's stream; otherwise the step on the peer's GPU runs on a stream
// of this process there that serves the caller's stream alone (a lane), joined to it by events
// both ways. A slot's next use waits on the GPU for the events after its last one; a slot
// whose last use was another stream's and has not ended is not taken, so that no stream's
// transfer waits behind another stream's (which may itself wait for this one). Where no slot
// or lane is free, `run` declines and the transfer goes through the staging agent, as do
// captured ones, those with hidden GPUs and larger ones (transport_staged.cpp chooses).
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cuda/runtime/block_pool.hpp"
#include "cuda/runtime/cuda_owners.hpp"
#include "cuda/staged/stream_slot_table.hpp"
#include "meshmem/ipc/vmm.hpp"
#include "meshmem/types.hpp"

namespace meshmem::detail {

class StreamPath {
 public:
  // One transfer: `rows` rows of `width` bytes, from `src` to `dst` (pitches apart); a put's
  // `signal` (on the target's GPU, or null) is updated after its data.
  struct Transfer {
    enum class Kind { Put, Get };
    Kind kind = Kind::Put;
    void* dst = nullptr;
    const void* src = nullptr;
    std::size_t width = 0;
    std::size_t rows = 1;
    std::size_t dst_pitch = 0;
    std::size_t src_pitch = 0;
    int peer_device = -1;  // the other side's GPU as this process numbers it
    std::uint64_t* signal = nullptr;
    std::uint64_t value = 0;
    SignalOp op = SignalOp::Set;
    std::size_t bytes() const { return width * rows; }
  };
  struct Setup {
    int device = -1;                  // this rank's GPU
    std::vector<int> peer_devices;    // every other GPU a transfer may name
    std::size_t slot_bytes = 0;       // the largest transfer taken
    std::size_t slots = 16;
    std::size_t lanes_per_device = 8;  // caller streams served at once on each other GPU
    bool split = false;               // test switch: the peer's step on a lane even on this GPU
    int rank = -1;
    std::chrono::milliseconds timeout{0};
  };
  explicit StreamPath(const Setup& setup);
  ~StreamPath();
  StreamPath(const StreamPath&) = delete;
  StreamPath& operator=(const StreamPath&) = delete;

  std::size_t max_bytes() const { return setup_.slot_bytes; }
  // Enqueues `t` on `stream` (a stream of this rank's GPU, not capturing: the caller checked),
  // which goes on once its data (and signal) landed; false, with nothing enqueued, where no
  // slot or lane is free for it now. Errors raise Error(Cuda) naming `what`; what was enqueued
  // before stays guarded (its slot's next use and drain() wait for it). Nothing waits on the host.
  bool run(const Transfer& t, cudaStream_t stream, const std::string& what);
  // Whether every enqueued transfer ended on the GPUs within MESHMEM_TIMEOUT (before a window's
  // peer mappings go); once a drain timed out, later ones only look.
  bool drain() noexcept;
  std::string describe() const;

 private:
  // The caller's stream as the caller means it: the legacy stream whether named by null or
  // cudaStreamLegacy, each thread's per-thread stream apart.
  using StreamKey = std::pair<cudaStream_t, std::thread::id>;
  static StreamKey key_of(cudaStream_t stream);
  // A caller stream's side on another GPU: a stream of this process there, an event per slot
  // and one for signals alone.
  struct Lane {
    int device = -1;
    std::unique_ptr<OwnedStream> stream;
    std::vector<std::unique_ptr<OwnedEvent>> done;  // by slot: after this lane's step on it
    std::unique_ptr<OwnedEvent> signalled;          // after a signal without data
  };
  // What a transfer enqueued so far, for guarding the slot if a later step fails.
  struct Touched {
    bool caller = false;
    Lane* lane = nullptr;
  };
  // The slots and lanes: host-NUMA VMM memory mapped for every GPU of the Comm here, or where
  // the device has none, a block of the pool's portable pinned memory (block_pool.hpp), neither
  // given back while a copy may still use it.
  struct PinnedSlots {
    ipc::SharedHostMemory vmm;
    PooledBlock block;
    void* base = nullptr;
  };
  Lane* lane_for(int device, const StreamKey& key, const std::string& what);
  // Each returns the event after its use of the slot.
  cudaEvent_t run_on_one_stream(const Transfer& t, std::size_t slot, cudaStream_t stream, Touched& touched,
                                const std::string& what);
  cudaEvent_t run_split(const Transfer& t, std::size_t slot, cudaStream_t stream, Lane& lane, Touched& touched,
                        const std::string& what);
  void signal_alone(const Transfer& t, cudaStream_t stream, Lane* lane, const std::string& what);
  void signal(const Transfer& t, cudaStream_t stream, const std::string& what);
  // After a step failed: events on every stream that got work, as the slot's last use.
  void guard(std::size_t slot, cudaStream_t stream, const Touched& touched, const StreamKey& key) noexcept;

  Setup setup_;
  std::size_t stride_ = 0;  // bytes between slots (256-aligned)
  PinnedSlots pinned_;
  std::vector<std::unique_ptr<OwnedEvent>> own_done_;  // by slot, on this rank's GPU: after its step there
  std::vector<std::unique_ptr<OwnedEvent>> ready_;     // by slot, on this rank's GPU: the caller's side ready
  std::unique_ptr<OwnedEvent> signal_ready_;           // the same for a signal without data
  std::unique_ptr<OwnedEvent> own_signalled_;          // after a signal without data on the caller's stream
  mutable std::mutex m_;  // everything below, and the enqueue order, from any thread
  std::map<std::pair<int, StreamKey>, Lane> lanes_;  // by GPU and caller stream
  StreamSlotTable<cudaEvent_t, StreamKey> slots_;
  bool stuck_ = false;  // a drain timed out
};

}  // namespace meshmem::detail
