// Unit tests of the ipc/ layer: UniqueFd, SharedMemory, pidfd fetching and FdChannel.
// No MPI. Tests that need a second process fork one; children report through their exit
// status (never through gtest) and always leave with _exit().
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "meshmem/error.hpp"
#include "meshmem/ipc/fd_channel.hpp"
#include "meshmem/ipc/pidfd.hpp"
#include "meshmem/ipc/shared_memory.hpp"
#include "meshmem/ipc/unique_fd.hpp"

namespace {

using meshmem::Error;
using meshmem::ErrorCode;
using meshmem::ipc::FdListener;
using meshmem::ipc::FdMessage;
using meshmem::ipc::MappedRegion;
using meshmem::ipc::SharedMemory;
using meshmem::ipc::UniqueFd;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

bool is_closed(int fd) { return ::fcntl(fd, F_GETFD) == -1 && errno == EBADF; }

bool is_cloexec(int fd) {
  const int flags = ::fcntl(fd, F_GETFD);
  return flags >= 0 && (flags & FD_CLOEXEC) != 0;
}

struct Pipe {
  UniqueFd read;
  UniqueFd write;
};

Pipe make_pipe(int flags = O_CLOEXEC) {
  int fds[2];
  if (::pipe2(fds, flags) != 0) throw std::runtime_error(std::string("pipe2: ") + strerror(errno));
  return Pipe{UniqueFd(fds[0]), UniqueFd(fds[1])};
}

// True when every write end of the pipe is closed: a non-blocking read sees EOF, whereas
// any remaining writer (say, a leaked copy in this process) makes it fail with EAGAIN.
bool writers_gone(int read_fd) {
  const int flags = ::fcntl(read_fd, F_GETFL);
  if (flags < 0 || ::fcntl(read_fd, F_SETFL, flags | O_NONBLOCK) != 0) return false;
  char c;
  const ssize_t r = ::read(read_fd, &c, 1);
  return r == 0;
}

int count_open_fds() {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int n = 0;
  while (const dirent* e = ::readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(dir);
  return n;  // includes the directory's own descriptor, the same in every call
}

// A socket path in a directory only this user may enter, made once for the test process.
std::string socket_name() {
  static meshmem::ipc::PrivateDir dir;
  return dir.path() + "/s-" + meshmem::ipc::random_token().substr(0, 12);
}

// A forked child running `body`; its return value is the exit status. If the test leaves
// early (a failed ASSERT), the destructor kills and reaps the child.
class Child {
 public:
  explicit Child(const std::function<int()>& body) {
    std::fflush(nullptr);  // do not let the child flush the parent's buffered output again
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error(std::string("fork: ") + strerror(errno));
    if (pid_ == 0) {
      int code = 120;
      try {
        code = body();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "child %d: exception: %s\n", static_cast<int>(::getpid()), e.what());
        code = 121;
      } catch (...) {
        code = 122;
      }
      std::fflush(nullptr);
      ::_exit(code);  // never run gtest's (the parent's) atexit handlers or return into it
    }
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      wait();
    }
  }

  pid_t pid() const { return pid_; }

  // Exit status, or 128 + signal number; -1 if waitpid fails.
  int wait() {
    int status = 0;
    pid_t r;
    do {
      r = ::waitpid(pid_, &status, 0);
    } while (r < 0 && errno == EINTR);
    pid_ = -1;
    if (r < 0) return -1;
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    return -1;
  }

 private:
  pid_t pid_ = -1;
};

// For children: report why they fail on stderr, return the code.
int child_fail(int code, const std::string& why) {
  std::fprintf(stderr, "child %d: %s\n", static_cast<int>(::getpid()), why.c_str());
  return code;
}

std::uint8_t pattern_byte(std::size_t i, unsigned seed) {
  return static_cast<std::uint8_t>((i * 131 + seed * 7 + (i >> 9)) & 0xff);
}

void fill_pattern(void* p, std::size_t n, unsigned seed) {
  auto* b = static_cast<std::uint8_t*>(p);
  for (std::size_t i = 0; i < n; ++i) b[i] = pattern_byte(i, seed);
}

// Index of the first byte that differs from the pattern, or n.
std::size_t check_pattern(const void* p, std::size_t n, unsigned seed) {
  const auto* b = static_cast<const std::uint8_t*>(p);
  for (std::size_t i = 0; i < n; ++i) {
    if (b[i] != pattern_byte(i, seed)) return i;
  }
  return n;
}

bool write_all(int fd, const void* data, std::size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t r = ::write(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

bool read_all(int fd, void* data, std::size_t n) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

const auto accept_all = [](const FdMessage&) { return true; };

// ---------------------------------------------------------------------------------------
// UniqueFd

TEST(UniqueFd, ClosesOnDestruction) {
  Pipe p = make_pipe();
  const int r = p.read.get();
  const int w = p.write.get();
  { Pipe gone = std::move(p); }
  EXPECT_TRUE(is_closed(r));
  EXPECT_TRUE(is_closed(w));
}

TEST(UniqueFd, ResetClosesTheOldDescriptorAndTakesTheNew) {
  Pipe p = make_pipe();
  const int first = p.read.release();
  const int second = p.write.release();
  UniqueFd fd(first);
  EXPECT_TRUE(static_cast<bool>(fd));
  fd.reset(second);
  EXPECT_TRUE(is_closed(first));
  EXPECT_FALSE(is_closed(second));
  EXPECT_EQ(fd.get(), second);
  fd.reset();
  EXPECT_TRUE(is_closed(second));
  EXPECT_FALSE(static_cast<bool>(fd));
  EXPECT_EQ(fd.get(), -1);
  fd.reset();  // resetting an empty one is harmless
}

TEST(UniqueFd, ResetToTheSameDescriptorKeepsItOpen) {
  Pipe p = make_pipe();
  const int r = p.read.get();
  p.read.reset(r);
  EXPECT_FALSE(is_closed(r));
}

TEST(UniqueFd, MoveTransfersOwnership) {
  Pipe p = make_pipe();
  const int r = p.read.get();
  const int w = p.write.get();

  UniqueFd a(std::move(p.read));
  EXPECT_EQ(p.read.get(), -1);  // NOLINT(bugprone-use-after-move): checking the moved-from state
  EXPECT_EQ(a.get(), r);
  EXPECT_FALSE(is_closed(r));

  UniqueFd b(p.write.release());
  b = std::move(a);  // closes b's old descriptor (w), takes r
  EXPECT_TRUE(is_closed(w));
  EXPECT_FALSE(is_closed(r));
  EXPECT_EQ(b.get(), r);
  EXPECT_EQ(a.get(), -1);  // NOLINT(bugprone-use-after-move)

  UniqueFd& same = b;
  b = std::move(same);  // self-move keeps the descriptor
  EXPECT_FALSE(is_closed(r));

  const int released = b.release();
  EXPECT_EQ(released, r);
  { UniqueFd owner(released); }
  EXPECT_TRUE(is_closed(r));
}

TEST(UniqueFd, ResetKeepsErrno) {
  Pipe p = make_pipe();
  errno = ENOSPC;
  p.read.reset();
  EXPECT_EQ(errno, ENOSPC);
}

// ---------------------------------------------------------------------------------------
// SharedMemory

TEST(SharedMemory, RoundToPages) {
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  EXPECT_EQ(meshmem::ipc::round_to_pages(0), page);
  EXPECT_EQ(meshmem::ipc::round_to_pages(1), page);
  EXPECT_EQ(meshmem::ipc::round_to_pages(page), page);
  EXPECT_EQ(meshmem::ipc::round_to_pages(page + 1), 2 * page);
  const std::size_t max = std::numeric_limits<std::size_t>::max();
  EXPECT_EQ(meshmem::ipc::round_to_pages(max - page + 1), max - page + 1);  // page aligned
  try {
    meshmem::ipc::round_to_pages(max);
    FAIL() << "no error for an overflowing size";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
  }
}

TEST(SharedMemory, CreateGivesZeroedPagesAndACloexecFd) {
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  SharedMemory shm = SharedMemory::create(3 * page + 5, "meshmem-test");
  EXPECT_EQ(shm.size(), 4 * page);
  ASSERT_NE(shm.data(), nullptr);
  EXPECT_GE(shm.fd(), 0);
  EXPECT_TRUE(is_cloexec(shm.fd()));
  const auto* b = static_cast<const std::uint8_t*>(shm.data());
  EXPECT_TRUE(std::all_of(b, b + shm.size(), [](std::uint8_t x) { return x == 0; }));

  // Moving keeps the memory; the moved-from object holds nothing.
  const int fd = shm.fd();
  void* data = shm.data();
  SharedMemory moved = std::move(shm);
  EXPECT_EQ(moved.fd(), fd);
  EXPECT_EQ(moved.data(), data);
  EXPECT_EQ(shm.data(), nullptr);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(shm.fd(), -1);         // NOLINT(bugprone-use-after-move)
}

TEST(SharedMemory, SecondMappingSeesTheSameMemory) {
  SharedMemory shm = SharedMemory::create(10000, nullptr);
  MappedRegion view = meshmem::ipc::map_shared(shm.fd(), 10000);
  ASSERT_EQ(view.size(), shm.size());
  ASSERT_NE(view.data(), shm.data());
  fill_pattern(shm.data(), shm.size(), 1);
  EXPECT_EQ(check_pattern(view.data(), view.size(), 1), view.size());

  MappedRegion moved;
  moved = std::move(view);
  EXPECT_EQ(view.data(), nullptr);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(check_pattern(moved.data(), moved.size(), 1), moved.size());
}

TEST(SharedMemory, ChildMapsTheInheritedMemfd) {
  const std::size_t bytes = (1u << 20) + 123;
  SharedMemory shm = SharedMemory::create(bytes, "meshmem-test-fork");
  std::vector<std::uint8_t> expected(shm.size());
  std::mt19937_64 rng{std::random_device{}()};
  for (std::size_t i = 0; i < expected.size(); i += 8) {
    const std::uint64_t v = rng();
    std::memcpy(expected.data() + i, &v, std::min<std::size_t>(8, expected.size() - i));
  }
  std::memcpy(shm.data(), expected.data(), expected.size());

  const int fd = shm.fd();
  Child child([&]() {
    // fork keeps the descriptor (MFD_CLOEXEC matters only for exec); map it afresh by number.
    MappedRegion region = meshmem::ipc::map_shared(fd, bytes);
    if (region.size() != expected.size()) return child_fail(2, "size differs");
    if (std::memcmp(region.data(), expected.data(), expected.size()) != 0) {
      return child_fail(3, "content differs");
    }
    auto* b = static_cast<std::uint8_t*>(region.data());
    for (std::size_t i = 0; i < region.size(); ++i) b[i] = static_cast<std::uint8_t>(~expected[i]);
    return 0;
  });
  ASSERT_EQ(child.wait(), 0);
  const auto* b = static_cast<const std::uint8_t*>(shm.data());
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < shm.size(); ++i) {
    if (b[i] != static_cast<std::uint8_t>(~expected[i])) ++wrong;
  }
  EXPECT_EQ(wrong, 0u);
}

TEST(SharedMemory, MapSharedRejectsAFileTooSmall) {
  SharedMemory shm = SharedMemory::create(4096, "meshmem-test-small");
  const std::size_t want = shm.size() + 1;
  try {
    meshmem::ipc::map_shared(shm.fd(), want);
    FAIL() << "mapped more than the file holds";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    const std::string what = e.what();
    EXPECT_NE(what.find(std::to_string(shm.size())), std::string::npos) << what;
    EXPECT_NE(what.find(std::to_string(meshmem::ipc::round_to_pages(want))), std::string::npos)
        << what;
  }
  try {
    meshmem::ipc::map_shared(shm.fd(), std::numeric_limits<std::size_t>::max());
    FAIL() << "no error for an overflowing size";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
  }
}

TEST(SharedMemory, MapSharedOfABadFdIsASystemError) {
  Pipe p = make_pipe();
  const int fd = p.read.get();
  p.read.reset();
  try {
    meshmem::ipc::map_shared(fd, 4096);
    FAIL() << "mapped a closed descriptor";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::System);
    EXPECT_NE(std::string(e.what()).find(strerror(EBADF)), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------
// pidfd

TEST(Pidfd, FetchesADescriptorOutOfAChild) {
  Pipe to_parent = make_pipe();
  Pipe to_child = make_pipe();
  constexpr std::size_t kBytes = 3 * 4096;
  Child child([&]() {
    to_parent.read.reset();
    to_child.write.reset();
    SharedMemory shm = SharedMemory::create(kBytes, "meshmem-test-pidfd");
    fill_pattern(shm.data(), shm.size(), 42);
    const int fd = shm.fd();
    if (!write_all(to_parent.write.get(), &fd, sizeof(fd))) return child_fail(2, "write");
    char done;
    // Stay alive, holding the memfd, until the parent has fetched it (or went away).
    (void)read_all(to_child.read.get(), &done, 1);
    return 0;
  });
  to_parent.write.reset();
  to_child.read.reset();
  int remote_fd = -1;
  ASSERT_TRUE(read_all(to_parent.read.get(), &remote_fd, sizeof(remote_fd)));

  int err = 0;
  UniqueFd fd = meshmem::ipc::try_fetch_fd(child.pid(), remote_fd, &err);
  if (!fd && (err == EPERM || err == ENOSYS)) {
    GTEST_SKIP() << "pidfd_getfd is not allowed here: " << strerror(err);
  }
  ASSERT_TRUE(fd) << strerror(err);
  EXPECT_EQ(err, 0);
  EXPECT_TRUE(is_cloexec(fd.get()));
  {
    MappedRegion region = meshmem::ipc::map_shared(fd.get(), kBytes);
    EXPECT_EQ(check_pattern(region.data(), region.size(), 42), region.size());
  }

  // The throwing form gives the same file: writes through one show in the other.
  UniqueFd again = meshmem::ipc::fetch_fd(child.pid(), remote_fd);
  ASSERT_TRUE(again);
  EXPECT_TRUE(is_cloexec(again.get()));
  MappedRegion a = meshmem::ipc::map_shared(fd.get(), kBytes);
  MappedRegion b = meshmem::ipc::map_shared(again.get(), kBytes);
  static_cast<std::uint8_t*>(a.data())[100] = 0x5a;
  EXPECT_EQ(static_cast<const std::uint8_t*>(b.data())[100], 0x5a);

  ASSERT_TRUE(write_all(to_child.write.get(), "x", 1));
  EXPECT_EQ(child.wait(), 0);
}

TEST(Pidfd, BogusFdGivesEbadfAndAnEmptyFd) {
  const int bogus = 1 << 20;  // above any descriptor this test process has open
  int err = 0;
  UniqueFd fd = meshmem::ipc::try_fetch_fd(::getpid(), bogus, &err);
  if (err == ENOSYS) GTEST_SKIP() << "no pidfd_getfd: " << strerror(err);
  EXPECT_FALSE(fd);
  EXPECT_EQ(err, EBADF) << strerror(err);

  try {
    meshmem::ipc::fetch_fd(::getpid(), bogus);
    FAIL() << "fetched a descriptor that does not exist";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::System);
    const std::string what = e.what();
    EXPECT_NE(what.find("pidfd_getfd(pid " + std::to_string(::getpid()) + ", fd " +
                        std::to_string(bogus) + ")"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find(strerror(EBADF)), std::string::npos) << what;
  }
}

// A watch made while the process lives says it ended once it is killed, before anyone reaps
// it (a zombie has ended): what the staged transport relies on to take back the slots that a
// dead reader held.
TEST(ProcessWatch, SeesAKilledChildEndBeforeItIsReaped) {
  Pipe to_child = make_pipe();
  Child child([&]() {
    to_child.write.reset();
    char c;
    (void)read_all(to_child.read.get(), &c, 1);  // until the parent kills it
    return 0;
  });
  to_child.read.reset();
  meshmem::ipc::ProcessWatch watch(child.pid());
  if (!watch.watching()) GTEST_SKIP() << "pidfd_open is not available here: " << strerror(errno);
  EXPECT_EQ(watch.pid(), child.pid());
  EXPECT_FALSE(watch.ended()) << "a child blocked in read() was said to have ended";
  ASSERT_EQ(::kill(child.pid(), SIGKILL), 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!watch.ended() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_TRUE(watch.ended()) << "a killed child was not seen to end within 10 s";
  siginfo_t info{};
  ASSERT_EQ(::waitid(P_PID, static_cast<id_t>(child.pid()), &info, WEXITED | WNOHANG | WNOWAIT), 0);
  EXPECT_EQ(info.si_pid, child.pid()) << "the child was not a zombie yet, though the watch said it ended";
  (void)child.wait();
  EXPECT_TRUE(watch.ended()) << "reaped, the child no longer counted as ended";
}

TEST(ProcessWatch, ItselfHasNotEndedAndNoProcessIsNotWatched) {
  meshmem::ipc::ProcessWatch self(::getpid());
  if (!self.watching()) GTEST_SKIP() << "pidfd_open is not available here: " << strerror(errno);
  EXPECT_FALSE(self.ended());
  meshmem::ipc::ProcessWatch none(-1);
  EXPECT_FALSE(none.watching());
  EXPECT_FALSE(none.ended());
  meshmem::ipc::ProcessWatch moved = std::move(self);
  EXPECT_TRUE(moved.watching());
  EXPECT_FALSE(moved.ended());
}

TEST(Pidfd, FetchesFromItself) {
  // ptrace access to one's own thread group is always granted, so this works wherever
  // pidfd_getfd exists.
  Pipe p = make_pipe();
  int err = 0;
  UniqueFd copy = meshmem::ipc::try_fetch_fd(::getpid(), p.write.get(), &err);
  if (err == ENOSYS) GTEST_SKIP() << "no pidfd_getfd: " << strerror(err);
  ASSERT_TRUE(copy) << strerror(err);
  EXPECT_NE(copy.get(), p.write.get());
  EXPECT_TRUE(is_cloexec(copy.get()));
  ASSERT_TRUE(write_all(copy.get(), "y", 1));
  char c = 0;
  ASSERT_TRUE(read_all(p.read.get(), &c, 1));
  EXPECT_EQ(c, 'y');
}

TEST(Pidfd, ExitedProcessGivesEsrch) {
  Child child([]() { return 0; });
  const pid_t pid = child.pid();
  ASSERT_EQ(child.wait(), 0);  // reaped: the pid names no process now
  int err = 0;
  UniqueFd fd = meshmem::ipc::try_fetch_fd(pid, 0, &err);
  if (err == ENOSYS) GTEST_SKIP() << "no pidfd_open: " << strerror(err);  // e.g. under valgrind
  EXPECT_FALSE(fd);
  EXPECT_EQ(err, ESRCH) << strerror(err);
  try {
    meshmem::ipc::fetch_fd(pid, 0);
    FAIL() << "fetched from a process that is gone";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::System);
    EXPECT_NE(std::string(e.what()).find("pidfd_open(pid " + std::to_string(pid)),
              std::string::npos)
        << e.what();
  }
}

// ---------------------------------------------------------------------------------------
// FdChannel

sockaddr_un address_of(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), std::min(path.size(), sizeof(addr.sun_path) - 1));
  return addr;
}

// Connects a raw client socket to a socket path, to send what send_fds never would.
UniqueFd connect_raw(const std::string& name) {
  UniqueFd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!s) throw std::runtime_error(std::string("socket: ") + strerror(errno));
  const sockaddr_un addr = address_of(name);
  if (::connect(s.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    throw std::runtime_error(std::string("connect: ") + strerror(errno));
  }
  return s;
}

// Sends raw bytes with `fds` attached (any number, up to the kernel's limit of 253).
void send_raw(int sock, const void* data, std::size_t n, const std::vector<int>& fds) {
  iovec iov{const_cast<void*>(data), n};
  std::vector<unsigned char> control(CMSG_SPACE(sizeof(int) * fds.size()));
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  if (!fds.empty()) {
    mh.msg_control = control.data();
    mh.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  if (::sendmsg(sock, &mh, MSG_NOSIGNAL) != static_cast<ssize_t>(n)) {
    throw std::runtime_error(std::string("sendmsg: ") + strerror(errno));
  }
}

std::vector<std::uint8_t> wire_message(std::uint32_t length, std::size_t actual_bytes) {
  std::vector<std::uint8_t> wire(sizeof(length) + actual_bytes, 0xab);
  std::memcpy(wire.data(), &length, sizeof(length));
  return wire;
}

TEST(FdChannel, RandomTokenIs32LowercaseHexDigits) {
  const std::string a = meshmem::ipc::random_token();
  const std::string b = meshmem::ipc::random_token();
  ASSERT_EQ(a.size(), 32u);
  EXPECT_TRUE(std::all_of(a.begin(), a.end(), [](char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
  })) << a;
  EXPECT_NE(a, b);
}

TEST(FdChannel, ListenerNameInUseIsASystemError) {
  const std::string name = socket_name();
  FdListener first(name);
  EXPECT_EQ(first.name(), name);
  EXPECT_TRUE(is_cloexec(first.fd()));
  try {
    FdListener second(name);
    FAIL() << "two listeners on one name";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::System);
    const std::string what = e.what();
    EXPECT_NE(what.find(name), std::string::npos) << what;
    EXPECT_NE(what.find(strerror(EADDRINUSE)), std::string::npos) << what;
  }
}

TEST(FdChannel, SendAndReceiveInOneProcess) {
  // A connect completes once queued in the backlog, so one process can send to itself.
  const std::string name = socket_name();
  FdListener listener(name);
  std::vector<Pipe> pipes;
  std::vector<int> fds;
  for (std::size_t i = 0; i < meshmem::ipc::kMaxFdsPerMessage; ++i) {
    pipes.push_back(make_pipe());
    fds.push_back(pipes.back().write.get());
  }
  std::vector<std::uint8_t> payload(meshmem::ipc::kMaxFdPayload);
  for (std::size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<std::uint8_t>(i * 7);
  meshmem::ipc::send_fds(name, payload.data(), payload.size(), fds.data(), fds.size(), 1000ms);

  std::vector<std::string> refused;
  auto msg = listener.receive(1000ms, accept_all, &refused);
  ASSERT_TRUE(msg);
  EXPECT_TRUE(refused.empty());
  EXPECT_EQ(msg->sender.pid, ::getpid());
  EXPECT_EQ(msg->sender.uid, ::geteuid());
  EXPECT_EQ(msg->sender.gid, ::getegid());
  EXPECT_EQ(msg->payload, payload);
  ASSERT_EQ(msg->fds.size(), fds.size());
  for (std::size_t i = 0; i < fds.size(); ++i) {
    EXPECT_TRUE(is_cloexec(msg->fds[i].get()));
    // Each received descriptor is the write end of pipe i, in order.
    const char c = static_cast<char>('a' + i);
    ASSERT_TRUE(write_all(msg->fds[i].get(), &c, 1));
    char got = 0;
    ASSERT_TRUE(read_all(pipes[i].read.get(), &got, 1));
    EXPECT_EQ(got, c);
  }

  // And the smallest message: no payload, no descriptors; an empty check accepts all.
  meshmem::ipc::send_fds(name, nullptr, 0, nullptr, 0, 1000ms);
  msg = listener.receive(1000ms, nullptr);
  ASSERT_TRUE(msg);
  EXPECT_TRUE(msg->payload.empty());
  EXPECT_TRUE(msg->fds.empty());
}

TEST(FdChannel, ChildSendsAMemfdToTheParent) {
  const std::string name = socket_name();
  constexpr std::size_t kBytes = 5 * 4096 + 17;
  const std::string text = "memfd from the child";
  Child child([&]() {
    SharedMemory shm = SharedMemory::create(kBytes, "meshmem-test-send");
    fill_pattern(shm.data(), shm.size(), 7);
    const int fd = shm.fd();
    // The parent starts listening only after a while: send_fds must retry until then.
    meshmem::ipc::send_fds(name, text.data(), text.size(), &fd, 1, 10000ms);
    return 0;
  });
  std::this_thread::sleep_for(50ms);
  FdListener listener(name);
  std::vector<std::string> refused;
  auto msg = listener.receive(10000ms, accept_all, &refused);
  ASSERT_TRUE(msg);
  EXPECT_TRUE(refused.empty());
  EXPECT_EQ(msg->sender.pid, child.pid());
  EXPECT_EQ(msg->sender.uid, ::geteuid());
  EXPECT_EQ(std::string(msg->payload.begin(), msg->payload.end()), text);
  ASSERT_EQ(msg->fds.size(), 1u);
  EXPECT_TRUE(is_cloexec(msg->fds[0].get()));
  MappedRegion region = meshmem::ipc::map_shared(msg->fds[0].get(), kBytes);
  EXPECT_EQ(check_pattern(region.data(), region.size(), 7), region.size());
  EXPECT_EQ(child.wait(), 0);
}

TEST(FdChannel, ParentSendsMemfdsToTheChild) {
  const std::string name = socket_name();
  constexpr std::size_t kBytes = 2 * 4096;
  const pid_t parent = ::getpid();
  Child child([&]() {
    FdListener listener(name);
    std::vector<std::string> refused;
    auto msg = listener.receive(
        10000ms, [&](const FdMessage& m) { return m.sender.pid == parent; }, &refused);
    if (!msg) return child_fail(2, "no message");
    if (!refused.empty()) return child_fail(3, "refused: " + refused.front());
    if (msg->sender.uid != ::geteuid()) return child_fail(4, "uid");
    if (msg->payload != std::vector<std::uint8_t>{1, 2, 3}) return child_fail(5, "payload");
    if (msg->fds.size() != 2) return child_fail(6, "descriptor count");
    for (unsigned i = 0; i < 2; ++i) {
      if (!is_cloexec(msg->fds[i].get())) return child_fail(7, "not close-on-exec");
      MappedRegion region = meshmem::ipc::map_shared(msg->fds[i].get(), kBytes);
      if (check_pattern(region.data(), region.size(), 100 + i) != region.size()) {
        return child_fail(8, "content of memfd " + std::to_string(i));
      }
    }
    return 0;
  });
  SharedMemory a = SharedMemory::create(kBytes, "meshmem-test-a");
  SharedMemory b = SharedMemory::create(kBytes, "meshmem-test-b");
  fill_pattern(a.data(), a.size(), 100);
  fill_pattern(b.data(), b.size(), 101);
  const int fds[2] = {a.fd(), b.fd()};
  const std::uint8_t payload[3] = {1, 2, 3};
  // The child may not be listening yet: send_fds retries.
  meshmem::ipc::send_fds(name, payload, sizeof(payload), fds, 2, 10000ms);
  EXPECT_EQ(child.wait(), 0);
}

TEST(FdChannel, RefusesAProcessThatIsNotTheExpectedPeer) {
  const std::string name = socket_name();
  FdListener listener(name);
  // The intruder sends the write end of this pipe. Once the intruder has exited and we
  // have dropped our own copy, the read end sees EOF only if the receiver closed the copy
  // it was handed; a leaked descriptor keeps the pipe open.
  Pipe probe = make_pipe();
  Child intruder([&]() {
    const int fd = probe.write.get();
    meshmem::ipc::send_fds(name, "evil", 4, &fd, 1, 5000ms);
    return 0;
  });
  const pid_t intruder_pid = intruder.pid();
  probe.write.reset();
  ASSERT_EQ(intruder.wait(), 0);  // its message is queued before the expected one

  Child expected([&]() {
    meshmem::ipc::send_fds(name, "good", 4, nullptr, 0, 5000ms);
    return 0;
  });
  const pid_t expected_pid = expected.pid();

  const int fds_before = count_open_fds();
  std::vector<pid_t> checked;
  std::vector<std::string> refused;
  auto msg = listener.receive(
      10000ms,
      [&](const FdMessage& m) {
        checked.push_back(m.sender.pid);
        return m.sender.pid == expected_pid;
      },
      &refused);
  ASSERT_TRUE(msg);
  EXPECT_EQ(msg->sender.pid, expected_pid);
  EXPECT_EQ(std::string(msg->payload.begin(), msg->payload.end()), "good");
  EXPECT_TRUE(msg->fds.empty());
  EXPECT_EQ(count_open_fds(), fds_before);
  EXPECT_TRUE(writers_gone(probe.read.get())) << "the refused descriptor was not closed";
  ASSERT_EQ(checked.size(), 2u);
  EXPECT_EQ(checked[0], intruder_pid);
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_NE(refused[0].find("pid " + std::to_string(intruder_pid) + " "), std::string::npos)
      << refused[0];
  EXPECT_EQ(expected.wait(), 0);
}

// The uid check behind the directory: a directory made accessible after the listener began
// (the listener refuses one that is at the start) lets another uid connect, and it is refused.
TEST(FdChannel, RefusesAnotherUidWithoutReadingIt) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a sender under another uid";
  meshmem::ipc::PrivateDir dir;
  const std::string name = dir.path() + "/opened";
  FdListener listener(name);
  ASSERT_EQ(::chmod(dir.path().c_str(), 0711), 0);
  ASSERT_EQ(::chmod(name.c_str(), 0777), 0);
  Pipe probe = make_pipe();
  constexpr uid_t kNobody = 65534;
  Child other([&]() {
    if (::setresgid(kNobody, kNobody, kNobody) != 0 || ::setresuid(kNobody, kNobody, kNobody) != 0) {
      return child_fail(2, std::string("setresuid: ") + strerror(errno));
    }
    const int fd = probe.write.get();
    meshmem::ipc::send_fds(name, "other", 5, &fd, 1, 5000ms);
    return 0;
  });
  const pid_t other_pid = other.pid();
  probe.write.reset();
  ASSERT_EQ(other.wait(), 0);
  // Then a message from ourselves, which is accepted.
  meshmem::ipc::send_fds(name, "self", 4, nullptr, 0, 1000ms);

  int checks = 0;
  std::vector<std::string> refused;
  auto msg = listener.receive(
      5000ms,
      [&](const FdMessage&) {
        ++checks;
        return true;
      },
      &refused);
  ASSERT_TRUE(msg);
  EXPECT_EQ(msg->sender.pid, ::getpid());
  EXPECT_EQ(checks, 1);  // the other uid never reached the caller's check
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_NE(refused[0].find("pid " + std::to_string(other_pid) + " uid 65534"), std::string::npos)
      << refused[0];
  EXPECT_NE(refused[0].find("uid differs"), std::string::npos) << refused[0];
  EXPECT_TRUE(writers_gone(probe.read.get())) << "the refused descriptor was not closed";
}

TEST(FdChannel, RefusesMalformedMessagesAndClosesTheirFds) {
  const std::string name = socket_name();
  FdListener listener(name);
  Pipe probe = make_pipe();
  const int w = probe.write.get();
  {
    // 1: a length over kMaxFdPayload.
    UniqueFd s = connect_raw(name);
    const auto wire = wire_message(meshmem::ipc::kMaxFdPayload + 1, 8);
    send_raw(s.get(), wire.data(), wire.size(), {w});
  }
  {
    // 2: a payload cut short by the sender closing.
    UniqueFd s = connect_raw(name);
    const auto wire = wire_message(10, 3);
    send_raw(s.get(), wire.data(), wire.size(), {w});
  }
  {
    // 3: more descriptors than the receiver has room for: MSG_CTRUNC.
    UniqueFd s = connect_raw(name);
    const auto wire = wire_message(2, 2);
    send_raw(s.get(), wire.data(), wire.size(),
             std::vector<int>(meshmem::ipc::kMaxFdsPerMessage + 4, w));
  }
  {
    // 4: a header cut short.
    UniqueFd s = connect_raw(name);
    send_raw(s.get(), "ab", 2, {w});
  }
  probe.write.reset();
  meshmem::ipc::send_fds(name, "fine", 4, nullptr, 0, 1000ms);

  const int fds_before = count_open_fds();
  std::vector<std::string> refused;
  auto msg = listener.receive(5000ms, accept_all, &refused);
  ASSERT_TRUE(msg);
  EXPECT_EQ(std::string(msg->payload.begin(), msg->payload.end()), "fine");
  EXPECT_EQ(count_open_fds(), fds_before);
  EXPECT_TRUE(writers_gone(probe.read.get())) << "a refused descriptor was not closed";
  ASSERT_EQ(refused.size(), 4u);
  EXPECT_NE(refused[0].find("payload length 257 exceeds 256"), std::string::npos) << refused[0];
  EXPECT_NE(refused[1].find("truncated"), std::string::npos) << refused[1];
  EXPECT_NE(refused[2].find("MSG_CTRUNC"), std::string::npos) << refused[2];
  EXPECT_NE(refused[3].find("truncated"), std::string::npos) << refused[3];
  for (const std::string& r : refused) {
    EXPECT_NE(r.find("pid " + std::to_string(::getpid())), std::string::npos) << r;
  }
}

TEST(FdChannel, StalledSenderIsRefusedAtTheTimeout) {
  const std::string name = socket_name();
  FdListener listener(name);
  UniqueFd s = connect_raw(name);
  const auto wire = wire_message(100, 10);  // and then nothing more, connection kept open
  send_raw(s.get(), wire.data(), wire.size(), {});
  std::vector<std::string> refused;
  auto start = Clock::now();
  auto msg = listener.receive(300ms, accept_all, &refused);
  auto elapsed = Clock::now() - start;
  EXPECT_FALSE(msg);
  EXPECT_GE(elapsed, 300ms);
  EXPECT_LT(elapsed, 3000ms);
  EXPECT_TRUE(refused.empty()) << "a partly read message is kept for the next call";
  // Refused once it has stalled for 5 s, counted from its connection.
  msg = listener.receive(6000ms, accept_all, &refused);
  elapsed = Clock::now() - start;
  EXPECT_FALSE(msg);
  EXPECT_GE(elapsed, 4900ms);
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_NE(refused[0].find("stalled"), std::string::npos) << refused[0];
}

// A connection of the same user held open without a word (or one that stalls) holds no
// other sender up: they are read side by side (before, each such connection stalled a
// receive by 5 s, and a few of them made a Comm's alloc time out).
TEST(FdChannel, AnIdleConnectionDoesNotHoldUpAnotherSender) {
  const std::string name = socket_name();
  FdListener listener(name);
  std::vector<UniqueFd> idle;
  for (int i = 0; i < 3; ++i) idle.push_back(connect_raw(name));
  meshmem::ipc::send_fds(name, "real", 4, nullptr, 0, 1000ms);
  std::vector<std::string> refused;
  const auto start = Clock::now();
  auto msg = listener.receive(8000ms, accept_all, &refused);
  ASSERT_TRUE(msg);
  EXPECT_EQ(std::string(msg->payload.begin(), msg->payload.end()), "real");
  EXPECT_LT(Clock::now() - start, 1000ms) << "an idle connection held the receive up";
  EXPECT_TRUE(refused.empty());  // the idle ones are still given their 5 s
}

// Another user floods the listener with connections (the socket's path is visible to everyone
// in /proc/net/unix): none connects at all (the directory is closed to other users; an abstract
// socket let every one in, and each cost the listener an accept), the real sender gets through
// at once, and nothing is reported.
TEST(FdChannel, AnotherUserCannotConnectAtAll) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a flooder under another uid";
  const std::string name = socket_name();
  FdListener listener(name);
  constexpr uid_t kNobody = 65534;
  Pipe go = make_pipe();
  Child flooder([&]() {
    if (::setresgid(kNobody, kNobody, kNobody) != 0 || ::setresuid(kNobody, kNobody, kNobody) != 0)
      return child_fail(2, std::string("setresuid: ") + strerror(errno));
    go.write.reset();  // the parent may start
    const auto until = Clock::now() + 1500ms;
    const sockaddr_un addr = address_of(name);
    int refused = 0;
    while (Clock::now() < until) {
      UniqueFd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
      if (s && ::connect(s.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0)
        return child_fail(3, "another user connected to the listener");
      if (errno != EACCES) return child_fail(4, std::string("connect: ") + strerror(errno) + ", not EACCES");
      ++refused;
    }
    return refused > 0 ? 0 : child_fail(5, "no connect tried");
  });
  go.write.reset();
  char byte;
  (void)::read(go.read.get(), &byte, 1);  // returns when the flooder dropped privileges
  std::this_thread::sleep_for(200ms);     // the flood is on
  std::thread sender([&] { meshmem::ipc::send_fds(name, "real", 4, nullptr, 0, 5000ms); });
  std::vector<std::string> refused;
  const auto start = Clock::now();
  auto msg = listener.receive(5000ms, accept_all, &refused);
  sender.join();
  const auto elapsed = Clock::now() - start;
  EXPECT_EQ(flooder.wait(), 0);
  ASSERT_TRUE(msg) << "the real sender did not get through the flood";
  EXPECT_EQ(std::string(msg->payload.begin(), msg->payload.end()), "real");
  EXPECT_LT(elapsed, 1000ms);
  EXPECT_TRUE(refused.empty()) << refused.front();
}

TEST(FdChannel, ReceiveTimesOutWithoutASender) {
  FdListener listener(socket_name());
  std::vector<std::string> refused;
  const auto start = Clock::now();
  auto msg = listener.receive(200ms, accept_all, &refused);
  const auto elapsed = Clock::now() - start;
  EXPECT_FALSE(msg);
  EXPECT_TRUE(refused.empty());
  EXPECT_GE(elapsed, 200ms);
  EXPECT_LT(elapsed, 2000ms);

  // A negative timeout only looks at what is already waiting.
  EXPECT_FALSE(listener.receive(-1ms, accept_all));
}

TEST(FdChannel, SendTimesOutWithoutAListener) {
  const std::string name = socket_name();
  const auto start = Clock::now();
  try {
    meshmem::ipc::send_fds(name, "x", 1, nullptr, 0, 200ms);
    FAIL() << "sent to nobody";
  } catch (const Error& e) {
    const auto elapsed = Clock::now() - start;
    EXPECT_EQ(e.code(), ErrorCode::Timeout);
    EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    EXPECT_GE(elapsed, 200ms);
    EXPECT_LT(elapsed, 2000ms);
  }
}

TEST(FdChannel, OversizedArgumentsAreInvalid) {
  // No listener and a bounded timeout: a missing check shows as Timeout, not as a hang.
  const std::string name = socket_name();
  std::vector<std::uint8_t> big(meshmem::ipc::kMaxFdPayload + 1);
  std::vector<int> many(meshmem::ipc::kMaxFdsPerMessage + 1, 0);
  auto code_of = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return e.code();
    }
    return ErrorCode::Internal;
  };
  EXPECT_EQ(code_of([&] { meshmem::ipc::send_fds(name, big.data(), big.size(), nullptr, 0, 200ms); }),
            ErrorCode::InvalidArgument);
  EXPECT_EQ(code_of([&] {
              meshmem::ipc::send_fds(name, "x", 1, many.data(), many.size(), 200ms);
            }),
            ErrorCode::InvalidArgument);
  EXPECT_EQ(code_of([&] {
              meshmem::ipc::send_fds(std::string(200, 'n'), "x", 1, nullptr, 0, 200ms);
            }),
            ErrorCode::InvalidArgument);
  EXPECT_EQ(code_of([&] { FdListener l(std::string(200, 'n')); }), ErrorCode::InvalidArgument);
  EXPECT_EQ(code_of([&] { FdListener l(""); }), ErrorCode::InvalidArgument);
}

}  // namespace
