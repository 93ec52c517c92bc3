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
// all-reduce, and the one after it the next (even) number; a watchdog thread aborts the
// communicator when the word stayed odd for MESHMEM_TIMEOUT. The all-reduce then ends, the
// stream goes on (so that no synchronisation hangs) and the Comm's next call raises Timeout,
// naming the other leaders (which of them is late is not known to NCCL; with two nodes it is
// the other one). The communicator is gone from then on: barriers raise that error, and graphs
// captured with such a barrier must not be replayed.
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

#include "../transport.hpp"
#include "device_runtime.hpp"
#include "nccl_library.hpp"

namespace meshmem::detail {

class LeaderAllReduce {
 public:
  // Collective over the Comm: every rank takes part in the agreement; only leaders make a
  // communicator. `on_failure` hears the watchdog's message (from its thread).
  LeaderAllReduce(const CommContext& ctx, const NcclLibrary* lib, std::function<void(const std::string&)> on_failure);
  LeaderAllReduce(const LeaderAllReduce&) = delete;
  LeaderAllReduce& operator=(const LeaderAllReduce&) = delete;
  // Lets streams pass the all-reduces enqueued here (the watchdog still watches), then
  // destroys the communicator (aborts it after a failure).
  ~LeaderAllReduce();

  bool leader() const { return leader_; }
  // Device address of the pinned word the node barrier's kernels store their numbers into;
  // null on ranks that are not leaders.
  std::uint64_t* passed_word() const { return passed_device_; }
  // Raises the failure of an earlier all-reduce (the communicator is gone since).
  void raise_failure(const std::string& what);
  // On a leader: the all-reduce on `stream` (captured too, if the stream captures). Raises
  // the failure of an earlier one first.
  void enqueue(cudaStream_t stream, const std::string& what);
  std::string describe() const;

 private:
  void watch();

  struct FreeHost {
    void operator()(std::uint64_t* p) const noexcept { (void)cudaFreeHost(p); }
  };

  const NcclLibrary* lib_;
  std::chrono::milliseconds timeout_;
  std::function<void(const std::string&)> on_failure_;
  bool leader_ = false;
  std::vector<int> leaders_;  // the leaders' ranks, in NCCL rank order
  int rank_ = 0;
  std::unique_ptr<std::uint64_t, FreeHost> passed_;  // pinned: the node kernels' numbers
  std::uint64_t* passed_device_ = nullptr;
  DevicePtr word_;  // the word the leaders all-reduce (its value means nothing)

  std::mutex mutex_;  // the communicator, failure_ and stop_ (abort must not race an enqueue)
  std::condition_variable wake_;
  NcclComm comm_;      // blocking: the all-reduces
  NcclComm root_;      // nonblocking, shares its resources with comm_
  std::string failure_;
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace meshmem::detail
