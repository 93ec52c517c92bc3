// Fault injection for tests (issue 13): hooks compiled into every build, so that CI drives the
// dead-peer and stall paths of the very code users run, deterministically, instead of timing
// signals from outside. MESHMEM_FAULT names, for a rank of the Comm, a point of the code and
// what happens when a thread of that rank reaches it:
//
//   MESHMEM_FAULT=<rank>:<point>:<action>[:hit=<n>][,...]
//     kill        the process dies at once, as in a crash (SIGKILL to itself: no unwinding,
//                 no MPI_Finalize, nothing flushed)
//     delay=<ms>  the thread sleeps that long, then goes on
//     stop=<ms>   the thread stops until the program resumes it (resume_stopped_faults(): tests
//                 that link the library's internals) or <ms> have passed
//     fail        the library call made at that point fails as if it had returned an error
//                 (only at points that say so: the parser refuses it elsewhere)
//     hit=<n>     on the n-th time that rank reaches the point (default: the first); each entry
//                 acts once
//
// The points are a fixed list (FaultPoint): an unknown name, a rank outside the Comm or a
// malformed action is refused with Error(InvalidArgument) when the Comm is made, so a typo
// cannot quietly disable the fault a test relies on. Unset, a point costs one predictable
// branch (FaultPlan::hit). CUDA-free and MPI-free.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "meshmem/config.hpp"

namespace meshmem::detail {

enum class FaultPoint : unsigned {
  CommStart,          // "comm.start": a Comm's constructor, before the Comm's communicator
                      // exists (late or dead there: the others cannot tell which rank is missing)
  CommJoined,         // "comm.joined": the communicator is made, before the ranks meet
                      // (late or dead there: the others name the rank)
  FdExchange,         // "fd.exchange": a descriptor exchange between node peers (alloc of a
                      // window shared on the node), before this rank offers its descriptor
  MpiPutAfterHeader,  // "mpi.put.after_header": an mpi transport put of more than 1 KiB (a
                      // smaller one is one message), its header sent and its data not yet
  MpiServePut,        // "mpi.serve.put": the target's progress thread (or a thread of it that
                      // waits and serves meanwhile) has a put's header (up to 1 KiB: with its
                      // bytes), before it takes the data in
  MpiServeGet,        // "mpi.serve.get": ... has a get's header, before sending the data
  MpiServeFlush,      // "mpi.serve.flush": ... has a flush (quiet), before answering it
  NcclConnect,        // "nccl.connect": the nccl transport's connect has its peers' NCCL ids,
                      // before it makes its NCCL communicators
  ProxyHeader,        // "proxy.header": a proxy thread of the nccl or mpi-device transport has a
                      // peer's header (a put, a get's request or answer, an acknowledgement),
                      // before it handles it
  LeadersEnqueue,     // "leaders.enqueue": a node leader's barrier(stream) across nodes, before it
                      // enqueues the all-reduce among the leaders (`fail`: ncclAllReduce fails)
  StagedCarry,        // "staged.carry": a staged transport agent has a node peer's descriptor (a
                      // chunk, or a get's request) from its channel, before it carries it out
  StagedAnswer,       // "staged.answer": a staged transport agent has posted a chunk of its
                      // answer to a node peer's get, before it goes on
  StagedCopyIn,       // "staged.copy_in": a staged transport agent enqueues the copies of node
                      // peers' chunks that one look at its channels took (`fail`: they fail)
  StagedEndsIn,       // "staged.ends_in": ... enqueues the stream writes that end them (signals,
                      // done words, consumed counts; `fail`: that enqueue fails)
  MpiCancel,          // "mpi.cancel": the mpi transport gives a transfer up and cancels its
                      // requests (`fail`: none ends, as a receive MPI has matched: all are kept)
};
constexpr unsigned kFaultPointCount = 15;
static_assert(static_cast<unsigned>(FaultPoint::MpiCancel) + 1 == kFaultPointCount,
              "a point added to FaultPoint is added to the count and to fault.cpp's list of names");

const char* to_string(FaultPoint point) noexcept;

enum class FaultAction { Kill, Delay, Stop, Fail };

struct FaultEntry {
  int rank = 0;
  FaultPoint point = FaultPoint::CommStart;
  FaultAction action = FaultAction::Kill;
  std::chrono::milliseconds duration{0};  // delay, or the longest stop
  unsigned hit = 1;                       // acts on this hit of the point
};

// MESHMEM_FAULT's parser and printer (the knob's; canonical text "none" when empty).
std::vector<FaultEntry> parse_faults(const char* var, const std::string& raw);
std::string print_faults(const std::vector<FaultEntry>& entries);

// One Comm's faults for this rank. Copies share their hit counts.
class FaultPlan {
 public:
  FaultPlan() = default;  // nothing armed
  // The entries of `options`' MESHMEM_FAULT for `rank`; raises Error(InvalidArgument) naming
  // the variable where an entry names a rank outside [0, size).
  FaultPlan(const Options& options, int rank, int size);

  // A thread of this rank reached `point`. True where the action taken is `fail`: the caller
  // fails its call there.
  bool hit(FaultPoint point) const { return armed_ ? take(point) : false; }
  bool armed() const { return armed_ != nullptr; }

 private:
  struct Armed;
  bool take(FaultPoint point) const;
  std::shared_ptr<Armed> armed_;
};

// For tests. Actions taken at `point` in this process so far, by any Comm: begun (a delay or
// stop counts when it begins), and delays and stops over (the thread goes on).
std::uint64_t faults_taken(FaultPoint point);
std::uint64_t faults_over(FaultPoint point);
// Ends every stop under way in this process (stops that begin later wait for the next call).
void resume_stopped_faults();

}  // namespace meshmem::detail
