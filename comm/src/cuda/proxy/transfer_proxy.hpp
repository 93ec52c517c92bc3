// TransferProxy: the proxy thread of a rank for the nccl and mpi-device transports, and what
// it owns: the wire and the streams per peer, the headers' MPI communicator, the done words
// (through its HostAgentCore). ProxyTransport (proxy_transport.hpp) is the callers' side.
#pragma once

#include <cuda_runtime_api.h>
#include <mpi.h>

#include <chrono>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "bootstrap.hpp"
#include "fault.hpp"
#include "cuda/agent/host_agent.hpp"
#include "cuda/agent/landing_windows.hpp"
#include "cuda/proxy/proxy_request.hpp"
#include "cuda/proxy/proxy_wire.hpp"
#include "cuda/runtime/block_pool.hpp"
#include "cuda/runtime/event_pool.hpp"
#include "meshmem/error.hpp"

namespace meshmem::detail {

template <class Owner>
struct HandoffBoard;

// The proxy thread of a rank and what it owns: the wire and the streams per peer, the
// headers' MPI communicator, the done words.
class TransferProxy {
 public:
  // With `watchdog` (the callers' streams wait without a timeout of their own: memop waits),
  // a transfer that does not end within `timeout` is ended here, with an error.
  // `captured`: where replays of captured transfers ring (CapturedHandoff), polled by the thread.
  TransferProxy(const char* name, MpiComm control, std::map<int, PeerStreams> streams, std::unique_ptr<ProxyWire> wire,
                int rank, int device, std::chrono::milliseconds timeout, bool watchdog, FaultPlan faults,
                std::shared_ptr<HandoffBoard<TransferProxy>> captured);
  TransferProxy(const TransferProxy&) = delete;
  TransferProxy& operator=(const TransferProxy&) = delete;
  ~TransferProxy() { stop(false); }

  // Stops the thread, then the wire; with `abort` (transfers still in flight) the wire waits
  // for nothing (NCCL's destroy would wait for them: its communicators are aborted).
  void stop(bool abort) noexcept;

  std::uint64_t* word(std::size_t i) const { return core_.word(i); }
  const char* name() const { return name_; }

  // Events for the callers to record (callers' threads).
  EventPool& events() { return events_; }

  // A done word; with all in use (that many transfers in flight) waits for one, bounded.
  std::size_t take_word(const std::string& what) { return core_.take_word(what); }
  void release_word(std::size_t w) { core_.release_word(w); }
  // A done word that a CUDA graph holds for its life (a transfer's end does not free it);
  // false when all are in use.
  bool try_take_graph_word(std::size_t* w) { return core_.try_take_graph_word(w); }
  // The graph is gone; a transfer of it still in flight (its wait gave up) frees the word
  // when it ends.
  void release_graph_word(std::size_t w) { core_.release_graph_word(w); }

  // Queues a transfer; returns the ticket its done word reaches at its end.
  std::uint64_t submit(ProxyRequest r) { return core_.submit(r); }

  void add_window(std::uint64_t id, void* local, std::size_t bytes);
  // Nothing more is enqueued into the window; returns once what was has ended (bounded):
  // what the wire still holds (it may read or write the window later), then the streams
  // (StreamMarks: a device error counts as ended, as it does for the staged agent).
  bool remove_window(std::uint64_t id);

  // Waits until every transfer handed over ended (bounded by MESHMEM_TIMEOUT); false if not.
  bool drain() { return core_.drain(); }

  // The first error noted since the last call ("" if none), and its code.
  std::string take_error(ErrorCode* code) { return core_.take_error(code); }

 private:
  struct Incoming {  // work enqueued on a peer's in-stream, ended in order
    cudaEvent_t done = nullptr;  // recorded after the work (null until it is enqueued)
    bool settled = false;        // enqueued (or failed to be: then refused, without an event)
    std::function<void()> deferred;  // a byte-less one's settling, run in its turn
    bool dropped = false;            // bytes nobody waits for (taken off the wire only)
    std::chrono::steady_clock::time_point started{};  // this rank's get: when it started
    bool ended = false;              // this rank's get, ended by the watchdog (its bytes may land later)
    bool is_put = true;   // a peer's put: acknowledge `id` (Refused if `refused`)
    std::uint64_t id = 0;
    bool refused = false;
    std::size_t word = 0;  // this rank's get: its done word and ticket
    std::uint64_t ticket = 0;
  };
  struct Outgoing {  // a header in flight
    Message message;
    MPI_Request request = MPI_REQUEST_NULL;
  };

  std::string where() const { return std::string(name_) + " transport on rank " + std::to_string(rank_); }

  // Records the first error; transfers still end (their streams go on), and the caller's
  // next call raises it.
  void note_error(const std::string& e, ErrorCode code = ErrorCode::Cuda) { core_.note_error(e, code); }

  void end(std::size_t w, std::uint64_t ticket) { core_.end(w, ticket); }

  bool wait_streams();

  void send_header(int peer, const Message& m);

  void release_bounce(const ProxyRequest& r) noexcept;

  void start(ProxyRequest r);

  // Enqueues the receive of `bytes` from `peer` into `into`, then `then` and the record of
  // `in`'s done event on the peer's in-stream (at once or later: ProxyWire::recv). `in` is
  // queued now, so that the peer's transfers end in order; a failure of `then` ends it
  // refused, without an event.
  void receive(int peer, void* into, std::size_t bytes, Incoming in, std::function<void()> then, const std::string& from);

  // Settles the peer's byte-less transfers whose turn came (every one before them settled).
  void run_deferred(int peer);

  // Takes `bytes` from the peer's wire into scratch memory and drops them: the peer sent them,
  // so the wire must take them, or every later transfer from it would meet the wrong bytes.
  void drop(int peer, std::size_t bytes, Incoming in, const std::string& from);

  // A peer's header.
  void handle(int peer, const Message& m);

  // Ends the puts and gets (whose answer has not come) that outlived the timeout: the
  // callers' streams wait without a timeout of their own (memop waits). A put's late
  // acknowledgement is then ignored; a get's late bytes are taken off the wire and dropped.
  void watch();

  // Work that ended on the in-streams, in order per peer.
  bool finish_incoming();

  void run();

  std::shared_ptr<HandoffBoard<TransferProxy>> captured_;
  const char* name_;
  PooledBlock words_memory_;  // mapped host memory: the done words (zeroed)
  HostAgentCore<ProxyRequest> core_;  // the queue, the done words lent, the first error, stop
  MpiComm control_;
  std::map<int, PeerStreams> streams_;
  std::unique_ptr<ProxyWire> wire_;
  int rank_;
  int device_;
  std::chrono::milliseconds timeout_;
  bool watchdog_;  // ends transfers that outlive timeout_ (the callers' streams cannot time out)
  FaultPlan faults_;

  // The proxy thread's own.
  std::map<int, std::uint64_t> next_id_;
  struct PutInFlight {
    std::size_t word;
    std::uint64_t ticket;
    std::chrono::steady_clock::time_point started;
  };
  std::map<int, std::map<std::uint64_t, PutInFlight>> puts_;  // by peer, id
  std::map<int, std::set<std::uint64_t>> abandoned_puts_;     // ended by the watchdog, acknowledgement not yet in
  std::map<int, std::map<std::uint64_t, ProxyRequest>> gets_;
  std::map<int, std::deque<Incoming>> incoming_;
  bool wire_failed_ = false;
  std::chrono::steady_clock::time_point next_watch_{};
  std::list<Outgoing> outgoing_;

  LandingWindows windows_;  // where the wire's puts land and its gets are read (under its lock until enqueued)

  EventPool events_;
  std::thread thread_;
};

}  // namespace meshmem::detail
