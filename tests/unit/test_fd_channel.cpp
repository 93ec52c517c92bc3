// Unit tests of the ipc/ layer's FdChannel (descriptor passing over Unix sockets). No MPI.
// Tests that need a second process fork one; children report through their exit status
// (never through gtest) and always leave with _exit().
#include "ipc_test_support.hpp"

namespace {

using namespace meshmem::test::ipc_support;

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
