// FdChannel: descriptors passed with SCM_RIGHTS over abstract-namespace Unix sockets.
//
// Each process listens on a name that includes an unguessable per-job token. A sender
// connects, writes one message (a small payload plus descriptors) and closes. The receiver
// reads the sender's credentials with SO_PEERCRED at accept time and refuses, closing every
// descriptor received, any sender whose uid differs from its own or whom `accept` rejects.
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

// Random token for socket names: 32 hex digits from getrandom().
std::string random_token();

class FdListener {
 public:
  // Binds and listens on the abstract name "\0<name>". Raises Error(System) if taken.
  explicit FdListener(const std::string& name);
  FdListener(FdListener&&) noexcept;
  FdListener& operator=(FdListener&&) noexcept;
  ~FdListener();

  const std::string& name() const { return name_; }
  int fd() const { return socket_.get(); }

  // Returns true to accept the message, false to refuse it.
  using Check = std::function<bool(const FdMessage&)>;

  // Waits up to `timeout` (zero: forever) for one message from a sender that passes the
  // uid check and `accept`. Refused senders are described in `*refused` (if given) and
  // their descriptors closed; the wait goes on. Returns nullopt on timeout. A negative
  // timeout takes only a message already waiting. Connections are read side by side, so a
  // stalled or idle one holds no other sender up; it is refused once it has sent no complete
  // message for 5 s (a partly read message is kept from one call to the next). Other users' connections are closed unread at once, and a flood of them is told
  // in two lines (the first, and how many more).
  std::optional<FdMessage> receive(std::chrono::milliseconds timeout, const Check& accept,
                                   std::vector<std::string>* refused = nullptr);

  struct Incoming;  // a connection of this user being read (fd_channel.cpp)

 private:
  std::string name_;
  UniqueFd socket_;
  std::vector<Incoming> incoming_;  // in the order accepted; kept from one receive to the next
};

// Connects to the listener `name` and sends one message. Retries a refused or missing
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
