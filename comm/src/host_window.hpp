// Host-memory windows: this rank's part is a memfd; node peers map it (shm transport,
// NodeMeeting).
#pragma once

#include <string>
#include <vector>

#include "meshmem/ipc/shared_memory.hpp"
#include "window_state.hpp"

namespace meshmem::detail {

class Bootstrap;
class FdExchange;
struct Topology;

class HostWindowMemory final : public WindowMemory {
 public:
  ipc::SharedMemory mine;
};

// Collective: makes this rank's part (state.local, state.storage). Raises the same Error on
// every rank if it fails on one.
void create_host_part(WindowState& state, Bootstrap& boot, const std::string& what);
// Collective over the Comm: passes this rank's part to the node peers and maps the parts of
// the peers in `map_peer` (state.peer); the mappings returned keep them mapped.
std::vector<ipc::MappedRegion> map_host_peers(WindowState& state, Bootstrap& boot, FdExchange& fds,
                                              const Topology& topo, const std::vector<bool>& map_peer,
                                              const std::string& what);

}  // namespace meshmem::detail
