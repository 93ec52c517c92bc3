// The node's pinned staging memory, for GPU pairs without peer access (the staged
// transport). Each rank makes one region of pinned host memory on the NUMA node nearest its
// GPU (VMM host-NUMA memory: 2 MiB pages, exported as a POSIX fd) and every rank of the node
// maps every region for the CPU and the GPUs it names. Each process holds its own reference
// to each region: no process pins the same pages again, none has to outlive another to
// unregister them, and the memory goes when the last process that maps it lets go.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "meshmem/ipc/vmm.hpp"

namespace meshmem::detail {

class Bootstrap;
class FdExchange;
struct Topology;

class StagingPool {
 public:
  // Collective over the Comm. `region_bytes` per rank (every rank asks the same; rounded up to
  // the host-NUMA granularity); `device`: this rank's GPU; `devices`: the GPUs (as this
  // process numbers them) that must reach every region, `device` included. A failure on any
  // rank raises the same Error on every rank.
  StagingPool(Bootstrap& boot, const Topology& topo, FdExchange& fds, std::size_t region_bytes, int device,
              const std::vector<int>& devices, const std::string& what);
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  // Rank r's region as mapped here (node ranks only; null for other nodes).
  void* region(int rank) const { return regions_[static_cast<std::size_t>(rank)].data(); }
  std::size_t region_bytes() const { return region_bytes_; }
  // Host NUMA node of this rank's region.
  int numa_node() const { return numa_node_; }
  // "4 x 8 MiB (node total 32 MiB), this rank's region on NUMA node 0, 2 MiB pages".
  std::string describe() const;

 private:
  std::vector<ipc::SharedHostMemory> regions_;  // by rank
  std::size_t region_bytes_ = 0;
  std::size_t granularity_ = 0;
  int numa_node_ = -1;
  int node_ranks_ = 1;
};

}  // namespace meshmem::detail
