#include "cuda/staged/staging_pool.hpp"

#include <algorithm>
#include <cstdint>

#include "bootstrap.hpp"
#include "fd_exchange.hpp"
#include "topology.hpp"
#include "meshmem/error.hpp"

namespace meshmem::detail {

namespace {

std::string mib(std::size_t bytes) {
  if (bytes % (1u << 20) == 0) return std::to_string(bytes >> 20) + " MiB";
  return std::to_string(bytes) + " bytes";
}

}  // namespace

StagingPool::StagingPool(Bootstrap& boot, const Topology& topo, FdExchange& fds, std::size_t region_bytes, int device,
                         const std::vector<int>& devices, const std::string& what)
    : regions_(static_cast<std::size_t>(topo.size)), node_ranks_(static_cast<int>(topo.node_ranks.size())) {
  // Every rank's region has the same size: the largest granularity of the ranks decides.
  std::uint64_t mine = 0;
  agreed_step(boot, what, [&] {
    numa_node_ = ipc::host_numa_node_of(device);
    if (numa_node_ < 0)
      throw Error(ErrorCode::Unsupported, what + ": device " + std::to_string(device) +
                                              " cannot allocate shareable pinned host memory "
                                              "(CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0)");
    mine = ipc::host_numa_granularity(numa_node_);
  });
  std::vector<std::uint64_t> all(static_cast<std::size_t>(topo.size));
  boot.allgather(&mine, all.data(), sizeof(mine), what);
  granularity_ = static_cast<std::size_t>(*std::max_element(all.begin(), all.end()));
  region_bytes_ = ipc::vmm_round(region_bytes, granularity_);
  ipc::UniqueFd fd;
  agreed_step(boot, what, [&] {
    regions_[topo.rank] = ipc::SharedHostMemory::create(region_bytes_, numa_node_, devices);
    fd = regions_[topo.rank].export_fd();
  });
  std::vector<ipc::UniqueFd> received = fds.exchange(fd.get(), what);
  agreed_step(boot, what, [&] {
    for (int r : topo.node_ranks)
      if (r != topo.rank) regions_[r] = ipc::SharedHostMemory::import(received[r].get(), region_bytes_, devices);
  });
}

std::string StagingPool::describe() const {
  return std::to_string(node_ranks_) + " x " + mib(region_bytes_) + " (node total " +
         mib(region_bytes_ * static_cast<std::size_t>(node_ranks_)) + "), this rank's region on NUMA node " +
         std::to_string(numa_node_) + ", " + mib(granularity_) + " pages";
}

}  // namespace meshmem::detail
