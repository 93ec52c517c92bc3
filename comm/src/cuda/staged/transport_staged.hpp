// StagedTransport: device windows of node peers whose GPU this GPU cannot access (no peer
// access: PCIe without P2P, IOMMU/ACS, or forced with MESHMEM_TRANSPORTS=staged,...).
// Data goes through this rank's region of the node's staging pool (staging_pool.hpp) in
// chunks: device-to-host on the source GPU's copy engine, host-to-device on the target GPU's,
// double-buffered over MESHMEM_STAGING_SLOTS slots so that the two run at once.
//
// Who drives it: each rank's staging agent (a thread, staging_agent.hpp) drives only its own
// GPU. The two ranks' agents share every transfer through a channel in the pool: this GPU
// copies chunks into this rank's slots and posts them, the peer's agent copies them onto its
// GPU, raises the signal and writes the done word (for a get the other way round). Measured
// why (MESHMEM_STAGING_CHANNELS, transport_staged.cpp): a process driving a GPU that another
// process keeps busy waits for the driver's time slice. `when-hidden` keeps the one-agent
// path, where this agent drives both GPUs where it sees both (the target's window is then
// mapped here for the target's GPU). The caller's thread only takes a done word, hands the
// request over and enqueues one kernel on its stream, so a put returns in microseconds
// whatever its size. The kernel first sets the transfer's ready word (in the pool) once the
// stream's earlier work is done, then waits on the GPU until the transfer's done word
// (written after the last copy and the signal) reaches its ticket; it times out like every
// device wait. Where the GPU is shared a stream memory write and wait do this instead for a
// visible transfer (the agent ends it at the timeout) and for a put through a channel whose
// reader copies a chunk under 28 KiB (a polling kernel would hold the time-sliced GPU from
// the reader's agent, whose small copies run on the compute engine: 2.39 ms per 4 KiB put,
// studies/timeslice_lab; this rank's agent ends it at the timeout, StagingAgent::end_overdue).
// With MESHMEM_STAGED_COMPLETION=source a put through a channel ends for its stream once its
// source is in the slots (the done word at ticket - 1); quiet(stream), barrier(stream), a get
// from the same rank, and on the host Window::free, barrier() and ~Comm wait for its landing
// (unlanded_). For a put of at most 64 KiB from this GPU to a hidden peer, its rows 4-byte
// aligned, the kernel first copies the bytes into a small slot of its stream's, so the agent
// only posts it (MESHMEM_STAGING_STREAM_FILL; by default not where ranks share a GPU).
//
// Order: the agent polls each transfer's ready word and enqueues a transfer only once its
// source is ready, in the order sources become ready; its streams never wait on a caller's
// stream. So a transfer whose stream waits (for a peer's signal, behind a graph launch that
// holds a staged transfer) holds no other transfer back, as on the ipc route. Transfers of
// one stream stay in order because the stream waits for each one's end (with source
// completion, for each one's source read: puts to one rank then land in channel order, the
// reader never batching two copies onto the same bytes). Done words are lent
// per transfer and taken back once a lane's counter shows the transfer ended; with all of
// them in use (about 64,000 transfers in flight) a call waits for the oldest, bounded by
// MESHMEM_TIMEOUT. (Until this version transfers were enqueued in call order with a stream
// wait on the event: such a transfer held every later one until MESHMEM_TIMEOUT.)
//
// CUDA graphs: under capture the graph gets a kernel that rings the transfer's doorbell on
// every replay (the agent polls them while captured transfers exist, CapturedHandoff) and
// waits for the ticket the agent answered with, in pinned memory; the
// request and its words live as long as the graph (a CUDA user object). Replays of one
// instantiated graph run one after another (CUDA orders them); two instantiations of one
// captured graph running at the same time share the words and can stall until
// MESHMEM_TIMEOUT (a limit). A graph must not be replayed after its Comm is gone (as with
// every route: its windows are gone too).
//
// The agent preloads meshmem's kernels on every GPU it drives: under CUDA's lazy loading a
// first launch may wait for the context to be idle, which a polling transfer wait never is
// (this hung back-to-back transfers until 6fa5e92). An application kernel launched for the
// first time while a staged wait is in flight stalls it until MESHMEM_TIMEOUT under lazy
// loading: the launch waits for an idle GPU and holds the agent's driver calls meanwhile.
// meshmem asks for eager loading when the program starts (module_loading.hpp), and a Comm
// with a staged route under lazy loading warns.
//
// Channels: agents poll them (yielding for 1 ms after recent work, then every 20 us, every
// 200 us after 20 ms without), so a transfer after a quiet spell starts up to 0.2 ms late; a
// chunk for a window the target already freed is dropped there, counted, and reported by this
// rank's next call. Nothing an agent enqueues waits for another rank (slots are reused once
// the host sees them taken), so a stalled peer delays only the transfers that need its slots,
// for at most MESHMEM_TIMEOUT.
#pragma once

#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "transport.hpp"
#include "cuda/runtime/block_pool.hpp"
#include "cuda/barrier/barrier_resources.hpp"
#include "cuda/staged/staging_agent.hpp"

namespace meshmem::detail {

template <class Owner>
struct HandoffBoard;
class GpuDevice;

class StagedTransport final : public Transport, private BarrierResources {
 public:
  // Learns which node peers' GPUs this process sees (the device runtime's PCI bus ids).
  explicit StagedTransport(const CommContext& ctx);
  ~StagedTransport() override;
  TransportKind kind() const override { return TransportKind::Staged; }
  Capabilities capabilities() const override { return Capabilities{true, false, true, true, true}; }
  bool serves(Memory memory) const override { return memory == Memory::Device && device_ != nullptr; }
  Reach reach(int rank, Memory memory) const override;
  // Collective: makes the node's staging pool and starts the agent.
  void connect(const std::vector<bool>& routed) override;
  std::unique_ptr<WindowAttachment> attach(WindowState& win, const std::vector<bool>& routed,
                                           const std::string& what) override;
  void put(const WindowState& win, int target, std::size_t offset, const void* src, std::size_t bytes,
           const SignalUpdate& signal, Stream stream) override;
  void get(void* dst, const WindowState& win, int target, std::size_t offset, std::size_t bytes,
           Stream stream) override;
  // One transfer (2D copies through the slots), not one per row.
  void put_strided(const WindowState& win, int target, std::size_t dst_offset, std::size_t dst_pitch, const void* src,
                   std::size_t src_pitch, std::size_t width, std::size_t height, Stream stream) override;
  // Raises what the agent knows failed (a transfer abandoned, a peer gone), as the next
  // transfer would. The caller's stream waits for each transfer's end, except a put with
  // source completion (MESHMEM_STAGED_COMPLETION=source): `stream` then waits for the ends of
  // its puts not yet known to have landed.
  void quiet(Stream stream) override;
  void complete_on_host(const char* call) override;
  void stop() noexcept override;
  // Waits (bounded) for this rank's transfers, those to hidden peers included.
  void settle() noexcept override;

  // Waits until every transfer handed to the agent has finished on the GPUs (bounded by
  // MESHMEM_TIMEOUT; false if not). A window's peer mappings go only after this.
  bool drain() noexcept;
  // The staging pool as this rank sees it ("" before connect).
  std::string describe() const override;
  // The barrier's node flags are words in rank r's region of the pool.
  const BarrierResources* barrier_resources() const override { return this; }


 private:
  bool keeps_node_flags() const override { return true; }
  bool has_node_flags() const override { return agent_ != nullptr; }
  std::uint64_t* node_flags(int rank) const override;
  // Raises, once, a transfer that failed since the last call (`where` begins the message).
  void raise_earlier_failure(const std::string& where);
  std::string what(const char* op, int target) const;
  void* mapped_part(const WindowState& win, int rank, const char* op) const;
  StagedRequest request(void* dst, int dst_device, const void* src, int src_device, std::size_t width, std::size_t rows,
                        std::size_t dst_pitch, std::size_t src_pitch) const;
  StagedRequest hidden_request(StagedRequest::Route route, int target, const WindowState& win, std::size_t offset,
                               std::size_t width, std::size_t rows, std::size_t dst_pitch, std::size_t src_pitch) const;
  // Hands one transfer to the agent; the caller's stream waits for its end.
  void transfer(StagedRequest r, int peer, Stream stream, const char* name);
  bool fills_slot(const StagedRequest& r, cudaStream_t stream) const;
  // Source completion: `stream` waits for the ends of its puts (to `peer` only, where given)
  // that have not landed yet.
  void wait_for_landing(cudaStream_t stream, int peer, const char* call);
  void capture_transfer(const StagedRequest& r, cudaGraph_t graph, int peer, cudaStream_t stream, const char* name);

  CommContext ctx_;
  GpuDevice* device_;       // null where device windows are unavailable
  std::vector<int> peer_device_;    // by rank: its GPU as this process numbers it, -1 if hidden
  std::vector<std::string> no_route_;
  std::size_t chunk_;
  std::size_t first_piece_;  // MESHMEM_STAGING_FIRST_PIECE (0: off)
  int slots_;
  bool stream_fill_;  // MESHMEM_STAGING_STREAM_FILL
  bool source_completion_;  // MESHMEM_STAGED_COMPLETION=source
  // Puts with source completion whose stream went on before they landed, by stream.
  struct Unlanded {
    std::uint64_t* done;
    std::uint64_t ticket;
    int peer;
    bool ends_at_timeout;  // its stream waited with a memory wait (StagedRequest::ends_at_timeout)
  };
  // By stream as the caller means it: the legacy stream whether named by null or
  // cudaStreamLegacy, each thread's own per-thread stream apart.
  using StreamKey = std::pair<cudaStream_t, std::thread::id>;
  static StreamKey key_of(cudaStream_t stream);
  static void forget(std::vector<Unlanded>& list, const std::vector<Unlanded>& also);
  std::mutex unlanded_m_;
  std::map<StreamKey, std::vector<Unlanded>> unlanded_;
  std::shared_ptr<StagingAgent> agent_;  // shared with window attachments (released later)
  std::shared_ptr<HandoffBoard<StagingAgent>> board_;  // shared with captured graphs
};

}  // namespace meshmem::detail
