// The CUDA-free half of the node report: the machine, descriptor passing, MPI, NCCL, what
// /sys says about each GPU, why a GPU pair is missing, and the text and JSON forms.
#include "node_report.hpp"

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <mpi.h>
#include <sys/wait.h>
#include <unistd.h>
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif

#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <meshmem/meshmem.hpp>
#include <sstream>

#include "meshmem/ipc/pidfd.hpp"

namespace meshmem::info {
namespace {

std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  if (f) std::getline(f, line);
  return line;
}

std::string real_path(const std::string& path) {
  char buf[PATH_MAX];
  return realpath(path.c_str(), buf) ? std::string(buf) : std::string();
}

// Whether a process of this user may take a descriptor out of another one the way ranks
// do (pidfd_getfd). A child takes one from its parent: like a sibling rank, and unlike a
// descendant, it needs ptrace permission that Yama's scope 1 does not give.
void probe_pidfd(NodeReport* r) {
  const int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    r->pidfd_detail = "could not open /dev/null to test with";
    return;
  }
  const pid_t parent = getpid();
  const pid_t child = fork();
  if (child == 0) {
    int err = 0;
    ipc::UniqueFd got = ipc::try_fetch_fd(parent, fd, &err);
    _exit(got ? 0 : (err > 0 && err < 126 ? err : 125));
  }
  int status = 0;
  if (child < 0 || waitpid(child, &status, 0) != child || !WIFEXITED(status)) {
    r->pidfd_detail = "the test process failed";
  } else if (WEXITSTATUS(status) == 0) {
    r->pidfd_getfd = true;
    r->pidfd_detail = "permitted between processes of this user";
  } else {
    const int err = WEXITSTATUS(status);
    r->pidfd_detail = std::string("refused (") + std::strerror(err) + ")" +
                      (err == EPERM ? ": ptrace permission is missing (Yama ptrace_scope, a container's seccomp or "
                                      "capabilities); meshmem passes descriptors over a Unix socket instead"
                                    : err == ENOSYS ? ": the kernel is older than 5.6; meshmem uses a Unix socket instead"
                                                    : "; meshmem uses a Unix socket instead");
  }
  close(fd);
}

std::string nccl_library_setting() {
  for (const Options::Setting& s : Options::from_environment().settings())
    if (s.name == "MESHMEM_NCCL_LIBRARY") return s.value;
  return "libnccl.so.2";
}

// The NCCL meshmem would load (MESHMEM_NCCL_LIBRARY), and its version.
std::string probe_nccl() {
  const std::string path = nccl_library_setting();
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    const char* e = dlerror();
    return "not found: " + std::string(e ? e : path) + " (the nccl transport is unavailable; set MESHMEM_NCCL_LIBRARY)";
  }
  using GetVersion = int (*)(int*);
  auto get = reinterpret_cast<GetVersion>(dlsym(h, "ncclGetVersion"));
  int v = 0;
  std::string out;
  if (get == nullptr || get(&v) != 0) {
    out = path + " has no working ncclGetVersion";
  } else {
    out = std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100) + " (" +
          path + ")";
  }
  dlclose(h);
  return out;
}

std::string mpi_cuda_aware() {
#if defined(OMPI_HAVE_MPI_EXT_CUDA) && OMPI_HAVE_MPI_EXT_CUDA
  return MPIX_Query_cuda_support() ? "yes (MPIX_Query_cuda_support)"
                                   : "no (MPIX_Query_cuda_support: this Open MPI was built without CUDA)";
#else
  return "unknown (this MPI has no MPIX_Query_cuda_support)";
#endif
}

int count_gpus_of_driver() {
  // One directory per GPU of the machine, whatever CUDA_VISIBLE_DEVICES hides.
  DIR* d = opendir("/proc/driver/nvidia/gpus");
  if (d == nullptr) return -1;
  int n = 0;
  while (const dirent* e = readdir(d))
    if (e->d_name[0] != '.') ++n;
  closedir(d);
  return n;
}

std::string yes_no(bool b) { return b ? "yes" : "no"; }

}  // namespace

void collect_system_facts(NodeReport* r) {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  r->hostname = host;
  r->cpus = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  r->numa_nodes = read_line("/sys/devices/system/node/online");
  if (const char* v = std::getenv("CUDA_VISIBLE_DEVICES")) r->visible_devices = v;
  r->gpus_on_machine = count_gpus_of_driver();
  probe_pidfd(r);
  r->ptrace_scope = read_line("/proc/sys/kernel/yama/ptrace_scope");
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("NSpid:", 0) == 0) {
      std::istringstream fields(line.substr(6));
      int count = 0;
      for (std::string f; fields >> f;) ++count;
      r->nested_pid_namespace = count > 1;
    }
  char version[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  MPI_Get_library_version(version, &len);
  r->mpi_library = std::string(version, static_cast<std::size_t>(len));
  if (const auto nl = r->mpi_library.find('\n'); nl != std::string::npos) r->mpi_library.resize(nl);
  if (const auto comma = r->mpi_library.find(','); comma != std::string::npos) r->mpi_library.resize(comma);
  r->mpi_cuda_aware = mpi_cuda_aware();
  r->nccl = probe_nccl();
}

void read_pci_sysfs(const std::string& bus_id, GpuFacts* g) {
  std::string id = bus_id;
  for (char& c : id) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  // cudaDeviceGetPCIBusId gives an 8-digit domain (00000000:19:00.0); /sys uses 4.
  if (id.size() > 12 && id.find(':') == 8) id = id.substr(4);
  const std::string dev = "/sys/bus/pci/devices/" + id;
  const std::string numa = read_line(dev + "/numa_node");
  g->numa_node = numa.empty() ? -1 : std::atoi(numa.c_str());
  g->cpus = read_line(dev + "/local_cpulist");
  const std::string path = real_path(dev);  // /sys/devices/pci0000:17/0000:17:00.0/.../0000:19:00.0
  const auto start = path.find("/pci");
  if (start != std::string::npos) g->pcie_root = path.substr(start + 1, path.find('/', start + 1) - start - 1);
  const std::string group = real_path(dev + "/iommu_group");
  if (!group.empty()) g->iommu_group = group.substr(group.rfind('/') + 1);
}

void explain_pair(const GpuFacts& a, const GpuFacts& b, PeerFacts* p) {
  const std::string staged = "meshmem routes this pair through the staged transport (pinned host memory)";
  if (!p->driver_allows) {
    p->reason = "the driver says no (cudaDeviceCanAccessPeer = 0)";
    if (!a.pcie_root.empty() && !b.pcie_root.empty() && a.pcie_root != b.pcie_root)
      p->reason += "; the GPUs are under different PCIe root complexes (" + a.pcie_root + ", " + b.pcie_root +
                   "), across which many platforms do not support P2P";
    if (!a.iommu_group.empty() || !b.iommu_group.empty())
      p->reason += "; the IOMMU is on (groups " + (a.iommu_group.empty() ? "-" : a.iommu_group) + ", " +
                   (b.iommu_group.empty() ? "-" : b.iommu_group) +
                   "): with PCIe ACS redirection peer traffic goes through the root complex or is blocked";
    p->advice = staged + "; for native P2P check the BIOS ACS and IOMMU settings (iommu=pt) or the VM's PCI "
                         "passthrough, then `nvidia-smi topo -p2p r`";
  } else if (!p->enabled) {
    p->reason = "the driver allows peer access but enabling it failed";
    p->advice = "run with MESHMEM_IPC_PEER_ACCESS=off, so that the staged transport (pinned host memory) carries this "
                "pair (meshmem's ipc route maps memory directly and may still try it); check dmesg for Xid errors";
  } else if (!p->copy_verified || !p->kernel_verified) {
    p->reason = std::string("peer access is granted but write-and-verify failed (") +
                (!p->copy_verified ? "copy engine" : "") + (!p->copy_verified && !p->kernel_verified ? " and " : "") +
                (!p->kernel_verified ? "kernel stores and loads" : "") +
                "): data written to the peer did not arrive intact; an IOMMU/ACS or virtualisation layer is the "
                "usual cause";
    p->advice = "do not use ipc for this pair: run with MESHMEM_IPC_PEER_ACCESS=off (the staged transport carries "
                "it) and report the machine to its administrators";
  }
}

std::vector<std::string> NodeReport::problems() const {
  std::vector<std::string> out;
  for (const PeerFacts& p : pairs)
    if (p.broken())
      out.push_back(hostname + ": GPU " + std::to_string(p.from) + " -> GPU " + std::to_string(p.to) + ": " +
                    p.reason);
  return out;
}

std::string NodeReport::text() const {
  std::ostringstream o;
  o << "node " << hostname << ": " << cpus << " CPUs, NUMA nodes " << (numa_nodes.empty() ? "none" : numa_nodes)
    << "\n";
  if (!gpu_part) {
    o << "  GPUs: not checked: " << gpu_why << "\n";
  } else if (!gpus_usable) {
    o << "  GPUs: none usable: " << gpu_why << "\n";
  } else {
    o << "  CUDA driver " << driver_version / 1000 << "." << driver_version % 1000 / 10 << ", runtime "
      << runtime_version / 1000 << "." << runtime_version % 1000 / 10 << "\n";
    o << "  GPUs (" << gpus.size() << " visible";
    if (gpus_on_machine >= 0) o << " of " << gpus_on_machine << " on the machine";
    if (!visible_devices.empty()) o << ", CUDA_VISIBLE_DEVICES=" << visible_devices;
    o << "):\n";
    for (const GpuFacts& g : gpus) {
      o << "    " << g.ordinal << ": " << g.name << ", sm_" << g.cc_major << g.cc_minor << ", "
        << g.memory_bytes / (1ull << 30) << " GiB, PCI " << g.pci_bus_id << ", NUMA "
        << (g.numa_node < 0 ? std::string("-") : std::to_string(g.numa_node)) << ", CPUs "
        << (g.cpus.empty() ? "-" : g.cpus) << ", root " << (g.pcie_root.empty() ? "-" : g.pcie_root) << ", IOMMU group "
        << (g.iommu_group.empty() ? "none" : g.iommu_group) << "\n";
      o << "       VMM " << yes_no(g.vmm) << ", POSIX-fd export " << yes_no(g.posix_fd) << ", host-NUMA memory "
        << (g.host_numa_alloc ? "yes (node " + std::to_string(g.host_numa_node) + ")" : std::string("no"));
      if (!g.vmm_error.empty()) o << " (" << g.vmm_error << ")";
      o << "\n";
    }
    if (gpus_on_machine > static_cast<int>(gpus.size()))
      o << "  " << gpus_on_machine - static_cast<int>(gpus.size())
        << " GPU(s) of this machine are hidden from this process (CUDA_VISIBLE_DEVICES or the container), so "
           "their pairs are not checked here; a rank on one of them is still reached through ipc or staged where "
           "the driver lets this process map its memory (meshmem-info --job shows each pair)\n";
    if (gpus.size() > 1) {
      o << "  peer access (row: from, column: to; P2P = works, verified by write and read back; A = native atomics; "
           "- = none):\n       ";
      for (const GpuFacts& g : gpus) o << "  GPU" << g.ordinal << "  ";
      o << "\n";
      for (const GpuFacts& a : gpus) {
        o << "    GPU" << a.ordinal;
        for (const GpuFacts& b : gpus) {
          std::string cell = "self";
          for (const PeerFacts& p : pairs)
            if (p.from == a.ordinal && p.to == b.ordinal)
              cell = p.works() ? (p.native_atomics ? "P2P+A" : "P2P") : p.broken() ? "BROKEN" : "-";
          char buf[16];
          std::snprintf(buf, sizeof buf, " %-7s", cell.c_str());
          o << buf;
        }
        o << "\n";
      }
      for (const PeerFacts& p : pairs)
        if (!p.reason.empty())
          o << "    GPU" << p.from << " -> GPU" << p.to << ": " << p.reason << "\n      what to do: " << p.advice
            << "\n";
    }
    bool any_bw = false;
    for (const PeerFacts& p : pairs) any_bw = any_bw || p.bandwidth_gbs >= 0;
    if (any_bw) {
      o << "  bandwidth, cudaMemcpyPeerAsync of 256 MiB (GB/s; row: from, column: to):\n       ";
      for (const GpuFacts& g : gpus) o << "  GPU" << g.ordinal << "  ";
      o << "\n";
      for (const GpuFacts& a : gpus) {
        o << "    GPU" << a.ordinal;
        for (const GpuFacts& b : gpus) {
          char buf[16] = " -      ";
          for (const PeerFacts& p : pairs)
            if (p.from == a.ordinal && p.to == b.ordinal && p.bandwidth_gbs >= 0)
              std::snprintf(buf, sizeof buf, " %-7.1f", p.bandwidth_gbs);
          o << buf;
        }
        o << "\n";
      }
    }
    for (const HostCopyFacts& h : host_copies) {
      char buf[128];
      std::snprintf(buf, sizeof buf, "    GPU%d pinned host memory: device to host %.1f GB/s, host to device %.1f GB/s\n",
                    h.ordinal, h.d2h_gbs, h.h2d_gbs);
      o << buf;
    }
  }
  o << "  descriptor passing: pidfd_getfd " << pidfd_detail;
  if (!ptrace_scope.empty()) o << "; Yama ptrace_scope " << ptrace_scope;
  if (nested_pid_namespace) o << "; in a PID namespace";
  o << "\n";
  o << "  MPI: " << mpi_library << "; CUDA-aware: " << mpi_cuda_aware << "\n";
  o << "  NCCL: " << nccl << "\n";
  return o.str();
}

void NodeReport::json(JsonWriter& w) const {
  w.begin_object();
  w.field("hostname", hostname).field("cpus", cpus).field("numa_nodes", numa_nodes);
  w.key("gpu").begin_object();
  w.field("built_with_cuda", gpu_part).field("usable", gpus_usable);
  if (!gpus_usable) w.field("why", gpu_why);
  w.field("driver_version", driver_version).field("runtime_version", runtime_version);
  w.key("cuda_visible_devices");
  if (visible_devices.empty()) w.null(); else w.value(visible_devices);
  w.field("gpus_on_machine", gpus_on_machine);
  w.key("devices").begin_array();
  for (const GpuFacts& g : gpus) {
    w.begin_object();
    w.field("ordinal", g.ordinal).field("name", g.name).field("pci_bus_id", g.pci_bus_id);
    w.field("numa_node", g.numa_node).field("cpus", g.cpus).field("pcie_root", g.pcie_root);
    w.key("iommu_group");
    if (g.iommu_group.empty()) w.null(); else w.value(g.iommu_group);
    w.field("memory_bytes", g.memory_bytes).field("compute_capability", std::to_string(g.cc_major) + "." + std::to_string(g.cc_minor));
    w.field("vmm", g.vmm).field("posix_fd", g.posix_fd).field("host_numa_alloc", g.host_numa_alloc);
    w.field("host_numa_node", g.host_numa_node);
    if (!g.vmm_error.empty()) w.field("vmm_error", g.vmm_error);
    w.end_object();
  }
  w.end_array();
  w.key("pairs").begin_array();
  for (const PeerFacts& p : pairs) {
    w.begin_object();
    w.field("from", p.from).field("to", p.to).field("driver_allows", p.driver_allows).field("enabled", p.enabled);
    w.field("copy_verified", p.copy_verified).field("kernel_verified", p.kernel_verified);
    w.field("works", p.works()).field("native_atomics", p.native_atomics).field("performance_rank", p.performance_rank);
    w.key("bandwidth_gbs");
    if (p.bandwidth_gbs >= 0) w.value(p.bandwidth_gbs); else w.null();
    if (!p.reason.empty()) w.field("reason", p.reason).field("advice", p.advice);
    w.end_object();
  }
  w.end_array();
  w.key("host_copies").begin_array();
  for (const HostCopyFacts& h : host_copies)
    w.begin_object().field("ordinal", h.ordinal).field("d2h_gbs", h.d2h_gbs).field("h2d_gbs", h.h2d_gbs).end_object();
  w.end_array();
  w.end_object();
  w.key("descriptor_passing").begin_object();
  w.field("pidfd_getfd", pidfd_getfd).field("detail", pidfd_detail);
  w.key("ptrace_scope");
  if (ptrace_scope.empty()) w.null(); else w.value(ptrace_scope);
  w.field("nested_pid_namespace", nested_pid_namespace).end_object();
  w.key("mpi").begin_object().field("library", mpi_library).field("cuda_aware", mpi_cuda_aware).end_object();
  w.field("nccl", nccl);
  w.key("problems").begin_array();
  for (const std::string& p : problems()) w.value(p);
  w.end_array();
  w.end_object();
}

}  // namespace meshmem::info
