#include "helper_cpus.hpp"

#include <dirent.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>

#include "knobs.hpp"
#include "log.hpp"

namespace meshmem::detail {
namespace {

enum class HelperCpusMode { Auto, Inherit };
constexpr std::pair<const char*, HelperCpusMode> kHelperCpusModes[] = {{"auto", HelperCpusMode::Auto},
                                                                      {"inherit", HelperCpusMode::Inherit}};
const TuningKnob<HelperCpusMode> kHelperCpus{
    Tier::User, "comm", "MESHMEM_HELPER_CPUS", HelperCpusMode::Auto, parse_named<kHelperCpusModes>,
    print_named<kHelperCpusModes>,
    "`auto`: meshmem's busy threads avoid the core a rank is bound to (other CPUs of its NUMA node); `inherit`: they "
    "keep the creator's CPUs",
    "`auto`: where a Comm is made on a thread bound to one core (Open MPI's default for two ranks), meshmem's busy "
    "threads (the staging agent, the nccl and mpi-device transfer proxies, the proxy barrier's thread, the host MPI "
    "progress thread, NCCL's own threads) run on the other CPUs of that core's NUMA node, less those other ranks of "
    "the node are bound to one core each (none left: they stay), instead of sharing the core with the caller's "
    "spinning thread (2 ranks on 1 x H100 bound to a core each: Jacobi with the staged halo 3.5x slower, a staged "
    "put 6.5x slower); the caller's threads keep their binding. `inherit`: the threads keep the creator's CPUs",
    false};

thread_local const HelperPlacement* in_force = nullptr;  // HelperCpusScope
std::atomic<bool> warned_shared{false};

std::string read_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// The NUMA node of `cpu` (its sysfs folder has a nodeN entry), or -1.
int numa_node_of(int cpu) {
  const std::string dir = "/sys/devices/system/cpu/cpu" + std::to_string(cpu);
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return -1;
  int node = -1;
  while (const dirent* e = readdir(d)) {
    if (std::strncmp(e->d_name, "node", 4) != 0) continue;
    char* end = nullptr;
    const long n = std::strtol(e->d_name + 4, &end, 10);
    if (end != e->d_name + 4 && *end == '\0') node = static_cast<int>(n);
  }
  closedir(d);
  return node;
}

std::vector<int> siblings_of(int cpu) {
  return parse_cpu_list(read_line("/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/thread_siblings_list"));
}

std::vector<int> cpus_of(pthread_t thread) {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (pthread_getaffinity_np(thread, sizeof set, &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

int set_cpus(pthread_t thread, const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  return pthread_setaffinity_np(thread, sizeof set, &set);
}

bool within(const std::vector<int>& a, const std::vector<int>& b) {  // a ⊆ b, both sorted
  return std::includes(b.begin(), b.end(), a.begin(), a.end());
}

}  // namespace

std::vector<int> parse_cpu_list(const std::string& list) {
  std::vector<int> cpus;
  std::stringstream in(list);
  std::string part;
  while (std::getline(in, part, ',')) {
    const auto dash = part.find('-');
    const std::string lo_s = part.substr(0, dash), hi_s = dash == std::string::npos ? lo_s : part.substr(dash + 1);
    char* end_lo = nullptr;
    char* end_hi = nullptr;
    const long lo = std::strtol(lo_s.c_str(), &end_lo, 10), hi = std::strtol(hi_s.c_str(), &end_hi, 10);
    if (lo_s.empty() || hi_s.empty() || *end_lo != '\0' || *end_hi != '\0' || lo < 0 || hi < lo) return {};
    for (long c = lo; c <= hi && c < CPU_SETSIZE; ++c) cpus.push_back(static_cast<int>(c));
  }
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  return cpus;
}

std::string print_cpu_list(const std::vector<int>& cpus) {
  std::string out;
  for (std::size_t i = 0; i < cpus.size();) {
    std::size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    out += (out.empty() ? "" : ",") + std::to_string(cpus[i]) + (j > i ? "-" + std::to_string(cpus[j]) : "");
    i = j + 1;
  }
  return out;
}

std::vector<int> cpus_of_this_thread() { return cpus_of(pthread_self()); }

bool bound_to_one_core(const std::vector<int>& mine) {
  if (mine.size() == 1) return true;
  if (mine.empty()) return false;
  const std::vector<int> core = siblings_of(mine.front());
  return !core.empty() && within(mine, core);
}

HelperPlacement plan_helper_cpus(bool inherit, const std::vector<int>& mine, const std::vector<int>& siblings,
                                 const std::vector<int>& node, int node_id, const std::vector<int>& taken) {
  const bool one_core = mine.size() == 1 || (!mine.empty() && !siblings.empty() && within(mine, siblings));
  if (inherit || !one_core || node.empty()) return {};
  std::vector<int> free;
  std::set_difference(node.begin(), node.end(), taken.begin(), taken.end(), std::back_inserter(free));
  const std::string where = node_id >= 0 ? "NUMA node " + std::to_string(node_id) : std::string("the online CPUs");
  const std::string core = "CPU " + print_cpu_list(mine) + ", the core this thread is bound to";
  if (free.empty())
    return {{}, "helper threads stay on " + core + ": every CPU of " + where + " is bound to a rank (MESHMEM_HELPER_CPUS)"};
  return {free, "helper threads on CPUs " + print_cpu_list(free) + " (" + where + " of " + core +
                    ", less the ranks' cores; MESHMEM_HELPER_CPUS)"};
}

HelperPlacement settle_helper_cpus(const Options& options, const std::vector<int>& taken) {
  const std::vector<int> mine = cpus_of_this_thread();
  if (mine.empty()) return {};
  const int node_id = numa_node_of(mine.front());
  const std::vector<int> node = parse_cpu_list(
      read_line(node_id >= 0 ? "/sys/devices/system/node/node" + std::to_string(node_id) + "/cpulist"
                             : std::string("/sys/devices/system/cpu/online")));
  return plan_helper_cpus(kHelperCpus.get(options) == HelperCpusMode::Inherit, mine, siblings_of(mine.front()), node,
                          node_id, taken);
}

HelperCpusScope::HelperCpusScope(const HelperPlacement& placement) : previous_(in_force) { in_force = &placement; }
HelperCpusScope::~HelperCpusScope() { in_force = previous_; }

void place_helper_thread(pthread_t thread, const char* what) {
  if (in_force == nullptr || in_force->cpus.empty()) return;
  const std::vector<int> creator = cpus_of_this_thread();
  const int rc = set_cpus(thread, in_force->cpus);
  // The kernel keeps only what the process's cpuset allows: read back what the thread got.
  const std::vector<int> got = cpus_of(thread);
  if ((rc != 0 || within(got, creator)) && !warned_shared.exchange(true))
    log(LogLevel::Warn, std::string("meshmem's ") + what + " thread still shares the caller's CPUs " +
                            print_cpu_list(creator) + " (asked for " + print_cpu_list(in_force->cpus) + ": " +
                            (rc != 0 ? std::string(std::strerror(rc)) : "the process's cpuset allows no other") +
                            "): its transfers wait for the caller's thread to leave the CPU; bind ranks to more CPUs");
}

CallerOnHelperCpus::CallerOnHelperCpus() {
  if (in_force == nullptr || in_force->cpus.empty()) return;
  std::vector<int> before = cpus_of_this_thread();
  if (set_cpus(pthread_self(), in_force->cpus) == 0) restore_ = std::move(before);
}

CallerOnHelperCpus::~CallerOnHelperCpus() {
  if (!restore_.empty()) (void)set_cpus(pthread_self(), restore_);
}

}  // namespace meshmem::detail
