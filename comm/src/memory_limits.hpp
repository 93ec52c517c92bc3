// How much memory a host window may take before the kernel ends a process instead of failing
// a call (issue 13, defect 6). A host window's part is a memfd whose pages are faulted in by
// alloc (MAP_POPULATE). Past a memory cgroup's limit the cgroup's OOM killer sends SIGKILL in the
// middle of that (fallocate and MADV_POPULATE_WRITE alike: tried on Linux 6.18, cgroup v1; only
// a cgroup with its OOM killer disabled gets ENOMEM from fallocate); past the machine's memory
// the global OOM killer picks a process anywhere on the machine; under strict overcommit the
// pages cannot be faulted in at all. No errno comes back in time, so the limits are read
// beforehand: each rank reads its own, the ranks gather what each would charge where (the
// ranks of a machine share its memory, those of a cgroup its limit), and a window that does not
// fit under some rank's limit is refused on every rank before anything is allocated.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace meshmem::detail {

class Bootstrap;

// One limit on the memory this process allocates, read now.
struct MemoryBound {
  enum class Kind {
    Cgroup,        // a memory cgroup level with a limit: shared by the processes in it
    Machine,       // the machine's memory (or its commit limit): shared by every process on it
    AddressSpace,  // RLIMIT_AS: this process's mappings, the peers' parts it maps included
  };
  Kind kind = Kind::Machine;
  std::string source;        // what the limit is and where it was read
  std::uint64_t limit = 0;
  std::uint64_t in_use = 0;  // counted against it now
  std::string in_use_how;    // how in_use was counted
  std::uint64_t dev = 0, ino = 0;  // Cgroup: its folder, the same for every process in it
};

// Where the bounds are read (tests point these at a tree of their own).
struct SystemFiles {
  std::string proc_self = "/proc/self";  // cgroup, mountinfo, statm
  std::string proc = "/proc";            // meminfo, sys/vm/overcommit_memory, sys/kernel/random/boot_id
  std::string root;                      // put before the mount points that mountinfo names
  bool rlimit_as = true;                 // this process's RLIMIT_AS
};

// Every bound that applies here: each level with a limit of this process's memory cgroup (the
// v1 memory controller's hierarchy, else v2's), from its own cgroup up to the top visible here;
// the machine's available memory, and its commit limit under vm.overcommit_memory = 2;
// RLIMIT_AS. What cannot be read is left out (this is a check before allocating, not the
// allocation: the kernel has the last word).
std::vector<MemoryBound> read_memory_bounds(const SystemFiles& files = {});

// Which memory the ranks that share a limit share: the boot id (one per running kernel, so
// containers of one machine share it, virtual machines do not), or the host name.
std::string machine_id(const SystemFiles& files = {});

// What one rank would charge for a window, gathered from every rank.
struct MemoryCharge {
  static constexpr int kMaxCgroups = 8;
  char machine[40] = {};
  std::uint64_t part = 0;  // bytes of its part (whole pages)
  std::uint32_t cgroups = 0;
  std::uint32_t unused = 0;
  std::uint64_t cgroup[kMaxCgroups][2] = {};  // (dev, ino) of its cgroup bounds
};
MemoryCharge charge_of(const std::vector<MemoryBound>& bounds, std::uint64_t part, const std::string& machine);

// Why a window of `bytes` per rank does not fit under the first of `bounds` (this rank's) that
// it does not fit under, or "" if it fits under all. `all`: every rank's charge (index = rank);
// `mapped_peers`: the node peers whose parts this rank maps (they count in its address space).
std::string why_not_fitting(const std::vector<MemoryBound>& bounds, const std::vector<MemoryCharge>& all, int rank,
                            int mapped_peers, std::uint64_t bytes, const std::string& at);

// Collective: every rank reads its bounds, the charges are gathered, and a window of `bytes`
// per rank that does not fit under some rank's bound raises the same Error(System) on every
// rank, naming the size, the limit, where it comes from and the rank. `at`: "comm.alloc on rank R".
void check_host_window_fits(Bootstrap& boot, std::uint64_t bytes, int mapped_peers, const std::string& at,
                            const std::string& what);

}  // namespace meshmem::detail
