// FdExchange: collective passing of one descriptor per rank to every other rank of its node.
// The mechanism is pidfd_getfd where every node peer permits it (or where forced), else
// SCM_RIGHTS over Unix sockets, each in a directory only the job's user may enter (other users
// cannot connect), made only then; senders are checked against the pid and uid of the rank
// they claim to be (SO_PEERCRED).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fault.hpp"
#include "meshmem/config.hpp"
#include "meshmem/ipc/fd_channel.hpp"
#include "meshmem/ipc/unique_fd.hpp"

namespace meshmem::detail {

class Bootstrap;
struct Topology;

class FdExchange {
 public:
  // Collective over the Comm. `faults`: the Comm's injected faults (tests).
  FdExchange(Bootstrap& boot, const Topology& topo, FdPassing requested, FaultPlan faults = FaultPlan());

  FdPassing mode() const { return mode_; }  // Pidfd or Socket
  const std::string& reason() const { return reason_; }  // why this mode, for diagnostics

  // Collective over the Comm: every rank offers `my_fd` (kept open by the caller until the
  // call returns everywhere, which it guarantees by agreeing at the end). Returns one entry
  // per rank: a descriptor of that node peer's `my_fd`, empty for this rank and other nodes.
  // A failure anywhere raises the same Error on every rank.
  std::vector<ipc::UniqueFd> exchange(int my_fd, const std::string& what);

 private:
  std::vector<ipc::UniqueFd> exchange_pidfd(const std::vector<int>& fds, std::string* error);
  std::vector<ipc::UniqueFd> exchange_socket(int my_fd, std::uint64_t seq, std::string* error);
  Bootstrap& boot_;
  const Topology& topo_;
  FaultPlan faults_;
  // Socket mode only: every rank's listener, in a private directory, and every node peer's
  // seen from here; a failure on any rank fails every rank.
  void open_listeners(const std::string& what);
  std::unique_ptr<ipc::PrivateDir> dir_;  // before listener_: it holds the listener's socket
  std::unique_ptr<ipc::FdListener> listener_;
  std::vector<std::string> socket_of_;  // per rank: its listener's path
  FdPassing mode_ = FdPassing::Socket;
  std::string reason_;
  std::uint64_t seq_ = 0;
  // Messages of a later exchange that a fast peer sent before this rank finished the
  // current one: (rank, seq) -> descriptor.
  std::map<std::pair<int, std::uint64_t>, ipc::UniqueFd> early_;
};

}  // namespace meshmem::detail
