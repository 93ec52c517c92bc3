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

// Collective: creates this rank's part, passes its descriptor to the node peers and maps
// the parts of the peers in `map_peer` (by rank). Fills state.local / state.peer.
void create_host_window(WindowState& state, Bootstrap& boot, FdExchange& fds, const Topology& topo,
                        const std::vector<bool>& map_peer, const std::string& what);

}  // namespace meshmem::detail
