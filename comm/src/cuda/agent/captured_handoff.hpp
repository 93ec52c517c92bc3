// CapturedHandoff: how a step that a host thread carries out (a staged or nccl transfer, a
// barrier across nodes met by a proxy thread) runs on every replay of a CUDA graph.
//
// At capture the graph gets one kernel that, once the stream's earlier work is done, advances
// the step's rung in pinned memory and rings its board's bell; the owner's thread polls the
// bell (HandoffBoard::poll) while captured steps exist, hands the request to its owner, and
// writes back the ticket it got and the replay it took up; the kernel then waits until the
// owner's done word reaches that ticket.
//
// Why not a host node that hands the request over: cudaGraphLaunch of a graph whose host
// nodes wait behind device work returns only once they ran (from about 32 in a chain on
// 1 x H100, CUDA 13.0: studies/queue_lab chain), and meanwhile holds a lock that other threads'
// copies, kernel launches and event calls wait for. An owner whose step needs such a call
// (the staging agent's copies, NCCL's launches) waited for a launch that waited for it: every
// replay stalled until MESHMEM_TIMEOUT. Stream memory writes do not wait for that lock.
//
// The request, with the words it holds, lives as long as the graph (a CUDA user object), and
// so does the board with its doorbells. The owner may stop before the graph is destroyed: its
// board then says so (HandoffBoard::close), nothing touches the owner, and the kernel of a
// later replay, or of one that waits, ends without waiting for an answer.
//
// Where the device waits with stream memory operations (ranks sharing a GPU) a step is gated
// (TicketWait::gated): the kernel rings and ends, and a stream memory wait waits for the
// slot's gate, which the owner's thread opens once the done word reached the ticket, and a
// watch thread once the step's time limit passed (with the fault the kernel would record).
// (A ring kernel whose slot another instantiation's replay holds polls until it is let go.)
//
// A Policy says what differs between owners:
//   using Owner = ...;   using Request = ...;
//   static std::uint64_t submit(Owner&, const Request&);  // each replay: the ticket to wait for
//   static void release(Owner&, const Request&);         // the graph is gone: its words go back
//
// Two instantiations of one graph running at once share the request's doorbell and words:
// their replays of a step take turns (HandoffSlot::holder), each its own transfer.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cuda/runtime/block_pool.hpp"
#include "cuda/runtime/kernels.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

class GpuDevice;

// Doorbells of a transport's captured transfers per rank (staged, nccl / mpi-device): 40 bytes each.
constexpr std::size_t kTransferDoorbells = 4096;

// `bytes` of pinned host memory of `device` for a board's doorbells (set_doorbells).
inline std::shared_ptr<void> doorbell_memory(int device, std::size_t bytes, const std::string& what) {
  auto block = std::make_shared<PooledBlock>(take_block(BlockMemory::MappedHost, device, bytes, what));
  void* data = block->get();
  return std::shared_ptr<void>(std::move(block), data);
}

// A fault of a captured step written from the host into the device's fault record (pinned,
// one address for both), as a device wait that timed out writes it: the next call raises it.
inline void record_fault_from_host(cuda::DeviceFault* f, cuda::FaultKind kind, int peer, std::uint64_t index,
                                   std::uint64_t seen, std::uint64_t expected, std::uint64_t window = 0) {
  if (f == nullptr) return;
  unsigned unclaimed = 0;
  if (!__atomic_compare_exchange_n(&f->claimed, &unclaimed, 1u, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) return;
  f->peer = peer;
  f->cmp = 0;
  f->window = window;
  f->index = index;
  f->seen = seen;
  f->expected = expected;
  __atomic_store_n(&f->code, static_cast<unsigned>(kind), __ATOMIC_RELEASE);
}

// Runs `check` every 50 ms on a thread of its own, which makes no CUDA call, until it returns
// false: gated steps' time limits (HandoffBoard::watch), which must hold while the owner's
// thread is stuck in a CUDA call (one that waits for a graph launch that waits for the gate).
void watch_handoffs(std::function<bool()> check);

// What captured steps share with their owner. Graphs' user-object destructors run on CUDA's
// threads, which may not call CUDA; they touch only this (and the owner while it is set).
template <class Owner>
struct HandoffBoard {
  std::mutex m;
  Owner* owner = nullptr;  // null once the owner stopped
  void open(Owner* o) {
    std::lock_guard<std::mutex> lock(m);
    owner = o;
  }
  // The owner stops answering doorbells (before its thread ends): a replay from now on ends
  // at once, and so do replays waiting for it. Stopped while its Comm lives (the replay then
  // reports HandoffStopped), Retired once the Comm goes (it writes nothing). Never reopened.
  void close(cuda::HandoffClosed why) {
    std::lock_guard<std::mutex> lock(m);
    owner = nullptr;
    if (bell == nullptr) return;
    const auto value = static_cast<std::uint64_t>(why);
    if (__atomic_load_n(bell + 1, __ATOMIC_RELAXED) >= value) return;
    // A gated step taken up and not ended: its wait ends below; while the Comm lives, its
    // next call says so (as the kernel does for the steps that wait in it).
    if (why == cuda::HandoffClosed::Stopped)
      for (std::size_t i : live_slots)
        if (entries[i].pending && __atomic_load_n(entries[i].done, __ATOMIC_ACQUIRE) < entries[i].ticket)
          record_fault_from_host(entries[i].fault_record, cuda::FaultKind::HandoffStopped, entries[i].peer, 1, 0,
                                 entries[i].seen);
    __atomic_store_n(bell + 1, value, __ATOMIC_SEQ_CST);
    // Gated steps wait with a stream memory operation, which cannot see the closed word:
    // their gates open, now and (the kernel reads the closed word again after closing the
    // gate) on every later replay.
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (std::size_t i : live_slots)
      if (entries[i].gated) open_gate(i);
  }

  // Doorbells: `bytes` of pinned host memory (zeroed) at `memory`, which the board keeps
  // alive as long as it lives, that is as long as graphs that may replay its steps exist (a
  // replay after the owner's Comm is gone reads them, finds the board closed, and ends): the
  // bell, the closed word (HandoffClosed), then one HandoffSlot per captured step.
  void set_doorbells(std::shared_ptr<void> memory, std::size_t bytes) {
    std::lock_guard<std::mutex> lock(m);
    bell = static_cast<std::uint64_t*>(memory.get());
    slots = reinterpret_cast<cuda::HandoffSlot*>(static_cast<char*>(memory.get()) + kBellBytes);
    memory_ = std::move(memory);
    const std::size_t count = bytes > kBellBytes ? (bytes - kBellBytes) / sizeof(cuda::HandoffSlot) : 0;
    entries.assign(count, Entry{});
    for (std::size_t i = count; i > 0; --i) free_slots.push_back(i - 1);
  }
  std::size_t doorbells() const { return entries.size(); }
  // Whether a captured step exists whose replays the owner must look for.
  bool live() const { return live_count.load(std::memory_order_relaxed) > 0; }
  // On the owner's thread: hands the request of every step rung since the last look to the
  // owner and answers it (ticket, then the replay taken up), and opens the gates of gated
  // steps that ended; true if any.
  bool poll() {
    std::lock_guard<std::mutex> lock(m);
    // Once the owner stopped, the requests' words (and the owner) may be gone.
    if (owner == nullptr || bell == nullptr) return false;
    bool any = pending_count > 0 && open_ended_gates();
    if (__atomic_load_n(bell, __ATOMIC_RELAXED) == 0) return any;
    // Taken (atomically) before the scan: a ring after this point rings again, so none is
    // missed; the acquire makes the rungs written before the ring taken visible.
    if (__atomic_exchange_n(bell, 0, __ATOMIC_ACQ_REL) == 0) return any;
    for (std::size_t i : live_slots) {
      Entry& e = entries[i];
      const std::uint64_t replay = __atomic_load_n(&slots[i].rung, __ATOMIC_ACQUIRE);
      if (replay <= e.seen) continue;
      e.seen = replay;
      e.rung_since = {};
      const std::uint64_t ticket = e.submit(*owner);
      any = true;
      if (e.gated) {
        if (!e.pending) ++pending_count;
        e.pending = true;
        e.ticket = ticket;
        e.since = std::chrono::steady_clock::now();
        continue;
      }
      __atomic_store_n(&slots[i].ticket, ticket, __ATOMIC_RELAXED);
      __atomic_store_n(&slots[i].ack, replay, __ATOMIC_RELEASE);
    }
    if (pending_count > 0) open_ended_gates();  // a step may have ended at once (a failed submit)
    return any;
  }

  // On the watch thread (watch_handoffs), every 50 ms: a gated step rung and not taken up, or
  // taken up and not ended, within its limit gets its fault recorded (Handoff, or its wait's
  // kind, as the kernel's wait would) and its gate opened: its stream goes on.
  void watch() {
    std::lock_guard<std::mutex> lock(m);
    if (bell == nullptr || __atomic_load_n(bell + 1, __ATOMIC_ACQUIRE) != 0) return;  // closed: nothing waits
    const auto now = std::chrono::steady_clock::now();
    for (std::size_t i : live_slots) {
      Entry& e = entries[i];
      if (!e.gated || e.limit.count() == 0) continue;
      if (e.pending) {
        const std::uint64_t reached = __atomic_load_n(e.done, __ATOMIC_ACQUIRE);
        if (reached >= e.ticket || now - e.since < e.limit) continue;
        record_fault_from_host(e.fault_record, e.fault, e.peer, 0, reached, e.ticket);
        open_gate(i);
        continue;
      }
      const std::uint64_t replay = __atomic_load_n(&slots[i].rung, __ATOMIC_ACQUIRE);
      if (replay <= e.seen) continue;
      if (e.rung_since == std::chrono::steady_clock::time_point{}) {
        e.rung_since = now;
        continue;
      }
      if (now - e.rung_since < e.limit) continue;
      // Not taken up in time (its owner's thread stuck or gone): never taken up from here on.
      record_fault_from_host(e.fault_record, cuda::FaultKind::Handoff, e.peer, 0, e.seen, replay);
      e.seen = replay;
      e.rung_since = {};
      open_gate(i);
    }
  }

  static constexpr std::size_t kBellBytes = 64;
  // The pinned bytes set_doorbells needs for `count` doorbells.
  static constexpr std::size_t bytes_for(std::size_t count) { return kBellBytes + count * sizeof(cuda::HandoffSlot); }
  struct Entry {
    std::function<std::uint64_t(Owner&)> submit;  // the request's hand-off (set while live)
    std::uint64_t seen = 0;                       // the last replay handed over
    // A gated step: its stream waits with a stream memory operation for the slot's gate,
    // which poll opens once `done` reached the ticket of the replay taken up (`pending`),
    // and watch once its limit passed (then with a fault, as the kernel's wait records).
    bool gated = false;
    const std::uint64_t* done = nullptr;
    std::chrono::milliseconds limit{0};  // 0: never
    cuda::DeviceFault* fault_record = nullptr;
    cuda::FaultKind fault = cuda::FaultKind::Transfer;
    int peer = -1;
    bool pending = false;
    std::uint64_t ticket = 0;
    std::chrono::steady_clock::time_point since{};       // taken up
    std::chrono::steady_clock::time_point rung_since{};  // first seen rung and not taken up
  };

  // Under m: slot i's stream goes on; its step is no longer pending.
  void open_gate(std::size_t i) {
    if (entries[i].pending) --pending_count;
    entries[i].pending = false;
    __atomic_store_n(&slots[i].gate, 1, __ATOMIC_SEQ_CST);
  }

  // Under m: opens the gate of every pending step whose done word reached its ticket; true if
  // any opened.
  bool open_ended_gates() {
    bool any = false;
    for (std::size_t i : live_slots) {
      const Entry& e = entries[i];
      if (!e.pending || __atomic_load_n(e.done, __ATOMIC_ACQUIRE) < e.ticket) continue;
      open_gate(i);
      any = true;
    }
    return any;
  }

  std::shared_ptr<void> memory_;  // the doorbells' owner
  std::uint64_t* bell = nullptr;   // then the closed word
  cuda::HandoffSlot* slots = nullptr;
  std::vector<Entry> entries;          // by slot
  std::vector<std::size_t> free_slots;
  std::vector<std::size_t> live_slots;  // slots of captured steps whose graph exists
  std::atomic<std::size_t> live_count{0};
  std::size_t pending_count = 0;  // gated entries pending
  bool watched = false;           // registered with watch_handoffs
};

// How the captured kernel waits: until *done reaches the ticket the owner answered with; on
// timeout the fault record gets `fault` and `peer`.
struct TicketWait {
  const std::uint64_t* done = nullptr;
  cuda::FaultKind fault = cuda::FaultKind::Transfer;
  int peer = -1;
  cuda::WaitLimit limit{};
  // Gated (the device waits with stream memory operations, where ranks share a GPU): a kernel
  // that rings and ends, then a stream memory wait for the slot's gate, which the owner's
  // thread opens once the step ended. A polling kernel there would keep its process's context
  // on the time-sliced GPU while the other process must copy: a captured 4 KiB staged put
  // replayed in 4.8 ms (1 x H100, bench/results/2026-11-25-*-staged-idle-*).
  bool gated = false;
  unsigned memop_flags = 0;  // the device's wait flags
  bool early = false;

  // A wait on `device` (its limit, launch and wait flags; gated where it waits with stream
  // memory operations) for the word `done`.
  static TicketWait on(const GpuDevice& device, const std::uint64_t* done, cuda::FaultKind fault, int peer);
};

template <class Policy>
class CapturedHandoff {
 public:
  using Owner = typename Policy::Owner;
  using Request = typename Policy::Request;
  using Board = HandoffBoard<Owner>;

  // Adds the step's kernel to the capture on `stream` (whose graph is `graph`). Takes
  // `request` and the words it holds: they go back through Policy::release when the graph is
  // destroyed, or before this raises. The caller holds the owner alive and none of its locks,
  // and wakes the owner's thread afterwards if it may sleep (it polls while board->live()).
  static void capture(const std::shared_ptr<Board>& board, Request request, const TicketWait& wait, cudaGraph_t graph,
                      cudaStream_t stream, const std::string& what) {
    auto captured = std::make_unique<Captured>(Captured{board, std::move(request), kNoSlot});
    std::size_t count = 0;
    {
      std::lock_guard<std::mutex> lock(board->m);
      count = board->entries.size();
      if (!board->free_slots.empty()) {
        captured->slot = board->free_slots.back();
        board->free_slots.pop_back();
        cuda::HandoffSlot& slot = board->slots[captured->slot];
        __atomic_store_n(&slot.rung, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&slot.ack, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&slot.gate, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&slot.holder, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&slot.ticket, 0, __ATOMIC_RELEASE);
        const Request* r = &captured->request;  // lives until the slot is given back
        typename Board::Entry entry;
        entry.submit = [r](Owner& o) { return Policy::submit(o, *r); };
        entry.gated = wait.gated;
        entry.done = wait.done;
        // Rounded up: a limit under a millisecond is not "never".
        entry.limit = std::chrono::milliseconds((wait.limit.timeout_ns + 999999) / 1000000);
        entry.fault_record = wait.limit.fault;
        entry.fault = wait.fault;
        entry.peer = wait.peer;
        board->entries[captured->slot] = std::move(entry);
        board->live_slots.push_back(captured->slot);
        if (wait.gated && !board->watched) {
          board->watched = true;
          std::weak_ptr<Board> weak = board;
          watch_handoffs([weak] {
            const auto b = weak.lock();
            if (b) b->watch();
            return b != nullptr;
          });
        }
        board->live_count.fetch_add(1, std::memory_order_relaxed);
      }
    }
    if (captured->slot == kNoSlot) {
      give_back(*captured);  // the request's words
      throw Error(ErrorCode::Unsupported, what + ": all " + std::to_string(count) +
                                              " doorbells of this rank's captured steps are held by steps captured "
                                              "into CUDA graphs that still exist; nothing was added to the capture");
    }
    Captured* c = hand_to_graph(std::move(captured), graph, what);
    // From here the graph owns the request: a failure below fails the capture, and the
    // graph's destruction gives the words and the slot back.
    cuda::HandoffSlot* slot = board->slots + c->slot;
    if (!wait.gated) {
      const cudaError_t k =
          cuda::launch_rung_wait(slot, board->bell, wait.done, wait.fault, wait.peer, wait.limit, stream, wait.early);
      if (k != cudaSuccess) ipc::check_cuda(k, "captured doorbell kernel launch", what);
      return;
    }
    const cudaError_t k = cuda::launch_rung_ring(slot, board->bell, wait.peer, wait.limit, stream, wait.early);
    if (k != cudaSuccess) ipc::check_cuda(k, "captured doorbell kernel launch", what);
    ipc::check_cu(ipc::cuda_driver().cuStreamWaitValue64(stream, reinterpret_cast<CUdeviceptr>(&slot->gate), 1,
                                                         CU_STREAM_WAIT_VALUE_GEQ | wait.memop_flags),
                  "cuStreamWaitValue64 (captured doorbell's gate)", what);
    // The replay is over: the slot goes to another instantiation's replay of the step.
    ipc::check_cu(ipc::cuda_driver().cuStreamWriteValue64(stream, reinterpret_cast<CUdeviceptr>(&slot->holder), 0, 0),
                  "cuStreamWriteValue64 (captured doorbell's holder)", what);
  }

 private:
  struct Captured {
    std::shared_ptr<Board> board;
    Request request;
    std::size_t slot;  // its doorbell (kNoSlot: none taken)
  };
  static constexpr std::size_t kNoSlot = ~std::size_t(0);

  // The graph holds `c` from here on (a user object): its destruction gives the words back.
  static Captured* hand_to_graph(std::unique_ptr<Captured> captured, cudaGraph_t graph, const std::string& what) {
    cudaUserObject_t object = nullptr;
    const cudaError_t rc = cudaUserObjectCreate(&object, captured.get(), &destroyed, 1, cudaUserObjectNoDestructorSync);
    if (rc != cudaSuccess) {
      give_back(*captured);
      ipc::check_cuda(rc, "cudaUserObjectCreate", what);
    }
    Captured* c = captured.release();  // the user object owns it now
    const cudaError_t kept = cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove);
    if (kept != cudaSuccess) {
      (void)cudaUserObjectRelease(object, 1);  // runs `destroyed`
      ipc::check_cuda(kept, "cudaGraphRetainUserObject", what);
    }
    return c;
  }

  static void give_back(Captured& c) {
    std::lock_guard<std::mutex> lock(c.board->m);
    if (c.board->owner != nullptr) Policy::release(*c.board->owner, c.request);
    if (c.slot != kNoSlot) {
      Board& b = *c.board;
      for (std::size_t k = 0; k < b.live_slots.size(); ++k)
        if (b.live_slots[k] == c.slot) {
          b.live_slots[k] = b.live_slots.back();
          b.live_slots.pop_back();
          if (b.entries[c.slot].pending) --b.pending_count;
          b.entries[c.slot] = typename Board::Entry{};
          b.free_slots.push_back(c.slot);
          b.live_count.fetch_sub(1, std::memory_order_relaxed);
          break;
        }
    }
  }

  // The graph's launches are complete: its replays' last writes to these words are done. A
  // transfer whose wait gave up may still run: the owners' releases keep its word until it
  // ended (a late end would move a reused word back).
  static void CUDART_CB destroyed(void* p) {
    auto* c = static_cast<Captured*>(p);
    give_back(*c);
    delete c;
  }
};

}  // namespace meshmem::detail
