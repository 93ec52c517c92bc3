#include "fd_exchange.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "backoff.hpp"
#include "bootstrap.hpp"
#include "log.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/pidfd.hpp"
#include "topology.hpp"

namespace meshmem::detail {

namespace {

// What a sender writes along with its descriptor.
struct FdHeader {
  std::int32_t rank;
  std::int32_t reserved;
  std::uint64_t seq;
};

// Where each rank's listener is (socket mode), as the others learn it.
struct ListenerInfo {
  char path[108];  // sun_path's size, NUL-terminated
};

}  // namespace

FdExchange::FdExchange(Bootstrap& boot, const Topology& topo, FdPassing requested, FaultPlan faults)
    : boot_(boot), topo_(topo), faults_(std::move(faults)) {
  const std::string what = "meshmem::Comm (fd passing)";
  // Probe pidfd_getfd with a descriptor of no consequence: each rank takes one of the next rank
  // of its node. (MESHMEM_FD_PASSING agrees on every rank, so all or none take part.)
  std::string probe_error;
  bool probed = false;
  std::uint64_t failed = 0;
  if (requested != FdPassing::Socket) {
    ipc::UniqueFd bait(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    const std::int32_t mine = bait ? bait.get() : -1;
    std::vector<std::int32_t> baits(static_cast<std::size_t>(topo.size));
    boot.allgather(&mine, baits.data(), sizeof(mine), what);
    if (topo.node_ranks.size() > 1) {
      const auto& nr = topo.node_ranks;
      const auto me = std::find(nr.begin(), nr.end(), topo.rank) - nr.begin();
      const int peer = nr[(static_cast<std::size_t>(me) + 1) % nr.size()];
      probed = true;
      int err = 0;
      if (baits[static_cast<std::size_t>(peer)] < 0) {
        probe_error = "rank " + std::to_string(peer) + " could not open /dev/null to be probed";
      } else if (!ipc::try_fetch_fd(topo.pid_of[peer], baits[static_cast<std::size_t>(peer)], &err)) {
        probe_error = "pidfd_getfd from rank " + std::to_string(peer) + " (pid " + std::to_string(topo.pid_of[peer]) +
                      ") failed: " + std::strerror(err);
      }
    }
    // The baits must stay open until every probe is done; agreeing is the barrier.
    failed = boot.allreduce_max(probe_error.empty() ? 0 : 1, what);
  }
  if (requested == FdPassing::Pidfd) {
    boot.agree(probe_error.empty(), ErrorCode::Unsupported,
               "MESHMEM_FD_PASSING=pidfd, but " + probe_error +
                   " (ptrace permission is needed; use MESHMEM_FD_PASSING=socket or auto)",
               what);
    mode_ = FdPassing::Pidfd;
    reason_ = "forced by MESHMEM_FD_PASSING=pidfd";
  } else if (requested == FdPassing::Socket) {
    mode_ = FdPassing::Socket;
    reason_ = "forced by MESHMEM_FD_PASSING=socket";
  } else if (failed == 0) {
    mode_ = FdPassing::Pidfd;
    reason_ = probed ? "pidfd_getfd permitted between node peers"
                     : "no node peers here; pidfd_getfd unprobed";
  } else {
    mode_ = FdPassing::Socket;
    reason_ = probe_error.empty() ? "pidfd_getfd refused on another rank"
                                  : probe_error + "; using SCM_RIGHTS sockets";
  }
  if (mode_ == FdPassing::Socket) open_listeners(what);
  log(LogLevel::Info, std::string("fd passing: ") + to_string(mode_) + " (" + reason_ + ")");
}

void FdExchange::open_listeners(const std::string& what) {
  // Its private directory and socket. Where they cannot be made (TMPDIR or /tmp unusable),
  // every rank fails here with the reason, instead of its peers waiting for it.
  ListenerInfo mine{};
  std::string error;
  try {
    dir_ = std::make_unique<ipc::PrivateDir>();
    listener_ = std::make_unique<ipc::FdListener>(dir_->path() + "/fd");
    std::strncpy(mine.path, listener_->name().c_str(), sizeof(mine.path) - 1);
  } catch (const std::exception& e) {
    error = "rank " + std::to_string(topo_.rank) + " cannot make its descriptor socket: " + e.what();
  }
  std::vector<ListenerInfo> infos(static_cast<std::size_t>(topo_.size));
  boot_.allgather(&mine, infos.data(), sizeof(mine), what);
  boot_.agree(error.empty(), ErrorCode::System, error, what);
  for (int r = 0; r < topo_.size; ++r) {
    infos[r].path[sizeof(infos[r].path) - 1] = '\0';
    socket_of_.emplace_back(infos[r].path);
  }
  // Every node peer's socket must be reachable from here: ranks that see different /tmp (a
  // mount namespace or container of their own) would otherwise wait a whole timeout at the
  // first exchange.
  std::string unseen;
  for (int peer : topo_.node_ranks) {
    struct stat st {};
    if (peer == topo_.rank || !unseen.empty()) continue;
    const int rc = ::lstat(socket_of_[peer].c_str(), &st);
    const std::string why = rc != 0 ? std::strerror(errno) : "not a socket";
    if (rc != 0 || !S_ISSOCK(st.st_mode))
      unseen = "rank " + std::to_string(peer) + "'s descriptor socket " + socket_of_[peer] + " is not there on rank " +
               std::to_string(topo_.rank) + " (" + why +
               "): the node's ranks must see one directory for it (TMPDIR, else /tmp); do they run in mount "
               "namespaces or containers of their own?";
  }
  boot_.agree(unseen.empty(), ErrorCode::Unsupported, unseen, what);
}

std::vector<ipc::UniqueFd> FdExchange::exchange(int my_fd, const std::string& what) {
  boot_.ensure_usable(what);
  faults_.hit(FaultPoint::FdExchange);
  const std::uint64_t seq = ++seq_;
  std::string error;
  std::vector<ipc::UniqueFd> result;
  try {
    if (mode_ == FdPassing::Pidfd) {
      std::vector<std::int32_t> fds(static_cast<std::size_t>(topo_.size));
      const std::int32_t mine = my_fd;
      boot_.allgather(&mine, fds.data(), sizeof(mine), what);
      result = exchange_pidfd(fds, &error);
    } else {
      result = exchange_socket(my_fd, seq, &error);
    }
  } catch (const Error& e) {
    // A peer that never sent or took its descriptor (late, dead): the ranks disagree already,
    // so no agree(); the Comm refuses collectives from now on, as after any wait that timed out.
    if (e.code() == ErrorCode::Timeout) {
      if (!boot_.usable()) throw;  // a collective of the exchange timed out and said so
      boot_.fail_timeout(what + " on rank " + std::to_string(topo_.rank) + ": " + std::string(e.message()));
    }
    error = e.message();
  }
  // Doubles as the barrier that keeps every offered descriptor open until all have it.
  boot_.agree(error.empty(), ErrorCode::System, error, what);
  return result;
}

std::vector<ipc::UniqueFd> FdExchange::exchange_pidfd(const std::vector<int>& fds,
                                                      std::string* error) {
  std::vector<ipc::UniqueFd> out(static_cast<std::size_t>(topo_.size));
  for (int peer : topo_.node_ranks) {
    if (peer == topo_.rank) continue;
    int err = 0;
    out[peer] = ipc::try_fetch_fd(topo_.pid_of[peer], fds[peer], &err);
    if (!out[peer]) {
      *error = "pidfd_getfd(pid " + std::to_string(topo_.pid_of[peer]) + " of rank " +
               std::to_string(peer) + ", fd " + std::to_string(fds[peer]) +
               ") failed: " + std::strerror(err);
      return {};
    }
  }
  return out;
}

std::vector<ipc::UniqueFd> FdExchange::exchange_socket(int my_fd, std::uint64_t seq,
                                                       std::string* error) {
  std::vector<ipc::UniqueFd> out(static_cast<std::size_t>(topo_.size));
  // Send first, to everyone: a connect completes once queued in the listener's backlog, so
  // no rank waits for another to accept before it can receive.
  const FdHeader header{topo_.rank, 0, seq};
  for (int peer : topo_.node_ranks) {
    if (peer == topo_.rank) continue;
    try {
      ipc::send_fds(socket_of_[peer], &header, sizeof(header), &my_fd, 1, boot_.timeout());
    } catch (const Error& e) {
      // The socket's name does not say whose it is.
      throw Error(e.code(), "sending the descriptor to rank " + std::to_string(peer) + ": " + std::string(e.message()));
    }
  }
  std::size_t expected = topo_.node_ranks.size() - 1;
  std::size_t got = 0;
  for (int peer : topo_.node_ranks) {
    auto it = early_.find({peer, seq});
    if (it != early_.end()) {
      out[peer] = std::move(it->second);
      early_.erase(it);
      ++got;
    }
  }
  std::vector<std::string> refused;
  const auto check = [&](const ipc::FdMessage& m) {
    if (m.payload.size() != sizeof(FdHeader) || m.fds.size() != 1) return false;
    FdHeader h;
    std::memcpy(&h, m.payload.data(), sizeof(h));
    if (h.rank < 0 || h.rank >= topo_.size || !topo_.same_node(h.rank) || h.rank == topo_.rank)
      return false;
    // The sender must be the process of the rank it claims to be, run by the same user.
    return m.sender.pid == topo_.pid_of[h.rank] &&
           static_cast<int>(m.sender.uid) == topo_.uid_of[h.rank] && h.seq >= seq;
  };
  Deadline deadline(boot_.timeout());
  while (got < expected) {
    auto msg = listener_->receive(deadline.remaining(), check, &refused);
    for (const auto& r : refused) log(LogLevel::Warn, r);
    refused.clear();
    if (!msg) {
      std::vector<int> missing;
      for (int peer : topo_.node_ranks)
        if (peer != topo_.rank && !out[peer]) missing.push_back(peer);
      throw Error(ErrorCode::Timeout,
                  "rank " + std::to_string(topo_.rank) + " received no descriptor from rank(s) " +
                      rank_list(missing) + " within " + describe_timeout(boot_.timeout()));
    }
    FdHeader h;
    std::memcpy(&h, msg->payload.data(), sizeof(h));
    if (h.seq > seq) {
      early_[{h.rank, h.seq}] = std::move(msg->fds.front());
    } else if (out[h.rank]) {
      *error = "rank " + std::to_string(h.rank) + " sent two descriptors for one exchange";
      return {};
    } else {
      out[h.rank] = std::move(msg->fds.front());
      ++got;
    }
  }
  return out;
}

}  // namespace meshmem::detail
