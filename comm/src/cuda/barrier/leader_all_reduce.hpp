// LeaderAllReduce: the part of a hierarchical barrier(stream) that crosses nodes. The node
// leaders (the lowest rank of each node) run an ncclAllReduce of one word on the caller's
// stream, through an NCCL communicator of the leaders alone; the node's other ranks wait for
// their leader in the node barrier that follows (stream_barrier.cpp). Nothing waits on the
// host.
//
// The communicator is made as the nccl transport makes its own (nccl_library.hpp): bounded by
// MESHMEM_TIMEOUT, nonblocking, connected by one all-reduce, then split into a blocking one
// that shares its resources (a nonblocking communicator starts a thread of NCCL's per call).
//
// NCCL's all-reduce waits forever for a leader that never comes. The node barrier's kernel
// before the all-reduce stores an odd number into a pinned word once the stream reaches the
// all-reduce, and the one after it the next (even) number as it starts; a watchdog thread
// aborts the communicator when the word stayed odd for twice MESHMEM_TIMEOUT (so that a node
// barrier that waits for a dead rank of its node, bounded by the timeout, reports first and
// names that rank). The all-reduce then ends, the stream goes on (so that no synchronisation
// hangs) and the Comm's next call raises Timeout, naming the other leaders (which of them is
// late is not known to NCCL; with two nodes it is the other one). Before the abort the
// leader marks a word of each node peer's barrier flags, so that their node kernel after the
// all-reduce, which the leader's stream now reaches, reports the failure (naming their
// leader) instead of passing as if the other nodes had come. The communicator is gone from
// then on: this rank's barriers raise that error, and the node's other ranks, whose mark
// stays set, report LeadersFailed at each later barrier without waiting for their leader.
//
// Since NCCL 2.26 an abort or destroy waits until every CUDA graph that captured an operation
// of the communicator is destroyed; so communicators that may be held by graphs, or that a
// failure left in any state, are aborted or destroyed by a detached thread, and neither the
// watchdog nor ~Comm waits for the user's graphs.
//
// NCCL's rule for captured collectives holds for this barrier: a barrier(stream) captured into
// a graph on one leader must be captured (and replayed) on every leader, not run eagerly on
// some of them.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fault.hpp"
#include "transport.hpp"
#include "cuda/runtime/block_pool.hpp"
#include "cuda/runtime/cuda_owners.hpp"
#include "cuda/proxy/nccl_library.hpp"

namespace meshmem::detail {

class LeaderAllReduce {
 public:
  // Collective over the Comm: every rank takes part in the agreement; only leaders make a
  // communicator. `on_failure` hears a failure's message (from the watchdog's thread too).
  LeaderAllReduce(const CommContext& ctx, const NcclLibrary* lib, std::function<void(const std::string&)> on_failure);
  LeaderAllReduce(const LeaderAllReduce&) = delete;
  LeaderAllReduce& operator=(const LeaderAllReduce&) = delete;
  // Waits, bounded, for the streams to pass the all-reduces enqueued here (the watchdog still
  // watches), then destroys the communicator; aborts it where one did not pass or a failure
  // came first (a detached thread does, where graphs may hold it).
  ~LeaderAllReduce();

  bool leader() const { return leader_; }
  // Device address of the pinned word the node barrier's kernels store their numbers into;
  // null on ranks that are not leaders.
  std::uint64_t* passed_word() const { return passed_; }
  // Raises the failure of an earlier all-reduce (the communicator is gone since).
  void raise_failure(const std::string& what);
  // On a leader: the all-reduce on `stream` (captured too, where `capturing`). Raises the
  // failure of an earlier one first; a failure of its own ends the communicator too.
  void enqueue(cudaStream_t stream, bool capturing, const std::string& what);
  std::string describe() const;
  // Runs (under the lock, on the watchdog's thread or the caller's) when this leader gives up
  // an all-reduce, before the abort lets its stream go on: the node part marks the node's
  // other ranks (HierarchicalBarrier). Set once, before any barrier.
  void before_giving_up(std::function<void()> mark) { before_giving_up_ = std::move(mark); }

 private:
  void watch();
  // Under mutex_: records the failure, reports it, and hands the communicators to a detached
  // thread that aborts them.
  void fail(const std::string& failure);
  // Hands the communicators to a detached thread that aborts (or destroys) them: NCCL may wait
  // there for the user's graphs.
  void release_detached(bool abort);

  static constexpr int kInjectedFailure = 3;  // ncclInternalError, for MESHMEM_FAULT's `fail`
  const NcclLibrary* lib_;
  FaultPlan faults_;  // leaders.enqueue
  std::chrono::milliseconds timeout_;
  std::function<void(const std::string&)> on_failure_;
  std::function<void()> before_giving_up_;
  bool leader_ = false;
  std::vector<int> leaders_;  // the leaders' ranks, in NCCL rank order
  int rank_ = 0;
  PooledBlock passed_memory_;  // mapped host memory: the node kernels' numbers
  std::uint64_t* passed_ = nullptr;
  PooledBlock word_;  // the word the leaders all-reduce (its value means nothing)

  std::mutex mutex_;  // the communicator, failure_ and stop_ (abort must not race an enqueue)
  std::condition_variable wake_;
  NcclComm comm_;      // blocking: the all-reduces
  NcclComm root_;      // nonblocking, shares its resources with comm_
  std::string failure_;
  bool captured_ = false;      // some all-reduce went into a graph
  std::uint64_t eager_ = 0;    // all-reduces enqueued outside capture
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace meshmem::detail
