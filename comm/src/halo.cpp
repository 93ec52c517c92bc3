// HaloExchange: the plan is checked once, collectively; exchange() then only issues puts
// and one signal per neighbour.
#include "meshmem/error.hpp"
#include "meshmem/halo.hpp"

#include <algorithm>
#include <set>
#include <tuple>

#include "backoff.hpp"
#include "comm_impl.hpp"
#include "device_interface.hpp"
#include "log.hpp"
#include "strided_rows.hpp"

namespace meshmem {
namespace detail {

struct HaloState {
  CommImpl* comm = nullptr;
  std::shared_ptr<WindowState> win;
  std::shared_ptr<WindowState> sig;  // one word per rank: the last exchange it delivered here
  std::vector<HaloRegion> sends;
  std::vector<int> send_to;    // distinct peers of `sends`
  std::vector<int> recv_from;  // ranks whose regions land here
  std::uint64_t epoch = 0;
  // Device windows: the copies to mapped neighbours, their signals and every wait of an
  // exchange in one kernel, its exchange number on the GPU (where ranks share a GPU, the
  // waits of an uncaptured exchange are stream memory operations after it: KernelHaloPlan).
  std::unique_ptr<DeviceHaloPlan> device_plan;
  // Device windows: regions of neighbours that are not mapped here (staged transport), and
  // those neighbours. Their transport moves the regions, then raises the neighbour's word for
  // this rank: after n exchanges it holds n, as the kernel's stores of mapped ones do. While
  // the host knows n (the plan was never captured) the signal sets n, else it adds 1, so that
  // a graph replay counts too. Not an addition always: the target's staging thread adds with a
  // kernel, and where ranks share a GPU that kernel waited for the other process's time slice
  // (Jacobi 4096^2, 2 ranks on 1 x H100: 4.50 ms per exchange against 0.38 ms with the set,
  // a stream memory operation).
  std::vector<HaloRegion> transport_sends;
  std::vector<int> transport_send_to;
  // Why complete() is refused, the same on every rank ("" if it is not): some rank sends
  // through a transport, so kernels cannot have written those halos.
  std::string complete_refused;

  ~HaloState() {
    device_plan.reset();  // before the signal words go: its watch may be writing them
    if (sig && !sig->freed()) sig->owner->free_in_destructor(*sig, "HaloExchange destructor");
  }
};

namespace {

// A region as every rank sees it (fixed size, for the allgather).
struct WireRegion {
  std::int64_t peer;
  std::uint64_t src_offset, dst_offset, width, height, src_pitch, dst_pitch;
};

std::string describe(int rank, std::size_t index, const WireRegion& r) {
  return "region " + std::to_string(index) + " of rank " + std::to_string(rank) + " (to rank " +
         std::to_string(r.peer) + ", dst_offset " + std::to_string(r.dst_offset) + ", " + std::to_string(r.height) +
         " x " + std::to_string(r.width) + " bytes, pitch " + std::to_string(r.dst_pitch) + ")";
}

}  // namespace

std::unique_ptr<HaloState> CommImpl::make_halo(const Window& win, const std::vector<HaloRegion>& sends) {
  const char* call = "comm.make_halo";
  const std::string at = where(call);
  boot.arrive(call);
  // Local checks, agreed: a plan that is wrong anywhere fails everywhere.
  std::vector<WireRegion> mine;
  const WindowState* w = nullptr;
  agreed_step(boot, call, [&] {
    w = &checked(win, call);
    for (std::size_t i = 0; i < sends.size(); ++i) {
      const HaloRegion& r = sends[i];
      check_rank(r.peer, call, "halo region's peer");
      const std::uint64_t sp = r.src_pitch ? r.src_pitch : r.width;
      const std::uint64_t dp = r.dst_pitch ? r.dst_pitch : r.width;
      if (r.width == 0 || r.height == 0)
        throw Error(ErrorCode::InvalidArgument, at + ": halo region " + std::to_string(i) + " is empty (width " +
                                                    std::to_string(r.width) + ", height " + std::to_string(r.height) + ")");
      if (r.height > 1 && (sp < r.width || dp < r.width))
        throw Error(ErrorCode::InvalidArgument, at + ": halo region " + std::to_string(i) + " has a pitch smaller than its width " +
                                                    std::to_string(r.width) + " (rows would overlap)");
      std::uint64_t src_end = 0, dst_end = 0;
      if (!rows_end(r.src_offset, r.width, r.height, sp, &src_end) || src_end > w->bytes)
        throw Error(ErrorCode::InvalidArgument, at + ": halo region " + std::to_string(i) + " reads past the end of window #" +
                                                    std::to_string(w->id) + " (" + std::to_string(w->bytes) + " bytes) here");
      if (!rows_end(r.dst_offset, r.width, r.height, dp, &dst_end) || dst_end > w->bytes)
        throw Error(ErrorCode::InvalidArgument, at + ": halo region " + std::to_string(i) + " writes past the end of window #" +
                                                    std::to_string(w->id) + " (" + std::to_string(w->bytes) + " bytes) of rank " +
                                                    std::to_string(r.peer));
      mine.push_back(WireRegion{r.peer, r.src_offset, r.dst_offset, r.width, r.height, sp, dp});
      (void)route(*w, r.peer, call);  // Error(Unsupported) naming the pair where nothing reaches it
    }
  });

  // Every rank's declaration, to every rank.
  const int n = topo.size;
  const std::uint64_t count = mine.size();
  std::vector<std::uint64_t> counts(static_cast<std::size_t>(n));
  boot.allgather(&count, counts.data(), sizeof(count), call);
  const std::uint64_t most = *std::max_element(counts.begin(), counts.end());
  std::vector<WireRegion> padded(most), all(most * static_cast<std::size_t>(n));
  std::copy(mine.begin(), mine.end(), padded.begin());
  if (most > 0) boot.allgather(padded.data(), all.data(), sizeof(WireRegion) * most, call);
  auto region = [&](int rank, std::size_t i) -> const WireRegion& { return all[static_cast<std::size_t>(rank) * most + i]; };

  // Neighbours must name each other.
  std::vector<std::set<int>> sends_to(static_cast<std::size_t>(n));
  for (int a = 0; a < n; ++a)
    for (std::size_t i = 0; i < counts[a]; ++i) sends_to[a].insert(static_cast<int>(region(a, i).peer));
  for (int a = 0; a < n; ++a)
    for (int b : sends_to[a])
      if (!sends_to[b].count(a))
        throw Error(ErrorCode::InvalidArgument, at + ": rank " + std::to_string(a) + " sends halos to rank " +
                                                    std::to_string(b) + ", but rank " + std::to_string(b) +
                                                    " declares none for rank " + std::to_string(a));
  // No two rows that land in one rank's window may overlap.
  for (int target = 0; target < n; ++target) {
    std::vector<std::tuple<std::uint64_t, std::uint64_t, int, std::size_t>> rows;  // start, end, sender, region
    for (int a = 0; a < n; ++a)
      for (std::size_t i = 0; i < counts[a]; ++i) {
        const WireRegion& r = region(a, i);
        if (r.peer != target) continue;
        for (std::uint64_t row = 0; row < r.height; ++row)
          rows.emplace_back(r.dst_offset + row * r.dst_pitch, r.dst_offset + row * r.dst_pitch + r.width, a, i);
      }
    std::sort(rows.begin(), rows.end());
    for (std::size_t k = 1; k < rows.size(); ++k) {
      const auto& [s0, e0, a0, i0] = rows[k - 1];
      const auto& [s1, e1, a1, i1] = rows[k];
      (void)s0;
      (void)e1;
      if (s1 < e0 && !(a0 == a1 && i0 == i1))
        throw Error(ErrorCode::InvalidArgument, at + ": halo regions overlap in rank " + std::to_string(target) +
                                                    "'s window: " + describe(a0, i0, region(a0, i0)) + " and " +
                                                    describe(a1, i1, region(a1, i1)));
    }
  }

  auto halo = std::make_unique<HaloState>();
  halo->comm = this;
  halo->win = win.state_;
  halo->sends = sends;
  for (auto& r : halo->sends) {
    if (r.src_pitch == 0) r.src_pitch = r.width;
    if (r.dst_pitch == 0) r.dst_pitch = r.width;
  }
  halo->send_to.assign(sends_to[topo.rank].begin(), sends_to[topo.rank].end());
  for (int a = 0; a < n; ++a)
    if (sends_to[a].count(topo.rank)) halo->recv_from.push_back(a);
  halo->sig = alloc(static_cast<std::size_t>(n) * sizeof(std::uint64_t), w->memory, true, call);
  if (w->memory == Memory::Device) {
    // One launch per exchange instead of one copy per region (a column is thousands of
    // 8-byte rows: a poor fit for the copy engine) and one signal operation per neighbour.
    const WindowState& sig = *halo->sig;
    DeviceHaloSpec spec;
    spec.signals_window = sig.id;
    agreed_step(boot, call, [&] {
      for (const HaloRegion& r : halo->sends) {
        Transport& t = route(*w, r.peer, call);
        if (t.capabilities().mapped && w->peer[r.peer] != nullptr) {
          spec.copies.push_back(DeviceCopy{static_cast<char*>(w->peer[r.peer]) + r.dst_offset,
                                           static_cast<const char*>(w->local) + r.src_offset, r.width, r.height,
                                           r.src_pitch, r.dst_pitch});
        } else if (t.capabilities().stream_ordered) {
          halo->transport_sends.push_back(r);
          if (std::find(halo->transport_send_to.begin(), halo->transport_send_to.end(), r.peer) ==
              halo->transport_send_to.end())
            halo->transport_send_to.push_back(r.peer);
        } else {
          throw Error(ErrorCode::Unsupported, at + ": rank " + std::to_string(r.peer) + "'s device window is reached through " +
                                                  to_string(t.kind()) + ", which cannot carry a device halo exchange");
        }
      }
      spec.transport_neighbours = halo->transport_send_to.size();
      for (int r : halo->send_to)
        if (std::find(halo->transport_send_to.begin(), halo->transport_send_to.end(), r) == halo->transport_send_to.end())
          spec.stores.push_back(static_cast<std::uint64_t*>(sig.peer[r]) + topo.rank);
      for (int r : halo->recv_from) {
        spec.waits.push_back(static_cast<const std::uint64_t*>(sig.local) + r);
        spec.wait_ranks.push_back(r);
      }
      DeviceScope scope(*device, nullptr, false, call);
      halo->device_plan = device->make_halo_plan(spec);
    });
    // complete() is refused on every rank where any rank has unmapped neighbours: refused on
    // the senders alone, their neighbours' waits would run into the timeout.
    const std::int64_t unmapped = halo->transport_send_to.empty() ? -1 : halo->transport_send_to.front();
    std::vector<std::int64_t> unmapped_of(static_cast<std::size_t>(n));
    boot.allgather(&unmapped, unmapped_of.data(), sizeof(unmapped), call);
    for (int a = 0; a < n && halo->complete_refused.empty(); ++a)
      if (unmapped_of[a] >= 0)
        halo->complete_refused = "rank " + std::to_string(unmapped_of[a]) + "'s window is not mapped on rank " +
                                 std::to_string(a) + " (a transport carries those halos), so kernels cannot have "
                                 "written them; use exchange() (complete() is refused on every rank of this exchange)";
  }
  return halo;
}

void CommImpl::halo_exchange(HaloState& halo, Stream stream, bool copy) {
  const char* call = copy ? "HaloExchange::exchange" : "HaloExchange::complete";
  require_mpi_alive(call);
  if (halo.win->freed() || halo.sig->freed())
    throw Error(ErrorCode::InvalidArgument, where(call) + ": the window of this halo exchange (or its Comm) was freed");
  const WindowState& w = *halo.win;
  check_stream(w, stream, call);
  if (!copy && !halo.complete_refused.empty()) throw Error(ErrorCode::Unsupported, where(call) + ": " + halo.complete_refused);
  if (w.memory == Memory::Device) {
    DeviceScope scope(*device, stream, true, call);
    halo.device_plan->begin(stream, scope.capturing(), call);
    ++halo.epoch;  // issued from here on (a refused call is not counted)
    // Unmapped neighbours first: each transfer ends before the stream moves on, so their
    // data and signals are out before this rank waits for its own halos. Where the plan has
    // lanes, each neighbour's transfers go on a lane of their own, joined to the stream here.
    // A neighbour's last region, where it is contiguous, carries the signal in the same
    // transfer (one round trip through the transport instead of two).
    const std::uint64_t known = halo.device_plan->next_exchange(scope.capturing());
    bool issued = false;  // a put of this exchange returned (the first may raise an earlier failure)
    try {
      for (std::size_t k = 0; k < halo.transport_send_to.size(); ++k) {
        const int peer = halo.transport_send_to[k];
        const Stream lane = halo.device_plan->lane(stream, k, call);
        const std::size_t word = static_cast<std::size_t>(topo.rank);
        const SignalUpdate signal = known != 0 ? SignalUpdate{halo.sig.get(), word, known, SignalOp::Set}
                                               : SignalUpdate{halo.sig.get(), word, 1, SignalOp::Add};
        const HaloRegion* last = nullptr;
        for (const HaloRegion& r : halo.transport_sends)
          if (r.peer == peer) last = &r;
        bool signalled = false;
        for (const HaloRegion& r : halo.transport_sends) {
          if (r.peer != peer) continue;
          Transport& t = route(w, peer, call);
          const char* src = static_cast<const char*>(w.local) + r.src_offset;
          const bool contiguous = r.height == 1 || (r.src_pitch == r.width && r.dst_pitch == r.width);
          if (&r == last && contiguous && halo.sig->memory == w.memory && &route(*halo.sig, peer, call) == &t) {
            t.put(w, peer, r.dst_offset, src, r.width * r.height, signal, lane);
            signalled = true;
          } else {
            t.put_strided(w, peer, r.dst_offset, r.dst_pitch, src, r.src_pitch, r.width, r.height, lane);
          }
          issued = true;
        }
        if (!signalled) route(*halo.sig, peer, call).put(*halo.sig, peer, 0, nullptr, 0, signal, lane);
        issued = true;
      }
      halo.device_plan->join(stream, call);
    } catch (const std::exception& e) {
      // Lanes forked from a capturing stream must join it, or the caller's capture cannot end.
      try {
        halo.device_plan->join(stream, call);
      } catch (const std::exception& j) {
        log(LogLevel::Error, std::string(call) + ": after a failed exchange: " + j.what());
      }
      // Some neighbours may have their signal already: after a capture it is an addition, and a
      // retry would count that exchange twice there (their later waits would pass early).
      if (issued) halo.device_plan->fail(std::string("its transfers to unmapped neighbours failed part-way: ") + e.what());
      throw;
    }
    halo.device_plan->run(stream, copy, scope.capturing(), call);
    return;
  }
  const std::uint64_t epoch = ++halo.epoch;
  for (const HaloRegion& r : halo.sends) {
    if (!copy) break;
    Transport& t = route(w, r.peer, call);
    const char* src = static_cast<const char*>(w.local) + r.src_offset;
    if (r.height == 1 || (r.src_pitch == r.width && r.dst_pitch == r.width))
      t.put(w, r.peer, r.dst_offset, src, r.width * r.height, SignalUpdate{}, stream);
    else
      t.put_strided(w, r.peer, r.dst_offset, r.dst_pitch, src, r.src_pitch, r.width, r.height, stream);
  }
  // One signal per neighbour, after its data on the same transport.
  for (int r : halo.send_to)
    route(*halo.sig, r, call).put(*halo.sig, r, 0, nullptr, 0, SignalUpdate{halo.sig.get(), static_cast<std::size_t>(topo.rank), epoch, SignalOp::Set}, stream);
  // Host windows: wait until every neighbour's signal for this exchange is here.
  const auto* words = static_cast<const std::uint64_t*>(halo.sig->local);
  auto arrived = [&](int r) { return __atomic_load_n(words + r, __ATOMIC_ACQUIRE) >= epoch; };
  wait_host([&] { return std::all_of(halo.recv_from.begin(), halo.recv_from.end(), arrived); },
            [&] {
              std::vector<int> missing;
              for (int m : halo.recv_from)
                if (!arrived(m)) missing.push_back(m);
              return where(call) + ": the halos of exchange " + std::to_string(epoch) + " from rank(s) " +
                     rank_list(missing) + " did not arrive within " + describe_timeout(options.timeout);
            });
}

}  // namespace detail

HaloExchange::HaloExchange() = default;
HaloExchange::HaloExchange(std::unique_ptr<detail::HaloState> state) : state_(std::move(state)) {}
HaloExchange::HaloExchange(HaloExchange&&) noexcept = default;
HaloExchange& HaloExchange::operator=(HaloExchange&&) noexcept = default;
HaloExchange::~HaloExchange() = default;

void HaloExchange::exchange(Stream stream) {
  if (!state_) throw Error(ErrorCode::InvalidArgument, "HaloExchange::exchange: the exchange is empty (default-constructed or moved from)");
  if (state_->win->freed())
    throw Error(ErrorCode::InvalidArgument, "HaloExchange::exchange: the window of this halo exchange (or its Comm) was freed");
  state_->win->owner->halo_exchange(*state_, stream, true);
}

void HaloExchange::complete(Stream stream) {
  if (!state_) throw Error(ErrorCode::InvalidArgument, "HaloExchange::complete: the exchange is empty (default-constructed or moved from)");
  if (state_->win->freed())
    throw Error(ErrorCode::InvalidArgument, "HaloExchange::complete: the window of this halo exchange (or its Comm) was freed");
  state_->win->owner->halo_exchange(*state_, stream, false);
}

std::uint64_t HaloExchange::exchanges() const { return state_ ? state_->epoch : 0; }

const std::vector<int>& HaloExchange::neighbours() const {
  static const std::vector<int> none;
  return state_ ? state_->recv_from : none;
}

HaloExchange Comm::make_halo(const Window& win, const std::vector<HaloRegion>& sends) {
  if (!impl_) throw Error(ErrorCode::InvalidArgument, "meshmem::Comm: used after being moved from");
  impl_->require_mpi_alive("comm.make_halo");
  return HaloExchange(impl_->make_halo(win, sends));
}

}  // namespace meshmem
