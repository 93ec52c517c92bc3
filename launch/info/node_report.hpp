// What meshmem-info finds out about one machine: its GPUs (PCI, NUMA, CPUs, VMM support),
// every ordered GPU pair (peer access, and for a missing or broken pair the reason and
// what to do), descriptor passing, MPI and NCCL. Collected by one process per node; printed
// as text or JSON. The GPU half (gpu_report.cu) is the only part that needs CUDA.
#pragma once

#include <string>
#include <vector>

#include "json_writer.hpp"

namespace meshmem::info {

struct GpuFacts {
  int ordinal = -1;
  std::string name;
  std::string pci_bus_id;        // 0000:19:00.0
  int numa_node = -1;            // from /sys; -1: the system has no NUMA or does not say
  std::string cpus;              // local_cpulist from /sys
  std::string pcie_root;         // root complex, pci0000:xx
  std::string iommu_group;       // empty: no IOMMU group (IOMMU off)
  unsigned long long memory_bytes = 0;
  int cc_major = 0, cc_minor = 0;
  bool vmm = false;              // VMM allocations work (cuMemCreate)
  bool posix_fd = false;         // ... exportable as POSIX fds
  int host_numa_node = -1;       // VMM host-NUMA memory: node nearest the GPU, -1: not supported
  bool host_numa_alloc = false;  // a 2 MiB host-NUMA allocation mapped for the GPU worked
  std::string vmm_error;         // why one of the three did not work
};

struct PeerFacts {
  int from = -1, to = -1;
  bool driver_allows = false;   // cudaDeviceCanAccessPeer
  bool enabled = false;         // cudaDeviceEnablePeerAccess succeeded
  bool copy_verified = false;   // copy engine: written from `from`, read back, every byte right
  bool kernel_verified = false;  // a kernel on `from` stores into `to`'s memory and loads it back
  bool native_atomics = false;  // cudaDevP2PAttrNativeAtomicSupported
  int performance_rank = -1;    // cudaDevP2PAttrPerformanceRank
  double bandwidth_gbs = -1;    // --bandwidth: cudaMemcpyPeerAsync, GB/s (-1: not measured)
  std::string reason;           // empty where the pair works
  std::string advice;
  bool works() const { return driver_allows && enabled && copy_verified && kernel_verified; }
  bool broken() const { return driver_allows && !works(); }  // granted, but does not work
};

struct HostCopyFacts {  // --bandwidth: pinned host memory <-> one GPU
  int ordinal = -1;
  double d2h_gbs = -1, h2d_gbs = -1;
};

struct NodeReport {
  std::string hostname;
  int cpus = 0;
  std::string numa_nodes;  // /sys/devices/system/node/online
  // GPUs
  bool gpu_part = false;   // meshmem-info built with CUDA
  bool gpus_usable = false;
  std::string gpu_why;     // why no GPU can be used
  int driver_version = 0, runtime_version = 0;
  std::string visible_devices;  // CUDA_VISIBLE_DEVICES, "" when unset
  int gpus_on_machine = -1;     // /proc/driver/nvidia/gpus, -1 when unknown
  std::vector<GpuFacts> gpus;
  std::vector<PeerFacts> pairs;  // every ordered pair of visible GPUs
  std::vector<HostCopyFacts> host_copies;
  // Descriptor passing and processes
  bool pidfd_getfd = false;
  std::string pidfd_detail;
  std::string ptrace_scope;  // /proc/sys/kernel/yama/ptrace_scope, "" without Yama
  bool nested_pid_namespace = false;
  // MPI and NCCL
  std::string mpi_library;
  std::string mpi_cuda_aware;  // "yes", "no", "unknown (...)"
  std::string nccl;            // "2.28.3 (libnccl.so.2)" or "not found: ..."

  // Problems that stop a job from running as asked (broken peer pairs): the exit code is
  // non-zero where there are any.
  std::vector<std::string> problems() const;
  std::string text() const;
  void json(JsonWriter& w) const;
};

// Everything but the GPUs (no CUDA needed).
void collect_system_facts(NodeReport* r);
// The GPUs and their pairs (gpu_report.cu; gpu_report_none.cpp where built without CUDA).
// `bandwidth`: also time copies between every pair and to and from pinned host memory.
void collect_gpu_facts(NodeReport* r, bool bandwidth);
// What /sys says about a PCI device (numa node, cpus, root complex, IOMMU group).
void read_pci_sysfs(const std::string& bus_id, GpuFacts* g);
// The reason and advice for a pair that is missing or broken, from what was found.
void explain_pair(const GpuFacts& a, const GpuFacts& b, PeerFacts* p);

}  // namespace meshmem::info
