// StagingAgent: the thread of a rank that moves its staged transfers (transport_staged.hpp)
// through its region of the node's staging pool (layout: channel_layout.hpp): with one agent
// where both GPUs are visible here (VisibleCopier), or through a channel with the peer's agent
// (ChannelWriter here, ChannelReader there). The agent itself keeps the callers' side: the
// transfers handed over and their done words (on a HostAgentCore, as the transfer proxy),
// the stream-filled slots, the landing windows, the dead-peer and overdue-put watches; its streams are StagingLanes, its
// slots' turns a SlotRing, its look at its streams a StreamWatchdog. Nothing it enqueues waits
// for another rank; slow, stalled or dead readers and held lanes are bounded by
// MESHMEM_TIMEOUT. The design, the watchdogs and the limits: docs/transports/staged.md.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fault.hpp"
#include "step_trace.hpp"
#include "worker_pulse.hpp"
#include "cuda/agent/captured_handoff.hpp"
#include "cuda/agent/host_agent.hpp"
#include "cuda/agent/landing_windows.hpp"
#include "cuda/runtime/event_pool.hpp"
#include "cuda/runtime/kernels.hpp"
#include "meshmem/ipc/awake_clock.hpp"
#include "meshmem/types.hpp"
#include "cuda/staged/channel_layout.hpp"
#include "cuda/staged/channel_counts.hpp"
#include "cuda/staged/channel_reader.hpp"
#include "cuda/staged/channel_writer.hpp"
#include "cuda/staged/fill_slot_table.hpp"
#include "cuda/staged/hidden_peers.hpp"
#include "cuda/staged/slot_ring.hpp"
#include "cuda/staged/staged_outgoing.hpp"
#include "cuda/staged/staged_request.hpp"
#include "cuda/staged/staging_lanes.hpp"
#include "cuda/staged/staging_pool.hpp"
#include "cuda/staged/staging_site.hpp"
#include "cuda/staged/stream_watchdog.hpp"
#include "cuda/staged/visible_copier.hpp"

namespace meshmem::detail {

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

  // Lends `r` a done word (r.word, r.done, r.word_is_lent) for one eager transfer, and its
  // ready word (r.ready), which it returns for the caller's stream to set. With every word in use (that many transfers waiting or running) the caller
  // waits for the oldest to end, as a full CUDA launch queue makes it wait; bounded by
  // MESHMEM_TIMEOUT.
  std::uint64_t* lend_word(StagedRequest& r, const std::string& what);
  // Gives `r` a done word (r.word, r.done) that a captured graph holds for its life
  // (release_captured_word), or false when every word is in use.
  bool try_hold_word(StagedRequest& r);
  std::size_t word_count() const { return site_.control.transfer_count(); }
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

  // The barrier's flags in rank r's region of the pool, as mapped here (node ranks).
  std::uint64_t* barrier_flags(int rank) const { return site_.control_of(rank).barrier_flags(); }
  const StagingPool& pool() const { return *site_.pool; }

  // The latest report of one of the agent's streams held back (watch_streams), or "".
  std::string held_report() const { return watchdog_.report(); }

  // The first error the agent met, or a count of this rank's transfers that hidden peers
  // could not carry out, once ("" if none); *code: Timeout where the first error was a wait
  // that ran out, else Cuda.
  std::string take_error(ErrorCode* code);

  // Waits until every transfer handed over was enqueued (its source ready), the lanes are
  // idle and transfers to and from hidden peers ended; bounded by MESHMEM_TIMEOUT (0: no
  // bound, as everywhere); false if not.
  bool drain() noexcept;
  // The last transfer handed over so far (drain_through's mark).
  std::uint64_t last_ticket() { return core_.last_ticket(); }
  // drain() for the transfers up to ticket `mark` only: each left the agent's hands, the
  // copies enqueued on the lanes and the reader's stream before then ended, and those of them
  // that hidden peers end (puts, and gets whose answers land here) have ended. Transfers
  // handed over later do not hold it (a freed window's release, run once the device's work
  // before the free has ended, beside the rank's later traffic); bounded the same way.
  bool drain_through(std::uint64_t mark) noexcept;

 private:
  using Clock = ipc::AwakeClock;  // a whole job suspended and resumed stalls no transfer
  using Lane = StagingLane;
  using Core = HostAgentCore<StagedRequest>;

  bool try_take_word(std::size_t* word) { return core_.try_take_word(word); }
  void run();
  void give_up_all(ReadyQueue<StagedRequest>& waiting);
  bool start_ready(ReadyQueue<StagedRequest>& waiting);
  bool take_withdrawn(std::uint64_t ticket);  // true (and forgotten) if withdraw() named it
  void give_up_if_context_failed(ReadyQueue<StagedRequest>& waiting);
  bool pump();
  // The first one since take_error() is the one the caller's next call raises; later ones
  // are only logged (where they are detected).
  void keep_error(const std::string& message, ErrorCode code = ErrorCode::Cuda) { core_.keep_error(message, code); }
  void fail(const StagedRequest& r, const std::string& message);
  void end_unstarted(const StagedRequest& r);
  void execute(const StagedRequest& r);
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
  // Whether a transfer a hidden peer (or this rank's answer to a get) is to end, of ticket
  // `through` or less, has not ended.
  bool remote_ends_pending(std::uint64_t through = UINT64_MAX);
  // What the agent holds and how far it got, for pulse_ (every ~100 ms, from its thread).
  std::string describe_state(std::size_t waiting) const;
  // Writes the posted counts (and the reader's consumed ones) whose copies are done; true if any.
  bool write_counts_after_copies();
  // Transfer `ticket` left the agent's hands (enqueued to its end, or failed); `answer`: the
  // answer to a peer's get (outside work, the peer's ticket).
  void ended(bool answer, std::uint64_t ticket);
  static StagingSite site_of(Setup& setup);
  ChannelReader::Agent reader_links();  // what reader_ reaches of this agent
  ChannelWriter::Agent writer_links();
  VisibleCopier::Agent copier_links();
  StreamWatchdog::Agent watchdog_links();

  StagingSite site_;  // first: the pool is destroyed last, after the lanes stopped using it
  // The transfers handed over, the done words free and lent (an eager transfer's word goes back
  // once its lane's counter, or its done word, reaches its end), the counts, the first error,
  // the stop flag: what the callers' threads and the agent's thread share.
  Core core_;
  FaultPlan faults_;
  // MESHMEM_STAGED_TRACE: S handed over (caller's thread), R source seen ready, P copy into a
  // slot enqueued (aux: bytes), O posted (aux: 1 for a transfer's last piece); I a peer's
  // descriptor seen, E carried out (enqueued with the rest of its look; aux: the rank whose
  // transfer it is). peer, id: the other rank and the transfer's ticket. L a look's batch
  // enqueued (peer -1, id: its descriptors, aux: its copies). Written at teardown.
  StepTrace trace_;
  StagingLanes lanes_;
  SlotRing slots_;  // this rank's staging slots' turns (copier_ and writer_)
  HiddenPeers hidden_peers_;
  std::vector<std::uint64_t> failed_seen_;  // by node index: a peer's count of this rank's transfers it refused, as last reported
  Clock::time_point next_watch_{};
  Clock::time_point next_stream_watch_{};

  std::shared_ptr<HandoffBoard<StagingAgent>> captured_;

  LandingWindows windows_;  // where hidden peers' chunks land and their gets are read

  EventPool events_;
  struct RemoteEnd {
    const std::uint64_t* done;
    std::uint64_t ticket;
    std::size_t word;
    int writer;  // whose GPU writes the done word: a put's reader, or this rank (a get's answer)
    int peer;    // the hidden peer it goes to or comes from: its death ends it (watch_readers)
    bool ends_at_timeout;  // StagedRequest::ends_at_timeout
    std::optional<Clock::time_point> posted;  // when its last descriptor was posted (end_overdue)
    bool ended() const { return __atomic_load_n(done, __ATOMIC_ACQUIRE) >= ticket; }
  };
  // Transfers a hidden peer (or this rank's answer to a get) ends, for the watches; their words
  // go back through core_. Entries whose done word reached the ticket are dropped as new ones
  // come. Taken before core_'s lock where both are.
  struct RemoteEnds {
    std::mutex m;
    std::vector<RemoteEnd> list;
    void drop_ended() {  // under m
      list.erase(std::remove_if(list.begin(), list.end(), [](const RemoteEnd& e) { return e.ended(); }), list.end());
    }
  };
  RemoteEnds remote_;
  // Tickets withdraw() ended unstarted, until the agent sees their ready word.
  struct Withdrawn {
    std::mutex m;
    std::vector<std::uint64_t> tickets;
    std::atomic<std::size_t> count{0};  // tickets.size(), read without m
  };
  Withdrawn withdrawn_;
  std::mutex hand_over_m_;  // callers' threads; guards fill_slots_ too
  FillSlotTable fill_slots_;
  ChannelWriter writer_;  // this rank's channels to hidden peers (after everything it uses)
  VisibleCopier copier_;  // transfers between GPUs visible here
  ChannelReader reader_;  // hidden peers' channels into this rank (after events_ and windows_, which it uses)
  StreamWatchdog watchdog_;  // the agent's own streams
  // Its loop's turns and its state, for the timeout errors of callers' threads
  // (describe_worker_pulses): a stall inside this thread shows there.
  std::shared_ptr<WorkerPulse> pulse_;
  std::thread thread_;
};

}  // namespace meshmem::detail
