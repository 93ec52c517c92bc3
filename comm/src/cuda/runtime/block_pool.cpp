#include "cuda/runtime/block_pool.hpp"

#include <cuda_runtime_api.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "free_ranges.hpp"
#include "log.hpp"
#include "cuda/runtime/cuda_owners.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"
#include "meshmem/ipc/vmm.hpp"

namespace meshmem::detail {
namespace {

constexpr std::size_t kAlign = 256;

std::size_t round_up(std::size_t bytes, std::size_t to) { return (bytes + to - 1) / to * to; }

// One mapping of granularity size (or more, for a large block) cut into blocks.
struct Chunk {
  ipc::VmmAllocation device_memory;
  ipc::SharedHostMemory host_memory;
  void* fallback_host = nullptr;  // cudaHostAlloc, where the device has no host-NUMA VMM
  char* base = nullptr;
  FreeRanges ranges;  // taken or quarantined bytes count as held

  explicit Chunk(std::size_t bytes) : ranges(bytes) {}
  Chunk(const Chunk&) = delete;
  Chunk& operator=(const Chunk&) = delete;
  ~Chunk() {
    // The one path that can wait for the device's kernels: documented (README, GPU memory).
    if (fallback_host != nullptr) (void)cudaFreeHost(fallback_host);
  }
};

thread_local int quiesced_device = -1;  // QuiescedRelease

struct Quarantined {
  Chunk* chunk;
  std::size_t offset, bytes;
  std::uint64_t marks;  // device synchronisations begun when it was given back
};

}  // namespace

// The chunks of one device, both kinds. Never destroyed (see pool_of): blocks may be given
// back by objects that outlive static destruction.
class BlockPool {
 public:
  explicit BlockPool(int device) : device_(device) {}

  PooledBlock take(BlockMemory kind, std::size_t bytes, const std::string& what) {
    const std::size_t want = round_up(bytes == 0 ? 1 : bytes, kAlign);
    PooledBlock block;
    {
      std::lock_guard<std::mutex> lock(m_);
      auto& list = chunks_[static_cast<int>(kind)];
      Chunk* chunk = nullptr;
      std::size_t offset = 0;
      for (auto& c : list) {
        offset = c->ranges.take(want);
        if (offset != c->ranges.size()) {
          chunk = c.get();
          break;
        }
      }
      if (chunk == nullptr) {
        list.push_back(make_chunk(kind, want, what));
        chunk = list.back().get();
        offset = chunk->ranges.take(want);
      }
      block.pool_ = this;
      block.chunk_ = chunk;
      block.offset_ = offset;
      block.bytes_ = want;
      block.data_ = chunk->base + offset;
    }
    if (kind == BlockMemory::MappedHost) std::memset(block.data_, 0, want);
    return block;
  }

  void give_back(void* chunk, std::size_t offset, std::size_t bytes) noexcept {
    std::unique_ptr<Chunk> gone;  // unmapped after the lock is let go
    std::lock_guard<std::mutex> lock(m_);
    auto* c = static_cast<Chunk*>(chunk);
    if (quiesced_device == device_) {
      c->ranges.put(offset, bytes);
      if (c->ranges.held() == 0) gone = detach(c);
      return;
    }
    quarantine_.push_back({c, offset, bytes, marks_});
  }

  std::uint64_t began() noexcept {
    std::lock_guard<std::mutex> lock(m_);
    return ++marks_;
  }

  void ended(std::uint64_t mark) noexcept {
    std::vector<std::unique_ptr<Chunk>> gone;  // unmapped after the lock is let go
    std::lock_guard<std::mutex> lock(m_);
    std::vector<Quarantined> still;
    for (const Quarantined& q : quarantine_) {
      if (q.marks >= mark) {  // given back after that synchronisation began
        still.push_back(q);
        continue;
      }
      q.chunk->ranges.put(q.offset, q.bytes);
      if (q.chunk->ranges.held() == 0) gone.push_back(detach(q.chunk));
    }
    quarantine_.swap(still);
  }

  bool quarantined() noexcept {
    std::lock_guard<std::mutex> lock(m_);
    return !quarantine_.empty();
  }

  std::size_t mapped() noexcept {
    std::lock_guard<std::mutex> lock(m_);
    std::size_t total = 0;
    for (const auto& list : chunks_)
      for (const auto& c : list) total += c->ranges.size();
    return total;
  }

 private:
  std::unique_ptr<Chunk> make_chunk(BlockMemory kind, std::size_t want, const std::string& what) {
    std::unique_ptr<Chunk> chunk;
    if (kind == BlockMemory::Device) {
      if (granularity_[0] == 0) granularity_[0] = ipc::vmm_granularity(device_);
      chunk = std::make_unique<Chunk>(round_up(want, granularity_[0]));
      chunk->device_memory = ipc::VmmAllocation::create(chunk->ranges.size(), device_);
      chunk->base = static_cast<char*>(chunk->device_memory.data());
      return chunk;
    }
    if (numa_ == -2) numa_ = ipc::host_numa_node_of(device_);
    if (numa_ >= 0) {
      if (granularity_[1] == 0) granularity_[1] = ipc::host_numa_granularity(numa_);
      chunk = std::make_unique<Chunk>(round_up(want, granularity_[1]));
      chunk->host_memory = ipc::SharedHostMemory::create(chunk->ranges.size(), numa_, {device_});
      chunk->base = static_cast<char*>(chunk->host_memory.data());
      return chunk;
    }
    chunk = std::make_unique<Chunk>(round_up(want, 64 * 1024));
    CurrentDevice current(device_);
    ipc::check_cuda(cudaHostAlloc(&chunk->fallback_host, chunk->ranges.size(), cudaHostAllocMapped | cudaHostAllocPortable),
                    "cudaHostAlloc", what + " (device " + std::to_string(device_) + " has no host-NUMA VMM)");
    chunk->base = static_cast<char*>(chunk->fallback_host);
    return chunk;
  }

  // An empty chunk out of its list (m_ held), for the caller to unmap once m_ is let go:
  // the cudaFreeHost of the fallback waits for the device's kernels.
  std::unique_ptr<Chunk> detach(Chunk* chunk) noexcept {
    for (auto& list : chunks_)
      for (auto it = list.begin(); it != list.end(); ++it)
        if (it->get() == chunk) {
          std::unique_ptr<Chunk> out = std::move(*it);
          list.erase(it);
          return out;
        }
    return nullptr;
  }

  const int device_;
  std::mutex m_;
  std::vector<std::unique_ptr<Chunk>> chunks_[2];  // by BlockMemory
  std::vector<Quarantined> quarantine_;
  std::uint64_t marks_ = 0;
  std::size_t granularity_[2] = {0, 0};
  int numa_ = -2;  // not asked yet
};

namespace {

BlockPool* pool_of(int device) {
  static std::mutex m;
  static auto* pools = new std::map<int, BlockPool*>();  // never destroyed, like the pools
  std::lock_guard<std::mutex> lock(m);
  BlockPool*& pool = (*pools)[device];
  if (pool == nullptr) pool = new BlockPool(device);
  return pool;
}

int current_device(const std::string& what) {
  int device = -1;
  ipc::check_cuda(cudaGetDevice(&device), "cudaGetDevice", what);
  return device;
}

}  // namespace

PooledBlock& PooledBlock::operator=(PooledBlock&& o) noexcept {
  if (this != &o) {
    give_back();
    pool_ = std::exchange(o.pool_, nullptr);
    chunk_ = o.chunk_;
    offset_ = o.offset_;
    bytes_ = o.bytes_;
    data_ = std::exchange(o.data_, nullptr);
  }
  return *this;
}

void PooledBlock::give_back() noexcept {
  if (pool_ == nullptr) return;
  std::exchange(pool_, nullptr)->give_back(chunk_, offset_, bytes_);
  data_ = nullptr;
}

PooledBlock take_block(BlockMemory kind, int device, std::size_t bytes, const std::string& what) {
  if (device < 0) device = current_device(what);
  return pool_of(device)->take(kind, bytes, what);
}

void fill_block(const PooledBlock& block, const void* source, std::size_t bytes, const std::string& what) {
  OwnedStream stream(what);  // of the current device (device blocks: mapped for their own device only)
  ipc::check_cuda(cudaMemcpyAsync(block.get(), source, bytes, cudaMemcpyHostToDevice, stream.get()), "cudaMemcpyAsync",
                  what);
  ipc::check_cuda(cudaStreamSynchronize(stream.get()), "cudaStreamSynchronize", what);
}

QuiescedRelease::QuiescedRelease(int device) noexcept : previous_(std::exchange(quiesced_device, device)) {}
QuiescedRelease::~QuiescedRelease() { quiesced_device = previous_; }

std::uint64_t device_quiescence_began(int device) noexcept { return pool_of(device)->began(); }
void device_quiescence_ended(int device, std::uint64_t mark) noexcept { pool_of(device)->ended(mark); }
bool in_quiesced_release() noexcept { return quiesced_device != -1; }
bool blocks_in_quarantine(int device) noexcept { return pool_of(device)->quarantined(); }
std::size_t block_pool_bytes(int device) noexcept { return pool_of(device)->mapped(); }

}  // namespace meshmem::detail
