// CUDA VMM allocations shared between the processes of a node: physical memory created
// with a POSIX-file-descriptor handle type, exported as a descriptor, imported by peers and
// mapped into their address space. Every piece (physical handle, VA range, mapping) has
// its own move-only owner; destruction unmaps, frees the range and releases the handle.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

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

// Granularity of shareable pinned host memory on host NUMA node `numa_node` (2 MiB on x86:
// the driver maps it with large pages).
std::size_t host_numa_granularity(int numa_node);
// The host NUMA node nearest `device` (CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID), 0 where the system
// has no NUMA; -1 where the device cannot allocate VMM host-NUMA memory.
int host_numa_node_of(int device);

// Pinned host memory shared between the processes of a node: physical memory created on a
// host NUMA node (CU_MEM_LOCATION_TYPE_HOST_NUMA) with a POSIX-fd handle, mapped here for the
// CPU and for `devices`. Every process that maps it holds its own reference, so it outlives
// whichever process made it, and none pins the same pages again (cudaHostRegister in each
// process would: 4 KiB page tables per process and device, and only the registering context
// can unregister them).
class SharedHostMemory {
 public:
  SharedHostMemory() = default;
  // `bytes` must be a multiple of host_numa_granularity(numa_node).
  static SharedHostMemory create(std::size_t bytes, int numa_node, const std::vector<int>& devices);
  // Another process's memory from its descriptor (its export_fd()), mapped the same way.
  static SharedHostMemory import(int fd, std::size_t bytes, const std::vector<int>& devices);
  void* data() const { return reinterpret_cast<void*>(range_.get()); }
  std::size_t size() const { return bytes_; }
  UniqueFd export_fd() const;

 private:
  static SharedHostMemory map(PhysicalMemory memory, std::size_t bytes, const std::vector<int>& devices,
                              const std::string& context);
  PhysicalMemory memory_;
  AddressRange range_;
  MemoryMapping mapping_;
  std::size_t bytes_ = 0;
};

}  // namespace meshmem::ipc
