// Unit tests of the ipc/ layer: UniqueFd, SharedMemory and pidfd fetching (FdChannel:
// test_fd_channel.cpp). No MPI. Tests that need a second process fork one; children report
// through their exit status (never through gtest) and always leave with _exit().
#include "ipc_test_support.hpp"

namespace {

using namespace meshmem::test::ipc_support;

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

}  // namespace
