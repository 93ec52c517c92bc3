// HiddenPeers: the processes of the node peers whose GPU this process cannot see, as the
// staging agent watches them (pidfds), and which of them it has seen end: nothing more goes to
// such a peer, and the transfers it was to end are ended here (StagingAgent::watch_readers).
// CUDA-free.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <string>
#include <vector>

#include "log.hpp"
#include "cuda/staged/staging_site.hpp"
#include "meshmem/ipc/pidfd.hpp"

namespace meshmem::detail {

class HiddenPeers {
 public:
  // `pids`: by rank (node peers share this process's pid namespace: fd_exchange.cpp checked
  // each one's id). `what` begins the log lines.
  HiddenPeers(const StagingSite& site, const std::vector<pid_t>& pids, const std::string& what)
      : site_(site), peers_(site.control.node_ranks) {
    for (int peer : site.hidden) {
      Peer& p = peers_[site.local_index(peer)];
      if (static_cast<std::size_t>(peer) < pids.size()) p.process = ipc::ProcessWatch(pids[static_cast<std::size_t>(peer)]);
      if (!p.process.watching())
        log(LogLevel::Info, what + ": rank " + std::to_string(peer) +
                                "'s process cannot be watched (pidfd_open refused): should it die, the staging slots "
                                "posted to it stay held");
    }
  }

  // The hidden peers whose process ended and that are not yet marked gone.
  std::vector<int> newly_ended() const {
    std::vector<int> ended;
    for (int peer : site_.hidden) {
      const Peer& p = peers_[site_.local_index(peer)];
      if (!p.gone && p.process.ended()) ended.push_back(peer);
    }
    return ended;
  }
  void mark_gone(int peer) { peers_[site_.local_index(peer)].gone = true; }
  bool gone(int peer) const { return peers_[site_.local_index(peer)].gone; }
  pid_t pid(int peer) const { return peers_[site_.local_index(peer)].process.pid(); }

 private:
  struct Peer {
    ipc::ProcessWatch process;
    bool gone = false;
  };
  const StagingSite& site_;
  std::vector<Peer> peers_;  // by node index
};

}  // namespace meshmem::detail
