// CapturedHandoff: how a step that a host thread carries out (a staged or nccl transfer, a
// barrier across nodes met by a proxy thread) runs on every replay of a CUDA graph.
//
// At capture the graph gets a host node that hands a copy of the request to its owner (the
// staging agent, the nccl proxy, the barrier proxy) and writes the ticket the owner returns
// into a word of its own, then a wait kernel that reads that ticket when it starts and waits
// until the owner's done word reaches it. The request, with the words it holds, lives as long
// as the graph (a CUDA user object). The owner may stop before the graph is destroyed: its
// board then says so, and neither callback touches it.
//
// A Policy says what differs between owners:
//   using Owner = ...;   using Request = ...;
//   static std::uint64_t submit(Owner&, const Request&);  // each replay: the ticket to wait for
//   static void release(Owner&, const Request&);         // the graph is gone: its words go back
//
// Two instantiations of one graph running at once share the request's words (a limit: their
// waits can then stall until MESHMEM_TIMEOUT).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "kernels.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

// What captured steps share with their owner. Host nodes and user-object destructors run on
// CUDA's threads, which may not call CUDA; they touch only this (and the owner while it is set).
template <class Owner>
struct HandoffBoard {
  std::mutex m;
  Owner* owner = nullptr;  // null once the owner stopped
  void set(Owner* o) {
    std::lock_guard<std::mutex> lock(m);
    owner = o;
  }
};

// How the captured wait kernel waits: until *done reaches the ticket read from *ticket_at; on
// timeout the fault record gets `fault` and `peer`.
struct TicketWait {
  const std::uint64_t* done = nullptr;
  std::uint64_t* ticket_at = nullptr;  // pinned host memory, written by the host node
  cuda::FaultKind fault = cuda::FaultKind::Transfer;
  int peer = -1;
  cuda::WaitLimit limit{};
  bool early = false;
};

template <class Policy>
class CapturedHandoff {
 public:
  using Owner = typename Policy::Owner;
  using Request = typename Policy::Request;
  using Board = HandoffBoard<Owner>;

  // Adds the host node and the wait kernel to the capture on `stream` (whose graph is
  // `graph`). Takes `request` and the words it holds: they go back through Policy::release
  // when the graph is destroyed, or before this raises. The caller holds the owner alive and
  // none of its locks.
  static void capture(const std::shared_ptr<Board>& board, Request request, const TicketWait& wait, cudaGraph_t graph,
                      cudaStream_t stream, const std::string& what) {
    auto captured = std::make_unique<Captured>(Captured{board, std::move(request), wait.ticket_at});
    __atomic_store_n(wait.ticket_at, 0, __ATOMIC_RELEASE);
    cudaUserObject_t object = nullptr;
    const cudaError_t rc = cudaUserObjectCreate(&object, captured.get(), &destroyed, 1, cudaUserObjectNoDestructorSync);
    if (rc != cudaSuccess) {
      give_back(*captured);
      ipc::check_cuda(rc, "cudaUserObjectCreate", what);
    }
    Captured* c = captured.release();  // the user object owns it now
    const cudaError_t kept = cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove);
    if (kept != cudaSuccess) {
      (void)cudaUserObjectRelease(object, 1);  // runs `destroyed`
      ipc::check_cuda(kept, "cudaGraphRetainUserObject", what);
    }
    // From here the graph owns the request: a failure below fails the capture, and the
    // graph's destruction gives the words back.
    ipc::check_cuda(cudaLaunchHostFunc(stream, &replay, c), "cudaLaunchHostFunc (captured hand-off)", what);
    const cudaError_t k =
        cuda::launch_ticket_wait(wait.done, 0, wait.ticket_at, wait.fault, wait.peer, wait.limit, stream, wait.early);
    if (k != cudaSuccess) ipc::check_cuda(k, "captured wait kernel launch", what);
  }

 private:
  struct Captured {
    std::shared_ptr<Board> board;
    Request request;
    std::uint64_t* ticket_at;
  };

  static void give_back(Captured& c) {
    std::lock_guard<std::mutex> lock(c.board->m);
    if (c.board->owner != nullptr) Policy::release(*c.board->owner, c.request);
  }

  static void CUDART_CB replay(void* p) {
    auto* c = static_cast<Captured*>(p);
    std::lock_guard<std::mutex> lock(c->board->m);
    // After the owner stopped nothing is written: the wait sees the last replay's ticket and
    // lets the stream pass with nothing done (replaying a graph whose Comm is gone is the
    // caller's error, as on every route).
    if (c->board->owner == nullptr) return;
    __atomic_store_n(c->ticket_at, Policy::submit(*c->board->owner, c->request), __ATOMIC_RELEASE);
  }

  // The graph's launches are complete: its replays' last writes to these words are done
  // (a transfer whose wait gave up may still run: the owner's release keeps its words then).
  static void CUDART_CB destroyed(void* p) {
    auto* c = static_cast<Captured*>(p);
    give_back(*c);
    delete c;
  }
};

}  // namespace meshmem::detail
