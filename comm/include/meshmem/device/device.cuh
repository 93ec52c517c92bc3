// Device-side API for directly mapped peers: kernels receive WindowView / SignalsView by
// value (Window::view(), Signals::view()) and use these helpers. A peer is reachable here
// when its entry in view.peers is non-null (same node, peer access).
//
// Ordering: a signal() is a system-scope release, so the calling thread's earlier writes
// (and, after __syncthreads(), those of its block) are visible to whoever observes the
// signal with wait_until() or read_signal(), which acquire.
#pragma once

#include <cuda/atomic>
#include <cstddef>
#include <cstdint>

#include "meshmem/device/views.hpp"
#include "meshmem/types.hpp"

namespace meshmem::device {

using SignalWord = cuda::atomic_ref<std::uint64_t, cuda::thread_scope_system>;

template <class T = void>
__device__ inline T* peer_ptr(const WindowView& w, int rank, std::size_t offset = 0) {
  return reinterpret_cast<T*>(static_cast<char*>(w.peers[rank]) + offset);
}

__device__ inline std::uint64_t* signal_ptr(const SignalsView& s, int rank, std::size_t index) {
  return s.peers[rank] + index;
}

namespace detail {
// The block copies `bytes` in accesses of T after a bytewise head that brings dst to T's
// alignment (src then shares it: the caller checked), and a bytewise tail.
template <class T>
__device__ inline void copy_block_as(unsigned char* d, const unsigned char* s, std::size_t bytes) {
  const std::size_t t = threadIdx.x;
  const std::size_t n = blockDim.x;
  std::size_t head = (sizeof(T) - (reinterpret_cast<std::uintptr_t>(d) & (sizeof(T) - 1))) & (sizeof(T) - 1);
  if (head > bytes) head = bytes;
  for (std::size_t i = t; i < head; i += n) d[i] = s[i];
  const std::size_t wide = (bytes - head) / sizeof(T);
  auto* dw = reinterpret_cast<T*>(d + head);
  const auto* sw = reinterpret_cast<const T*>(s + head);
  for (std::size_t i = t; i < wide; i += n) dw[i] = sw[i];
  for (std::size_t i = head + wide * sizeof(T) + t; i < bytes; i += n) d[i] = s[i];
}
}  // namespace detail

// Copies with every thread of the calling block, in the widest accesses (16, 8, 4, 2 bytes)
// that the two pointers' alignments share: a row that starts 8 bytes into a 16-byte line
// (a grid's interior after its ghost column) still moves in 8-byte accesses, which matters
// most where the destination is host memory (every access crosses the bus). All threads of
// the block must call it with the same arguments.
__device__ inline void copy_block(void* dst, const void* src, std::size_t bytes) {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  const auto shared = reinterpret_cast<std::uintptr_t>(d) ^ reinterpret_cast<std::uintptr_t>(s);
  if ((shared & 15) == 0) detail::copy_block_as<uint4>(d, s, bytes);
  else if ((shared & 7) == 0) detail::copy_block_as<std::uint64_t>(d, s, bytes);
  else if ((shared & 3) == 0) detail::copy_block_as<std::uint32_t>(d, s, bytes);
  else if ((shared & 1) == 0) detail::copy_block_as<std::uint16_t>(d, s, bytes);
  else detail::copy_block_as<unsigned char>(d, s, bytes);
}

__device__ inline void put_block(const WindowView& w, int target, std::size_t offset, const void* src,
                                 std::size_t bytes) {
  copy_block(peer_ptr(w, target, offset), src, bytes);
}

__device__ inline void get_block(void* dst, const WindowView& w, int target, std::size_t offset,
                                 std::size_t bytes) {
  copy_block(dst, peer_ptr(w, target, offset), bytes);
}

// One thread: updates target's signal word after this thread's earlier writes.
__device__ inline void signal(const SignalsView& s, int target, std::size_t index, std::uint64_t value,
                              SignalOp op) {
  __threadfence_system();
  SignalWord word(*signal_ptr(s, target, index));
  if (op == SignalOp::Set)
    word.store(value, cuda::memory_order_release);
  else
    word.fetch_add(value, cuda::memory_order_release);
}

// Whole block: put, then one signal once every thread's part of the put is written.
__device__ inline void put_signal_block(const WindowView& w, int target, std::size_t offset, const void* src,
                                        std::size_t bytes, const SignalsView& s, std::size_t index,
                                        std::uint64_t value, SignalOp op) {
  put_block(w, target, offset, src, bytes);
  __syncthreads();
  if (threadIdx.x == 0) signal(s, target, index, value, op);
}

using meshmem::compare;  // meshmem/types.hpp: the same test as the host's

__device__ inline std::uint64_t read_signal(const SignalsView& s, std::size_t index) {
  return SignalWord(*signal_ptr(s, s.rank, index)).load(cuda::memory_order_acquire);
}

// One thread (or all, each polling): returns once this rank's word compares true.
__device__ inline void wait_until(const SignalsView& s, std::size_t index, Cmp cmp, std::uint64_t value) {
  while (!compare(read_signal(s, index), cmp, value)) __nanosleep(64);
}

}  // namespace meshmem::device
