#include "helper_cpus.hpp"

#include <dirent.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>

#include "knobs.hpp"
#include "log.hpp"

namespace meshmem::detail {
namespace {

enum class HelperCpus { Auto, Inherit };
constexpr std::pair<const char*, HelperCpus> kHelperCpusNames[] = {{"auto", HelperCpus::Auto},
                                                                  {"inherit", HelperCpus::Inherit}};
const TuningKnob<HelperCpus> kHelperCpus{
    "comm", "MESHMEM_HELPER_CPUS", HelperCpus::Auto, parse_named<kHelperCpusNames>, print_named<kHelperCpusNames>,
    "`auto`: where a Comm is made on a thread bound to a single CPU (Open MPI's default for two ranks), meshmem's "
    "busy threads (the staging agent, the nccl and mpi-device transfer proxies, the host MPI transport's progress "
    "thread) run on the CPUs of that CPU's NUMA node instead of sharing it with the caller's spinning thread "
    "(2 ranks on 1 x H100 bound to a core each: Jacobi with the staged halo 3.5x slower, a staged put 8x slower); "
    "the caller's threads keep their binding. `inherit`: the threads keep the creator's CPUs",
    false};

// Leaked: read by helper threads that may outlive static destruction.
std::mutex& settled_m = *new std::mutex;
std::vector<int>& settled = *new std::vector<int>;  // empty: keep the creator's mask
std::string& settled_text = *new std::string;
std::atomic<bool> refused_said{false};

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

}  // namespace

std::vector<int> parse_cpu_list(const std::string& list) {
  std::vector<int> cpus;
  std::stringstream in(list);
  std::string part;
  while (std::getline(in, part, ',')) {
    if (part.empty()) continue;
    int lo = 0, hi = 0;
    const auto dash = part.find('-');
    try {
      lo = std::stoi(part.substr(0, dash));
      hi = dash == std::string::npos ? lo : std::stoi(part.substr(dash + 1));
    } catch (...) {
      return {};  // not a list: treated as unknown
    }
    for (int c = lo; c <= hi && c < CPU_SETSIZE; ++c) cpus.push_back(c);
  }
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

std::string settle_helper_cpus(const Options& options) {
  std::vector<int> cpus;
  std::string text;
  cpu_set_t mine;
  CPU_ZERO(&mine);
  if (kHelperCpus.get(options) == HelperCpus::Auto &&
      pthread_getaffinity_np(pthread_self(), sizeof mine, &mine) == 0 && CPU_COUNT(&mine) == 1) {
    int bound = 0;
    while (!CPU_ISSET(bound, &mine)) ++bound;
    const int node = numa_node_of(bound);
    const std::string list = read_line(node >= 0 ? "/sys/devices/system/node/node" + std::to_string(node) + "/cpulist"
                                                 : std::string("/sys/devices/system/cpu/online"));
    cpus = parse_cpu_list(list);
    if (cpus.size() > 1)
      text = "helper threads on CPUs " + print_cpu_list(cpus) + " (" +
             (node >= 0 ? "NUMA node " + std::to_string(node) : std::string("every online CPU")) + " of CPU " +
             std::to_string(bound) + ", the one this thread is bound to; MESHMEM_HELPER_CPUS)";
    else
      cpus.clear();
  }
  std::lock_guard<std::mutex> lock(settled_m);
  settled = std::move(cpus);
  settled_text = text;
  return text;
}

void place_helper_thread(const char* what) {
  cpu_set_t set;
  CPU_ZERO(&set);
  {
    std::lock_guard<std::mutex> lock(settled_m);
    if (settled.empty()) return;
    for (int c : settled) CPU_SET(c, &set);
  }
  // The kernel keeps only the CPUs the process's cpuset allows; none of them: refused.
  const int rc = pthread_setaffinity_np(pthread_self(), sizeof set, &set);
  if (rc != 0 && !refused_said.exchange(true))
    log(LogLevel::Warn, std::string("meshmem's ") + what + " thread could not move to its CPUs (" +
                            describe_helper_cpus() + "): pthread_setaffinity_np: " + std::strerror(rc) +
                            "; it shares the creator's CPU");
}

std::string describe_helper_cpus() {
  std::lock_guard<std::mutex> lock(settled_m);
  return settled_text;
}

}  // namespace meshmem::detail
