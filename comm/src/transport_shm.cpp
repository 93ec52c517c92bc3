#include "transport_shm.hpp"

#include <atomic>
#include <cstring>

#include "host_window.hpp"
#include "topology.hpp"

namespace meshmem::detail {

namespace {
// The peers' parts of one window, mapped here.
class ShmAttachment final : public WindowAttachment {
 public:
  explicit ShmAttachment(std::vector<ipc::MappedRegion> peers) : peers_(std::move(peers)) {}

 private:
  std::vector<ipc::MappedRegion> peers_;
};
}  // namespace

std::unique_ptr<Transport> make_shm_transport(const CommContext& ctx) { return std::make_unique<ShmTransport>(ctx); }

Reach ShmTransport::reach(int rank, Memory memory) const {
  if (memory != Memory::Host) return Reach::no("host windows only");
  const Topology& topo = ctx_.topo;
  if (!topo.same_node(rank))
    return Reach::no("rank " + std::to_string(rank) + " is on node " + std::to_string(topo.node_of[rank]) +
                     ", this rank on node " + std::to_string(topo.node()));
  return Reach::yes();
}

std::unique_ptr<WindowAttachment> ShmTransport::attach(WindowState& win, const std::vector<bool>& routed,
                                                       const std::string& what) {
  return std::make_unique<ShmAttachment>(map_host_peers(win, ctx_.boot, ctx_.fds, ctx_.topo, routed, what));
}

void ShmTransport::put(const WindowState& win, int target, std::size_t offset, const void* src,
                       std::size_t bytes, const SignalUpdate& signal, Stream) {
  // memmove: a put to this rank's own window (or from a buffer inside a mapped window) may
  // overlap its source.
  if (bytes > 0) std::memmove(static_cast<char*>(win.peer[target]) + offset, src, bytes);
  if (signal.sig != nullptr) {
    auto* words = static_cast<std::uint64_t*>(signal.sig->peer[target]);
    apply_signal(words + signal.index, signal.value, signal.op);
  }
}

void ShmTransport::get(void* dst, const WindowState& win, int target, std::size_t offset,
                       std::size_t bytes, Stream) {
  if (bytes > 0) std::memmove(dst, static_cast<const char*>(win.peer[target]) + offset, bytes);
}

void ShmTransport::quiet(Stream) {
  // Stores through the mapping are complete once issued; order them before what follows.
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

}  // namespace meshmem::detail
