#include "topology.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
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

std::string node_key() {
  char name[kNodeKeyBytes] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) name[0] = '\0';
  std::string key = name;
  std::ifstream boot_id("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (boot_id >> id) key += "/" + id;
  if (key.size() >= kNodeKeyBytes) key.resize(kNodeKeyBytes - 1);
  return key;
}

std::vector<RealPlacement> place_by_key(const std::vector<std::string>& keys) {
  std::vector<RealPlacement> placement(keys.size());
  std::map<std::string, std::vector<int>> nodes;  // key -> its ranks, ascending
  for (std::size_t r = 0; r < keys.size(); ++r) nodes[keys[r]].push_back(static_cast<int>(r));
  for (const auto& [key, ranks] : nodes)
    for (std::size_t i = 0; i < ranks.size(); ++i)
      placement[static_cast<std::size_t>(ranks[i])] =
          RealPlacement{ranks.front(), static_cast<int>(i), static_cast<int>(ranks.size())};
  return placement;
}

Topology Topology::discover(Bootstrap& boot, int simulate_nodes) {
  const std::string what = "meshmem::Comm (topology)";
  Topology t;
  t.rank = boot.rank();
  t.size = boot.size();

  // A rank late past the timeout, whose partners gave up on an earlier step of the
  // construction (a bounded collective that it then completed alone against their abandoned
  // parts), raises Timeout here, naming the missing ranks, instead of going on through every
  // later step's timeout (CI: 10.8 s to give up without it, against a bound of 10).
  boot.arrive(what);
  struct Record {
    char key[kNodeKeyBytes];
    std::int64_t pid;
    std::int64_t uid;
  } me{};
  const std::string key = node_key();
  std::memcpy(me.key, key.data(), key.size());  // zero-terminated: me is zeroed, key is short
  me.pid = static_cast<std::int64_t>(getpid());
  me.uid = static_cast<std::int64_t>(geteuid());
  std::vector<Record> all(static_cast<std::size_t>(t.size));
  boot.allgather(&me, all.data(), sizeof(Record), what);

  std::vector<std::string> keys;
  for (const Record& rec : all) {
    keys.emplace_back(rec.key, strnlen(rec.key, sizeof(rec.key)));
    t.pid_of.push_back(static_cast<pid_t>(rec.pid));
    t.uid_of.push_back(static_cast<int>(rec.uid));
  }
  const std::vector<RealPlacement> placement = place_by_key(keys);
  for (const RealPlacement& p : placement) t.host_of.push_back(p.host);
  t.node_of = assign_nodes(placement, simulate_nodes);
  t.node_count = 1 + *std::max_element(t.node_of.begin(), t.node_of.end());
  for (int r = 0; r < t.size; ++r)
    if (t.node_of[r] == t.node_of[t.rank]) t.node_ranks.push_back(r);
  return t;
}

}  // namespace meshmem::detail
