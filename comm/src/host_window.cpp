#include "host_window.hpp"

#include "bootstrap.hpp"
#include "fd_exchange.hpp"
#include "topology.hpp"

namespace meshmem::detail {

void create_host_part(WindowState& state, Bootstrap& boot, const std::string& what) {
  auto memory = std::make_unique<HostWindowMemory>();
  agreed_step(boot, what, [&] { memory->mine = ipc::SharedMemory::create(state.bytes, "meshmem-window"); });
  state.local = memory->mine.data();
  state.peer.assign(static_cast<std::size_t>(boot.size()), nullptr);
  state.peer[static_cast<std::size_t>(boot.rank())] = state.local;
  state.storage = std::move(memory);
}

std::vector<ipc::MappedRegion> map_host_peers(WindowState& state, Bootstrap& boot, FdExchange& fds,
                                              const Topology& topo, const std::vector<bool>& map_peer,
                                              const std::string& what) {
  auto& memory = static_cast<HostWindowMemory&>(*state.storage);
  std::vector<ipc::UniqueFd> received = fds.exchange(memory.mine.fd(), what);
  std::vector<ipc::MappedRegion> peers(static_cast<std::size_t>(topo.size));
  agreed_step(boot, what, [&] {
    for (int r = 0; r < topo.size; ++r) {
      if (r == topo.rank || !map_peer[r] || !received[r]) continue;
      // The received descriptor closes when `received` goes; the mapping keeps the memory.
      peers[r] = ipc::map_shared(received[r].get(), state.bytes);
      state.peer[r] = peers[r].data();
    }
  });
  return peers;
}

}  // namespace meshmem::detail
