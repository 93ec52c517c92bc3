// FdChannel: descriptors passed with SCM_RIGHTS over filesystem Unix sockets.
//
// Each process listens on a socket in a directory that only its user may enter (PrivateDir,
// mode 0700): another user cannot even connect, so a flood of other users' connections costs
// the listener nothing (an abstract socket, which anyone may connect to, once cost 34-49x).
// A sender connects, writes one message (a small payload plus descriptors) and closes. The
// receiver reads the sender's credentials with SO_PEERCRED at accept time and refuses, closing
// every descriptor received, any sender whose uid differs from its own or whom `accept` rejects.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "meshmem/ipc/unique_fd.hpp"

namespace meshmem::ipc {

struct PeerCredentials {
  pid_t pid = -1;
  uid_t uid = static_cast<uid_t>(-1);
  gid_t gid = static_cast<gid_t>(-1);
};

struct FdMessage {
  PeerCredentials sender;
  std::vector<std::uint8_t> payload;
  std::vector<UniqueFd> fds;
};

inline constexpr std::size_t kMaxFdPayload = 256;  // bytes of payload per message
inline constexpr std::size_t kMaxFdsPerMessage = 16;

// Random token: 32 hex digits from getrandom().
std::string random_token();

// A new directory that only this user may enter (mkdtemp, mode 0700) under $TMPDIR, or /tmp
// where $TMPDIR is unset or too long for a socket path, named meshmem-<machine>-<pid>-XXXXXX
// (<machine>: 8 hex digits of the kernel's boot id); removed, with the sockets left in it, on
// destruction. Before it is made, the ones this user's killed processes of this machine left
// there are removed (their process gone, nobody listening on their socket, or none made in a
// minute).
// Raises Error(System) if it cannot be made.
class PrivateDir {
 public:
  PrivateDir();
  PrivateDir(PrivateDir&& other) noexcept : path_(std::move(other.path_)) { other.path_.clear(); }
  PrivateDir& operator=(PrivateDir&& other) noexcept;
  PrivateDir(const PrivateDir&) = delete;
  PrivateDir& operator=(const PrivateDir&) = delete;
  ~PrivateDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

class FdListener {
 public:
  // Binds and listens on the socket file `path` (removed on destruction), in a directory that
  // only this user may enter: owned by it, no access for group or others (PrivateDir). Raises
  // Error(InvalidArgument) for a path too long or in another directory, Error(System) if the
  // path is taken.
  explicit FdListener(const std::string& path);
  FdListener(FdListener&&) noexcept;
  FdListener& operator=(FdListener&&) noexcept;
  ~FdListener();

  const std::string& name() const { return name_; }  // the socket's path
  int fd() const { return socket_.get(); }

  // Returns true to accept the message, false to refuse it.
  using Check = std::function<bool(const FdMessage&)>;

  // Waits up to `timeout` (zero: forever) for one message from a sender that passes the
  // uid check and `accept`. Refused senders are described in `*refused` (if given) and
  // their descriptors closed; the wait goes on. Returns nullopt on timeout. A negative
  // timeout takes only a message already waiting. Connections are read side by side, so a
  // stalled or idle one holds no other sender up; it is refused once it has sent no complete
  // message for 5 s (a partly read message is kept from one call to the next). Other users
  // cannot connect (the directory); a connection of another uid all the same (root, or a
  // directory made accessible since) is closed unread at once, and a flood of them is told in
  // two lines (the first, and how many more).
  std::optional<FdMessage> receive(std::chrono::milliseconds timeout, const Check& accept,
                                   std::vector<std::string>* refused = nullptr);

  struct Incoming;  // a connection of this user being read (fd_channel.cpp)

 private:
  std::string name_;
  UniqueFd socket_;
  std::vector<Incoming> incoming_;  // in the order accepted; kept from one receive to the next
};

// Connects to the listener at path `name` and sends one message. Retries a refused or missing
// listener until `timeout` (zero: forever; negative: one attempt), then raises
// Error(Timeout). Raises Error(InvalidArgument) for more than kMaxFdPayload bytes or
// kMaxFdsPerMessage descriptors. Returning means the message is queued at the listener,
// not that it was accepted: a refused sender is not told.
//
// Wire format (one message per connection): a uint32_t payload length in host byte order,
// the payload, and the descriptors in one SCM_RIGHTS message with the first bytes.
void send_fds(const std::string& name, const void* payload, std::size_t payload_bytes,
              const int* fds, std::size_t fd_count, std::chrono::milliseconds timeout);

}  // namespace meshmem::ipc
