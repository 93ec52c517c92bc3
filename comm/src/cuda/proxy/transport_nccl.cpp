#define MESHMEM_DEFINING_GPU_PART
#include "cuda/proxy/transport_nccl.hpp"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "backoff.hpp"
#include "bootstrap.hpp"
#include "fault.hpp"
#include "gpu_part.hpp"
#include "helper_cpus.hpp"
#include "knobs.hpp"
#include "log.hpp"
#include "strided_rows.hpp"
#include "topology.hpp"
#include "cuda/agent/captured_handoff.hpp"
#include "cuda/runtime/cuda_owners.hpp"
#include "cuda/runtime/gpu_device.hpp"
#include "cuda/runtime/stream_ops.hpp"
#include "cuda/runtime/event_pool.hpp"
#include "cuda/runtime/kernels.hpp"
#include "cuda/proxy/transport_nccl_knobs.hpp"
#include "meshmem/error.hpp"
#include "cuda/proxy/nccl_library.hpp"

namespace meshmem::detail {

namespace {

// MESHMEM_NCCL_LIBRARY: transport_nccl_knobs.hpp.

constexpr int kTagInit = 2;

// The NCCL_HOSTID that meshmem set in this process ("" if none): one per process, set once,
// as NCCL (2.23 on) reads the variable once per process. Each process is then a host of its
// own for NCCL, whatever grouping a Comm simulates (ranks of one simulated node never pair
// over NCCL here). A value that is not meshmem's is the user's, and kept.
std::mutex host_id_m;
std::string host_id_set;

bool user_set_host_id() {
  std::lock_guard<std::mutex> lock(host_id_m);
  const char* v = std::getenv("NCCL_HOSTID");
  return v != nullptr && v != host_id_set;
}

std::string process_host_id() {
  char name[256] = {};
  (void)gethostname(name, sizeof(name) - 1);
  return std::string(name) + "/meshmem-simulated-pid-" + std::to_string(getpid());
}

// Before NCCL's first communicator in this process reads it (setenv is not safe beside other
// threads' getenv: it runs once, on the thread that makes the Comm).
void set_host_id(const std::string& id) {
  std::lock_guard<std::mutex> lock(host_id_m);
  if (host_id_set == id) return;
  host_id_set = id;
  setenv("NCCL_HOSTID", id.c_str(), 1);
}

// Waits until no communicator of `comms` (nonblocking; [2i] to peers[i], [2i+1] from it) has
// work in progress, bounded by `deadline`. Raises NCCL's error, or Timeout naming the peers
// whose communicators are still busy (the caller aborts them).
void wait_for_nccl(const NcclLibrary& lib, const std::vector<NcclCommHandle>& comms, const std::vector<int>& peers,
                   const Deadline& deadline, const char* step, const std::string& what) {
  Backoff backoff;
  for (;;) {
    std::vector<int> busy;
    for (std::size_t i = 0; i < comms.size(); ++i) {
      int state = 0;
      lib.check(lib.comm_get_async_error(comms[i], &state), "ncclCommGetAsyncError", what);
      const int peer = peers[i / 2];
      if (state == NcclLibrary::kInProgress) {
        if (busy.empty() || busy.back() != peer) busy.push_back(peer);
      } else if (state != 0) {
        lib.check(state, ("NCCL's " + std::string(step) + " with rank " + std::to_string(peer)).c_str(), what);
      }
    }
    if (busy.empty()) return;
    // The communicators of one group end together: one late or dead peer holds up the others.
    if (deadline.expired())
      throw Error(ErrorCode::Timeout, what + ": NCCL's " + step + " with rank(s) " + rank_list(busy) +
                                          " did not end within " + describe_timeout(deadline.timeout()) +
                                          (busy.size() > 1 ? " (made in one group: one late or dead rank among them, "
                                                             "or a rank that they wait for in groups of their own, "
                                                             "holds up all)"
                                                           : "") +
                                          "; its communicators are aborted");
    backoff.pause();
  }
}

}  // namespace

// The NCCL communicators of one peer: one per direction, each split from a nonblocking one
// made and connected under MESHMEM_TIMEOUT (connect()).
struct NcclPeer {
  NcclComm out;  // this rank sends to the peer (this rank is 0, the peer 1)
  NcclComm in;   // the peer sends here (the peer is 0, this rank 1)
  NcclComm out_root, in_root;  // the nonblocking ones they were split from (sharing resources)
};

// ncclSend / ncclRecv on the proxy's stream per direction: stream-ordered both ways, so a
// receive's follow-up is enqueued at once.
class NcclWire final : public ProxyWire {
 public:
  NcclWire(const NcclLibrary* lib, std::map<int, NcclPeer> peers, std::chrono::milliseconds timeout)
      : lib_(lib), timeout_(timeout), peers_(std::move(peers)) {}
  ~NcclWire() override { stop(false); }
  void send(int peer, const void* src, std::size_t bytes, cudaStream_t stream, std::function<void()> after_read,
            const std::string& what) override {
    lib_->check(lib_->send(src, bytes, NcclLibrary::kInt8, 1, peers_.at(peer).out.get(), stream), "ncclSend", what);
    if (after_read) after_read();
  }
  void recv(int peer, void* dst, std::size_t bytes, cudaStream_t stream, std::function<void()> then,
            const std::string& what) override {
    lib_->check(lib_->recv(dst, bytes, NcclLibrary::kInt8, 0, peers_.at(peer).in.get(), stream), "ncclRecv", what);
    then();
  }
  // With `abort` the communicators are aborted, not destroyed (NCCL's destroy would wait for
  // transfers still in flight).
  // Runs more than once in a teardown (~Comm, ~ProxyTransport, ~TransferProxy): only the call
  // that hands communicators over waits for them.
  void stop(bool abort) noexcept override {
    bool handed = false;
    for (auto& [peer, p] : peers_) {
      for (NcclComm* c : {&p.out, &p.in, &p.out_root, &p.in_root}) {
        handed = handed || c->get() != nullptr;
        c->reset(abort);
      }
    }
    if (!abort && handed) await_nccl_destroys(timeout_, "nccl transport");
  }

 private:
  const NcclLibrary* lib_;
  std::chrono::milliseconds timeout_;
  std::map<int, NcclPeer> peers_;
};

std::unique_ptr<Transport> make_nccl_transport(const CommContext& ctx) { return std::make_unique<NcclTransport>(ctx); }

NcclTransport::NcclTransport(const CommContext& ctx) : ProxyTransport(ctx, "nccl") {
  const Topology& topo = ctx_.topo;
  // Every rank decides the same way (node_count and device availability are agreed), so the
  // gathering below is collective or skipped everywhere.
  if (device_ == nullptr || topo.node_count == 1) return;
  std::string why;
  lib_ = NcclLibrary::get(kNcclLibrary.get(ctx.options), &why);
  // Nodes simulated on one machine are hosts of their own for NCCL too: NCCL tells hosts apart
  // by NCCL_HOSTID (else hostname and boot id) and refuses two ranks of one host on one GPU in
  // a communicator, so each process gets an id of its own. Ranks of different simulated nodes
  // that share a GPU then pair up as ranks of different real nodes do (over NCCL's network
  // transport). A user's own NCCL_HOSTID is kept; such pairs then have no route.
  bool simulated_here = false;
  for (int r = 0; r < topo.size; ++r)
    simulated_here = simulated_here || (!topo.same_node(r) && topo.host_of[r] == topo.host_of[topo.rank]);
  if (lib_ != nullptr && simulated_here && !user_set_host_id()) host_id_ = process_host_id();
  // Bit 0: NCCL loaded; bit 1: this process has an NCCL host id of its own.
  const std::int32_t mine = (lib_ != nullptr ? 1 : 0) | (host_id_.empty() ? 0 : 2);
  std::vector<std::int32_t> all(static_cast<std::size_t>(topo.size));
  ctx_.boot.allgather(&mine, all.data(), sizeof(mine), "meshmem::Comm (nccl transport)");
  const std::vector<std::string>& bus = device_->bus_ids();
  for (int r = 0; r < topo.size; ++r) {
    if (topo.same_node(r)) continue;
    if (lib_ == nullptr)
      no_route_[r] = "NCCL is not loaded here: " + why;
    else if ((all[r] & 1) == 0)
      no_route_[r] = "rank " + std::to_string(r) + " could not load NCCL (its log says why)";
    else if (topo.host_of[r] == topo.host_of[topo.rank] && bus[r] == bus[topo.rank] &&
             (host_id_.empty() || (all[r] & 2) == 0))
      no_route_[r] = "rank " + std::to_string(r) + " uses this rank's GPU " + bus[r] +
                     " (nodes simulated on one machine) and NCCL_HOSTID is set by the user, so NCCL sees one "
                     "host and puts one rank per GPU in a communicator";
  }
}

void NcclTransport::connect(const std::vector<bool>& routed) {
  const std::string what = "meshmem::Comm (nccl transport) on rank " + std::to_string(ctx_.topo.rank);
  require_thread_multiple("turns requests into NCCL transfers");
  MpiComm control = MpiComm::dup(ctx_.boot.comm(), what, ctx_.options.timeout);
  std::vector<int> peers;
  for (int r = 0; r < ctx_.topo.size; ++r)
    if (routed[r]) peers.push_back(r);
  // Ranks of other simulated nodes on this machine are reached as ranks of other real nodes
  // are: through NCCL's network transport, not its peer-to-peer or shared-memory ones (with
  // NCCL's P2P transport between two such communicators per pair the 2 x H200 runs hung at
  // the first transfers; not understood yet). Set before NCCL's first initialisation reads
  // them; a user's own values are kept.
  bool same_machine = false;
  for (int r : peers) same_machine = same_machine || ctx_.topo.host_of[r] == ctx_.topo.host_of[ctx_.topo.rank];
  if (same_machine) {
    for (const char* var : {"NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE"})
      if (std::getenv(var) == nullptr) setenv(var, "1", 0);
    log(LogLevel::Info, "nccl transport: peers on simulated nodes of this machine: NCCL_P2P_DISABLE and "
                        "NCCL_SHM_DISABLE set (unless given), so NCCL reaches them over its network transport");
  }
  if (!host_id_.empty()) set_host_id(host_id_);  // before this Comm's NCCL communicators are made
  if (!peers.empty()) (void)cuda::preload_kernels();  // see the lazy-loading note of transport_staged.hpp
  std::map<int, PeerStreams> streams;
  std::map<int, NcclPeer> comms;
  PooledBlock scratch;  // the connection transfers' bytes
  agreed_step(ctx_.boot, "meshmem::Comm (nccl transport)", [&] {
    if (peers.empty()) return;  // some other ranks use nccl, this one does not
    // The sender of each direction makes its unique id and gives it to the receiver.
    std::vector<NcclUniqueId> out_ids(peers.size()), in_ids(peers.size());
    std::vector<MPI_Request> requests;
    for (std::size_t i = 0; i < peers.size(); ++i) {
      lib_->check(lib_->get_unique_id(&out_ids[i]), "ncclGetUniqueId", what);
      requests.emplace_back();
      check_mpi(MPI_Isend(&out_ids[i], sizeof(NcclUniqueId), MPI_BYTE, peers[i], kTagInit, control.get(), &requests.back()),
                "MPI_Isend (NCCL id)", what);
      requests.emplace_back();
      check_mpi(MPI_Irecv(&in_ids[i], sizeof(NcclUniqueId), MPI_BYTE, peers[i], kTagInit, control.get(), &requests.back()),
                "MPI_Irecv (NCCL id)", what);
    }
    for (MPI_Request& q : requests)
      if (!ctx_.boot.wait(&q, what + ": NCCL ids"))
        throw Error(ErrorCode::Timeout, what + ": a peer's NCCL id did not come within MESHMEM_TIMEOUT");
    ctx_.faults.hit(FaultPoint::NcclConnect);
    // Bounded by MESHMEM_TIMEOUT, where NCCL's own initialisation would wait for a late or
    // dead peer forever: each direction's communicator is first made nonblocking (NCCL makes
    // it in the background; aborted when the time is up) and connected (a byte each way,
    // grouped, so that no later ncclSend waits on the host for a peer's side of a
    // connection), then split into a blocking one that shares its resources and connections.
    // Transfers go through the blocking ones: on a nonblocking communicator every ncclSend
    // would start a thread of NCCL's (about 50 us here).
    const Deadline deadline(ctx_.options.timeout);
    std::vector<NcclCommHandle> handles(2 * peers.size(), nullptr);  // [2i]: to peers[i], [2i+1]: from it
    // The split's children: NCCL writes them when its split job ends, also after a failure
    // or an abort of their parents, so this outlives that abort.
    std::vector<NcclCommHandle> children(handles.size(), nullptr);
    std::vector<NcclComm> roots;
    roots.reserve(handles.size());
    // Until the pairs hold them, every communicator made here is aborted on the way out (a
    // destroy would wait for work of a peer that may never come): the roots first, which
    // ends their split job, then the children it made.
    struct AbortOnExit {
      const NcclLibrary* lib;
      std::vector<NcclComm>& roots;
      std::vector<NcclCommHandle>& children;
      bool kept = false;
      ~AbortOnExit() {
        if (kept) return;
        for (NcclComm& c : roots) c.reset(true);
        for (NcclCommHandle& h : children)
          if (h != nullptr) NcclComm(lib, std::exchange(h, nullptr)).reset(true);
      }
    } abort_on_exit{lib_, roots, children};
    // A call that fails inside a group still ends the group (NCCL keeps it per thread).
    int failed_rc = 0;
    const char* failed_call = nullptr;
    const auto note = [&](int rc, const char* call) {
      if (rc != 0 && rc != NcclLibrary::kInProgress && failed_call == nullptr) failed_rc = rc, failed_call = call;
    };
    const auto end_group = [&](const char* call) {
      const int rc = lib_->group_end();
      if (failed_call != nullptr) lib_->check(failed_rc, failed_call, what);
      if (rc != NcclLibrary::kInProgress) lib_->check(rc, call, what);
    };
    NcclConfig nonblocking = NcclConfig::make(false, true);
    // NCCL's threads start in here with this thread's CPUs: not on a caller bound to one core.
    const CallerOnHelperCpus on_helper_cpus;
    lib_->check(lib_->group_start(), "ncclGroupStart", what);
    for (std::size_t i = 0; i < peers.size(); ++i) {
      const int a = lib_->comm_init_rank_config(&handles[2 * i], 2, out_ids[i], 0, &nonblocking);
      const int b = lib_->comm_init_rank_config(&handles[2 * i + 1], 2, in_ids[i], 1, &nonblocking);
      for (NcclCommHandle h : {handles[2 * i], handles[2 * i + 1]})
        if (h != nullptr) roots.emplace_back(lib_, h);
      note(a, "ncclCommInitRankConfig (to the peer)");
      note(b, "ncclCommInitRankConfig (from the peer)");
    }
    end_group("ncclGroupEnd (communicator initialisation)");
    wait_for_nccl(*lib_, handles, peers, deadline, "initialisation", what);
    scratch = take_block(BlockMemory::Device, -1, 2 * peers.size(), what);
    void* bytes = scratch.get();
    for (int peer : peers) {
      PeerStreams& p = streams[peer];
      p.out = std::make_unique<OwnedStream>(what);
      p.in = std::make_unique<OwnedStream>(what);
    }
    lib_->check(lib_->group_start(), "ncclGroupStart", what);
    for (std::size_t i = 0; i < peers.size(); ++i) {
      PeerStreams& p = streams[peers[i]];
      note(lib_->send(static_cast<char*>(bytes) + 2 * i, 1, NcclLibrary::kInt8, 1, handles[2 * i], p.out->get()),
           "ncclSend (connection)");
      note(lib_->recv(static_cast<char*>(bytes) + 2 * i + 1, 1, NcclLibrary::kInt8, 0, handles[2 * i + 1],
                      p.in->get()),
           "ncclRecv (connection)");
    }
    end_group("ncclGroupEnd (connections)");
    wait_for_nccl(*lib_, handles, peers, deadline, "connection", what);
    for (std::size_t i = 0; i < peers.size(); ++i) {
      PeerStreams& p = streams[peers[i]];
      for (cudaStream_t st : {p.out->get(), p.in->get()})
        if (!stream_ends_by(st, deadline, "cudaStreamQuery (connection)", what))
          throw Error(ErrorCode::Timeout, what + ": NCCL's first transfer with rank " + std::to_string(peers[i]) +
                                              " did not end within " + describe_timeout(deadline.timeout()) +
                                              "; its communicators are aborted");
    }
    NcclConfig blocking = NcclConfig::make(true, false);
    lib_->check(lib_->group_start(), "ncclGroupStart", what);
    for (std::size_t i = 0; i < handles.size(); ++i)
      note(lib_->comm_split(handles[i], 0, static_cast<int>(i % 2), &children[i], &blocking), "ncclCommSplit");
    end_group("ncclGroupEnd (split)");
    wait_for_nccl(*lib_, handles, peers, deadline, "split into blocking communicators", what);
    for (std::size_t i = 0; i < handles.size(); ++i)
      if (children[i] == nullptr)
        throw Error(ErrorCode::Internal, what + ": ncclCommSplit ended without a communicator (with rank " +
                                             std::to_string(peers[i / 2]) + ")");
    for (std::size_t i = 0; i < peers.size(); ++i) {
      NcclPeer& p = comms[peers[i]];
      p.out = NcclComm(lib_, children[2 * i]);
      p.in = NcclComm(lib_, children[2 * i + 1]);
      p.out_root = std::move(roots[2 * i]);
      p.in_root = std::move(roots[2 * i + 1]);
    }
    abort_on_exit.kept = true;  // `comms` owns every communicator now
    start_proxy(std::move(control), std::move(streams), std::make_unique<NcclWire>(lib_, std::move(comms), ctx_.options.timeout));
  });
  if (proxy_)
    log(LogLevel::Info, "nccl transport: NCCL " + lib_->version_text() + " (" + lib_->path + "), " +
                          std::to_string(peers.size()) + " peers, two communicators each");
}

std::string NcclTransport::describe() const {
  if (!lib_) return "";
  const std::string host = host_id_.empty() ? "" : ", NCCL_HOSTID " + host_id_;
  return "NCCL " + lib_->version_text() + " (" + lib_->path + ")" + host + (proxy_ ? "" : ", not connected");
}

}  // namespace meshmem::detail
