// StagingAgent: the thread of a rank that moves its staged transfers (transport_staged.hpp)
// through its region of the node's staging pool (layout: channel_layout.hpp): with one agent
// where both GPUs are visible here, or through a channel with the peer's agent. Nothing it
// enqueues waits for another rank; slow, stalled or dead readers and held lanes are bounded by
// MESHMEM_TIMEOUT. The design, the watchdogs and the limits: docs/transports/staged.md.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fault.hpp"
#include "piece_cursor.hpp"
#include "progress_watch.hpp"
#include "step_trace.hpp"
#include "worker_pulse.hpp"
#include "cuda/agent/captured_handoff.hpp"
#include "cuda/agent/landing_windows.hpp"
#include "cuda/runtime/event_pool.hpp"
#include "cuda/runtime/kernels.hpp"
#include "meshmem/ipc/awake_clock.hpp"
#include "meshmem/ipc/pidfd.hpp"
#include "meshmem/types.hpp"
#include "cuda/staged/channel_layout.hpp"
#include "cuda/staged/channel_counts.hpp"
#include "cuda/staged/channel_reader.hpp"
#include "cuda/staged/staged_outgoing.hpp"
#include "cuda/staged/fill_slot_table.hpp"
#include "cuda/staged/staging_pool.hpp"
#include "cuda/staged/staging_site.hpp"

namespace meshmem::detail {

// One transfer, as the agent enqueues it: `rows` rows of `width` bytes, `src_pitch` /
// `dst_pitch` apart (a contiguous transfer is one row).
struct StagedRequest {
  static constexpr std::uint64_t kAddress = kChannelAddress;  // a window id that is none: a raw address
  enum class Route { Visible, ToHidden, FromHidden };
  Route route = Route::Visible;
  int peer = -1;                // the other rank
  // ToHidden, a stream-filled put: the caller's stream copied the source into this slot (an offset
  // in this rank's region of the pool, FillSlots) before it set `ready`; kAddress: none.
  std::uint64_t filled_slot = kAddress;
  // Set to `ticket` by the caller's stream once the source is ready (ControlWords::ready;
  // null: handed over by a captured doorbell, rung once it is).
  const std::uint64_t* ready = nullptr;
  cudaStream_t stream = nullptr;  // the caller's stream (with `ready`): its transfers become ready in order
  void* dst = nullptr;          // Visible, FromHidden: an address here
  int dst_device = -1;
  const void* src = nullptr;    // Visible, ToHidden: an address here
  int src_device = -1;
  std::size_t width = 0;
  std::size_t rows = 1;
  std::size_t src_pitch = 0;
  std::size_t dst_pitch = 0;
  std::uint64_t* signal = nullptr;  // Visible: on dst_device, or null
  std::uint64_t value = 0;
  SignalOp op = SignalOp::Set;
  // ToHidden: the target's window and offset (and signal word); FromHidden: the window read.
  std::uint64_t window = kAddress;
  std::uint64_t offset = 0;
  std::uint64_t signal_window = kAddress;
  std::uint64_t signal_index = 0;
  // Its done word (ControlWords::transfer(word)) reaches `ticket` at its end; the caller's
  // stream waits for that.
  std::size_t word = 0;
  std::uint64_t* done = nullptr;
  bool word_is_lent = false;  // an eager transfer's word: back to the free list after its end
  // ToHidden, not stream-filled (MESHMEM_STAGED_COMPLETION=source): the done word reaches
  // ticket - 1 once the source is copied into the slots, which the caller's stream waits for.
  bool source_complete = false;
  // ToHidden: the caller's stream waits with a stream memory wait, which cannot time out: the
  // agent ends the transfer if its reader has not MESHMEM_TIMEOUT after it was posted in full
  // (end_overdue).
  bool ends_at_timeout = false;
  std::uint64_t ticket = 0;  // even (StagingAgent::submit)
  std::size_t bytes() const { return width * rows; }
};

class StagingAgent {
 public:
  struct Setup {
    std::unique_ptr<StagingPool> pool;
    std::vector<int> devices;  // this rank's GPU first, then the visible peers' GPUs it drives
    std::size_t chunk = 0;
    std::size_t first_piece = 0;  // MESHMEM_STAGED_FIRST_PIECE (PieceCursor's ramp; 0: none)
    int slots = 0;
    int rank = 0;
    int ranks = 0;
    std::vector<int> node_ranks;  // Topology::node_ranks
    std::vector<bool> hidden;     // by rank: a node peer whose GPU this process cannot see
    // By rank: process ids (those of hidden peers are watched). Node peers share this
    // process's pid namespace: the descriptor exchange checked each one's id (fd_exchange.cpp).
    std::vector<pid_t> pids;
    FaultPlan faults;  // staged.carry, staged.answer
    std::string trace_prefix;  // MESHMEM_STAGED_TRACE: "" or where the step trace goes (+ "." + rank)
    std::chrono::milliseconds timeout{0};
    // Where replays of captured transfers ring (CapturedHandoff): polled while any exists.
    // Required.
    std::shared_ptr<HandoffBoard<StagingAgent>> captured;
  };
  explicit StagingAgent(Setup setup);
  StagingAgent(const StagingAgent&) = delete;
  StagingAgent& operator=(const StagingAgent&) = delete;
  ~StagingAgent();

  void stop() noexcept;

  // A done word for one transfer (ControlWords::transfer), or false when every word is in use.
  bool try_take_word(std::size_t* word);
  // As try_take_word, but with every word in use (that many transfers waiting or running) the
  // caller waits for the oldest to end, as a full CUDA launch queue makes it wait; bounded by
  // MESHMEM_TIMEOUT.
  std::size_t take_word(const std::string& what);
  void release_word(std::size_t word);
  // The word of a captured transfer whose graph is gone: free again once the transfer of its
  // last replay (ticket `last`, 0: none) ended, so that a late end of one whose wait gave up
  // cannot move a reused word back.
  void release_captured_word(std::size_t word, const std::uint64_t* done, std::uint64_t last);

  // Queues a transfer (its done word set); returns its ticket: the value its done word
  // reaches at its end.
  std::uint64_t submit(StagedRequest r);

  // A transfer was captured (Setup::captured has a live step now): the agent polls its
  // doorbells from now on, also if it slept.
  void captured_added();
  // Held by a caller's thread from submit (or submit_filled) to the enqueue of the operation
  // that sets the transfer's ready word: one stream's ready words then come in the order of
  // its tickets, which ReadyQueue relies on (it looks at each stream's oldest only), also
  // where several threads hand over transfers on one stream.
  std::unique_lock<std::mutex> hand_over() { return std::unique_lock<std::mutex>(hand_over_m_); }
  // A stream-filled put (r.route ToHidden, r.ready set, at most FillSlots::kSlotBytes from this
  // rank's GPU), under hand_over(): if `stream` has a fill slot, or one is free for it,
  // submits r with its slot and calls enqueue(slot, retired, previous, ticket), which enqueues
  // the slot's fill on `stream` (cuda::SlotFill; `retired`: the slot's word, `previous`: the
  // slot's last transfer, to wait for); false (nothing submitted) where every slot is retired or
  // belongs to another stream whose last transfer there has not ended. What enqueue throws goes to the caller, the ticket in
  // *ticket (then withdraw it). A slot stays its stream's, so its previous transfer is that
  // stream's, which the stream waited for already: the fill never waits on another stream.
  using FillUse = FillSlotTable::Use;
  template <class Enqueue>
  bool submit_filled(StagedRequest r, cudaStream_t stream, std::uint64_t* ticket, Enqueue enqueue) {
    std::size_t i = 0;
    if (!fill_slots_.slot_of(stream, &i)) return false;
    r.filled_slot = site_.fill_offset(i);
    const FillUse before = fill_slots_.last(i);
    *ticket = submit(r);
    enqueue(site_.slots + r.filled_slot, site_.control.fill_retired(i), before, *ticket);
    fill_slots_.used(i, FillUse{r.done, *ticket, r.peer});
    return true;
  }

  // Transfer `ticket` (submitted) will never be marked ready by its stream (its wait could not
  // be enqueued; the caller raised that): it ends without being started. `ready` is its word.
  void withdraw(std::uint64_t ticket, std::uint64_t* ready);

  // Where hidden peers' transfers land: this rank's device windows by id (attach / release;
  // remove_window returns once nothing more is enqueued into it and what was has ended,
  // bounded by MESHMEM_TIMEOUT).
  void add_window(std::uint64_t id, void* local, std::size_t bytes);
  void remove_window(std::uint64_t id);

  const ControlWords& control() const { return site_.control; }
  // Rank r's control words, in its region of the pool as mapped here (node ranks).
  ControlWords control_of(int rank) const { return site_.control_of(rank); }
  const StagingPool& pool() const { return *site_.pool; }

  // The latest report of one of the agent's streams held back (watch_streams), or "".
  std::string held_report();

  // The first error the agent met, or a count of this rank's transfers that hidden peers
  // could not carry out, once ("" if none); *code: Timeout where the first error was a wait
  // that ran out, else Cuda.
  std::string take_error(ErrorCode* code);

  // Waits until every transfer handed over was enqueued (its source ready), the lanes are
  // idle and transfers to and from hidden peers ended; bounded by MESHMEM_TIMEOUT (0: no
  // bound, as everywhere); false if not.
  bool drain() noexcept;

 private:
  using Clock = ipc::AwakeClock;  // a whole job suspended and resumed stalls no transfer
  using StreamWatch = ProgressWatch<Clock>;  // how far the GPU got with one of the agent's streams
  struct Lane {
    std::size_t ordinal = 0;          // its done counter: ControlWords::lane_done(ordinal)
    cudaStream_t stream = nullptr;
    std::vector<cudaEvent_t> copied;  // per slot: the device-to-host copy into it is done
    std::vector<cudaEvent_t> freed;   // per slot: the host-to-device copy out of it is done
    std::uint64_t ended = 0;          // transfers enqueued to end on this lane (its counter's goal)
    struct LentEnd {
      std::uint64_t count;   // the lane's counter at its end
      std::size_t word;      // its done word
      std::uint64_t ticket;  // what its end writes there
    };
    std::deque<LentEnd> lent;  // eager transfers whose end is enqueued here, oldest first
    std::deque<std::size_t> pieces;  // slots of pieces whose copy out is enqueued here, oldest first
    std::uint64_t pieces_done = 0;   // pieces seen done (their `freed` event, or a later one of the slot)
    StreamWatch watch;
  };
  // What last used a slot: the copy out of it (an event) or a hidden reader's consumed count.
  struct SlotUse {
    cudaEvent_t event = nullptr;
    int reader = -1;
    std::uint64_t sequence = 0;
  };
  // A transfer between two GPUs visible here, as far as its pieces are enqueued.
  struct VisibleTransfer {
    StagedRequest request;
    PieceCursor pieces;
    Clock::time_point moved;  // when a piece was last enqueued (or it started)
  };
  // A transfer to a hidden reader (a put, or the answer to its get), or this rank's request
  // for a get from it, as far as it is posted on the channel.
  using Outgoing = StagedOutgoing;
  using Descriptor = ChannelDescriptor;

  void reclaim_words();  // under ledger_.m
  void run();
  void give_up_all(ReadyQueue<StagedRequest>& waiting);
  bool start_ready(ReadyQueue<StagedRequest>& waiting);
  bool take_withdrawn(std::uint64_t ticket);  // true (and forgotten) if withdraw() named it
  void give_up_if_context_failed(ReadyQueue<StagedRequest>& waiting);
  bool pump();
  // The first one since take_error(); takes ledger_.m (keep_error_locked: under ledger_.m).
  void keep_error(const std::string& message, ErrorCode code = ErrorCode::Cuda);
  void keep_error_locked(const std::string& message, ErrorCode code);
  void fail(const StagedRequest& r, const std::string& message);
  void end_unstarted(const StagedRequest& r);
  void execute(const StagedRequest& r);
  void enqueue_visible_piece(const StagedRequest& r, const PieceCursor::Piece& p, std::size_t s, const std::string& what);
  void end_visible(const StagedRequest& r, bool signal, const std::string& what);
  void abandon_visible(const StagedRequest& r, const std::string& message, ErrorCode code = ErrorCode::Cuda);
  bool advance_outgoing(Outgoing& o, bool* moved);
  void abandon_outgoing(const Outgoing& o, const std::string& message, ErrorCode code = ErrorCode::Cuda);
  // This rank's transfer with done word `word` and `ticket` left the channel queue (posted in
  // full, or abandoned): end_overdue's clock starts.
  void mark_posted(std::size_t word, std::uint64_t ticket);
  // Every ~10 ms: hidden peers whose process ended give their slots back, and the puts they
  // were to end and the gets they were to answer are ended here (see the header comment).
  void watch_readers();
  // Every ~10 ms: transfers whose callers' streams wait with a stream memory wait
  // (StagedRequest::ends_at_timeout) that their live reader has not ended MESHMEM_TIMEOUT
  // after they were posted in full are ended here.
  void end_overdue();
  // Every ~100 ms while work is enqueued: a stream whose work has not moved for
  // held_after_ is logged (see the header comment); true while any stream holds work.
  bool watch_streams();
  void watch(StreamWatch& w, std::uint64_t done, bool pending, const std::string& stream, const std::string& holds);
  // What the agent holds and how far it got, for pulse_ (every ~100 ms, from its thread).
  std::string describe_state(std::size_t waiting) const;
  // A lane held past MESHMEM_TIMEOUT: the ends of its eager transfers are written from here.
  void end_held(Lane& lane, int device);
  bool take_slot(bool on_host, std::size_t* s);
  std::string slot_holders() const;
  std::uint64_t consumed_by(int reader) const;
  bool ring_has_room(int reader) const;
  // `copied`: the slot's event, recorded after the piece's copy into it, where more pieces of
  // the transfer follow (the host then writes its count: CountAfterCopy); null: the lane does.
  // `filled`: the bytes are in the slot already (a stream-filled put): this thread writes the count
  // where every earlier one is written.
  std::uint64_t post(int reader, Descriptor d, cudaEvent_t copied = nullptr, bool filled = false);
  // Writes the posted counts (and the reader's consumed ones) whose copies are done; true if any.
  bool write_counts_after_copies();
  bool stalled(Clock::time_point moved) const {
    return site_.timeout.count() != 0 && Clock::now() - moved >= site_.timeout;
  }
  void ended(bool answer);  // a transfer left the agent's hands (enqueued to its end, or failed)
  static StagingSite site_of(Setup& setup);
  ChannelReader::Agent reader_links();  // what reader_ reaches of this agent

  StagingSite site_;  // first: the pool is destroyed last, after the lanes stopped using it
  FaultPlan faults_;
  // MESHMEM_STAGED_TRACE: S handed over (caller's thread), R source seen ready, P copy into a
  // slot enqueued (aux: bytes), O posted (aux: 1 for a transfer's last piece); I a peer's
  // descriptor seen, E carried out (enqueued with the rest of its look; aux: the rank whose
  // transfer it is). peer, id: the other rank and the transfer's ticket. L a look's batch
  // enqueued (peer -1, id: its descriptors, aux: its copies). Written at teardown.
  StepTrace trace_;
  std::map<int, Lane> lanes_;
  std::deque<CountAfterCopy> posted_after_copies_;  // this GPU's lane: posted counts
  std::vector<SlotUse> slot_use_;
  std::size_t next_slot_ = 0;
  // This rank's writer side of the channel to one node peer (hidden peers; ChannelReader reads theirs).
  struct PeerChannel {
    std::uint64_t posted = 0;       // descriptors posted to it
    std::uint64_t failed_seen = 0;  // its count of this rank's transfers it refused, as last reported
    ipc::ProcessWatch process;      // its process (hidden peers)
    bool gone = false;              // its process ended; nothing more goes to it
  };
  std::vector<PeerChannel> peers_;  // by node index
  Clock::time_point next_watch_{};
  Clock::time_point next_stream_watch_{};
  std::chrono::milliseconds held_after_;  // 2 s, or half of MESHMEM_TIMEOUT if that is less
  StreamWatch incoming_watch_;
  std::deque<VisibleTransfer> visible_;          // oldest first; only the oldest takes slots
  std::vector<std::deque<Outgoing>> outgoing_;   // by node index of the reader: oldest first, one at a time on a channel

  std::shared_ptr<HandoffBoard<StagingAgent>> captured_;

  LandingWindows windows_;  // where hidden peers' chunks land and their gets are read

  EventPool events_;
  struct CapturedEnd {  // release_captured_word
    const std::uint64_t* done;
    std::uint64_t ticket;
    std::size_t word;
  };
  struct RemoteEnd {
    const std::uint64_t* done;
    std::uint64_t ticket;
    std::size_t word;
    int writer;  // whose GPU writes the done word: a put's reader, or this rank (a get's answer)
    int peer;    // the hidden peer it goes to or comes from: its death ends it (watch_readers)
    bool ends_at_timeout;  // StagedRequest::ends_at_timeout
    std::optional<Clock::time_point> posted;  // when its last descriptor was posted (end_overdue)
  };
  // What the callers' threads and the agent's thread share, under `m`: the transfers handed
  // over, the done words free and lent, the counts, the first error, the stop flag.
  struct Ledger {
    std::mutex m;
    std::condition_variable cv;
    std::deque<StagedRequest> queue;
    std::vector<std::size_t> free_words;
    std::vector<CapturedEnd> released_captured;
    std::vector<RemoteEnd> remote_lent;  // words of transfers a hidden peer (or the answer to a get) ends
    std::uint64_t submitted = 0;
    std::uint64_t handled = 0;  // transfers enqueued to their end, or failed
    std::vector<std::uint64_t> withdrawn;  // tickets withdraw() ended unstarted
    std::atomic<std::size_t> withdrawn_count{0};  // withdrawn.size(), read without m
    std::uint64_t answers = 0;  // answers to hidden peers' gets not yet posted to their end
    bool stop = false;
    std::string error;
    ErrorCode error_code = ErrorCode::Cuda;
  };
  Ledger ledger_;
  std::mutex hand_over_m_;  // callers' threads; guards fill_slots_ too
  FillSlotTable fill_slots_;
  ChannelReader reader_;  // hidden peers' channels into this rank (after events_ and windows_, which it uses)
  std::string held_report_;
  // Its loop's turns and its state, for the timeout errors of callers' threads
  // (describe_worker_pulses): a stall inside this thread shows there.
  std::shared_ptr<WorkerPulse> pulse_;
  std::thread thread_;
};

}  // namespace meshmem::detail
