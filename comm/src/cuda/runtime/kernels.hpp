// Launchers of meshmem's own kernels (comm/src/cuda/kernels.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "meshmem/types.hpp"

namespace meshmem::detail::cuda {

// What a device-side wait that ran out of time leaves for the host: pinned host memory
// mapped into the device (DeviceFaultRecord owns it). The first wait to time out claims it;
// `code` is written last, so the host reads the other fields once it sees code != 0.
// HostBarrier: reported from the host (a barrier(stream) across nodes whose proxy meeting
// timed out; DeviceFaultRecord keeps its message). ProxyRelease: a captured barrier(stream)
// across nodes that its proxy thread did not release in time. LeadersFailed: a hierarchical
// barrier's node kernel found that this node's leader gave up its all-reduce (`peer`: the
// leader; `expected`: the kernel's number). HandoffStopped: a captured step replayed after
// the thread that carries it out stopped (`expected`: the replay; `index` 1 where it had been
// taken up but did not end).
enum class FaultKind : unsigned {
  None = 0, WaitUntil = 1, Barrier = 2, Halo = 3, Transfer = 4, HostBarrier = 5, ProxyRelease = 6, NodeBarrier = 7,
  LeadersFailed = 8, Handoff = 9, HandoffStopped = 10
};
struct DeviceFault {
  unsigned claimed;
  unsigned code;      // FaultKind, 0 while no wait timed out
  int peer;           // the rank waited for, -1 where any rank may signal
  unsigned cmp;       // Cmp of a wait_until
  std::uint64_t window;    // the signals window's id (0: the barrier's own flags)
  std::uint64_t index;     // the signal word
  std::uint64_t seen;      // its value when the wait gave up
  std::uint64_t expected;  // what it waited for
};

// Where a device wait reports its timeout, and after how long (0: waits forever). The time is
// this process's AwakeClock where `awake_ns` is set (pinned host memory its watcher keeps at
// now(), every 50 ms): a wait on the GPU does not time out while the whole job is suspended
// (the GPU's own clock, used where it is null, goes on meanwhile).
struct WaitLimit {
  DeviceFault* fault;
  std::uint64_t timeout_ns;
  const std::int64_t* awake_ns;
};

// Every launcher takes `early`: a programmatic dependent launch (compute capability 9.0+):
// the kernel may start while the kernel before it on the stream still runs, and waits on
// the GPU (griddepcontrol.wait) for that kernel's completion and memory before its own
// work. It hides the launch latency of back-to-back barriers and waits; after anything
// other than a kernel it is an ordinary launch.

// Whether the kernels' code for the current device has the GPU-side wait (built for
// compute capability 9.0 or later): without it an early launch would not wait.
bool early_launch_compiled();

// Loads every meshmem kernel into the current device's context now. Under CUDA's lazy
// loading (the default) a kernel's first launch loads it, and loading may synchronise the
// context: behind a polling kernel that waits for work another thread of this process has
// still to enqueue (the staged transport's agent), that is a deadlock until the wait times
// out. The CUDA guide's advice for kernels that must run concurrently: preload them.
cudaError_t preload_kernels();

// SM copy of `bytes` (dst, src device-accessible). If `signal` is non-null, the word is
// updated (system-scope release) after the whole copy is written: one launch for a small
// put_signal. bytes may be 0 (signal only).
cudaError_t launch_copy(void* dst, const void* src, std::size_t bytes, std::uint64_t* signal,
                        std::uint64_t value, SignalOp op, cudaStream_t stream, bool early);

// Blocks `stream` until each of words[0 .. count) compares true against `value`, or until
// the limit (then the fault names window `window_id`, word `first_index` + i).
// With `reset`, each word is set to `then` once its wait is over.
cudaError_t launch_wait(std::uint64_t* words, std::size_t count, Cmp cmp, std::uint64_t value, bool reset, std::uint64_t then,
                        std::uint64_t window_id, std::size_t first_index, WaitLimit limit, cudaStream_t stream,
                        bool early);

// Blocks `stream` until *word (host or device memory mapped here) reaches `until`: the end of
// a step a host thread carries out (a staged or nccl transfer with rank `peer`: `sequence`, or
// less, a staged put with source completion waiting for its source read); on timeout the
// fault record gets `fault` and `peer`. First, where `ready` is given (host memory mapped
// here), it sets *ready to `sequence`: the stream's work before it is done, the host thread
// may start. With `give_up`, a wait that times out sets *word to `until | kTransferGivenUp`
// unless it reached `until` meanwhile: the transfer's reader (a staged transfer's, which checks
// the word before each chunk) then drops what of it comes later, its writer posts no more of
// it, and its owner does not lend the word again while the mark stands (a reader's end written
// later replaces it: that was the reader's last write). (Captured steps: launch_rung_wait.)
constexpr std::uint64_t kTransferGivenUp = std::uint64_t(1) << 62;
cudaError_t launch_ticket_wait(std::uint64_t* ready, std::uint64_t* word, std::uint64_t sequence, FaultKind fault,
                               int peer, WaitLimit limit, cudaStream_t stream, bool early, std::uint64_t until,
                               bool give_up);

// A small staged put whose caller's stream fills its slot itself (StagedTransport's stream-filled
// puts): the slot (pinned host memory mapped here) is free once the transfer that used it
// last ended (`prev_done` reached `prev_ticket`; null: never used); then `rows` rows of
// `width` bytes, `src_pitch` apart on this GPU, go into it packed, and *ready is set to
// `ticket`; then the stream waits for *done to reach it, as launch_ticket_wait does. Where
// the wait for the slot times out (a fault), or the transfer that used it last was given up,
// nothing is copied and *ready is set to `ticket | kSlotNotFilled`: the host thread copies from
// `src` (the stream still waits). The slot is then retired for good (*retired set, and a fill
// finding it set copies nothing): a reader that took the timed-out transfer before it was given
// up may copy out of the slot at any later time, also after later transfers of this stream
// ended (those to another reader do not follow its copies). The wait for *done gives up as
// launch_ticket_wait's does.
constexpr std::uint64_t kSlotNotFilled = std::uint64_t(1) << 63;
struct SlotFill {
  char* slot;
  const char* src;
  std::size_t width, rows, src_pitch;
  const std::uint64_t* prev_done;
  std::uint64_t prev_ticket;
  int prev_peer;  // named by a timeout of the wait for the slot
  std::uint64_t* retired;  // the slot's word (ControlWords::fill_retired): nonzero, never filled again
  std::uint64_t* ready;
  std::uint64_t* done;
  std::uint64_t ticket;
  int peer;
};
cudaError_t launch_slot_fill(const SlotFill& fill, WaitLimit limit, cudaStream_t stream, bool early);

// A captured step's doorbell (pinned host memory; CapturedHandoff): `rung` counts the replays
// that reached it (the device advances it), `ack` the replays its owner took up, `ticket` what
// the owner's done word reaches at the end of the one taken up last. `holder` is 1 while a
// replay of the step runs (taken with a compare-and-swap by the step's kernel, on this GPU
// only: atomic among its own kernels): two instantiations of one graph replayed at once share
// the doorbell, and their replays of the step take turns.
struct HandoffSlot {
  std::uint64_t rung;
  std::uint64_t ack;
  std::uint64_t ticket;
  std::uint64_t gate;  // a gated step's: 0 while its replay runs, 1 once the owner let it go
  std::uint64_t holder;
};

// The word after a board's bell: whether its owner still answers doorbells. Stopped: the
// owner's thread ended while its Comm lives (MPI_Finalize): a replay reports HandoffStopped.
// Retired: the Comm is gone, and with it the fault record and done words: a replay writes
// nothing at all and ends.
enum class HandoffClosed : std::uint64_t { Open = 0, Stopped = 1, Retired = 2 };

// Once the stream's earlier work is done: takes the slot (holder; waits while another
// instantiation's replay of the step holds it, FaultKind::Handoff with `peer` on timeout),
// advances slot->rung and sets *bell (both pinned host memory, polled by the step's owner
// thread: no host node, see captured_handoff.hpp), waits until the owner acknowledged this
// replay (FaultKind::Handoff with `peer` on timeout), then until *done reaches the ticket the
// owner gave it (`fault` and `peer` on timeout), and lets the slot go. Gives up at once, or at
// its next look (every 256 polls) while waiting, once bell[1] (HandoffClosed) is not Open.
cudaError_t launch_rung_wait(HandoffSlot* slot, std::uint64_t* bell, const std::uint64_t* done, FaultKind fault, int peer,
                             WaitLimit limit, cudaStream_t stream, bool early);
// A gated step's part (the stream then waits for slot->gate >= 1 with a stream memory
// operation, then lets the slot go with a stream write of holder = 0): takes the slot as
// above, closes the gate, advances the rung, rings, and ends. Where the board is closed, or
// the slot was not taken in time, it opens the gate instead (HandoffStopped, or Handoff,
// reported as above).
cudaError_t launch_rung_ring(HandoffSlot* slot, std::uint64_t* bell, int peer, WaitLimit limit, cudaStream_t stream,
                             bool early);

// One block: takes this rank's next barrier number from *counter (device memory, advanced
// by the kernel itself, so a graph replay takes a new one), stores it into word `rank` of
// every peer's flags (peer_flags: device array of the peers' flag words; a null entry is a
// rank the barrier leaves out), then waits until every peer's word here reaches it; a wait
// that times out reports `fault`. Where `passed` is not null (pinned host memory), the number
// is stored there so that a host thread can see where the stream is: an odd number once the
// waits end, an even one as soon as the kernel starts (the hierarchical barrier's kernels
// before and after its all-reduce: odd means the stream is at the all-reduce). Where
// `leaders_failed` is not null (the node part on a rank that does not lead its node), a
// non-zero word there once the waits end (the leader's rank + 1, stored before its stream
// went on past an all-reduce it gave up) reports LeadersFailed: the barrier did not wait
// for the other nodes. The waits also end once that word is set, so that the barriers after
// it (which the leader never comes to) report at once instead of timing out.
cudaError_t launch_barrier(std::uint64_t* const* peer_flags, std::uint64_t* my_flags, std::uint64_t* counter,
                           int rank, int size, std::uint64_t* passed, const std::uint64_t* leaders_failed,
                           FaultKind fault, WaitLimit limit, cudaStream_t stream, bool early);

// Runs `count` 2-D copies described by `table` (device memory) in one launch: blockIdx.y
// picks the copy, 16-byte accesses where the copy's layout allows.
struct Copy2D {
  char* dst;
  const char* src;
  std::uint64_t width, height, src_pitch, dst_pitch;
};

// The signals of one halo exchange, all in device memory: the exchange number lives in
// *epoch and is advanced by the kernel (graph replays and several streams stay right).
struct HaloSync {
  std::uint64_t* const* stores;    // neighbours' words for this rank, mapped here
  const std::uint64_t* const* waits;  // this rank's words of the neighbours it receives from
  const int* wait_ranks;           // who writes each of `waits`
  int nstores, nwaits;
  std::uint64_t* epoch;            // exchanges run so far
  unsigned* arrived;               // copy blocks done in the running exchange
  std::uint64_t window;            // the signals window's id (for the fault)
};

// The copies of `table`, then (the last block to finish) the next exchange number stored
// into every neighbour's word, then waits for every neighbour's word here to reach it.
cudaError_t launch_halo(const Copy2D* table, int count, std::uint64_t largest, const HaloSync& sync, WaitLimit limit,
                        cudaStream_t stream, bool early);

}  // namespace meshmem::detail::cuda
