// Small GPU memory of meshmem's own (barrier counters, peer tables, fault records, done
// words, staging slots) from CUDA VMM chunks, given back without cudaFree or cudaFreeHost.
//
// Why: cudaFree, cudaFreeHost and cudaHostUnregister wait until every kernel of the device has
// ended, and while one of them waits, the other threads' kernel launches, copies, event and
// stream calls, cudaMalloc and cudaHostAlloc wait with it (studies/queue_lab blocking and
// contention, 1 x H100). A destructor that called them waited as long as a user's longest, or
// stuck, kernel, and froze the process's CUDA calls meanwhile (meshmem's proxies' among them:
// the very calls that would end a stream's wait). Unmapping VMM memory waits for nothing.
//
// Unmapping is not an implicit device synchronisation as cudaFree is: a block given back
// is quarantined, and its memory is reused or unmapped only once the device's work issued
// before it was given back has ended (the window releaser's context events, or its device
// synchronisation: window_releaser.hpp calls device_quiescence_began / _ended). Until then
// the chunk stays mapped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace meshmem::detail {

enum class BlockMemory {
  Device,      // device memory of the device
  MappedHost,  // pinned host memory that the CPU and the device read and write at one address
};

class BlockPool;

// A block of a BlockPool chunk, at least 256-byte aligned; move-only, given back on
// destruction (quarantined, see above). Device blocks hold whatever the memory held before;
// host blocks are zeroed when taken.
class PooledBlock {
 public:
  PooledBlock() = default;
  PooledBlock(PooledBlock&& o) noexcept
      : pool_(std::exchange(o.pool_, nullptr)),
        chunk_(o.chunk_),
        offset_(o.offset_),
        bytes_(o.bytes_),
        data_(std::exchange(o.data_, nullptr)) {}
  PooledBlock& operator=(PooledBlock&& o) noexcept;
  PooledBlock(const PooledBlock&) = delete;
  PooledBlock& operator=(const PooledBlock&) = delete;
  ~PooledBlock() { give_back(); }
  // The block's address, the same for the CPU (host blocks) and the device.
  void* get() const { return data_; }
  std::size_t size() const { return bytes_; }
  explicit operator bool() const { return data_ != nullptr; }
  // Never given back: for memory that something outside CUDA's view may still use (a
  // message MPI still holds); it stays mapped until the process ends.
  void abandon() noexcept {
    pool_ = nullptr;
    data_ = nullptr;
  }

 private:
  friend class BlockPool;
  void give_back() noexcept;
  BlockPool* pool_ = nullptr;
  void* chunk_ = nullptr;
  std::size_t offset_ = 0, bytes_ = 0;
  void* data_ = nullptr;
};

// `bytes` (at least 1) of `kind` for `device` (-1: the current device); raises Error(Cuda)
// naming `what`.
PooledBlock take_block(BlockMemory kind, int device, std::size_t bytes, const std::string& what);
// `bytes` from `source` (host memory) into `block`, complete on return (a stream of the
// pool's: no wait for the user's streams).
void fill_block(const PooledBlock& block, const void* source, std::size_t bytes, const std::string& what);

// `values` copied into a device block of the current device that `owner` holds (null for none).
template <class T>
T* device_array(PooledBlock& owner, const std::vector<T>& values, const std::string& what) {
  if (values.empty()) return nullptr;
  owner = take_block(BlockMemory::Device, -1, values.size() * sizeof(T), what);
  fill_block(owner, values.data(), values.size() * sizeof(T), what);
  return static_cast<T*>(owner.get());
}

// A device synchronisation of `device` begins: the returned mark goes to ..._ended once it
// has ended (with or without an error of the device: the memory is unmapped either way).
std::uint64_t device_quiescence_began(int device) noexcept;
void device_quiescence_ended(int device, std::uint64_t mark) noexcept;
// While it lives, blocks of `device` given back on this thread are freed at once: for memory
// whose device work has ended (the releaser's jobs).
class QuiescedRelease {
 public:
  explicit QuiescedRelease(int device) noexcept;
  ~QuiescedRelease();
  QuiescedRelease(const QuiescedRelease&) = delete;
  QuiescedRelease& operator=(const QuiescedRelease&) = delete;

 private:
  int previous_;
};
// Whether this thread is inside a QuiescedRelease (of any device).
bool in_quiesced_release() noexcept;
// Whether blocks of `device` wait for a device synchronisation to be reused or unmapped.
bool blocks_in_quarantine(int device) noexcept;
// Bytes of chunks mapped for `device` now (both kinds), for reports and tests.
std::size_t block_pool_bytes(int device) noexcept;

}  // namespace meshmem::detail
