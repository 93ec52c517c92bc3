// The memory limits a host window is checked against before it is allocated (issue 13,
// defect 6), read from made-up /proc and cgroup trees: cgroup v1 and v2, a container's view
// of its own cgroup, strict overcommit; and which ranks' parts count against which limit.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <locale>
#include <stdexcept>
#include <string>
#include <vector>

#include "memory_limits.hpp"

using namespace meshmem::detail;

namespace {

constexpr std::uint64_t MiB = std::uint64_t(1) << 20;

class FakeSystem {
 public:
  FakeSystem() {
    char tmpl[] = "/tmp/meshmem-memlimits-XXXXXX";
    const char* made = mkdtemp(tmpl);
    if (made == nullptr) throw std::runtime_error("mkdtemp failed");
    root = made;
    write("proc/meminfo", "MemTotal: 8000000 kB\nMemAvailable: 4000000 kB\nSwapFree: 1000 kB\n"
                          "CommitLimit: 3000000 kB\nCommitted_AS: 2500000 kB\n");
    write("proc/sys/vm/overcommit_memory", "0\n");
    write("proc/sys/kernel/random/boot_id", "0f0e0d0c-aaaa-bbbb-cccc-000000000001\n");
  }
  ~FakeSystem() { (void)std::system(("rm -rf '" + root + "'").c_str()); }

  void write(const std::string& path, const std::string& text) const {
    std::string dir = root;
    std::size_t from = 0;
    for (std::size_t slash; (slash = path.find('/', from)) != std::string::npos; from = slash + 1) {
      dir += "/" + path.substr(from, slash - from);
      ::mkdir(dir.c_str(), 0755);
    }
    std::ofstream(root + "/" + path) << text;
  }
  SystemFiles files() const {
    SystemFiles f;
    f.proc_self = root + "/proc/self";
    f.proc = root + "/proc";
    f.root = root;
    f.rlimit_as = false;
    return f;
  }
  std::string root;
};

const char* kV1Mounts =
    "30 25 0:26 / /sys/fs/cgroup/cpu rw,relatime shared:9 - cgroup cgroup rw,cpu\n"
    "33 25 0:29 / /sys/fs/cgroup/memory rw,relatime shared:12 - cgroup cgroup rw,memory\n"
    "40 25 0:36 / /sys/fs/cgroup/unified rw,relatime shared:19 - cgroup2 cgroup2 rw\n";

std::vector<MemoryBound> of_kind(const std::vector<MemoryBound>& all, MemoryBound::Kind kind) {
  std::vector<MemoryBound> out;
  for (const auto& b : all)
    if (b.kind == kind) out.push_back(b);
  return out;
}

}  // namespace

// cgroup v1: every level with a limit, from the process's own cgroup up; in use = usage less
// the page cache that no process maps.
TEST(MemoryLimits, CgroupV1LevelsWithALimit) {
  FakeSystem sys;
  sys.write("proc/self/mountinfo", kV1Mounts);
  sys.write("proc/self/cgroup", "5:cpu:/\n4:memory:/job/step\n0::/\n");
  sys.write("sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
  sys.write("sys/fs/cgroup/memory/memory.usage_in_bytes", "5000000000\n");
  sys.write("sys/fs/cgroup/memory/job/memory.limit_in_bytes", std::to_string(1024 * MiB) + "\n");
  sys.write("sys/fs/cgroup/memory/job/memory.usage_in_bytes", std::to_string(300 * MiB) + "\n");
  sys.write("sys/fs/cgroup/memory/job/memory.stat",
            "cache 1\ninactive_file 7\ntotal_active_file " + std::to_string(100 * MiB) + "\ntotal_inactive_file " +
                std::to_string(50 * MiB) + "\ntotal_mapped_file " + std::to_string(30 * MiB) + "\n");
  sys.write("sys/fs/cgroup/memory/job/step/memory.limit_in_bytes", std::to_string(512 * MiB) + "\n");
  sys.write("sys/fs/cgroup/memory/job/step/memory.usage_in_bytes", std::to_string(10 * MiB) + "\n");

  const auto bounds = read_memory_bounds(sys.files());
  const auto cgroups = of_kind(bounds, MemoryBound::Kind::Cgroup);
  ASSERT_EQ(cgroups.size(), 2u);
  EXPECT_EQ(cgroups[0].limit, 512 * MiB);
  EXPECT_EQ(cgroups[0].in_use, 10 * MiB);
  EXPECT_NE(cgroups[0].source.find("memory cgroup /job/step (cgroup v1, limit in " + sys.root +
                                   "/sys/fs/cgroup/memory/job/step/memory.limit_in_bytes)"),
            std::string::npos)
      << cgroups[0].source;
  EXPECT_EQ(cgroups[1].limit, 1024 * MiB);
  EXPECT_EQ(cgroups[1].in_use, 180 * MiB);  // 300 - (100 + 50 - 30)
  EXPECT_NE(cgroups[1].source.find("memory cgroup /job "), std::string::npos) << cgroups[1].source;
  EXPECT_NE(cgroups[0].ino, cgroups[1].ino);

  const auto machine = of_kind(bounds, MemoryBound::Kind::Machine);
  ASSERT_EQ(machine.size(), 1u);  // no commit limit outside strict overcommit
  EXPECT_EQ(machine[0].limit, (4000000 + 1000) * std::uint64_t(1024));
  EXPECT_EQ(machine[0].in_use, 0u);
}

// cgroup v2 as a container sees it: the mount shows the hierarchy from the pod's cgroup on;
// "max" is no limit.
TEST(MemoryLimits, CgroupV2SeenFromAContainer) {
  FakeSystem sys;
  sys.write("proc/self/mountinfo", "50 40 0:30 /kube\\040pods/pod1 /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n");
  sys.write("proc/self/cgroup", "0::/kube pods/pod1/ctr\n");
  sys.write("sys/fs/cgroup/memory.max", std::to_string(2048 * MiB) + "\n");
  sys.write("sys/fs/cgroup/memory.current", std::to_string(100 * MiB) + "\n");
  sys.write("sys/fs/cgroup/memory.stat", "anon 5\nactive_file " + std::to_string(10 * MiB) + "\ninactive_file " +
                                             std::to_string(20 * MiB) + "\nfile_mapped " + std::to_string(40 * MiB) + "\n");
  sys.write("sys/fs/cgroup/ctr/memory.max", "max\n");
  sys.write("sys/fs/cgroup/ctr/memory.current", std::to_string(60 * MiB) + "\n");

  const auto cgroups = of_kind(read_memory_bounds(sys.files()), MemoryBound::Kind::Cgroup);
  ASSERT_EQ(cgroups.size(), 1u);
  EXPECT_EQ(cgroups[0].limit, 2048 * MiB);
  EXPECT_EQ(cgroups[0].in_use, 100 * MiB);  // all of its page cache is mapped
  EXPECT_NE(cgroups[0].source.find("memory cgroup /kube pods/pod1 (cgroup v2, limit in " + sys.root +
                                   "/sys/fs/cgroup/memory.max)"),
            std::string::npos)
      << cgroups[0].source;
}

TEST(MemoryLimits, NoMemoryCgroupNoCgroupBound) {
  FakeSystem sys;
  sys.write("proc/self/mountinfo", "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n");
  sys.write("proc/self/cgroup", "");
  const auto bounds = read_memory_bounds(sys.files());
  EXPECT_TRUE(of_kind(bounds, MemoryBound::Kind::Cgroup).empty());
  EXPECT_EQ(of_kind(bounds, MemoryBound::Kind::Machine).size(), 1u);
  EXPECT_EQ(machine_id(sys.files()), "0f0e0d0c-aaaa-bbbb-cccc-000000000001");
}

// vm.overcommit_memory = 2: the commit limit is a bound too.
TEST(MemoryLimits, StrictOvercommitAddsTheCommitLimit) {
  FakeSystem sys;
  sys.write("proc/self/mountinfo", "");
  sys.write("proc/self/cgroup", "");
  sys.write("proc/sys/vm/overcommit_memory", "2\n");
  const auto machine = of_kind(read_memory_bounds(sys.files()), MemoryBound::Kind::Machine);
  ASSERT_EQ(machine.size(), 2u);
  EXPECT_EQ(machine[1].limit, 3000000 * std::uint64_t(1024));
  EXPECT_EQ(machine[1].in_use, 2500000 * std::uint64_t(1024));
  EXPECT_NE(machine[1].source.find("vm.overcommit_memory = 2"), std::string::npos);
}

// A cgroup's limit counts the parts of every rank of the machine in it (not those of another
// machine, even where its cgroup has the same inode); the machine's memory, those of every rank
// on it; the address space, this rank's part and the peers' parts it maps.
// A process whose global C++ locale reads numbers its own way (a host application set it, as a
// Python process on a GPU machine did: every bound read 0 and an 8 KiB host window was refused)
// still reads the limits as the files write them.
TEST(MemoryLimits, ReadTheSameUnderAnotherGlobalLocale) {
  struct ZeroNumbers : std::num_get<char> {
    iter_type do_get(iter_type in, iter_type end, std::ios_base& io, std::ios_base::iostate& err,
                     unsigned long& v) const override {
      std::num_get<char>::do_get(in, end, io, err, v);
      v = 0;
      return end;
    }
  };
  FakeSystem sys;
  sys.write("proc/self/mountinfo", "50 40 0:30 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n");
  sys.write("proc/self/cgroup", "0::/job\n");
  sys.write("sys/fs/cgroup/job/memory.max", std::to_string(2048 * MiB) + "\n");
  sys.write("sys/fs/cgroup/job/memory.current", std::to_string(400 * MiB) + "\n");
  sys.write("sys/fs/cgroup/job/memory.stat", "active_file " + std::to_string(64 * MiB) + "\ninactive_file " +
                                                 std::to_string(36 * MiB) + "\nfile_mapped 0\n");
  const std::locale before = std::locale::global(std::locale(std::locale::classic(), new ZeroNumbers));
  std::vector<MemoryBound> bounds;
  try {
    bounds = read_memory_bounds(sys.files());
  } catch (...) {
    std::locale::global(before);
    throw;
  }
  std::locale::global(before);
  const auto machine = of_kind(bounds, MemoryBound::Kind::Machine);
  ASSERT_EQ(machine.size(), 1u);
  EXPECT_EQ(machine[0].limit, (4000000ull + 1000ull) * 1024);
  const auto cgroups = of_kind(bounds, MemoryBound::Kind::Cgroup);
  ASSERT_EQ(cgroups.size(), 1u);
  EXPECT_EQ(cgroups[0].limit, 2048 * MiB);
  EXPECT_EQ(cgroups[0].in_use, 300 * MiB);  // 400 less the 100 of page cache no process maps
}

TEST(MemoryLimits, WhoseParts) {
  MemoryBound cgroup;
  cgroup.kind = MemoryBound::Kind::Cgroup;
  cgroup.source = "memory cgroup /job";
  cgroup.limit = 1000 * MiB;
  cgroup.in_use = 100 * MiB;
  cgroup.dev = 7;
  cgroup.ino = 42;
  MemoryBound other = cgroup;
  other.ino = 43;
  const auto on = [&](const char* machine, const MemoryBound& b, std::uint64_t part) {
    return charge_of({b}, part, machine);
  };
  for (std::uint64_t part : {400 * MiB, 500 * MiB}) {
    // ranks 0 and 1 share the cgroup on machine A; rank 2 is in another cgroup there; rank 3
    // is on machine B, in a cgroup with the same numbers.
    const std::vector<MemoryCharge> all = {on("A", cgroup, part), on("A", cgroup, part), on("A", other, part),
                                           on("B", cgroup, part)};
    const std::string why = why_not_fitting({cgroup}, all, 1, 0, part - 5, "comm.alloc on rank 1");
    if (part == 400 * MiB) {
      EXPECT_EQ(why, "") << "800 MiB fit in the 900 MiB free";
      continue;
    }
    EXPECT_NE(why.find("comm.alloc on rank 1: a host window of " + std::to_string(part - 5) +
                       " bytes per rank does not fit in memory cgroup /job: the limit of 1048576000 bytes (1000.0 MiB) "
                       "has 943718400 bytes (900.0 MiB) free"),
              std::string::npos)
        << why;
    EXPECT_NE(why.find("needs 1048576000 bytes (1000.0 MiB) there (2 ranks' parts of 524288000 bytes: ranks 0, 1)"),
              std::string::npos)
        << why;
  }

  MemoryBound machine;
  machine.kind = MemoryBound::Kind::Machine;
  machine.source = "this machine's available memory";
  machine.limit = 1000 * MiB;
  const std::vector<MemoryCharge> three = {on("A", cgroup, 300 * MiB), on("A", other, 300 * MiB),
                                           on("A", other, 300 * MiB), on("B", cgroup, 300 * MiB)};
  EXPECT_EQ(why_not_fitting({machine}, three, 0, 0, 300 * MiB, "x"), "");
  const std::vector<MemoryCharge> four = {on("A", cgroup, 300 * MiB), on("A", other, 300 * MiB),
                                          on("A", other, 300 * MiB), on("A", cgroup, 300 * MiB)};
  EXPECT_NE(why_not_fitting({machine}, four, 0, 0, 300 * MiB, "x").find("4 ranks' parts"), std::string::npos);

  MemoryBound as;
  as.kind = MemoryBound::Kind::AddressSpace;
  as.source = "this process's address-space limit (RLIMIT_AS, ulimit -v)";
  as.limit = 1000 * MiB;
  as.in_use = 200 * MiB;
  const std::vector<MemoryCharge> one = {on("A", cgroup, 300 * MiB)};
  EXPECT_EQ(why_not_fitting({as}, one, 0, 1, 300 * MiB, "x"), "");
  const std::string why = why_not_fitting({as}, one, 0, 2, 300 * MiB, "x");
  EXPECT_NE(why.find("RLIMIT_AS"), std::string::npos) << why;
  EXPECT_NE(why.find("this rank's part of 314572800 bytes and the parts of the 2 node peers it maps"), std::string::npos)
      << why;
}
