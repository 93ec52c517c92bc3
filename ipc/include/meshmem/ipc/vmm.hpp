// CUDA VMM allocations shared between the processes of a node: physical memory created
// with a POSIX-file-descriptor handle type, exported as a descriptor, imported by peers and
// mapped into their address space. Every piece (physical handle, VA range, mapping) has
// its own move-only owner; destruction unmaps, frees the range and releases the handle.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <utility>

#include "meshmem/ipc/unique_fd.hpp"

namespace meshmem::ipc {

class PhysicalMemory {
 public:
  PhysicalMemory() = default;
  explicit PhysicalMemory(CUmemGenericAllocationHandle h) : handle_(h) {}
  PhysicalMemory(PhysicalMemory&& o) noexcept : handle_(std::exchange(o.handle_, 0)) {}
  PhysicalMemory& operator=(PhysicalMemory&& o) noexcept;
  ~PhysicalMemory();
  CUmemGenericAllocationHandle get() const { return handle_; }

 private:
  CUmemGenericAllocationHandle handle_ = 0;
};

class AddressRange {
 public:
  AddressRange() = default;
  AddressRange(CUdeviceptr ptr, std::size_t bytes) : ptr_(ptr), bytes_(bytes) {}
  AddressRange(AddressRange&& o) noexcept : ptr_(std::exchange(o.ptr_, 0)), bytes_(o.bytes_) {}
  AddressRange& operator=(AddressRange&& o) noexcept;
  ~AddressRange();
  CUdeviceptr get() const { return ptr_; }

 private:
  CUdeviceptr ptr_ = 0;
  std::size_t bytes_ = 0;
};

class MemoryMapping {
 public:
  MemoryMapping() = default;
  MemoryMapping(CUdeviceptr ptr, std::size_t bytes) : ptr_(ptr), bytes_(bytes) {}
  MemoryMapping(MemoryMapping&& o) noexcept : ptr_(std::exchange(o.ptr_, 0)), bytes_(o.bytes_) {}
  MemoryMapping& operator=(MemoryMapping&& o) noexcept;
  ~MemoryMapping();

 private:
  CUdeviceptr ptr_ = 0;
  std::size_t bytes_ = 0;
};

// Allocation granularity of `device` for exportable pinned device memory.
std::size_t vmm_granularity(int device);
// Bytes rounded up to the granularity (at least one granule).
std::size_t vmm_round(std::size_t bytes, std::size_t granularity);

// Physical memory on `device`, mapped read-write for `device` here, exportable as a fd.
class VmmAllocation {
 public:
  VmmAllocation() = default;
  // `bytes` must be a multiple of vmm_granularity(device).
  static VmmAllocation create(std::size_t bytes, int device);
  void* data() const { return reinterpret_cast<void*>(range_.get()); }
  std::size_t size() const { return bytes_; }
  // A new descriptor of the physical memory, to pass to peers.
  UniqueFd export_fd() const;

 private:
  // Declaration order is teardown order reversed: unmap, free the range, release.
  PhysicalMemory memory_;
  AddressRange range_;
  MemoryMapping mapping_;
  std::size_t bytes_ = 0;
};

// A peer's allocation, imported from its descriptor and mapped read-write for `device`.
// The imported handle is released once mapped: the mapping keeps the memory alive.
class PeerMapping {
 public:
  PeerMapping() = default;
  static PeerMapping import(int fd, std::size_t bytes, int device);
  void* data() const { return reinterpret_cast<void*>(range_.get()); }

 private:
  AddressRange range_;
  MemoryMapping mapping_;
};

}  // namespace meshmem::ipc
