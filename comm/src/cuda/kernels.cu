#include <algorithm>

#include "kernels.hpp"
#include "meshmem/device/device.cuh"

namespace meshmem::detail::cuda {

namespace {

constexpr int kThreads = 512;

__global__ void copy_kernel(void* dst, const void* src, std::size_t bytes) {
  // Each block copies its own contiguous slice.
  const std::size_t per_block = (bytes + gridDim.x - 1) / gridDim.x;
  const std::size_t begin = per_block * blockIdx.x;
  if (begin >= bytes) return;
  const std::size_t len = begin + per_block > bytes ? bytes - begin : per_block;
  device::copy_block(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin, len);
}

// One block, so that one thread can signal once the block's writes are done.
__global__ void copy_signal_kernel(void* dst, const void* src, std::size_t bytes, std::uint64_t* signal,
                                   std::uint64_t value, SignalOp op) {
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

__global__ void wait_kernel(const std::uint64_t* word, Cmp cmp, std::uint64_t value) {
  device::SignalWord w(*const_cast<std::uint64_t*>(word));
  while (!device::compare(w.load(::cuda::memory_order_acquire), cmp, value)) __nanosleep(100);
}

__global__ void barrier_kernel(std::uint64_t* const* peer_flags, std::uint64_t* my_flags, int rank, int size,
                               std::uint64_t epoch) {
  const int r = static_cast<int>(threadIdx.x);
  if (r >= size || r == rank) return;
  // Earlier stream work is complete (stream order); the fence orders it before the flag.
  __threadfence_system();
  device::SignalWord(peer_flags[r][rank]).store(epoch, ::cuda::memory_order_release);
  device::SignalWord mine(my_flags[r]);
  while (mine.load(::cuda::memory_order_acquire) < epoch) {
  }
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

__global__ void copies_kernel(const Copy2D* table) {
  const Copy2D c = table[blockIdx.y];
  const std::uint64_t bits = reinterpret_cast<std::uintptr_t>(c.dst) | reinterpret_cast<std::uintptr_t>(c.src) |
                             c.width | (c.height > 1 ? (c.src_pitch | c.dst_pitch) : 0);
  if ((bits & 15) == 0) copy_2d<uint4>(c);
  else if ((bits & 7) == 0) copy_2d<std::uint64_t>(c);
  else if ((bits & 3) == 0) copy_2d<std::uint32_t>(c);
  else copy_2d<unsigned char>(c);
}

}  // namespace

cudaError_t launch_copies(const Copy2D* table, int count, std::uint64_t largest, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  // About 4 KiB a block for the largest copy (remote stores need many blocks in flight;
  // 64 KiB a block measured 3x slower on H200), at most 128 blocks per copy.
  unsigned blocks = static_cast<unsigned>(std::min<std::uint64_t>(128, std::max<std::uint64_t>(1, largest / 4096)));
  copies_kernel<<<dim3(blocks, static_cast<unsigned>(count)), 256, 0, stream>>>(table);
  return cudaGetLastError();
}

cudaError_t launch_barrier(std::uint64_t* const* peer_flags, std::uint64_t* my_flags, int rank, int size,
                           std::uint64_t epoch, cudaStream_t stream) {
  const int threads = (size + 31) / 32 * 32;
  barrier_kernel<<<1, threads, 0, stream>>>(peer_flags, my_flags, rank, size, epoch);
  return cudaGetLastError();
}

cudaError_t launch_copy(void* dst, const void* src, std::size_t bytes, std::uint64_t* signal,
                        std::uint64_t value, SignalOp op, cudaStream_t stream) {
  const std::size_t wide = (bytes + 15) / 16;
  const int threads = static_cast<int>(wide < kThreads ? (wide < 32 ? 32 : (wide + 31) / 32 * 32) : kThreads);
  if (signal != nullptr) {
    copy_signal_kernel<<<1, threads, 0, stream>>>(dst, src, bytes, signal, value, op);
  } else {
    if (bytes == 0) return cudaSuccess;
    // About 16 KiB a block: one block for small puts (latency), a full grid of several
    // blocks per SM for large ones (NVLink needs many stores in flight).
    std::size_t blocks = (bytes + 16383) / 16384;
    if (blocks > 1024) blocks = 1024;
    copy_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(dst, src, bytes);
  }
  return cudaGetLastError();
}

cudaError_t launch_wait(const std::uint64_t* word, Cmp cmp, std::uint64_t value, cudaStream_t stream) {
  wait_kernel<<<1, 1, 0, stream>>>(word, cmp, value);
  return cudaGetLastError();
}

}  // namespace meshmem::detail::cuda
