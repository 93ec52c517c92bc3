// NodeMeeting: a host-side meeting of the ranks of one node through shared memory. Each
// rank writes only its own page (a memfd the node peers map), so a meeting costs a store
// and a few loads of peers' cache lines: well under a microsecond, against several for an
// MPI gather/release. Each rank brings a note (two bits) that the others read.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshmem/ipc/shared_memory.hpp"
#include "window_state.hpp"

namespace meshmem::detail {

class Bootstrap;
class FdExchange;
struct Topology;

class NodeMeeting {
 public:
  // Collective over the Comm; the meetings are among topo.node_ranks.
  NodeMeeting(Bootstrap& boot, FdExchange& fds, const Topology& topo, const std::string& what);
  NodeMeeting(const NodeMeeting&) = delete;
  NodeMeeting& operator=(const NodeMeeting&) = delete;

  // Brings `note` (below kNoteLimit) to the next meeting and returns once every node rank
  // has come to it; notes[r] is then rank r's note (node ranks only). Raises Error(Timeout) after the
  // Bootstrap's timeout, naming the ranks that did not come, and the Comm refuses further
  // collectives (as after any timeout). `what` names the calling API.
  static constexpr unsigned kNoteBits = 2;
  static constexpr unsigned kNoteLimit = 1u << kNoteBits;
  void meet(unsigned note, std::vector<unsigned>& notes, const char* what);

 private:
  // A rank's page: word e % 2 holds (e << kNoteBits) | note for meeting e. Two words suffice: a
  // rank can publish meeting e + 1 while slower ranks still read its word for e, but not
  // e + 2 before every rank has come to e + 1.
  static std::uint64_t* words(void* page) { return static_cast<std::uint64_t*>(page); }

  Bootstrap& boot_;
  const Topology& topo_;
  WindowState pages_;  // host window of one page per rank
  std::vector<ipc::MappedRegion> mapped_;  // the node peers' pages
  std::uint64_t meeting_ = 0;
};

}  // namespace meshmem::detail
