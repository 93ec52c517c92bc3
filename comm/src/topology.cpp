#include "topology.hpp"

#include <unistd.h>

#include <algorithm>
#include <map>
#include <utility>

#include "bootstrap.hpp"

namespace meshmem::detail {

std::vector<int> assign_nodes(const std::vector<RealPlacement>& placement, int simulate) {
  std::vector<int> node(placement.size());
  std::map<std::pair<int, int>, int> index;  // (host, group) -> node index
  for (std::size_t r = 0; r < placement.size(); ++r) {
    const RealPlacement& p = placement[r];
    const int groups = std::max(1, std::min(simulate, p.local_size));
    const int group = static_cast<int>(static_cast<long long>(p.local_rank) * groups / p.local_size);
    auto [it, inserted] = index.emplace(std::make_pair(p.host, group), static_cast<int>(index.size()));
    node[r] = it->second;
  }
  return node;
}

Topology Topology::discover(Bootstrap& boot, int simulate_nodes) {
  const std::string what = "meshmem::Comm (topology)";
  Topology t;
  t.rank = boot.rank();
  t.size = boot.size();

  // MPI_Comm_split_type and the node's MPI_Allreduce cannot be bounded: every rank enters them
  // only once all have met here. A rank late past the timeout, whose partners gave up on an
  // earlier step of the construction (a bounded collective that it then completed alone
  // against their abandoned parts), raises Timeout here instead of waiting in them for ever.
  boot.arrive(what);
  MPI_Comm shared = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split_type(boot.comm(), MPI_COMM_TYPE_SHARED, boot.rank(), MPI_INFO_NULL,
                                &shared),
            "MPI_Comm_split_type", what);
  RealPlacement mine;
  int host = boot.rank();
  int rc = MPI_Comm_rank(shared, &mine.local_rank);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_size(shared, &mine.local_size);
  if (rc == MPI_SUCCESS) rc = MPI_Allreduce(&host, &mine.host, 1, MPI_INT, MPI_MIN, shared);
  MPI_Comm_free(&shared);
  check_mpi(rc, "MPI_Comm_rank/size/Allreduce on the node communicator", what);

  struct Record {
    RealPlacement placement;
    std::int64_t pid;
    std::int64_t uid;
  } me{mine, static_cast<std::int64_t>(getpid()), static_cast<std::int64_t>(geteuid())};
  std::vector<Record> all(static_cast<std::size_t>(t.size));
  boot.allgather(&me, all.data(), sizeof(Record), what);

  std::vector<RealPlacement> placement;
  for (const Record& rec : all) {
    placement.push_back(rec.placement);
    t.host_of.push_back(rec.placement.host);
    t.pid_of.push_back(static_cast<pid_t>(rec.pid));
    t.uid_of.push_back(static_cast<int>(rec.uid));
  }
  t.node_of = assign_nodes(placement, simulate_nodes);
  t.node_count = 1 + *std::max_element(t.node_of.begin(), t.node_of.end());
  for (int r = 0; r < t.size; ++r)
    if (t.node_of[r] == t.node_of[t.rank]) t.node_ranks.push_back(r);
  return t;
}

}  // namespace meshmem::detail
