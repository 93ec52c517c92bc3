#include "topology.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
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

namespace {
// "net:<st_dev>:<st_ino>": which namespace of that kind this process is in ("" where unreadable).
std::string namespace_of(const char* kind) {
  struct stat st {};
  const std::string path = std::string("/proc/self/ns/") + kind;
  if (::stat(path.c_str(), &st) != 0) return "";
  return std::string(kind) + ":" + std::to_string(static_cast<unsigned long long>(st.st_dev)) + ":" +
         std::to_string(static_cast<unsigned long long>(st.st_ino));
}
}  // namespace

std::string machine_key() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) name[0] = '\0';
  std::string key = name;
  std::ifstream boot_id("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (boot_id >> id) key += "/" + id;
  return key;
}

std::string node_key() {
  std::string key = machine_key();
  for (const char* kind : {"net", "pid"}) key += "/" + namespace_of(kind);
  return key;
}

std::uint64_t node_id(const std::string& key) {
  std::uint64_t h = 14695981039346656037ull;  // FNV-1a, 64 bits
  for (unsigned char c : key) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::vector<RealPlacement> place_by_id(const std::vector<std::uint64_t>& ids) {
  std::vector<RealPlacement> placement(ids.size());
  std::map<std::uint64_t, std::vector<int>> nodes;  // id -> its ranks, ascending
  for (std::size_t r = 0; r < ids.size(); ++r) nodes[ids[r]].push_back(static_cast<int>(r));
  for (const auto& [id, ranks] : nodes)
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
    std::uint64_t node;
    std::int64_t pid;
    std::int64_t uid;
  } me{node_id(node_key()), static_cast<std::int64_t>(getpid()), static_cast<std::int64_t>(geteuid())};
  std::vector<Record> all(static_cast<std::size_t>(t.size));
  boot.allgather(&me, all.data(), sizeof(Record), what);

  std::vector<std::uint64_t> ids;
  for (const Record& rec : all) {
    ids.push_back(rec.node);
    t.pid_of.push_back(static_cast<pid_t>(rec.pid));
    t.uid_of.push_back(static_cast<int>(rec.uid));
  }
  const std::vector<RealPlacement> placement = place_by_id(ids);
  for (const RealPlacement& p : placement) t.host_of.push_back(p.host);
  t.node_of = assign_nodes(placement, simulate_nodes);
  t.node_count = 1 + *std::max_element(t.node_of.begin(), t.node_of.end());
  for (int r = 0; r < t.size; ++r)
    if (t.node_of[r] == t.node_of[t.rank]) t.node_ranks.push_back(r);
  return t;
}

}  // namespace meshmem::detail
