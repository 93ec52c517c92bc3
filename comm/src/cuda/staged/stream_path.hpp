// StreamPath: small staged transfers between two GPUs that this process both sees, enqueued by
// the calling thread as stream work only (MESHMEM_STAGED_STREAM_PATH): the device-to-host copy
// into a pinned slot of this process, the host-to-device copy out of it, and the signal, with
// no host thread between them. Where the peer's GPU is this rank's own (ranks sharing a GPU)
// every step runs on the caller's stream; otherwise the step on the peer's GPU runs on this
// process's stream of that GPU, joined to the caller's stream by events both ways. A slot's
// next use waits on the GPU for the event after its last one, so the host never waits for a
// slot. Transfers under graph capture, to hidden GPUs and over the size go through the staging
// agent (transport_staged.cpp chooses).
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/runtime/block_pool.hpp"
#include "cuda/runtime/cuda_owners.hpp"
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
    bool split = false;               // test switch: the peer's step on a stream of its own even on this GPU
    int rank = -1;
    std::chrono::milliseconds timeout{0};
  };
  explicit StreamPath(const Setup& setup);
  ~StreamPath();
  StreamPath(const StreamPath&) = delete;
  StreamPath& operator=(const StreamPath&) = delete;

  std::size_t max_bytes() const { return setup_.slot_bytes; }
  // Enqueues `t` on `stream` (not capturing; the caller checked): the stream goes on once its
  // data (and signal) landed. Errors raise Error(Cuda) naming `what`; nothing waits on the host.
  void run(const Transfer& t, cudaStream_t stream, const std::string& what);
  // Whether every enqueued transfer ended on the GPUs within MESHMEM_TIMEOUT (before a window's
  // peer mappings go).
  bool drain() noexcept;
  std::string describe() const;

 private:
  // The peer GPU's side: a stream of this process there and an event per slot on it.
  struct Lane {
    int device = -1;
    std::unique_ptr<OwnedStream> stream;
    std::vector<std::unique_ptr<OwnedEvent>> done;  // by slot: after this lane's step on it
  };
  // The slots: host-NUMA VMM memory mapped for every GPU of the Comm here, or where the device
  // has none, a block of the pool's portable pinned memory; neither given back through
  // cudaFreeHost, which waits for every kernel of the device (block_pool.hpp).
  struct PinnedSlots {
    ipc::SharedHostMemory vmm;
    PooledBlock block;
    void* base = nullptr;
  };
  Lane& lane_of(int device, const std::string& what);
  void run_on_one_stream(const Transfer& t, std::size_t slot, cudaStream_t stream, const std::string& what);
  void run_split(const Transfer& t, std::size_t slot, cudaStream_t stream, Lane& lane, const std::string& what);
  void signal(const Transfer& t, cudaStream_t stream, const std::string& what);

  Setup setup_;
  PinnedSlots pinned_;
  std::vector<std::unique_ptr<OwnedEvent>> own_done_;  // by slot, on this rank's GPU: after its step there
  std::vector<std::unique_ptr<OwnedEvent>> ready_;     // by slot, on this rank's GPU: the caller's side ready
  std::vector<Lane> lanes_;
  std::mutex m_;  // slot choice and enqueue order, from any thread
  std::vector<cudaEvent_t> last_;  // by slot: the event after its last use (null: never used)
  std::size_t next_ = 0;
  std::uint64_t transfers_ = 0;
};

}  // namespace meshmem::detail
