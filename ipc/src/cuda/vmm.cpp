#include "meshmem/ipc/vmm.hpp"

#include <cstdint>
#include <string>

#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::ipc {

namespace {

// Pinned physical memory at `location` (a device, or a host NUMA node), exportable as a fd.
CUmemAllocationProp exportable_prop(CUmemLocationType location, int id) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = location;
  prop.location.id = id;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}
CUmemAllocationProp device_prop(int device) { return exportable_prop(CU_MEM_LOCATION_TYPE_DEVICE, device); }
CUmemAllocationProp host_numa_prop(int numa_node) { return exportable_prop(CU_MEM_LOCATION_TYPE_HOST_NUMA, numa_node); }

void set_access(CUdeviceptr ptr, std::size_t bytes, int device, const std::string& context) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  check_cu(cuda_driver().cuMemSetAccess(ptr, bytes, &access, 1), "cuMemSetAccess", context);
}

AddressRange reserve(std::size_t bytes, std::size_t alignment, const std::string& context) {
  CUdeviceptr ptr = 0;
  check_cu(cuda_driver().cuMemAddressReserve(&ptr, bytes, alignment, 0, 0), "cuMemAddressReserve", context);
  return AddressRange(ptr, bytes);
}

}  // namespace

// Destructors run at teardown, possibly after the driver shut down at process exit; their
// failures cannot be acted on and are ignored.
PhysicalMemory& PhysicalMemory::operator=(PhysicalMemory&& o) noexcept {
  if (this != &o) {
    PhysicalMemory old(std::exchange(handle_, std::exchange(o.handle_, 0)));
  }
  return *this;
}
PhysicalMemory::~PhysicalMemory() {
  if (handle_ != 0) (void)cuda_driver().cuMemRelease(handle_);
}

AddressRange& AddressRange::operator=(AddressRange&& o) noexcept {
  if (this != &o) {
    AddressRange old(std::exchange(ptr_, std::exchange(o.ptr_, 0)), bytes_);
    bytes_ = o.bytes_;
  }
  return *this;
}
AddressRange::~AddressRange() {
  if (ptr_ != 0) (void)cuda_driver().cuMemAddressFree(ptr_, bytes_);
}

MemoryMapping& MemoryMapping::operator=(MemoryMapping&& o) noexcept {
  if (this != &o) {
    MemoryMapping old(std::exchange(ptr_, std::exchange(o.ptr_, 0)), bytes_);
    bytes_ = o.bytes_;
  }
  return *this;
}
MemoryMapping::~MemoryMapping() {
  if (ptr_ != 0) (void)cuda_driver().cuMemUnmap(ptr_, bytes_);
}

std::size_t vmm_granularity(int device) {
  const CUmemAllocationProp prop = device_prop(device);
  std::size_t granularity = 0;
  check_cu(cuda_driver().cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
           "cuMemGetAllocationGranularity", "device " + std::to_string(device));
  return granularity;
}

std::size_t vmm_round(std::size_t bytes, std::size_t granularity) {
  if (bytes == 0) return granularity;
  if (bytes > SIZE_MAX - granularity)
    throw Error(ErrorCode::InvalidArgument, std::to_string(bytes) + " bytes cannot be rounded to the allocation granularity");
  return (bytes + granularity - 1) / granularity * granularity;
}

VmmAllocation VmmAllocation::create(std::size_t bytes, int device) {
  const std::string context = "VMM allocation of " + std::to_string(bytes) + " bytes on device " + std::to_string(device);
  const CUmemAllocationProp prop = device_prop(device);
  VmmAllocation a;
  CUmemGenericAllocationHandle handle = 0;
  check_cu(cuda_driver().cuMemCreate(&handle, bytes, &prop, 0), "cuMemCreate", context);
  a.memory_ = PhysicalMemory(handle);
  a.range_ = reserve(bytes, 0, context);
  check_cu(cuda_driver().cuMemMap(a.range_.get(), bytes, 0, handle, 0), "cuMemMap", context);
  a.mapping_ = MemoryMapping(a.range_.get(), bytes);
  set_access(a.range_.get(), bytes, device, context);
  a.bytes_ = bytes;
  return a;
}

UniqueFd VmmAllocation::export_fd() const {
  int fd = -1;
  check_cu(cuda_driver().cuMemExportToShareableHandle(&fd, memory_.get(), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
           "cuMemExportToShareableHandle", "VMM allocation of " + std::to_string(bytes_) + " bytes");
  return UniqueFd(fd);
}

PeerMapping PeerMapping::import(int fd, std::size_t bytes, int device) {
  const std::string context = "mapping a peer's VMM allocation of " + std::to_string(bytes) +
                              " bytes (fd " + std::to_string(fd) + ") for device " + std::to_string(device);
  CUmemGenericAllocationHandle handle = 0;
  check_cu(cuda_driver().cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<std::intptr_t>(fd)),
                                                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
           "cuMemImportFromShareableHandle", context);
  PhysicalMemory imported(handle);  // released on return; the mapping holds the memory
  PeerMapping m;
  m.range_ = reserve(bytes, 0, context);
  check_cu(cuda_driver().cuMemMap(m.range_.get(), bytes, 0, handle, 0), "cuMemMap", context);
  m.mapping_ = MemoryMapping(m.range_.get(), bytes);
  set_access(m.range_.get(), bytes, device, context);
  return m;
}

std::size_t host_numa_granularity(int numa_node) {
  const CUmemAllocationProp prop = host_numa_prop(numa_node);
  std::size_t granularity = 0;
  check_cu(cuda_driver().cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
           "cuMemGetAllocationGranularity", "host NUMA node " + std::to_string(numa_node));
  return granularity;
}

int host_numa_node_of(int device) {
  const std::string context = "device " + std::to_string(device);
  int supported = 0;
  check_cu(cuda_driver().cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                              device),
           "cuDeviceGetAttribute(HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)", context);
  if (!supported) return -1;
  int node = -1;
  check_cu(cuda_driver().cuDeviceGetAttribute(&node, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, device),
           "cuDeviceGetAttribute(HOST_NUMA_ID)", context);
  return node < 0 ? 0 : node;  // no NUMA: id 0, as cuMemCreate asks
}

SharedHostMemory SharedHostMemory::map(PhysicalMemory memory, std::size_t bytes, const std::vector<int>& devices,
                                       const std::string& context) {
  SharedHostMemory m;
  m.range_ = reserve(bytes, 0, context);
  check_cu(cuda_driver().cuMemMap(m.range_.get(), bytes, 0, memory.get(), 0), "cuMemMap", context);
  m.mapping_ = MemoryMapping(m.range_.get(), bytes);
  // The CPU (HOST_NUMA: the id is ignored) and each device, in one call.
  std::vector<CUmemAccessDesc> access(devices.size() + 1);
  access[0].location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
  access[0].location.id = 0;
  access[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  for (std::size_t i = 0; i < devices.size(); ++i) {
    access[i + 1].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access[i + 1].location.id = devices[i];
    access[i + 1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  check_cu(cuda_driver().cuMemSetAccess(m.range_.get(), bytes, access.data(), access.size()), "cuMemSetAccess", context);
  m.memory_ = std::move(memory);
  m.bytes_ = bytes;
  return m;
}

SharedHostMemory SharedHostMemory::create(std::size_t bytes, int numa_node, const std::vector<int>& devices) {
  const std::string context = "shared host memory of " + std::to_string(bytes) + " bytes on host NUMA node " +
                              std::to_string(numa_node);
  const CUmemAllocationProp prop = host_numa_prop(numa_node);
  CUmemGenericAllocationHandle handle = 0;
  check_cu(cuda_driver().cuMemCreate(&handle, bytes, &prop, 0), "cuMemCreate", context);
  return map(PhysicalMemory(handle), bytes, devices, context);
}

SharedHostMemory SharedHostMemory::import(int fd, std::size_t bytes, const std::vector<int>& devices) {
  const std::string context = "mapping a peer's shared host memory of " + std::to_string(bytes) + " bytes (fd " +
                              std::to_string(fd) + ")";
  CUmemGenericAllocationHandle handle = 0;
  check_cu(cuda_driver().cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<std::intptr_t>(fd)),
                                                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
           "cuMemImportFromShareableHandle", context);
  return map(PhysicalMemory(handle), bytes, devices, context);
}

UniqueFd SharedHostMemory::export_fd() const {
  int fd = -1;
  check_cu(cuda_driver().cuMemExportToShareableHandle(&fd, memory_.get(), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
           "cuMemExportToShareableHandle", "shared host memory of " + std::to_string(bytes_) + " bytes");
  return UniqueFd(fd);
}

}  // namespace meshmem::ipc
