// Host-memory windows: this rank's part is a memfd; node peers reached through shm map it.
#pragma once

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
  std::vector<ipc::MappedRegion> peers;  // by rank; empty where not mapped
};

// Collective, in two steps so that the caller can make the new part reachable (register it
// with the progress thread) before any peer can know the window exists:
// create_host_part makes this rank's part (state.local); connect_host_peers passes its
// descriptor to the node peers and maps the parts of the peers in `map_peer` (state.peer).
// Either raises the same Error on every rank if it fails on one.
void create_host_part(WindowState& state, Bootstrap& boot, const std::string& what);
void connect_host_peers(WindowState& state, Bootstrap& boot, FdExchange& fds, const Topology& topo,
                        const std::vector<bool>& map_peer, const std::string& what);

}  // namespace meshmem::detail
