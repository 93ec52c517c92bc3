#include "cuda/barrier/leader_all_reduce.hpp"

#include <algorithm>
#include <cstring>
#include <optional>

#include "backoff.hpp"
#include "bootstrap.hpp"
#include "fault.hpp"
#include "log.hpp"
#include "topology.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

namespace {

// A step among the leaders that did not end within `deadline`.
Error leaders_late(const char* step, const Deadline& deadline, const std::string& leaders, const std::string& what) {
  return Error(ErrorCode::Timeout, what + ": " + step + " among the node leaders (ranks " + leaders +
                                       ") did not end within " + describe_timeout(deadline.timeout()) +
                                       ": a leader is late or dead; the communicator is aborted");
}

// Waits until `comm` (nonblocking) has no work in progress, bounded by `deadline`.
void wait_until_settled(const NcclLibrary& lib, NcclCommHandle comm, const Deadline& deadline, const char* step,
                        const std::string& leaders, const std::string& what) {
  Backoff backoff;
  for (;;) {
    int state = 0;
    lib.check(lib.comm_get_async_error(comm, &state), "ncclCommGetAsyncError", what);
    if (state == 0) return;
    if (state != NcclLibrary::kInProgress) lib.check(state, step, what);
    if (deadline.expired()) throw leaders_late(step, deadline, leaders, what);
    backoff.pause();
  }
}

void wait_for_stream(cudaStream_t stream, const Deadline& deadline, const char* step, const std::string& leaders,
                     const std::string& what) {
  if (!stream_ends_by(stream, deadline, "cudaStreamQuery", what)) throw leaders_late(step, deadline, leaders, what);
}

}  // namespace

LeaderAllReduce::LeaderAllReduce(const CommContext& ctx, const NcclLibrary* lib,
                                 std::function<void(const std::string&)> on_failure)
    : lib_(lib), faults_(ctx.faults), timeout_(ctx.options.timeout), on_failure_(std::move(on_failure)),
      rank_(ctx.topo.rank) {
  const Topology& topo = ctx.topo;
  std::vector<bool> seen(static_cast<std::size_t>(topo.node_count), false);
  for (int r = 0; r < topo.size; ++r)
    if (!seen[topo.node_of[r]]) seen[topo.node_of[r]] = true, leaders_.push_back(r);
  const auto me = std::find(leaders_.begin(), leaders_.end(), rank_);
  leader_ = me != leaders_.end();
  const int index = static_cast<int>(me - leaders_.begin());
  const std::string what = "meshmem::Comm (barrier(stream): the node leaders' NCCL communicator) on rank " +
                           std::to_string(rank_);
  const std::string leaders = rank_list(leaders_);

  // The first leader's unique id reaches every rank (the others ignore it).
  NcclUniqueId mine{};
  agreed_step(ctx.boot, what, [&] {
    if (rank_ == leaders_.front()) lib_->check(lib_->get_unique_id(&mine), "ncclGetUniqueId", what);
  });
  std::vector<NcclUniqueId> all(static_cast<std::size_t>(topo.size));
  ctx.boot.allgather(&mine, all.data(), sizeof(NcclUniqueId), what);

  agreed_step(ctx.boot, what, [&] {
    if (!leader_) return;
    passed_memory_ = take_block(BlockMemory::MappedHost, -1, sizeof(std::uint64_t), what);  // zeroed
    passed_ = static_cast<std::uint64_t*>(passed_memory_.get());
    device_array(word_, std::vector<std::uint64_t>(1, 0), what);

    // The split's child: NCCL writes it when its split job ends, also after a failure or an
    // abort of the root, so it outlives that abort.
    NcclCommHandle child = nullptr;
    // Every communicator made here is aborted if a step fails (a destroy would wait for a
    // leader that may never come): the root first, which ends its split job, then the child.
    struct AbortOnExit {
      LeaderAllReduce& self;
      NcclCommHandle& child;
      bool kept = false;
      ~AbortOnExit() {
        if (kept) return;
        self.root_.reset(true);
        if (self.comm_.get() == nullptr && child != nullptr) NcclComm(self.lib_, child).reset(true);
        self.comm_.reset(true);
      }
    } abort_on_exit{*this, child};
    // Three quarters of the timeout: the node's other ranks wait for this step in the
    // Bootstrap's agreement, bounded by the whole timeout; NCCL's message must come first.
    const Deadline deadline(timeout_.count() > 0 ? std::max(timeout_ * 3 / 4, std::chrono::milliseconds(1)) : timeout_);
    NcclConfig nonblocking = NcclConfig::make(false, true);
    NcclCommHandle root = nullptr;
    const int rc = lib_->comm_init_rank_config(&root, static_cast<int>(leaders_.size()), all[leaders_.front()], index,
                                               &nonblocking);
    if (root != nullptr) root_ = NcclComm(lib_, root);
    if (rc != NcclLibrary::kInProgress) lib_->check(rc, "ncclCommInitRankConfig", what);
    wait_until_settled(*lib_, root, deadline, "ncclCommInitRankConfig", leaders, what);
    // One all-reduce connects the leaders, so that no later one waits on the host for them.
    OwnedStream stream(what);
    const int ar = lib_->all_reduce(word_.get(), word_.get(), 1, NcclLibrary::kUint64, NcclLibrary::kSum, root,
                                    stream.get());
    if (ar != NcclLibrary::kInProgress) lib_->check(ar, "ncclAllReduce (connection)", what);
    wait_until_settled(*lib_, root, deadline, "the first ncclAllReduce", leaders, what);
    wait_for_stream(stream.get(), deadline, "the first ncclAllReduce", leaders, what);
    NcclConfig blocking = NcclConfig::make(true, false);
    const int sp = lib_->comm_split(root, 0, index, &child, &blocking);
    if (sp != NcclLibrary::kInProgress) lib_->check(sp, "ncclCommSplit", what);
    wait_until_settled(*lib_, root, deadline, "ncclCommSplit", leaders, what);
    if (child == nullptr)
      throw Error(ErrorCode::Internal, what + ": ncclCommSplit ended without a communicator");
    comm_ = NcclComm(lib_, child);
    // The split shares the root's connections; this checks that the blocking one works.
    lib_->check(lib_->all_reduce(word_.get(), word_.get(), 1, NcclLibrary::kUint64, NcclLibrary::kSum, child,
                                 stream.get()),
                "ncclAllReduce (first on the blocking communicator)", what);
    wait_for_stream(stream.get(), deadline, "the first ncclAllReduce of the blocking communicator", leaders, what);
    abort_on_exit.kept = true;
  });
  if (leader_ && timeout_.count() > 0) watchdog_ = std::thread([this] { watch(); });
}

LeaderAllReduce::~LeaderAllReduce() {
  // The eager all-reduces are passed once the word is even and at twice their count (graph
  // replays only add to it). Bounded: the watchdog ends an all-reduce within twice the
  // timeout; the stream may also never get there (it waits for something else).
  bool passed_all = true;
  if (leader_) {
    const Deadline deadline(timeout_.count() > 0 ? 2 * timeout_ + std::chrono::milliseconds(1000)
                                                 : std::chrono::milliseconds(0));
    Backoff backoff;
    for (;;) {
      const std::uint64_t passed = __atomic_load_n(passed_, __ATOMIC_ACQUIRE);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!failure_.empty()) break;
      }
      if (passed % 2 == 0 && passed >= 2 * eager_) break;
      if (deadline.expired()) {
        passed_all = false;
        break;
      }
      backoff.pause();
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  if (comm_.get() == nullptr && root_.get() == nullptr) return;  // a failure released them
  if (!passed_all) {
    log(LogLevel::Warn, "barrier(stream) across nodes on rank " + std::to_string(rank_) +
                            ": at ~Comm this rank's stream had not passed its last all-reduce among the node leaders "
                            "within twice MESHMEM_TIMEOUT; the leaders' NCCL communicator is aborted");
    if (before_giving_up_) before_giving_up_();
    release_detached(true);
  } else if (captured_) {
    release_detached(false);  // graphs that captured the all-reduce may still exist
  } else {
    comm_.reset(false);
    root_.reset(false);
    await_nccl_destroys(timeout_, "barrier(stream) across nodes on rank " + std::to_string(rank_) + " (the leaders' all-reduce)");
  }
}

void LeaderAllReduce::release_detached(bool abort) {
  std::thread([comm = std::move(comm_), root = std::move(root_), abort]() mutable {
    comm.reset(abort);
    root.reset(abort);
  }).detach();
}

void LeaderAllReduce::fail(const std::string& failure) {
  failure_ = failure;
  // Reported before the abort lets the stream go on: a caller that synchronises with the
  // stream, then calls the Comm, must find the failure there; and the node's other ranks
  // must find their mark once this rank's node kernel after the all-reduce lets them pass.
  if (on_failure_) on_failure_(failure_);
  if (before_giving_up_) before_giving_up_();
  release_detached(true);
}

void LeaderAllReduce::watch() {
  std::unique_lock<std::mutex> lock(mutex_);
  std::uint64_t watched = 0;  // an odd number: the stream is at that barrier's all-reduce
  std::optional<Deadline> deadline;
  const std::chrono::milliseconds limit = 2 * timeout_;
  while (!stop_ && failure_.empty()) {
    // A few milliseconds of precision are enough for a timeout of seconds.
    wake_.wait_for(lock, std::chrono::milliseconds(5));
    if (stop_) return;
    const std::uint64_t passed = __atomic_load_n(passed_, __ATOMIC_ACQUIRE);
    if (passed % 2 == 0) {
      deadline.reset();
      continue;
    }
    if (!deadline || passed != watched) {
      watched = passed;
      deadline.emplace(limit);
      continue;
    }
    if (!deadline->expired()) continue;
    std::vector<int> others;
    for (int r : leaders_)
      if (r != rank_) others.push_back(r);
    fail("rank " + std::to_string(rank_) + " (the leader of its node) waited " + describe_timeout(limit) +
         " (twice MESHMEM_TIMEOUT) in barrier(stream) number " + std::to_string((watched + 1) / 2) +
         " for the all-reduce among the node leaders; leader rank(s) " + rank_list(others) +
         " did not come (late or dead); the leaders' NCCL communicator was aborted");
    return;
  }
}

namespace {
[[noreturn]] void raise(const std::string& what, const std::string& failure) {
  throw Error(ErrorCode::Timeout, what + ": an earlier barrier(stream) across nodes failed: " + failure);
}
}  // namespace

void LeaderAllReduce::raise_failure(const std::string& what) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!failure_.empty()) raise(what, failure_);
}

void LeaderAllReduce::enqueue(cudaStream_t stream, bool capturing, const std::string& what) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!failure_.empty()) raise(what, failure_);
  const bool injected = faults_.hit(FaultPoint::LeadersEnqueue);
  const int rc = injected ? kInjectedFailure
                          : lib_->all_reduce(word_.get(), word_.get(), 1, NcclLibrary::kUint64, NcclLibrary::kSum,
                                             comm_.get(), stream);
  if (rc != 0) {
    // Raised here; later barriers raise it again (the communicator is gone).
    const std::string failure = what + ": ncclAllReduce (barrier(stream) among the node leaders) failed: " +
                                lib_->error_string(rc) + " (ncclResult_t " + std::to_string(rc) +
                                (injected ? ", injected by MESHMEM_FAULT" : "") +
                                "); the leaders' NCCL communicator was aborted";
    failure_ = failure;
    // The node kernel after it still runs (HierarchicalBarrier keeps the pairs): the node's
    // other ranks learn of it there.
    if (before_giving_up_) before_giving_up_();
    release_detached(true);
    throw Error(ErrorCode::Cuda, failure);
  }
  if (capturing)
    captured_ = true;
  else
    ++eager_;
}

std::string LeaderAllReduce::describe() const {
  return "an NCCL " + lib_->version_text() + " all-reduce among the node leaders (ranks " + rank_list(leaders_) + ")";
}

}  // namespace meshmem::detail
