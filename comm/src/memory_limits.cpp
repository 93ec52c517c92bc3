#include "memory_limits.hpp"

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <stdexcept>

#include "bootstrap.hpp"
#include "log.hpp"
#include "meshmem/error.hpp"

namespace meshmem::detail {
namespace {

constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
// cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit value; anything this
// large is no limit on any machine.
constexpr std::uint64_t kUnlimited = std::uint64_t(1) << 62;

std::uint64_t add(std::uint64_t a, std::uint64_t b) { return a > kMax - b ? kMax : a + b; }
std::uint64_t mul(std::uint64_t a, std::uint64_t b) { return b != 0 && a > kMax / b ? kMax : a * b; }

bool read_first_line(const std::string& path, std::string& line) {
  std::ifstream in(path);
  return static_cast<bool>(std::getline(in, line));
}

// The words of a line, split at spaces and tabs. The files below are read without iostreams'
// number parsing: that follows the process's global C++ locale, which a host application (a
// Python interpreter's extensions, say) may have changed.
std::vector<std::string> words_of(const std::string& line) {
  std::vector<std::string> out;
  std::size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
    const std::size_t from = i;
    while (i < line.size() && line[i] != ' ' && line[i] != '\t') ++i;
    if (i > from) out.push_back(line.substr(from, i - from));
  }
  return out;
}

// A decimal number and nothing else.
bool parse_number(const std::string& word, std::uint64_t& value) {
  if (word.empty() || word.size() > 20) return false;
  std::uint64_t v = 0;
  for (char c : word) {
    if (c < '0' || c > '9') return false;
    const std::uint64_t digit = static_cast<std::uint64_t>(c - '0');
    if (v > (kMax - digit) / 10) return false;
    v = v * 10 + digit;
  }
  value = v;
  return true;
}

// A file holding one number ("max" for v2's no limit: kMax).
bool read_number(const std::string& path, std::uint64_t& value) {
  std::string line;
  if (!read_first_line(path, line)) return false;
  const auto w = words_of(line);
  if (w.size() != 1) return false;
  if (w[0] == "max") {
    value = kMax;
    return true;
  }
  return parse_number(w[0], value);
}

// "key value [kB]" lines (memory.stat, /proc/meminfo): the values of the keys asked for.
std::map<std::string, std::uint64_t> read_keyed(const std::string& path, std::initializer_list<const char*> keys) {
  std::map<std::string, std::uint64_t> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const auto w = words_of(line);
    std::uint64_t value = 0;
    if (w.size() < 2 || !parse_number(w[1], value)) continue;
    std::string key = w[0];
    if (!key.empty() && key.back() == ':') key.pop_back();
    for (const char* k : keys)
      if (key == k) out[key] = w.size() > 2 && w[2] == "kB" ? mul(value, 1024) : value;
  }
  return out;
}

bool octal(char c) { return c >= '0' && c <= '7'; }

// mountinfo escapes space, tab, newline and backslash as \ooo.
std::string unescape(const std::string& s) {
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size() && octal(s[i + 1]) && octal(s[i + 2]) && octal(s[i + 3])) {
      out += static_cast<char>(std::stoi(s.substr(i + 1, 3), nullptr, 8));
      i += 3;
    } else {
      out += s[i];
    }
  }
  return out;
}

struct CgroupMount {
  std::string root;   // the part of the hierarchy mounted, as the hierarchy names it
  std::string point;  // where
};

// The memory controller's hierarchy: a v1 mount carrying `memory`, else the v2 mount.
bool find_memory_hierarchy(const SystemFiles& files, int& version, CgroupMount& mount) {
  std::ifstream in(files.proc_self + "/mountinfo");
  bool have_v2 = false;
  CgroupMount v2;
  for (std::string line; std::getline(in, line);) {
    const std::vector<std::string> f = words_of(line);
    const auto dash = std::find(f.begin(), f.end(), "-");
    if (dash == f.end() || dash - f.begin() < 5 || f.end() - dash < 4) continue;
    const std::string& type = *(dash + 1);
    const std::string options = "," + *(dash + 3) + ",";
    CgroupMount m{unescape(f[3]), files.root + unescape(f[4])};
    if (type == "cgroup" && options.find(",memory,") != std::string::npos) {
      version = 1;
      mount = m;
      return true;
    }
    if (type == "cgroup2" && !have_v2) {
      have_v2 = true;
      v2 = m;
    }
  }
  if (!have_v2) return false;
  version = 2;
  mount = v2;
  return true;
}

// This process's cgroup in that hierarchy, as /proc/self/cgroup names it.
bool own_cgroup_path(const SystemFiles& files, int version, std::string& path) {
  std::ifstream in(files.proc_self + "/cgroup");
  for (std::string line; std::getline(in, line);) {
    const auto a = line.find(':');
    const auto b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = "," + line.substr(a + 1, b - a - 1) + ",";
    const bool match = version == 1 ? controllers.find(",memory,") != std::string::npos
                                    : line.compare(0, b + 1, "0::") == 0;
    if (match) {
      path = line.substr(b + 1);
      return true;
    }
  }
  return false;
}

bool is_dir(const std::string& path, struct stat& st) { return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode); }

std::string folder_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos || slash == 0 ? "/" : path.substr(0, slash);
}

// The bound of one cgroup level, if it has a limit.
bool read_cgroup_level(int version, const std::string& dir, const std::string& name, MemoryBound& bound) {
  const std::string limit_file = dir + (version == 1 ? "/memory.limit_in_bytes" : "/memory.max");
  const std::string usage_file = version == 1 ? "memory.usage_in_bytes" : "memory.current";
  std::uint64_t limit = 0, usage = 0;
  if (!read_number(limit_file, limit) || limit >= kUnlimited) return false;
  if (!read_number(dir + "/" + usage_file, usage)) return false;
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return false;
  // Page cache that the kernel drops before it resorts to the OOM killer: file pages that no
  // process maps. (v1: the hierarchical total_* counters of this level.)
  const char* active = version == 1 ? "total_active_file" : "active_file";
  const char* inactive = version == 1 ? "total_inactive_file" : "inactive_file";
  const char* mapped = version == 1 ? "total_mapped_file" : "file_mapped";
  auto stat = read_keyed(dir + "/memory.stat", {active, inactive, mapped});
  const std::uint64_t file = add(stat[active], stat[inactive]);
  const std::uint64_t droppable = std::min(usage, file - std::min(file, stat[mapped]));
  bound.kind = MemoryBound::Kind::Cgroup;
  bound.source = "memory cgroup " + name + " (cgroup v" + std::to_string(version) + ", limit in " + limit_file + ")";
  bound.limit = limit;
  bound.in_use = usage - droppable;
  bound.in_use_how = usage_file + " less " + std::to_string(droppable) + " bytes of page cache it can drop";
  bound.dev = static_cast<std::uint64_t>(st.st_dev);
  bound.ino = static_cast<std::uint64_t>(st.st_ino);
  return true;
}

void read_cgroup_bounds(const SystemFiles& files, std::vector<MemoryBound>& out) {
  int version = 0;
  CgroupMount mount;
  std::string path;
  if (!find_memory_hierarchy(files, version, mount) || !own_cgroup_path(files, version, path)) return;
  // The cgroup's folder: the mount shows the hierarchy from `mount.root` on. (Where the path
  // is not under it, as from a cgroup namespace whose mount was made outside it, try the path
  // below the mount point, else the mount's top.)
  std::string relative = path;
  if (mount.root != "/" && path.compare(0, mount.root.size(), mount.root) == 0 &&
      (path.size() == mount.root.size() || path[mount.root.size()] == '/'))
    relative = path.substr(mount.root.size());
  while (relative.size() > 1 && relative.back() == '/') relative.pop_back();
  if (relative == "/") relative.clear();
  std::string top = mount.point;
  while (top.size() > 1 && top.back() == '/') top.pop_back();
  struct stat st {};
  std::string dir = top + relative;
  if (!is_dir(dir, st)) dir = top;
  if (!is_dir(dir, st)) return;
  const std::string prefix = mount.root == "/" ? "" : mount.root;
  for (;;) {
    const std::string inside = dir.size() > top.size() ? dir.substr(top.size()) : "";
    MemoryBound bound;
    if (read_cgroup_level(version, dir, prefix + (inside.empty() && prefix.empty() ? "/" : inside), bound))
      out.push_back(bound);
    if (dir.size() <= top.size()) break;
    dir = folder_of(dir);
  }
}

void read_machine_bounds(const SystemFiles& files, std::vector<MemoryBound>& out) {
  const std::string meminfo = files.proc + "/meminfo";
  auto m = read_keyed(meminfo, {"MemAvailable", "SwapFree", "CommitLimit", "Committed_AS"});
  if (m.count("MemAvailable")) {
    MemoryBound b;
    b.kind = MemoryBound::Kind::Machine;
    b.source = "this machine's available memory (MemAvailable + SwapFree in " + meminfo + ")";
    b.limit = add(m["MemAvailable"], m["SwapFree"]);
    b.in_use = 0;  // MemAvailable is what is free
    out.push_back(b);
  }
  std::string mode;
  if (read_first_line(files.proc + "/sys/vm/overcommit_memory", mode) && mode == "2" && m.count("CommitLimit") &&
      m.count("Committed_AS")) {
    // Strict overcommit: a memfd's pages are accounted one by one as they are faulted in; a
    // page past the limit cannot be faulted in (the populate fails silently, the first touch
    // of that page does not return).
    MemoryBound b;
    b.kind = MemoryBound::Kind::Machine;
    b.source = "this machine's commit limit (vm.overcommit_memory = 2; CommitLimit in " + meminfo + ")";
    b.limit = m["CommitLimit"];
    b.in_use = m["Committed_AS"];
    b.in_use_how = "Committed_AS";
    out.push_back(b);
  }
}

void read_address_space_bound(const SystemFiles& files, std::vector<MemoryBound>& out) {
  rlimit as{};
  if (::getrlimit(RLIMIT_AS, &as) != 0 || as.rlim_cur == RLIM_INFINITY) return;
  std::string line;
  std::uint64_t pages = 0;
  if (read_first_line(files.proc_self + "/statm", line)) {
    const auto w = words_of(line);
    if (w.empty() || !parse_number(w[0], pages)) pages = 0;
  }
  const long page = ::sysconf(_SC_PAGESIZE);
  MemoryBound b;
  b.kind = MemoryBound::Kind::AddressSpace;
  b.source = "this process's address-space limit (RLIMIT_AS, ulimit -v)";
  b.limit = static_cast<std::uint64_t>(as.rlim_cur);
  b.in_use = mul(pages, page > 0 ? static_cast<std::uint64_t>(page) : 4096);
  b.in_use_how = "mapped now";
  out.push_back(b);
}

std::string sized(std::uint64_t bytes) {
  std::string s = std::to_string(bytes) + " bytes";
  const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int unit = -1;
  while (v >= 1024 && unit < 3) {
    v /= 1024;
    ++unit;
  }
  if (unit >= 0) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), " (%.1f %s)", v, units[unit]);
    s += buf;
  }
  return s;
}

}  // namespace

std::vector<MemoryBound> read_memory_bounds(const SystemFiles& files) {
  std::vector<MemoryBound> out;
  read_cgroup_bounds(files, out);
  read_machine_bounds(files, out);
  if (files.rlimit_as) read_address_space_bound(files, out);
  return out;
}

std::string machine_id(const SystemFiles& files) {
  std::string id;
  if (read_first_line(files.proc + "/sys/kernel/random/boot_id", id) && !id.empty()) return id;
  char host[64] = {};
  if (::gethostname(host, sizeof(host) - 1) == 0) return std::string("host ") + host;
  return {};
}

MemoryCharge charge_of(const std::vector<MemoryBound>& bounds, std::uint64_t part, const std::string& machine) {
  MemoryCharge c;
  std::strncpy(c.machine, machine.c_str(), sizeof(c.machine) - 1);
  c.part = part;
  for (const MemoryBound& b : bounds) {
    if (b.kind != MemoryBound::Kind::Cgroup || c.cgroups == MemoryCharge::kMaxCgroups) continue;
    c.cgroup[c.cgroups][0] = b.dev;
    c.cgroup[c.cgroups][1] = b.ino;
    ++c.cgroups;
  }
  return c;
}

std::string why_not_fitting(const std::vector<MemoryBound>& bounds, const std::vector<MemoryCharge>& all, int rank,
                            int mapped_peers, std::uint64_t bytes, const std::string& at) {
  const MemoryCharge& mine = all[static_cast<std::size_t>(rank)];
  for (const MemoryBound& b : bounds) {
    std::uint64_t need = 0;
    std::vector<int> sharers;
    if (b.kind == MemoryBound::Kind::AddressSpace) {
      need = mul(mine.part, 1 + static_cast<std::uint64_t>(std::max(mapped_peers, 0)));
    } else {
      for (std::size_t r = 0; r < all.size(); ++r) {
        const MemoryCharge& c = all[r];
        if (std::strncmp(c.machine, mine.machine, sizeof(c.machine)) != 0) continue;
        bool shares = b.kind == MemoryBound::Kind::Machine;
        for (std::uint32_t i = 0; i < c.cgroups && !shares; ++i)
          shares = c.cgroup[i][0] == b.dev && c.cgroup[i][1] == b.ino;
        if (!shares) continue;
        sharers.push_back(static_cast<int>(r));
        need = add(need, c.part);
      }
    }
    const std::uint64_t free = b.limit - std::min(b.limit, b.in_use);
    if (need <= free) continue;
    std::string why = at + ": a host window of " + std::to_string(bytes) + " bytes per rank does not fit in " + b.source +
                      ": the limit of " + sized(b.limit) + " has " + sized(free) + " free" +
                      (b.in_use_how.empty() ? std::string()
                                            : " (" + std::to_string(b.in_use) + " bytes in use: " + b.in_use_how + ")") +
                      ", and the window needs " + sized(need) + " there (";
    if (b.kind == MemoryBound::Kind::AddressSpace) {
      why += "this rank's part of " + std::to_string(mine.part) + " bytes" +
             (mapped_peers == 1 ? std::string(" and the part of the node peer it maps")
              : mapped_peers > 1 ? " and the parts of the " + std::to_string(mapped_peers) + " node peers it maps"
                                 : std::string()) +
             "). Refused before anything was allocated (past the limit the mappings fail).";
    } else {
      why += std::to_string(sharers.size()) + (sharers.size() == 1 ? " rank's part" : " ranks' parts") + " of " +
             std::to_string(mine.part) + " bytes: rank" + (sharers.size() == 1 ? " " : "s ") + rank_list(sharers) + "). " +
             (b.kind == MemoryBound::Kind::Cgroup
                  ? "Refused before anything was allocated: past the limit the cgroup's OOM killer would end a process."
                  : "Refused before anything was allocated: past it the kernel would end a process (OOM killer) or stall "
                    "the first touch of a page.");
    }
    return why;
  }
  return {};
}

void check_host_window_fits(Bootstrap& boot, std::uint64_t bytes, int mapped_peers, const std::string& at,
                            const std::string& what) {
  const long page_size = ::sysconf(_SC_PAGESIZE);
  const std::uint64_t page = page_size > 0 ? static_cast<std::uint64_t>(page_size) : 4096;
  // The part as SharedMemory::create makes it: whole pages, at least one.
  const std::uint64_t part = bytes == 0 ? page : (bytes > kMax - (page - 1) ? kMax : (bytes + page - 1) / page * page);
  // Reading cannot fail short of memory; whatever happens, this rank must reach the gather.
  std::vector<MemoryBound> bounds;
  try {
    bounds = read_memory_bounds();
  } catch (const std::exception& e) {
    log(LogLevel::Warn, at + ": memory limits not read: " + e.what());
  }
  if (log_enabled(LogLevel::Debug))
    for (const MemoryBound& b : bounds)
      log(LogLevel::Debug, at + ": memory bound: " + b.source + ": limit " + std::to_string(b.limit) + ", in use " +
                               std::to_string(b.in_use) + " (" + b.in_use_how + ")");
  const MemoryCharge mine = charge_of(bounds, part, machine_id());
  std::vector<MemoryCharge> all(static_cast<std::size_t>(boot.size()));
  boot.allgather(&mine, all.data(), sizeof(MemoryCharge), what);
  agreed_step(boot, what, [&] {
    const std::string why = why_not_fitting(bounds, all, boot.rank(), mapped_peers, bytes, at);
    if (!why.empty()) throw Error(ErrorCode::System, why);
  });
}

}  // namespace meshmem::detail
