#include "node_meeting.hpp"

#include "backoff.hpp"
#include "bootstrap.hpp"
#include "host_window.hpp"
#include "topology.hpp"
#include "meshmem/error.hpp"

namespace meshmem::detail {

NodeMeeting::NodeMeeting(Bootstrap& boot, FdExchange& fds, const Topology& topo, const std::string& what)
    : boot_(boot), topo_(topo) {
  pages_.bytes = 2 * sizeof(std::uint64_t);
  pages_.memory = Memory::Host;
  create_host_part(pages_, boot, what);
  std::vector<bool> map_peer(static_cast<std::size_t>(topo.size), false);
  for (int r : topo.node_ranks) map_peer[r] = true;
  mapped_ = map_host_peers(pages_, boot, fds, topo, map_peer, what);
}

void NodeMeeting::meet(unsigned note, std::vector<unsigned>& notes, const char* what) {
  if (!boot_.usable()) boot_.ensure_usable(what);  // raises; the message only when needed
  if (note >= kNoteLimit) throw Error(ErrorCode::InvalidArgument, std::string(what) + ": meeting note out of range");
  const std::uint64_t e = ++meeting_;
  __atomic_store_n(&words(pages_.local)[e % 2], (e << kNoteBits) | note, __ATOMIC_RELEASE);
  notes.assign(static_cast<std::size_t>(topo_.size), 0);
  Deadline deadline(boot_.timeout());
  Backoff backoff;
  for (int r : topo_.node_ranks) {
    const std::uint64_t* word = &words(pages_.peer[r])[e % 2];
    for (;;) {
      const std::uint64_t w = __atomic_load_n(word, __ATOMIC_ACQUIRE);
      if ((w >> kNoteBits) >= e) {
        notes[r] = static_cast<unsigned>(w & (kNoteLimit - 1));
        break;
      }
      if (deadline.expired()) {
        std::vector<int> missing;
        for (int m : topo_.node_ranks)
          if ((__atomic_load_n(&words(pages_.peer[m])[e % 2], __ATOMIC_ACQUIRE) >> kNoteBits) < e) missing.push_back(m);
        boot_.fail_timeout(std::string(what) + " on rank " + std::to_string(topo_.rank) + ": rank(s) " + rank_list(missing) +
                           " did not arrive within " + describe_timeout(boot_.timeout()));
      }
      backoff.pause();
    }
    backoff.reset();
  }
}

}  // namespace meshmem::detail
