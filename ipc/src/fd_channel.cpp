// Wire format, one message per connection (both ends on one host, so native byte order):
//   uint32_t payload length (<= kMaxFdPayload), then the payload bytes.
// The descriptors ride in one SCM_RIGHTS control message on the first sendmsg, so they
// arrive with the first bytes of the stream.
#include "meshmem/ipc/fd_channel.hpp"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <dirent.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <cctype>
#include <thread>
#include <vector>

#include "meshmem/error.hpp"
#include "meshmem/ipc/awake_clock.hpp"

namespace meshmem::ipc {
namespace {

// Suspending the whole job (every rank stopped, then resumed) is neither a stalled sender nor
// a missed deadline.
using Clock = AwakeClock;
using std::chrono::microseconds;
using std::chrono::milliseconds;

constexpr std::size_t kHeaderBytes = sizeof(std::uint32_t);
// Longest a single connection may stall a receive (or a send): one stuck peer must not
// hold the listener up for the whole job timeout.
constexpr milliseconds kMaxStall{5000};
// Room for kMaxFdsPerMessage descriptors; a sender passing more sees MSG_CTRUNC here.
constexpr std::size_t kControlBytes = CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage);

[[noreturn]] void throw_system(const std::string& what, int err) {
  throw Error(ErrorCode::System, what + ": " + std::strerror(err));
}

std::string display(const std::string& path) { return "\"" + path + "\""; }

struct SocketAddress {
  sockaddr_un addr;
  socklen_t length;
};

SocketAddress socket_address(const std::string& path) {
  SocketAddress a{};
  if (path.empty() || path.size() > sizeof(a.addr.sun_path) - 1) {
    throw Error(ErrorCode::InvalidArgument,
                "socket path " + display(path) + " must have 1 to " + std::to_string(sizeof(a.addr.sun_path) - 1) +
                    " bytes");
  }
  a.addr.sun_family = AF_UNIX;
  std::memcpy(a.addr.sun_path, path.data(), path.size());
  a.length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path.size() + 1);
  return a;
}

// The directory of `path` must be one that only this user may enter, or other users could
// connect to the socket.
void check_private_directory(const std::string& path) {
  const auto slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) throw_system("lstat of the directory of socket " + display(path), errno);
  if (!S_ISDIR(st.st_mode) || st.st_uid != ::geteuid() || (st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    throw Error(ErrorCode::InvalidArgument,
                "socket " + display(path) + ": its directory \"" + dir + "\" (mode " + mode + ", owner uid " +
                    std::to_string(st.st_uid) +
                    ") may be entered by other users; a descriptor socket needs one only uid " +
                    std::to_string(::geteuid()) + " may enter (mode 0700)");
  }
}

timeval to_timeval(milliseconds ms) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(ms.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((ms.count() % 1000) * 1000);
  return tv;
}

milliseconds ceil_ms(Clock::duration d) { return std::chrono::ceil<milliseconds>(d); }

// Moves every descriptor of every SCM_RIGHTS message into `fds` at once, before anything
// else can fail, so that none of them can leak. `fds` must have room reserved for them.
void take_fds(msghdr& mh, std::vector<UniqueFd>& fds) noexcept {
  for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c != nullptr; c = CMSG_NXTHDR(&mh, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const unsigned char* data = CMSG_DATA(c);
    for (std::size_t i = 0; i < count; ++i) {
      int fd = -1;
      std::memcpy(&fd, data + i * sizeof(int), sizeof(int));  // CMSG_DATA may be unaligned
      fds.emplace_back(fd);
    }
  }
}


}  // namespace

std::string random_token() {
  unsigned char bytes[16];
  std::size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t r = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      throw_system("getrandom(16 bytes)", errno);
    }
    got += static_cast<std::size_t>(r);
  }
  static const char digits[] = "0123456789abcdef";
  std::string token;
  token.reserve(2 * sizeof(bytes));
  for (unsigned char b : bytes) {
    token.push_back(digits[b >> 4]);
    token.push_back(digits[b & 0xf]);
  }
  return token;
}

namespace {
std::string private_base() {
  // Room for "/meshmem-XXXXXX/" and a short socket name within sun_path's 107 bytes.
  const char* tmp = std::getenv("TMPDIR");
  if (tmp != nullptr && tmp[0] == '/' && std::strlen(tmp) < 64) return tmp;
  return "/tmp";
}
}  // namespace

namespace {
// Removes directory `dir` with the files in it (sockets; it holds no subdirectories).
void remove_with_files(const std::string& dir) {
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") (void)::unlink((dir + "/" + name).c_str());
    }
    ::closedir(d);
  }
  (void)::rmdir(dir.c_str());
}

// This kernel, as 8 hex digits of its boot id: a directory of a process of another machine
// that shares this TMPDIR (a network file system) has another, and is never taken for a
// dead one of this machine.
std::string machine_tag() {
  static const std::string tag = [] {
    std::string id;
    if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
      char buf[64] = {};
      if (std::fgets(buf, sizeof buf, f) != nullptr) id = buf;
      std::fclose(f);
    }
    std::string hex;
    for (char c : id)
      if (std::isxdigit(static_cast<unsigned char>(c)) && hex.size() < 8) hex += static_cast<char>(std::tolower(c));
    return hex.size() == 8 ? hex : std::string("00000000");
  }();
  return tag;
}

// Whether nobody listens on the socket file `path`: connect() is refused. No socket file counts
// only in a directory over a minute old (its maker may be about to bind).
bool nobody_listens(const std::string& path, const struct stat& dir) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return errno == ENOENT && ::time(nullptr) - dir.st_mtime > 60;
  if (!S_ISSOCK(st.st_mode)) return false;
  const SocketAddress address = socket_address(path);
  UniqueFd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!s) return false;
  return ::connect(s.get(), reinterpret_cast<const sockaddr*>(&address.addr), address.length) != 0 &&
         errno == ECONNREFUSED;
}

// Removes the private directories that processes of this user left in `base` when they were
// killed (a normal end removes its own): named for this machine and a process that no longer
// exists here, and holding no socket anyone listens on (a process of another pid namespace of
// this kernel that shares this /tmp may have the same number).
void remove_stale_private_dirs(const std::string& base) {
  DIR* d = ::opendir(base.c_str());
  if (d == nullptr) return;
  std::vector<std::string> stale;
  const std::string prefix = "meshmem-" + machine_tag() + "-";
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    unsigned long pid = 0;
    char rest[16] = {};
    if (name.compare(0, prefix.size(), prefix) != 0 ||
        std::sscanf(name.c_str() + prefix.size(), "%lu-%15s", &pid, rest) != 2 || std::strlen(rest) != 6 || pid == 0 ||
        pid > static_cast<unsigned long>(INT_MAX))
      continue;
    const std::string dir = base + "/" + name;
    struct stat st {};
    if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid()) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // alive (or not ours to ask)
    if (!nobody_listens(dir + "/fd", st)) continue;
    stale.push_back(dir);
  }
  ::closedir(d);
  for (const std::string& dir : stale) remove_with_files(dir);
}
}  // namespace

PrivateDir::PrivateDir() {
  const std::string base = private_base();
  remove_stale_private_dirs(base);
  std::string templ = base + "/meshmem-" + machine_tag() + "-" + std::to_string(::getpid()) + "-XXXXXX";
  if (::mkdtemp(templ.data()) == nullptr) throw_system("mkdtemp(" + templ + ")", errno);
  path_ = templ;  // mode 0700, owned by this user
}

PrivateDir& PrivateDir::operator=(PrivateDir&& other) noexcept {
  if (this != &other) {
    PrivateDir old(std::move(*this));
    path_ = std::move(other.path_);
    other.path_.clear();
  }
  return *this;
}

PrivateDir::~PrivateDir() {
  if (!path_.empty()) remove_with_files(path_);
}

FdListener::FdListener(const std::string& name) : name_(name) {
  const SocketAddress address = socket_address(name);
  check_private_directory(name);
  // Non-blocking so that a connection that vanishes between poll() and accept4() gives
  // EAGAIN instead of blocking receive() past its timeout.
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) throw_system("socket(AF_UNIX) for listener " + display(name), errno);
  socket_.reset(fd);
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&address.addr), address.length) != 0) {
    throw_system("bind to socket " + display(name), errno);
  }
  if (::listen(fd, SOMAXCONN) != 0) throw_system("listen on socket " + display(name), errno);
}

namespace {

}  // namespace

// A connection being read, side by side with the others: a sender that stalls (or a
// connection held open without a word) holds up no one else.
struct FdListener::Incoming {
  UniqueFd conn;
  PeerCredentials sender;
  std::string who;
  std::uint8_t header[kHeaderBytes] = {};
  std::vector<std::uint8_t> payload;
  std::size_t got = 0;  // bytes of header + payload read
  std::vector<UniqueFd> fds;
  Clock::time_point since;
};

FdListener::FdListener(FdListener&& other) noexcept
    : name_(std::move(other.name_)), socket_(std::move(other.socket_)), incoming_(std::move(other.incoming_)) {
  other.name_.clear();
}

FdListener& FdListener::operator=(FdListener&& other) noexcept {
  if (this != &other) {
    FdListener old(std::move(*this));
    name_ = std::move(other.name_);
    socket_ = std::move(other.socket_);
    incoming_ = std::move(other.incoming_);
    other.name_.clear();
  }
  return *this;
}

FdListener::~FdListener() {
  if (!name_.empty() && socket_) (void)::unlink(name_.c_str());
}

namespace {

enum class Step { More, Done, Refused };

// Reads what `in` has now (non-blocking). Done: the whole message is in; Refused: `*reason`.
Step read_available(FdListener::Incoming& in, std::string* reason) {
  const std::string refused = "refused a message from " + in.who + ": ";
  for (;;) {
    const std::size_t total = kHeaderBytes + in.payload.size();
    if (in.got >= kHeaderBytes && in.got == total) {
      if (in.fds.size() > kMaxFdsPerMessage) {
        *reason = refused + std::to_string(in.fds.size()) + " descriptors, more than " +
                  std::to_string(kMaxFdsPerMessage);
        return Step::Refused;
      }
      return Step::Done;
    }
    std::uint8_t* to = in.got < kHeaderBytes ? in.header + in.got : in.payload.data() + (in.got - kHeaderBytes);
    const std::size_t want = in.got < kHeaderBytes ? kHeaderBytes - in.got : total - in.got;
    iovec iov{to, want};
    alignas(cmsghdr) unsigned char control[kControlBytes];
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = control;
    mh.msg_controllen = sizeof(control);
    in.fds.reserve(in.fds.size() + kMaxFdsPerMessage);  // take_fds must not allocate midway
    const ssize_t r = ::recvmsg(in.conn.get(), &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return Step::More;
      *reason = refused + "recvmsg: " + std::strerror(errno) + " (after " + std::to_string(in.got) + " bytes)";
      return Step::Refused;
    }
    take_fds(mh, in.fds);
    if ((mh.msg_flags & MSG_CTRUNC) != 0) {
      *reason = refused + "control data truncated (MSG_CTRUNC; more than " + std::to_string(kMaxFdsPerMessage) +
                " descriptors?)";
      return Step::Refused;
    }
    if (r == 0) {
      *reason = refused + "truncated message (connection closed after " + std::to_string(in.got) + " of " +
                std::to_string(in.got < kHeaderBytes ? kHeaderBytes : total) + " bytes)";
      return Step::Refused;
    }
    const bool had_header = in.got >= kHeaderBytes;
    in.got += static_cast<std::size_t>(r);
    if (!had_header && in.got >= kHeaderBytes) {
      std::uint32_t length = 0;
      std::memcpy(&length, in.header, sizeof(length));
      if (length > kMaxFdPayload) {
        *reason = refused + "payload length " + std::to_string(length) + " exceeds " + std::to_string(kMaxFdPayload) +
                  " bytes";
        return Step::Refused;
      }
      in.payload.resize(length);
    }
  }
}

// Connections of the same user read at once, at most; more wait in the kernel's backlog.
constexpr std::size_t kMaxIncoming = 64;
constexpr int kAcceptsPerRound = 256;

}  // namespace

std::optional<FdMessage> FdListener::receive(milliseconds timeout, const Check& accept,
                                             std::vector<std::string>* refused) {
  const bool forever = timeout == milliseconds::zero();
  const Clock::time_point deadline = Clock::now() + timeout;
  std::vector<Incoming>& incoming = incoming_;
  // Connections of other users are closed unread at once; a flood of them is told in one line.
  std::size_t other_users = 0;
  std::string first_other;
  auto report = [&](std::string reason) {
    if (refused != nullptr) refused->push_back(std::move(reason));
  };
  auto finish = [&] {
    if (other_users > 1)
      report("refused " + std::to_string(other_users - 1) + " more connection(s) of other users after: " + first_other);
  };
  for (;;) {
    // Wait for the listener or a connection, until the deadline or the oldest stall.
    Clock::time_point until = forever ? Clock::time_point::max() : deadline;
    for (const Incoming& in : incoming) until = std::min(until, in.since + kMaxStall);
    int poll_ms = -1;
    if (until != Clock::time_point::max()) {
      const Clock::duration left = until - Clock::now();
      // Rounded up: rounding down would spin on poll(0) through the last millisecond.
      poll_ms = left <= Clock::duration::zero()
                    ? 0
                    : static_cast<int>(std::min<milliseconds::rep>(ceil_ms(left).count(), INT_MAX));
    }
    std::vector<pollfd> polls{{socket_.get(), POLLIN, 0}};
    for (const Incoming& in : incoming) polls.push_back({in.conn.get(), POLLIN, 0});
    const int ready = ::poll(polls.data(), polls.size(), poll_ms);
    if (ready < 0) {
      if (errno == EINTR) continue;
      throw_system("poll on socket " + display(name_), errno);
    }
    if ((polls[0].revents & POLLNVAL) != 0) {
      throw Error(ErrorCode::Internal, "poll on socket " + display(name_) + ": descriptor closed");
    }
    // Everything waiting in the backlog: other users' connections closed at once.
    // At most kAcceptsPerRound a round: a flood must not keep the reads below from running.
    for (int accepted = 0; (polls[0].revents & POLLIN) != 0 && incoming.size() < kMaxIncoming &&
                           accepted < kAcceptsPerRound;
         ++accepted) {
      const int c = ::accept4(socket_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (c < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        throw_system("accept4 on socket " + display(name_), errno);
      }
      UniqueFd conn(c);
      ucred cred{};
      socklen_t cred_len = sizeof(cred);
      // SO_PEERCRED holds the sender's credentials as of its connect(), set by the kernel;
      // the sender cannot forge them.
      if (::getsockopt(conn.get(), SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) != 0) {
        report(std::string("refused a connection: SO_PEERCRED failed: ") + std::strerror(errno));
        continue;
      }
      const std::string who = "pid " + std::to_string(cred.pid) + " uid " + std::to_string(cred.uid);
      // Another user's descriptors are never even read: closing the connection unread makes
      // the kernel drop whatever it carried.
      const uid_t our_uid = ::geteuid();
      if (cred.uid != our_uid) {
        if (other_users++ == 0) {
          first_other = "refused a connection from " + who + ": uid differs from ours (" + std::to_string(our_uid) + ")";
          report(first_other);
        }
        continue;
      }
      Incoming in;
      in.conn = std::move(conn);
      in.sender = PeerCredentials{cred.pid, cred.uid, cred.gid};
      in.who = who;
      in.since = Clock::now();
      incoming.push_back(std::move(in));
    }
    // Every connection with something to read, oldest first; the first complete message
    // that passes the caller's check is returned.
    const auto now = Clock::now();
    for (std::size_t i = 0; i < incoming.size();) {
      Incoming& in = incoming[i];
      std::string reason;
      const Step step = read_available(in, &reason);
      if (step == Step::More) {
        if (now - in.since < kMaxStall) {
          ++i;
          continue;
        }
        reason = "refused a message from " + in.who + ": sender stalled: no complete message within " +
                 std::to_string(kMaxStall.count()) + " ms (" + std::to_string(in.got) + " bytes)";
      }
      if (step == Step::Done) {
        FdMessage msg;
        msg.sender = in.sender;
        msg.payload = std::move(in.payload);
        msg.fds = std::move(in.fds);
        incoming.erase(incoming.begin() + static_cast<std::ptrdiff_t>(i));
        if (!accept || accept(msg)) {
          finish();
          return msg;
        }
        report("refused a message from pid " + std::to_string(msg.sender.pid) + " uid " +
               std::to_string(msg.sender.uid) + ": rejected by the caller's check (" +
               std::to_string(msg.payload.size()) + " payload bytes, " + std::to_string(msg.fds.size()) +
               " descriptors)");
        continue;  // msg goes out of scope: its descriptors are closed now
      }
      report(std::move(reason));
      incoming.erase(incoming.begin() + static_cast<std::ptrdiff_t>(i));  // closes it and its descriptors
    }
    if (!forever && Clock::now() >= deadline) {
      finish();
      return std::nullopt;
    }
  }
}

void send_fds(const std::string& name, const void* payload, std::size_t payload_bytes,
              const int* fds, std::size_t fd_count, milliseconds timeout) {
  if (payload_bytes > kMaxFdPayload) {
    throw Error(ErrorCode::InvalidArgument,
                "send_fds to " + display(name) + ": payload of " + std::to_string(payload_bytes) +
                    " bytes exceeds " + std::to_string(kMaxFdPayload));
  }
  if (fd_count > kMaxFdsPerMessage) {
    throw Error(ErrorCode::InvalidArgument,
                "send_fds to " + display(name) + ": " + std::to_string(fd_count) +
                    " descriptors exceed " + std::to_string(kMaxFdsPerMessage));
  }
  if ((payload_bytes > 0 && payload == nullptr) || (fd_count > 0 && fds == nullptr)) {
    throw Error(ErrorCode::InvalidArgument, "send_fds to " + display(name) + ": null buffer");
  }
  const SocketAddress address = socket_address(name);

  const bool forever = timeout == milliseconds::zero();
  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline = start + timeout;
  microseconds pause(100);
  UniqueFd sock;
  for (;;) {
    // Non-blocking connect: with the listener's backlog full it fails with EAGAIN at
    // once (and we retry) instead of blocking without a bound.
    const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (s < 0) throw_system("socket(AF_UNIX) to send to " + display(name), errno);
    sock.reset(s);
    if (::connect(s, reinterpret_cast<const sockaddr*>(&address.addr), address.length) == 0) {
      break;
    }
    const int err = errno;
    // Nobody listening yet (no socket file, or one not yet listening), or a full backlog: retry.
    if (err != ECONNREFUSED && err != ENOENT && err != EAGAIN && err != EINTR) {
      throw_system("connect to socket " + display(name), err);
    }
    sock.reset();  // a socket whose connect failed is not reused
    const Clock::time_point now = Clock::now();
    if (!forever && now >= deadline) {
      throw Error(ErrorCode::Timeout,
                  "send_fds: no listener took a connection on socket " + display(name) +
                      " in " + std::to_string(ceil_ms(now - start).count()) +
                      " ms of trying (last error: " + std::strerror(err) + ")");
    }
    Clock::duration sleep = pause;
    if (!forever) sleep = std::min(sleep, deadline - now);
    std::this_thread::sleep_for(sleep);
    pause = std::min<microseconds>(pause * 2, milliseconds(10));
  }

  // Blocking from here on, bounded by SO_SNDTIMEO. One small message never fills a Unix
  // socket buffer, so this only guards against the unexpected.
  const int flags = ::fcntl(sock.get(), F_GETFL);
  if (flags < 0) throw_system("fcntl(F_GETFL) on socket to " + display(name), errno);
  if (::fcntl(sock.get(), F_SETFL, flags & ~O_NONBLOCK) != 0) {
    throw_system("fcntl(F_SETFL) on socket to " + display(name), errno);
  }
  const timeval tv = to_timeval(kMaxStall);
  if (::setsockopt(sock.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) != 0) {
    throw_system("setsockopt(SO_SNDTIMEO) on socket to " + display(name), errno);
  }

  std::uint8_t wire[kHeaderBytes + kMaxFdPayload];
  const std::uint32_t length = static_cast<std::uint32_t>(payload_bytes);
  std::memcpy(wire, &length, kHeaderBytes);
  if (payload_bytes > 0) std::memcpy(wire + kHeaderBytes, payload, payload_bytes);
  const std::size_t total = kHeaderBytes + payload_bytes;

  alignas(cmsghdr) unsigned char control[kControlBytes] = {};
  std::size_t sent = 0;
  while (sent < total) {
    iovec iov{wire + sent, total - sent};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    // The descriptors go with the first bytes only; a partial write's rest goes without.
    if (sent == 0 && fd_count > 0) {
      mh.msg_control = control;
      mh.msg_controllen = CMSG_SPACE(sizeof(int) * fd_count);
      cmsghdr* c = CMSG_FIRSTHDR(&mh);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fd_count);
      std::memcpy(CMSG_DATA(c), fds, sizeof(int) * fd_count);
    }
    // MSG_NOSIGNAL: a receiver that has gone away gives EPIPE, not a SIGPIPE that kills us.
    const ssize_t r = ::sendmsg(sock.get(), &mh, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        throw Error(ErrorCode::Timeout, "send_fds to socket " + display(name) +
                                            ": the receiver took nothing for " +
                                            std::to_string(kMaxStall.count()) + " ms");
      }
      throw_system("sendmsg to socket " + display(name) + " (" + std::to_string(total) +
                       " bytes, " + std::to_string(fd_count) + " descriptors)",
                   errno);
    }
    sent += static_cast<std::size_t>(r);
  }
}

}  // namespace meshmem::ipc
