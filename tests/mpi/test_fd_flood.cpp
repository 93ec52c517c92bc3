// Another user floods the job's descriptor-passing sockets with connections while the ranks
// alloc and free windows (descriptors through SCM_RIGHTS sockets, MESHMEM_FD_PASSING=socket).
// The flooder, a child of rank 0 running as `nobody`, finds the job's sockets as any user can,
// in /proc/net/unix (told their inodes, so as to leave other jobs alone), and connects to each
// in a loop. None of its connections may succeed (the
// sockets live in directories only the job's user may enter); before, every one was accepted
// and refused, and the job ran 34-49x slower. The times with and without the flood are printed
// (a benchmark row, not asserted: the machine is shared).
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <meshmem/meshmem.hpp>

#include "mpi_test.hpp"

using namespace meshmem;

namespace {

constexpr uid_t kNobody = 65534;
constexpr int kLoops = 200;

// What the flooder did, written to its parent through a pipe.
struct FloodCount {
  long long sockets_seen = 0;  // distinct sockets of the job found in /proc/net/unix
  long long attempts = 0;
  long long connected = 0;     // must stay 0
  long long refused_eacces = 0;
  int first_errno = 0;         // of a failure other than EACCES
};

// The socket inodes of processes `pids` (read by rank 0, as root, before the flood).
std::set<std::string> socket_inodes(const std::vector<int>& pids) {
  std::set<std::string> inodes;
  for (int pid : pids) {
    const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) continue;
    while (const dirent* e = ::readdir(d)) {
      char target[256] = {};
      const ssize_t n = ::readlink((dir + "/" + e->d_name).c_str(), target, sizeof(target) - 1);
      const std::string t(target, n > 0 ? static_cast<std::size_t>(n) : 0);
      if (t.rfind("socket:[", 0) == 0) inodes.insert(t.substr(8, t.size() - 9));
    }
    ::closedir(d);
  }
  return inodes;
}

// The names of this job's bound sockets in /proc/net/unix (readable by every user): "@..." for
// an abstract one, a path else. Other jobs on the machine are left alone.
std::set<std::string> job_sockets(const std::set<std::string>& inodes) {
  std::set<std::string> names;
  std::ifstream in("/proc/net/unix");
  std::string line;
  std::getline(in, line);  // the header
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string f, inode, path;
    for (int i = 0; i < 6 && fields >> f; ++i) {
    }
    if (fields >> inode >> path && inodes.count(inode) != 0) names.insert(path);
  }
  return names;
}

[[noreturn]] void flood(const std::set<std::string>& inodes, int stop_fd, int result_fd) {
  FloodCount n;
  if (::setresgid(kNobody, kNobody, kNobody) != 0 || ::setresuid(kNobody, kNobody, kNobody) != 0) {
    n.first_errno = errno;
    (void)!::write(result_fd, &n, sizeof n);
    ::_exit(2);
  }
  std::set<std::string> seen;
  for (;;) {
    char byte;
    if (::read(stop_fd, &byte, 1) == 0) break;  // the parent closed it: stop
    for (const std::string& name : job_sockets(inodes)) {
      seen.insert(name);
      sockaddr_un addr{};
      addr.sun_family = AF_UNIX;
      socklen_t len = 0;
      if (name[0] == '@') {  // abstract: the name after a NUL
        std::memcpy(addr.sun_path + 1, name.data() + 1, std::min(name.size() - 1, sizeof(addr.sun_path) - 1));
        len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size());
      } else {
        std::memcpy(addr.sun_path, name.data(), std::min(name.size(), sizeof(addr.sun_path) - 1));
        len = sizeof(addr);
      }
      const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (s < 0) continue;
      ++n.attempts;
      if (::connect(s, reinterpret_cast<const sockaddr*>(&addr), len) == 0)
        ++n.connected;
      else if (errno == EACCES)
        ++n.refused_eacces;
      else if (errno != EAGAIN && errno != ENOENT && errno != ECONNREFUSED && n.first_errno == 0)
        n.first_errno = errno;
      ::close(s);
    }
    // A flood, not a CPU hog: on a machine with few cores a spinning flooder would slow the
    // job by taking its cores, whatever meshmem does.
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  n.sockets_seen = static_cast<long long>(seen.size());
  (void)!::write(result_fd, &n, sizeof n);
  ::_exit(0);
}

double alloc_free_loops(Comm& c) {
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kLoops; ++i) {
    Window w = c.alloc(4096, Memory::Host);
    static_cast<unsigned char*>(w.local())[0] = static_cast<unsigned char>(i);
    w.free();
  }
  MPI_Barrier(MPI_COMM_WORLD);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

class FdFlood : public meshmem::test::MpiTest {};

TEST_F(FdFlood, AnotherUserCannotConnectToTheJobsSockets) {
  int root = ::geteuid() == 0 ? 1 : 0, all_root = 0;
  MPI_Allreduce(&root, &all_root, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all_root) GTEST_SKIP() << "needs root to run a flooder under another uid";
  Comm c(MPI_COMM_WORLD);
  if (c.fd_passing() != FdPassing::Socket) GTEST_SKIP() << "descriptors do not go through sockets here";
  if (c.size() < 2 || c.node_count() != 1) GTEST_SKIP() << "needs node peers on one node";
  const double quiet = alloc_free_loops(c);
  const int mine = static_cast<int>(::getpid());
  std::vector<int> pids(static_cast<std::size_t>(c.size()));
  MPI_Allgather(&mine, 1, MPI_INT, pids.data(), 1, MPI_INT, MPI_COMM_WORLD);
  int stop[2], result[2];
  pid_t child = -1;
  if (c.rank() == 0) {
    const std::set<std::string> inodes = socket_inodes(pids);
    ASSERT_EQ(::pipe(stop), 0);
    ASSERT_EQ(::pipe(result), 0);
    ::fcntl(stop[0], F_SETFL, O_NONBLOCK);
    std::fflush(nullptr);
    child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      ::close(stop[1]);
      ::close(result[0]);
      flood(inodes, stop[0], result[1]);
    }
    ::close(stop[0]);
    ::close(result[1]);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the flood is on
  }
  const double flooded = alloc_free_loops(c);
  if (c.rank() == 0) {
    ::close(stop[1]);
    FloodCount n;
    ASSERT_EQ(::read(result[0], &n, sizeof n), static_cast<ssize_t>(sizeof n));
    ::close(result[0]);
    int status = 0;
    ::waitpid(child, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the flooder failed (errno " << n.first_errno << ")";
    std::printf("[rank 0] flooder (uid %u): %lld socket(s) of the job seen, %lld connect(s) tried, %lld connected, "
                "%lld refused (EACCES); %d alloc/free of 4 KiB: %.3f s without the flood, %.3f s under it (%.2fx)\n",
                kNobody, n.sockets_seen, n.attempts, n.connected, n.refused_eacces, kLoops, quiet, flooded,
                flooded / quiet);
    EXPECT_GT(n.sockets_seen, 0) << "the flooder found none of the job's sockets: the test proves nothing";
    EXPECT_GT(n.attempts, 0);
    EXPECT_EQ(n.connected, 0) << "another user connected to the job's descriptor sockets";
    EXPECT_EQ(n.first_errno, 0) << std::strerror(n.first_errno);
  }
}

// The descriptor sockets' setup: a rank that cannot make its private directory (TMPDIR names
// one that does not exist) fails every rank at once, with its reason, instead of its peers
// waiting a whole timeout for it (before: the others waited for its part of the exchange of
// socket names). In pidfd mode no socket directory is made at all, so the same TMPDIR does
// no harm there.
class FdSetup : public meshmem::test::MpiTest {
 protected:
  // Runs `f` with TMPDIR on rank 1 pointing where no directory exists.
  template <class F>
  void with_bad_tmpdir_on_rank_1(F&& f) {
    const char* old = std::getenv("TMPDIR");
    const std::string saved = old ? old : "";
    if (meshmem::test::world_rank() == 1) ::setenv("TMPDIR", "/nonexistent-meshmem-test-dir", 1);
    f();
    if (meshmem::test::world_rank() == 1) {
      if (old) ::setenv("TMPDIR", saved.c_str(), 1); else ::unsetenv("TMPDIR");
    }
  }
};

TEST_F(FdSetup, ARankThatCannotMakeItsSocketFailsEveryRankAtOnce) {
  if (meshmem::test::world_size() < 2) GTEST_SKIP() << "needs two ranks";
  Options o = Options::from_environment();
  o.set("MESHMEM_FD_PASSING", "socket");
  o.timeout = std::chrono::milliseconds(20000);
  const auto t0 = std::chrono::steady_clock::now();
  std::string message;
  with_bad_tmpdir_on_rank_1([&] {
    try {
      Comm c(MPI_COMM_WORLD, o);
      if (c.node_count() != 1) message = "skip";
    } catch (const Error& e) {
      message = e.what();
    }
  });
  if (message == "skip") GTEST_SKIP() << "the ranks are on several nodes";
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(message.find("rank 1 cannot make its descriptor socket"), std::string::npos) << message;
  EXPECT_NE(message.find("/nonexistent-meshmem-test-dir"), std::string::npos) << message;
  EXPECT_LT(seconds, 10.0) << "the ranks waited for rank 1 instead of failing with it (MESHMEM_TIMEOUT 20 s)";
}

TEST_F(FdSetup, PidfdModeMakesNoSocketDirectory) {
  if (meshmem::test::world_size() < 2) GTEST_SKIP() << "needs two ranks";
  Options o = Options::from_environment();
  o.set("MESHMEM_FD_PASSING", "auto");
  with_bad_tmpdir_on_rank_1([&] {
    try {
      Comm c(MPI_COMM_WORLD, o);
      // auto took pidfd here (else rank 1 could not have made a socket): windows still map.
      EXPECT_EQ(c.fd_passing(), FdPassing::Pidfd);
      Window w = c.alloc(4096, Memory::Host);
      c.barrier();
    } catch (const Error& e) {
      // Where pidfd_getfd is refused, auto falls back to sockets, and rank 1 cannot make one.
      EXPECT_NE(std::string(e.what()).find("cannot make its descriptor socket"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
