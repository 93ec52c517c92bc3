// The transport table: every transport meshmem has, in the order they are tried. For each
// rank and memory kind the Comm takes the first transport that reaches it
// (MESHMEM_TRANSPORTS reorders the table or leaves entries out). A new transport is a file
// pair (transport_<name>.{hpp,cpp}, or comm/src/cuda/ for the GPU part), one line in
// kTable (transport_registry.cpp), one TransportKind and its knobs beside its code.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "meshmem/config.hpp"
#include "transport.hpp"

namespace meshmem::detail {

using TransportFactory = std::unique_ptr<Transport> (*)(const CommContext& ctx);

struct TransportEntry {
  TransportKind kind;
  const char* name;
  TransportFactory make;  // null where this build lacks the transport
  const char* missing;    // then: why
};

// The table, in the order tried by default.
const std::vector<TransportEntry>& transport_table();

// The entries of `table` to make, in the order of `allowed` (MESHMEM_TRANSPORTS); each
// entry left out is reported in *left_out as "name: why".
std::vector<const TransportEntry*> order_entries(const std::vector<TransportEntry>& table,
                                                 const std::vector<TransportKind>& allowed,
                                                 std::vector<std::string>* left_out);

// Per rank and memory kind, the first transport that reaches it, or every reason why none.
class RouteTable {
 public:
  // `tried`: the transports made, in the order tried; `left_out`: why the others were not.
  RouteTable(const std::vector<Transport*>& tried, const std::vector<std::string>& left_out, int size);

  Transport* find(int rank, Memory memory) const { return at(rank, memory).transport; }
  // "ipc: ...; shm: ...; mpi: ..." where find() is null.
  const std::string& why_none(int rank, Memory memory) const {
    static const std::string reached;
    const Route& r = at(rank, memory);
    return r.transport == nullptr ? r.why : reached;
  }
  // Why each transport serving `memory` tried before find()'s did not reach `rank` (where
  // none did: every transport's reason, and those left out); empty where none was skipped.
  const std::string& why_not_earlier(int rank, Memory memory) const { return at(rank, memory).why; }
  // Whether this rank routes anything to `rank` through `t`.
  bool routes_through(const Transport* t, int rank) const;
  bool routes_through(const Transport* t, int rank, Memory memory) const { return find(rank, memory) == t; }
  // By rank: whether this rank routes anything (or windows of `memory`) through `t`.
  std::vector<bool> ranks_through(const Transport* t) const;
  std::vector<bool> ranks_through(const Transport* t, Memory memory) const;

 private:
  struct Route {
    Transport* transport = nullptr;
    std::string why;  // the reasons of the transports tried before `transport`, or of all
  };
  const Route& at(int rank, Memory memory) const {
    return routes_[memory == Memory::Device ? 0 : 1][static_cast<std::size_t>(rank)];
  }
  int size_;
  std::array<std::vector<Route>, 2> routes_;  // [device, host][rank]
};

}  // namespace meshmem::detail
