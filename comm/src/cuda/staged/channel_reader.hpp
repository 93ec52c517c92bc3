// ChannelReader: the staging agent's side of the channels from its hidden node peers (the
// writers): it takes the descriptors they post into this rank's region of the staging pool,
// copies their chunks onto this rank's GPU on its own stream (the incoming stream), raises
// their signals and done words, moves each channel's consumed count on, and hands the gets
// they ask for to the agent's writer side as answers. A refused descriptor (a window freed
// here, a range outside it) still moves its channel on and ends its transfer, and is counted
// once. It runs on the agent's thread only. The design: docs/transports/staged.md.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "fault.hpp"
#include "step_trace.hpp"
#include "cuda/agent/landing_windows.hpp"
#include "cuda/runtime/event_pool.hpp"
#include "cuda/staged/channel_counts.hpp"
#include "cuda/staged/channel_layout.hpp"
#include "cuda/staged/staged_outgoing.hpp"
#include "cuda/staged/staging_site.hpp"

namespace meshmem::detail {

// Under `windows`' lock: `windows` resolved (its problem ending "; nothing was written"), or,
// for kChannelAddress, `offset` as an address of this process.
inline void* resolve_for_channel(const LandingWindows& windows, std::uint64_t window, std::uint64_t offset,
                                 std::size_t width, std::size_t rows, std::size_t pitch, std::string* problem) {
  if (window == kChannelAddress) return reinterpret_cast<void*>(offset);
  char* at = windows.resolve(window, offset, width, rows, pitch, problem);
  if (at == nullptr) *problem += "; nothing was written";
  return at;
}

class ChannelReader {
 public:
  // What the reader reaches of its agent (all outlive it).
  struct Agent {
    const StagingSite* site = nullptr;
    FaultPlan* faults = nullptr;  // staged.carry, staged.copy_in, staged.ends_in
    StepTrace* trace = nullptr;
    EventPool* events = nullptr;
    LandingWindows* windows = nullptr;
    // Keeps an error for the rank's next call.
    std::function<void(const std::string&)> keep_error;
    // Queues the answer to the get of the writer at node index `from` on the agent's writer
    // side; returns it as queued (carry_out may mark it counted).
    std::function<StagedOutgoing&(std::size_t from, StagedOutgoing answer)> answer;
  };
  // Makes the incoming stream where the site has hidden peers (none otherwise: nothing comes).
  explicit ChannelReader(Agent agent);
  ChannelReader(const ChannelReader&) = delete;
  ChannelReader& operator=(const ChannelReader&) = delete;
  ~ChannelReader();

  // Takes every descriptor hidden peers posted here since the last look; true if any. What they
  // ask for is enqueued on the incoming stream together at the end (flush), under the windows'
  // lock from the first descriptor's resolve to the enqueueing: a window freed meanwhile waits
  // for it.
  bool poll();
  // Writes the consumed counts whose copies are done (CountAfterCopy); true if any.
  bool write_counts_after_copies();
  bool counts_pending() const { return !consumed_after_copies_.empty(); }

  // The incoming stream (null without hidden peers).
  cudaStream_t stream() const { return stream_; }
  // The writer at node index `from` died: chunks of this rank's gets from it that still come
  // are not carried out (the agent ended those gets).
  void writer_gone(std::size_t from) { writers_[from].gone = true; }
  // The last chunk of the answer to this rank's get with done word `word` and `ticket` was
  // carried out (its end is enqueued on the incoming stream).
  bool answered(std::size_t word, std::uint64_t ticket) const {
    const auto it = last_answered_.find(word);
    return it != last_answered_.end() && it->second == ticket;
  }
  // How far the incoming stream got: the chunks of readable channels consumed (*done) and
  // those seen and not yet consumed (*left).
  void progress(std::uint64_t* done, std::uint64_t* left) const;
  // Descriptors taken from the writer at node index `from`.
  std::uint64_t seen(std::size_t from) const { return writers_[from].seen; }

 private:
  // What one look at the incoming channels took (poll), enqueued on the incoming stream at its
  // end as one copy batch and one batch of stream writes (flush): a middle rank of
  // Jacobi gets a halo from each neighbour at about the same time, and two driver calls
  // instead of four save its agent 2.4-3 us per pair (studies/driver_call_lab's reader-pair
  // rows). Whatever carry_out enqueues on the stream directly (a strided chunk's 2D
  // copy, an Add signal's kernel, the ends after an error) comes after a flush, so each
  // signal, done word and consumed count follows its copy, and a channel's consumed counts
  // stay in take order.
  struct IncomingBatch {
    static constexpr std::size_t kNoWord = ~std::size_t(0);
    std::vector<void*> dsts;  // the contiguous chunks' copies
    std::vector<const void*> srcs;
    std::vector<std::size_t> sizes;
    struct Copied {  // per copy: how its transfer is refused if the copies fail
      int writer;
      std::pair<std::uint64_t, std::uint64_t> transfer;  // (done rank, ticket)
      bool last;     // its transfer's last chunk
      bool own_get;  // the answer to this rank's get
      bool counted;  // carry_out counted the transfer's refusal already
    };
    std::vector<Copied> copied;
    // Set signals of last chunks, written after every copy and before every end of the batch
    // (earlier descriptors' ends included: a signal only has to follow its own copy); each
    // with its copy's place in the batch (-1: none there), dropped where that copy failed.
    std::vector<std::pair<CUstreamBatchMemOpParams, long>> signals;
    struct End {  // a done word or consumed count, in take order
      CUstreamBatchMemOpParams op;
      int mid_writer = -1;  // >= 0: the consumed count of a chunk that more chunks follow (CountAfterCopy-able)
      std::uint64_t* word = nullptr;
      std::uint64_t value = 0;
      // The done word of this rank's own get (kNoWord: none), marked answered (last_answered_)
      // once this write is enqueued: watch_readers ends only gets whose end is not.
      std::size_t answered_word = kNoWord;
      std::uint64_t ticket = 0;
    };
    std::vector<End> ends;
    struct Traced {  // MESHMEM_STAGED_TRACE's E step, once enqueued
      int writer;
      std::uint64_t ticket;
      std::int64_t done_rank;
    };
    std::vector<Traced> traced;
    bool empty() const { return dsts.empty() && signals.empty() && ends.empty() && traced.empty(); }
    std::uint64_t round = 0;  // how many times it was enqueued
    void clear() {
      ++round;
      dsts.clear();
      srcs.clear();
      sizes.clear();
      copied.clear();
      signals.clear();
      ends.clear();
      traced.clear();
    }
  };
  // One writer's channel, as read here.
  struct Writer {
    std::uint64_t seen = 0;  // its descriptors taken here
    bool refused = false;    // a chunk of its current transfer was refused here
    std::pair<std::uint64_t, std::uint64_t> current = kNoTransfer;  // (done rank, ticket) of that transfer
    bool broken = false;     // its channel held a wrong entry; no longer read
    bool gone = false;       // its process ended (writer_gone)
  };
  static constexpr std::pair<std::uint64_t, std::uint64_t> kNoTransfer{~std::uint64_t(0), ~std::uint64_t(0)};
  using Descriptor = ChannelDescriptor;

  void carry_out(int writer, std::uint64_t sequence, const Descriptor& d);
  void count_refusal(int writer, bool own_get);
  // `last_copy_failed`: set where the batch's last copy could not be enqueued. Never throws:
  // what it could not enqueue is kept as this rank's error, and those transfers' waits time out.
  void flush(bool* last_copy_failed = nullptr) noexcept;
  void enqueue_batch(bool* last_copy_failed);
  // Enqueues `ops`, then `ends`, in one batch on the incoming stream; then marks the ends of
  // this rank's own gets among them answered (last_answered_).
  void write_ends(std::vector<CUstreamBatchMemOpParams>& ops, const std::vector<IncomingBatch::End>& ends,
                  const char* call);
  void keep_error(const std::string& message) { agent_.keep_error(message); }

  Agent agent_;
  const StagingSite& site_;
  cudaStream_t stream_ = nullptr;  // chunks from hidden peers, onto this rank's GPU
  std::vector<Writer> writers_;    // by node index
  IncomingBatch batch_;            // under the windows' lock while it holds copies
  std::deque<CountAfterCopy> consumed_after_copies_;  // on stream_: consumed counts
  bool batch_copies_ = true;  // cudaMemcpyBatchAsync (false once the driver said it is not supported)
  std::map<std::size_t, std::uint64_t> last_answered_;  // by done word: the ticket of this rank's get whose answer's last chunk was carried out
};

}  // namespace meshmem::detail
