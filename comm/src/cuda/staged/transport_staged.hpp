// StagedTransport: device windows of node peers whose GPUs have no peer access, carried through
// the node's pinned staging pool by each rank's StagingAgent (staging_agent.hpp). This is the
// callers' side: a transfer becomes a request with a done word the caller's stream waits for
// (or a doorbell under graph capture), and puts with source completion are tracked until they
// land. How the pipeline works, its knobs, orderings and limits: docs/transports/staged.md.
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
#include "cuda/staged/stream_path.hpp"

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
  // Whether a transfer of `bytes` with `peer` on `stream`, this rank's side at `mine`, goes by
  // the stream path (see transport_staged.cpp), and then enqueues it there.
  bool by_stream_path(int peer, std::size_t bytes, const void* mine, cudaStream_t stream) const;
  // False where the stream path declined it (no free slot or lane): it goes through the agents.
  bool stream_path_transfer(const StreamPath::Transfer& t, int peer, cudaStream_t stream, const char* name);
  bool fills_slot(const StagedRequest& r, cudaStream_t stream) const;
  // Source completion: `stream` waits for the ends of its puts (to `peer` only, where given)
  // that have not landed yet.
  void wait_for_landing(cudaStream_t stream, int peer, const char* call);
  void capture_transfer(const StagedRequest& r, cudaGraph_t graph, int peer, cudaStream_t stream, const char* name);

  CommContext ctx_;
  GpuDevice* device_;       // null where device windows are unavailable
  std::vector<int> peer_device_;    // by rank: its GPU as this process numbers it, -1 if hidden
  // By rank: its GPU as this process numbers it where both sides see each other's GPU, -1 if
  // not; whatever MESHMEM_STAGED_CHANNELS says (the stream path's choice).
  std::vector<int> seen_device_;
  std::vector<std::string> no_route_;
  std::size_t chunk_;
  std::size_t first_piece_;  // MESHMEM_STAGED_FIRST_PIECE (0: off)
  int slots_;
  bool stream_fill_;  // MESHMEM_STAGED_STREAM_FILL
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
  std::shared_ptr<StreamPath> stream_path_;  // null: off, or no peer's GPU seen here; shared likewise
  std::shared_ptr<HandoffBoard<StagingAgent>> board_;  // shared with captured graphs
};

}  // namespace meshmem::detail
