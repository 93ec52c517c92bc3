#include "transport_registry.hpp"

#include "gpu_part.hpp"
#include "transport_mpi.hpp"
#include "transport_shm.hpp"

namespace meshmem {

namespace detail {

// The transports, in the order tried. Device windows: ipc (same node, VMM mappings), then
// staged (same node, GPUs without peer access: through the node's pinned staging pool), then
// nccl (other nodes: NCCL transfers driven by proxy threads), then mpi-device (other nodes, where
// NCCL is absent or disabled: the same proxies, MPI messages through pinned host memory).
// Host windows: shm (same node, memfd mappings), then mpi (any node, progress thread).
const std::vector<TransportEntry>& transport_table() {
  static const std::vector<TransportEntry> table = {
      {TransportKind::Ipc, "ipc", make_ipc_transport, kNoGpuPart},
      {TransportKind::Staged, "staged", make_staged_transport, kNoGpuPart},
      {TransportKind::Nccl, "nccl", make_nccl_transport, kNoGpuPart},
      {TransportKind::MpiDevice, "mpi-device", make_mpi_device_transport, kNoGpuPart},
      {TransportKind::Shm, "shm", make_shm_transport, ""},
      {TransportKind::Mpi, "mpi", make_mpi_transport, ""},
  };
  return table;
}

std::vector<const TransportEntry*> order_entries(const std::vector<TransportEntry>& table,
                                                 const std::vector<TransportKind>& allowed,
                                                 std::vector<std::string>* left_out) {
  std::vector<const TransportEntry*> order;
  for (TransportKind k : allowed)
    for (const TransportEntry& e : table)
      if (e.kind == k) order.push_back(&e);
  for (const TransportEntry& e : table) {
    bool listed = false;
    for (TransportKind k : allowed) listed = listed || k == e.kind;
    if (!listed) left_out->push_back(std::string(e.name) + ": not in MESHMEM_TRANSPORTS");
  }
  return order;
}

RouteTable::RouteTable(const std::vector<Transport*>& tried, const std::vector<std::string>& left_out, int size)
    : size_(size) {
  for (Memory memory : {Memory::Device, Memory::Host}) {
    auto& routes = routes_[memory == Memory::Device ? 0 : 1];
    routes.assign(static_cast<std::size_t>(size), Route{});
    for (int r = 0; r < size; ++r) {
      Route& route = routes[static_cast<std::size_t>(r)];
      std::string why, why_serving;  // every transport's reason; those serving `memory`
      for (Transport* t : tried) {
        Reach reach = t->reach(r, memory);
        if (reach.ok) {
          route.transport = t;
          break;
        }
        const std::string one = std::string(to_string(t->kind())) + ": " + reach.why;
        why += (why.empty() ? "" : "; ") + one;
        if (t->serves(memory)) why_serving += (why_serving.empty() ? "" : "; ") + one;
      }
      if (route.transport != nullptr) {
        route.why = why_serving;  // "device windows only" explains nothing about a host route
        continue;
      }
      for (const std::string& l : left_out) why += (why.empty() ? "" : "; ") + l;
      route.why = why.empty() ? "no transport is allowed" : why;
    }
  }
}

bool RouteTable::routes_through(const Transport* t, int rank) const {
  return find(rank, Memory::Device) == t || find(rank, Memory::Host) == t;
}

std::vector<bool> RouteTable::ranks_through(const Transport* t) const {
  std::vector<bool> routed(static_cast<std::size_t>(size_));
  for (int r = 0; r < size_; ++r) routed[r] = routes_through(t, r);
  return routed;
}

std::vector<bool> RouteTable::ranks_through(const Transport* t, Memory memory) const {
  std::vector<bool> routed(static_cast<std::size_t>(size_));
  for (int r = 0; r < size_; ++r) routed[r] = routes_through(t, r, memory);
  return routed;
}

}  // namespace detail

const char* to_string(TransportKind kind) noexcept {
  if (kind == TransportKind::None) return "none";
  for (const detail::TransportEntry& e : detail::transport_table())
    if (e.kind == kind) return e.name;
  return "?";
}

}  // namespace meshmem
