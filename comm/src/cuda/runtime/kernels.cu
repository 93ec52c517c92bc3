#include <algorithm>

#include "cuda/runtime/kernels.hpp"
#include "meshmem/device/device.cuh"

namespace meshmem::detail::cuda {

namespace {

constexpr int kThreads = 512;

// The start of every meshmem kernel: waits for the stream's previous kernel (completion and
// memory; without a programmatic launch it returns at once).
__device__ inline void after_previous_kernel(bool early) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (early) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next programmatic launch on the stream start (it waits for this kernel's end the
// same way). Only kernels that never poll call it: behind a polling kernel (wait, barrier,
// halo) a dependent grid made resident early could hold the SMs that the work it waits for
// needs; those trigger their dependents when they exit.
__device__ inline void let_next_kernel_start(bool early) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (early) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

template <class... Params, class... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, bool early, Args... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  if (early) {
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  const cudaError_t rc = cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
  if (rc != cudaSuccess) (void)cudaGetLastError();  // reported by the caller; not left for the application
  return rc;
}

__global__ void copy_kernel(void* dst, const void* src, std::size_t bytes, bool early) {
  after_previous_kernel(early);
  let_next_kernel_start(early);
  // Each block copies its own contiguous slice.
  const std::size_t per_block = (bytes + gridDim.x - 1) / gridDim.x;
  const std::size_t begin = per_block * blockIdx.x;
  if (begin >= bytes) return;
  const std::size_t len = begin + per_block > bytes ? bytes - begin : per_block;
  device::copy_block(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin, len);
}

// One block, so that one thread can signal once the block's writes are done.
__global__ void copy_signal_kernel(void* dst, const void* src, std::size_t bytes, std::uint64_t* signal,
                                   std::uint64_t value, SignalOp op, bool early) {
  after_previous_kernel(early);
  let_next_kernel_start(early);
  if (bytes > 0) device::copy_block(dst, src, bytes);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    device::SignalWord word(*signal);
    if (op == SignalOp::Set)
      word.store(value, ::cuda::memory_order_release);
    else
      word.fetch_add(value, ::cuda::memory_order_release);
  }
}

__device__ inline std::uint64_t global_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The clock of a wait's timeout (see WaitLimit).
__device__ inline std::uint64_t limit_ns(const WaitLimit& limit) {
  if (limit.awake_ns == nullptr) return global_ns();
  return static_cast<std::uint64_t>(*reinterpret_cast<const volatile std::int64_t*>(limit.awake_ns));
}

// Writes the fault record unless another report claimed it first; `code` last, so that the
// host reads the other fields once it sees it.
__device__ void record_fault(DeviceFault* f, FaultKind kind, int peer, unsigned cmp, std::uint64_t window,
                             std::uint64_t index, std::uint64_t seen, std::uint64_t expected) {
  if (atomicCAS(&f->claimed, 0u, 1u) != 0u) return;
  f->peer = peer;
  f->cmp = cmp;
  f->window = window;
  f->index = index;
  f->seen = seen;
  f->expected = expected;
  __threadfence_system();
  ::cuda::atomic_ref<unsigned, ::cuda::thread_scope_system>(f->code).store(static_cast<unsigned>(kind),
                                                                         ::cuda::memory_order_release);
}

// Polls `word` until it compares true; false once the limit passed (the fault is written),
// or, without a fault, once `give_up` (where not null) is non-zero: the caller reports why.
__device__ bool wait_word(const std::uint64_t* word, Cmp cmp, std::uint64_t value, const WaitLimit& limit,
                          FaultKind kind, int peer, std::uint64_t window, std::uint64_t index,
                          const std::uint64_t* give_up = nullptr) {
  device::SignalWord w(*const_cast<std::uint64_t*>(word));
  // The clock is first read at the first check (spin 255), not before the first poll: a
  // barrier's wait is usually over sooner, and the deadline moves by those few microseconds.
  std::uint64_t start = 0;
  for (unsigned spins = 0;; ++spins) {
    const std::uint64_t v = w.load(::cuda::memory_order_acquire);
    if (device::compare(v, cmp, value)) return true;
    if (spins >= 64) __nanosleep(100);  // a first burst without sleeping: most waits are short
    if ((spins & 255) != 255) continue;
    if (give_up != nullptr && device::SignalWord(*const_cast<std::uint64_t*>(give_up)).load(::cuda::memory_order_relaxed) != 0)
      return false;
    if (limit.timeout_ns == 0) continue;
    if (start == 0) start = limit_ns(limit);
    if (limit_ns(limit) - start > limit.timeout_ns) {
      record_fault(limit.fault, kind, peer, static_cast<unsigned>(cmp), window, index, v, value);
      return false;
    }
  }
}

__global__ void wait_kernel(std::uint64_t* words, std::size_t count, Cmp cmp, std::uint64_t value, bool reset,
                            std::uint64_t then, std::uint64_t window, std::size_t first, WaitLimit limit, bool early) {
  after_previous_kernel(early);
  const std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  // A timed-out wait resets nothing: the word keeps what the fault reports.
  if (wait_word(words + i, cmp, value, limit, FaultKind::WaitUntil, -1, window, first + i) && reset)
    device::SignalWord(words[i]).store(then, ::cuda::memory_order_relaxed);
}

// A transfer wait that timed out, where its reader drops what comes after (`give_up`): the word
// is marked given up (kTransferGivenUp), so that chunks of it its reader takes later are not
// carried out (DESIGN: after a timeout nothing meshmem posted still writes into user memory).
// Read again just before the store: an end written meanwhile stands (its owner may lend the
// word again once it sees it). A store, not a compare-and-swap: system-scope atomics on pinned
// host memory are not atomic against the host or a peer GPU's writes without native host
// atomics (PCIe). What is left: an end that lands between this read and the store (a few
// instructions apart, unless the GPU preempts the kernel right there) is overwritten, and the
// word is retired like every marked one; only if its owner saw that end and lent the word to
// another transfer within that gap would the mark reach the other transfer.
__device__ void mark_given_up(std::uint64_t* word, std::uint64_t until) {
  device::SignalWord w(*word);
  if (w.load(::cuda::memory_order_acquire) >= until) return;
  w.store(until | kTransferGivenUp, ::cuda::memory_order_release);
}

__global__ void ticket_wait_kernel(std::uint64_t* ready, std::uint64_t* word, std::uint64_t sequence,
                                   std::uint64_t until, FaultKind fault, int peer, WaitLimit limit, bool early,
                                   bool give_up) {
  after_previous_kernel(early);
  // The stream's earlier work is complete (stream order, and the wait above for a programmatic
  // launch): the host thread may start on the transfer once it sees this.
  if (ready != nullptr) device::SignalWord(*ready).store(sequence, ::cuda::memory_order_release);
  if (!wait_word(word, Cmp::GE, until, limit, fault, peer, 0, 0) && give_up) mark_given_up(word, until);
}

__global__ void __launch_bounds__(1024) slot_fill_kernel(SlotFill f, WaitLimit limit, bool early) {
  after_previous_kernel(early);
  // The slot's previous transfer timed out (reported: fault record): its reader may still copy
  // out of the slot, so it is left alone and the agent copies this one (kSlotNotFilled).
  // One given up (kTransferGivenUp) may still be copied out of by a reader that took it before,
  // for as long as that reader takes: the slot is retired (launch_slot_fill).
  __shared__ bool slot_free;
  if (threadIdx.x == 0) {
    device::SignalWord retired(*f.retired);
    const bool was_retired = retired.load(::cuda::memory_order_acquire) != 0;
    // Given up is that transfer's own mark (its fill kernel's `ticket | kTransferGivenUp`): a
    // word that ended well may have been lent again since, and marked for a later transfer.
    slot_free = !was_retired &&
                (f.prev_done == nullptr ||
                 (wait_word(f.prev_done, Cmp::GE, f.prev_ticket, limit, FaultKind::Transfer, f.prev_peer, 0, 0) &&
                  device::SignalWord(*const_cast<std::uint64_t*>(f.prev_done)).load(::cuda::memory_order_acquire) !=
                      (f.prev_ticket | kTransferGivenUp)));
    if (!slot_free && !was_retired) retired.store(1, ::cuda::memory_order_release);
  }
  __syncthreads();
  if (slot_free)
    for (std::size_t r = 0; r < f.rows; ++r) device::copy_block(f.slot + r * f.width, f.src + r * f.src_pitch, f.width);
  __threadfence_system();  // every thread's bytes are out before the ready word
  __syncthreads();
  if (threadIdx.x != 0) return;
  device::SignalWord(*f.ready).store(slot_free ? f.ticket : f.ticket | kSlotNotFilled, ::cuda::memory_order_release);
  if (!wait_word(f.done, Cmp::GE, f.ticket, limit, FaultKind::Transfer, f.peer, 0, 0)) mark_given_up(f.done, f.ticket);
}

// A board's closed word (HandoffClosed, the word after its bell).
__device__ std::uint64_t board_closed(const std::uint64_t* closed) {
  return device::SignalWord(*const_cast<std::uint64_t*>(closed)).load(::cuda::memory_order_acquire);
}

// A captured step's wait gave up because its board closed (HandoffClosed): reported where its
// Comm still lives; after the Comm is gone its fault record may be another's memory.
__device__ void report_closed(const std::uint64_t* closed, const WaitLimit& limit, int peer, std::uint64_t replay,
                              bool taken_up) {
  if (board_closed(closed) == static_cast<std::uint64_t>(HandoffClosed::Stopped))
    record_fault(limit.fault, FaultKind::HandoffStopped, peer, 0, 0, taken_up ? 1 : 0, 0, replay);
}

// Takes a captured step's slot (HandoffSlot::holder) for this replay: another instantiation
// of the graph may be replaying the step right now (its stream's kernel holds it). A
// compare-and-swap among this GPU's kernels, which alone take it; false where the board closed
// or the wait timed out (Handoff fault recorded: a replay of the step that never ended).
__device__ bool take_handoff_slot(HandoffSlot* slot, const std::uint64_t* closed, const WaitLimit& limit, int peer) {
  auto* holder = reinterpret_cast<unsigned long long*>(&slot->holder);
  for (;;) {
    if (atomicCAS(holder, 0ull, 1ull) == 0ull) {
      __threadfence_system();  // the previous holder's reads of the slot are behind
      return true;
    }
    if (!wait_word(&slot->holder, Cmp::EQ, 0, limit, FaultKind::Handoff, peer, 0, 0, closed)) return false;
  }
}

__device__ void give_handoff_slot(HandoffSlot* slot) {
  __threadfence_system();
  atomicExch(reinterpret_cast<unsigned long long*>(&slot->holder), 0ull);
}

__global__ void rung_wait_kernel(HandoffSlot* slot, std::uint64_t* bell, const std::uint64_t* done, FaultKind fault,
                                 int peer, WaitLimit limit, bool early) {
  after_previous_kernel(early);
  const std::uint64_t* closed = bell + 1;
  device::SignalWord rung(slot->rung);
  // Nobody answers (the board closed), or the slot stayed another replay's: nothing rung.
  if (board_closed(closed) != 0 || !take_handoff_slot(slot, closed, limit, peer))
    return report_closed(closed, limit, peer, rung.load(::cuda::memory_order_relaxed) + 1, false);
  // The stream's earlier work is complete (stream order): the owner may start on it once it
  // sees the ring. The slot is this replay's, so the rung has one writer.
  const std::uint64_t replay = rung.load(::cuda::memory_order_relaxed) + 1;
  rung.store(replay, ::cuda::memory_order_release);
  device::SignalWord(*bell).store(1, ::cuda::memory_order_release);  // after the rung: the owner scans on it
  // Without a fault written, wait_word gave up because the board closed.
  if (!wait_word(&slot->ack, Cmp::GE, replay, limit, FaultKind::Handoff, peer, 0, 0, closed)) {
    report_closed(closed, limit, peer, replay, false);
  } else {
    const std::uint64_t ticket = device::SignalWord(slot->ticket).load(::cuda::memory_order_acquire);
    if (!wait_word(done, Cmp::GE, ticket, limit, fault, peer, 0, 0, closed)) report_closed(closed, limit, peer, replay, true);
  }
  give_handoff_slot(slot);
}

__global__ void rung_ring_kernel(HandoffSlot* slot, std::uint64_t* bell, int peer, WaitLimit limit, bool early) {
  after_previous_kernel(early);
  const std::uint64_t* closed = bell + 1;
  device::SignalWord gate(slot->gate);
  device::SignalWord rung(slot->rung);
  // The stream write after the gate's wait lets the slot go, whether or not it was taken (an
  // untaken one is a replay whose wait for the slot timed out: a fault the next call raises;
  // its gate, opened here, is the holder's too, which then goes on early, and its write may
  // let go of a later replay's turn: after that timeout the Comm is to be abandoned). The
  // write is a memory operation racing the kernels' compare-and-swap only while the word is
  // 1, where every compare fails.
  if (board_closed(closed) != 0 || !take_handoff_slot(slot, closed, limit, peer)) {
    gate.store(1, ::cuda::memory_order_release);
    return report_closed(closed, limit, peer, rung.load(::cuda::memory_order_relaxed) + 1, false);
  }
  const std::uint64_t replay = rung.load(::cuda::memory_order_relaxed) + 1;
  // The gate closes before the ring (the owner opens it only after seeing the rung), and the
  // closed word is read again after it: a board closing meanwhile opens every gate after
  // setting the word, so either that opening or this one comes last.
  gate.store(0, ::cuda::memory_order_relaxed);
  rung.store(replay, ::cuda::memory_order_release);
  device::SignalWord(*bell).store(1, ::cuda::memory_order_release);
  __threadfence_system();
  if (board_closed(closed) != 0) {
    gate.store(1, ::cuda::memory_order_release);
    report_closed(closed, limit, peer, replay, false);
  }
}

__global__ void barrier_kernel(std::uint64_t* const* peer_flags, std::uint64_t* my_flags, std::uint64_t* counter,
                               int rank, int size, std::uint64_t* passed, const std::uint64_t* leaders_failed,
                               FaultKind fault, WaitLimit limit, bool early) {
  __shared__ std::uint64_t epoch;
  after_previous_kernel(early);
  if (threadIdx.x == 0) {
    epoch = *counter + 1;  // this rank's barrier kernels run one at a time (StreamSequence)
    *counter = epoch;
  }
  __syncthreads();
  if (passed != nullptr && (epoch & 1) == 0 && threadIdx.x == 0)
    device::SignalWord(*passed).store(epoch, ::cuda::memory_order_release);
  // Earlier stream work is complete (stream order); the fence orders it before the flags.
  __threadfence_system();
  // A null entry: a rank the barrier leaves out (on another node).
  for (int r = static_cast<int>(threadIdx.x); r < size; r += static_cast<int>(blockDim.x))
    if (r != rank && peer_flags[r] != nullptr)
      device::SignalWord(peer_flags[r][rank]).store(epoch, ::cuda::memory_order_release);
  for (int r = static_cast<int>(threadIdx.x); r < size; r += static_cast<int>(blockDim.x)) {
    if (r == rank || peer_flags[r] == nullptr) continue;
    // A marked rank stops waiting: its leader will not come to later barriers either.
    wait_word(my_flags + r, Cmp::GE, epoch, limit, fault, r, 0, static_cast<std::uint64_t>(r), leaders_failed);
  }
  if (leaders_failed != nullptr) {
    __syncthreads();  // every wait ended (the leader's flag seen, its mark stored before, or the mark)
    const std::uint64_t leader = device::SignalWord(*const_cast<std::uint64_t*>(leaders_failed))
                                     .load(::cuda::memory_order_acquire);
    if (threadIdx.x == 0 && leader != 0)
      record_fault(limit.fault, FaultKind::LeadersFailed, static_cast<int>(leader - 1), 0, 0, 0, leader, epoch);
  }
  if (passed == nullptr || (epoch & 1) == 0) return;
  __syncthreads();
  if (threadIdx.x == 0) device::SignalWord(*passed).store(epoch, ::cuda::memory_order_release);
}

template <class T>
__device__ void copy_2d(const Copy2D& c) {
  const std::uint64_t per_row = c.width / sizeof(T);
  const std::uint64_t total = per_row * c.height;
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  const std::uint64_t first = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c.height == 1) {  // a contiguous run: no division per element
    for (std::uint64_t i = first; i < total; i += stride)
      reinterpret_cast<T*>(c.dst)[i] = reinterpret_cast<const T*>(c.src)[i];
    return;
  }
  for (std::uint64_t i = first; i < total; i += stride) {
    const std::uint64_t row = i / per_row, col = i - row * per_row;
    reinterpret_cast<T*>(c.dst + row * c.dst_pitch)[col] = reinterpret_cast<const T*>(c.src + row * c.src_pitch)[col];
  }
}

__device__ void copy_block_of(const Copy2D& c) {
  const std::uint64_t bits = reinterpret_cast<std::uintptr_t>(c.dst) | reinterpret_cast<std::uintptr_t>(c.src) |
                             c.width | (c.height > 1 ? (c.src_pitch | c.dst_pitch) : 0);
  if ((bits & 15) == 0) copy_2d<uint4>(c);
  else if ((bits & 7) == 0) copy_2d<std::uint64_t>(c);
  else if ((bits & 3) == 0) copy_2d<std::uint32_t>(c);
  else copy_2d<unsigned char>(c);
}

__global__ void halo_kernel(const Copy2D* table, int count, HaloSync sync, WaitLimit limit, bool early) {
  after_previous_kernel(early);
  if (static_cast<int>(blockIdx.y) < count) copy_block_of(table[blockIdx.y]);
  // Every thread's copies are visible system-wide before its block counts as done; the
  // last block to finish signals for all.
  __threadfence_system();
  __syncthreads();
  __shared__ bool last;
  __shared__ std::uint64_t epoch;
  if (threadIdx.x == 0) {
    const unsigned total = gridDim.x * gridDim.y;
    last = atomicAdd(sync.arrived, 1u) == total - 1;
    if (last) {
      *sync.arrived = 0;  // the next exchange starts after this kernel (StreamSequence)
      epoch = *sync.epoch + 1;
      *sync.epoch = epoch;
    }
  }
  __syncthreads();
  if (!last) return;
  __threadfence_system();
  for (int i = static_cast<int>(threadIdx.x); i < sync.nstores; i += static_cast<int>(blockDim.x))
    device::SignalWord(*sync.stores[i]).store(epoch, ::cuda::memory_order_release);
  for (int i = static_cast<int>(threadIdx.x); i < sync.nwaits; i += static_cast<int>(blockDim.x))
    wait_word(sync.waits[i], Cmp::GE, epoch, limit, FaultKind::Halo, sync.wait_ranks[i], sync.window,
              static_cast<std::uint64_t>(sync.wait_ranks[i]));
}

}  // namespace

cudaError_t preload_kernels() {
  cudaFuncAttributes a{};
  const void* kernels[] = {reinterpret_cast<const void*>(copy_kernel), reinterpret_cast<const void*>(copy_signal_kernel),
                           reinterpret_cast<const void*>(wait_kernel), reinterpret_cast<const void*>(ticket_wait_kernel),
                           reinterpret_cast<const void*>(rung_wait_kernel), reinterpret_cast<const void*>(rung_ring_kernel),
                           reinterpret_cast<const void*>(barrier_kernel), reinterpret_cast<const void*>(halo_kernel)};
  for (const void* k : kernels) {
    const cudaError_t rc = cudaFuncGetAttributes(&a, k);
    if (rc != cudaSuccess) return rc;
  }
  return cudaSuccess;
}

bool early_launch_compiled() {
  cudaFuncAttributes attributes{};
  if (cudaFuncGetAttributes(&attributes, wait_kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attributes.binaryVersion >= 90;
}

cudaError_t launch_barrier(std::uint64_t* const* peer_flags, std::uint64_t* my_flags, std::uint64_t* counter,
                           int rank, int size, std::uint64_t* passed, const std::uint64_t* leaders_failed,
                           FaultKind fault, WaitLimit limit, cudaStream_t stream, bool early) {
  const unsigned threads = static_cast<unsigned>(std::min(1024, (size + 31) / 32 * 32));
  return launch(barrier_kernel, 1, threads, stream, early, peer_flags, my_flags, counter, rank, size, passed,
                leaders_failed, fault, limit, early);
}

cudaError_t launch_halo(const Copy2D* table, int count, std::uint64_t largest, const HaloSync& sync, WaitLimit limit,
                        cudaStream_t stream, bool early) {
  // About 4 KiB a block for the largest copy (remote stores need many blocks in flight;
  // 64 KiB a block measured 3x slower on H200), at most 128 blocks per copy.
  const unsigned blocks =
      count == 0 ? 1u : static_cast<unsigned>(std::min<std::uint64_t>(128, std::max<std::uint64_t>(1, largest / 4096)));
  return launch(halo_kernel, dim3(blocks, static_cast<unsigned>(std::max(count, 1))), 256, stream, early, table, count,
                sync, limit, early);
}

cudaError_t launch_copy(void* dst, const void* src, std::size_t bytes, std::uint64_t* signal,
                        std::uint64_t value, SignalOp op, cudaStream_t stream, bool early) {
  const std::size_t wide = (bytes + 15) / 16;
  const int threads = static_cast<int>(wide < kThreads ? (wide < 32 ? 32 : (wide + 31) / 32 * 32) : kThreads);
  if (signal != nullptr) {
    return launch(copy_signal_kernel, 1, static_cast<unsigned>(threads), stream, early, dst, src, bytes, signal, value, op, early);
  } else {
    if (bytes == 0) return cudaSuccess;
    // About 16 KiB a block: one block for small puts (latency), a full grid of several
    // blocks per SM for large ones (NVLink needs many stores in flight).
    std::size_t blocks = (bytes + 16383) / 16384;
    if (blocks > 1024) blocks = 1024;
    return launch(copy_kernel, static_cast<unsigned>(blocks), static_cast<unsigned>(threads), stream, early, dst, src, bytes, early);
  }
}

cudaError_t launch_wait(std::uint64_t* words, std::size_t count, Cmp cmp, std::uint64_t value, bool reset, std::uint64_t then,
                        std::uint64_t window_id, std::size_t first_index, WaitLimit limit, cudaStream_t stream,
                        bool early) {
  if (count == 0) return cudaSuccess;
  const unsigned threads = static_cast<unsigned>(std::min<std::size_t>(256, (count + 31) / 32 * 32));
  const unsigned blocks = static_cast<unsigned>((count + threads - 1) / threads);
  return launch(wait_kernel, blocks, threads, stream, early, words, count, cmp, value, reset, then, window_id, first_index,
                limit, early);
}

cudaError_t launch_rung_ring(HandoffSlot* slot, std::uint64_t* bell, int peer, WaitLimit limit, cudaStream_t stream,
                             bool early) {
  return launch(rung_ring_kernel, 1, 1, stream, early, slot, bell, peer, limit, early);
}

cudaError_t launch_rung_wait(HandoffSlot* slot, std::uint64_t* bell, const std::uint64_t* done, FaultKind fault, int peer,
                             WaitLimit limit, cudaStream_t stream, bool early) {
  return launch(rung_wait_kernel, 1, 1, stream, early, slot, bell, done, fault, peer, limit, early);
}

// One block of 1024 threads: its stores into pinned host memory are what the fill waits for, and
// 256 threads left 64 KiB taking ~8 us (8-byte accesses) where 1024 take ~4.5, the launch floor
// of that lab (studies/fill_lab, 1 x H200); more blocks would need a count of finished blocks.
cudaError_t launch_slot_fill(const SlotFill& fill, WaitLimit limit, cudaStream_t stream, bool early) {
  return launch(slot_fill_kernel, 1, 1024, stream, early, fill, limit, early);
}

cudaError_t launch_ticket_wait(std::uint64_t* ready, std::uint64_t* word, std::uint64_t sequence, FaultKind fault,
                               int peer, WaitLimit limit, cudaStream_t stream, bool early, std::uint64_t until,
                               bool give_up) {
  return launch(ticket_wait_kernel, 1, 1, stream, early, ready, word, sequence, until, fault, peer, limit, early,
                give_up);
}

}  // namespace meshmem::detail::cuda
