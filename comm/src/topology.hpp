// Which ranks share a node. Ranks of different simulated nodes (MESHMEM_SIMULATE_NODES) are
// treated exactly like ranks of different real nodes.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

namespace meshmem::detail {

class Bootstrap;

// Where one rank runs, as read on the real machine.
struct RealPlacement {
  int host = 0;         // lowest rank of its real node
  int local_rank = 0;   // its rank within the real node
  int local_size = 1;   // ranks on the real node
};

// What names this process's real node: its host name (its UTS namespace's), the kernel's
// boot id (as NCCL tells hosts apart), and its network and pid namespaces, since node peers
// pass descriptors through Unix sockets (in a private directory of the shared /tmp, within one
// network namespace's job) and check each other by pid (SO_PEERCRED, pidfd: one pid namespace). Ranks with equal keys share a
// node; two containers of one machine with the same host name but namespaces of their own
// are two nodes. MPI_COMM_TYPE_SHARED is not asked: some Open MPI 4.1 builds put ranks of one
// node in nodes of their own (open-mpi/ompi#11585, PMIx 4.2.3; seen with Open MPI 4.1.6 on the
// GPU machines for the ranks that a remote daemon starts), which would turn node peers into
// remote ones.
std::string node_key();

// The host name and boot id alone: the ranks that share a machine's GPUs, whatever their
// namespaces (meshmem::node_local_rank, to pick a GPU).
std::string machine_key();

// What ranks exchange: a 64-bit FNV-1a hash of the key (NCCL hashes its host key the same
// size), so a rank sends 8 bytes whatever its host name's length.
std::uint64_t node_id(const std::string& key);

// Each rank's real placement from every rank's node id: its node is the ranks with its id,
// its host the lowest of them, its local rank its place among them.
std::vector<RealPlacement> place_by_id(const std::vector<std::uint64_t>& ids);

// Node index per rank: ranks of one real node are split into `simulate` contiguous groups
// of (nearly) equal size (at most one group per rank); nodes are numbered in rank order.
std::vector<int> assign_nodes(const std::vector<RealPlacement>& placement, int simulate);

struct Topology {
  int rank = 0;
  int size = 1;
  std::vector<int> node_of;    // node index of every rank
  std::vector<int> host_of;    // real node of every rank (its lowest rank), whatever MESHMEM_SIMULATE_NODES says
  int node_count = 1;
  std::vector<int> node_ranks; // ranks on this rank's node, ascending (this rank included)
  std::vector<pid_t> pid_of;   // process id of every rank (meaningful for node peers)
  std::vector<int> uid_of;     // user id of every rank

  bool same_node(int r) const { return node_of[r] == node_of[rank]; }
  int node() const { return node_of[rank]; }
  // Place of rank `r` in node_ranks (node_ranks.size() if it is on another node): the index
  // that per-node tables (channels, slots, bit sets) use.
  std::size_t node_index(int r) const {
    return static_cast<std::size_t>(std::find(node_ranks.begin(), node_ranks.end(), r) - node_ranks.begin());
  }

  static Topology discover(Bootstrap& boot, int simulate_nodes);
};

}  // namespace meshmem::detail
