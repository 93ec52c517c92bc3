// MpiTransport: reaches any rank, on this node or another. Each rank runs a progress thread
// that serves one-sided requests (put, get, signal, flush) over two-sided MPI on a
// communicator of its own, so a put completes without the target making any call. Needs
// MPI_THREAD_MULTIPLE. The thread polls with backoff: it never spins without yielding, and
// sleeps up to MESHMEM_MPI_IDLE_SLEEP between polls once nothing came for 200 ms (MPI cannot
// wake it when a message comes), so a request to an idle rank waits for its next poll.
//
// The serving side never waits for one origin: a put's data, a get's answer or a flush's
// answer in flight with an origin is a transfer that each serving pass tests, and requests
// that origin sends meanwhile wait behind it (its order is kept); other origins are served as
// usual. A transfer that makes no progress for MESHMEM_TIMEOUT is given up (a put is dropped).
//
// After a timeout (a peer stalled, stopped or dead): every MPI request the timed-out call
// posted is cancelled, and one that cannot be (already matched) is kept with its memory until
// it ends, so nothing lands in freed memory; a receive into the caller's memory that was
// cancelled writes nothing later (the error says whether every one was). Payloads and answers
// carry a tag of their own (from the header), so a late answer to a call that gave up never
// matches a later call: the progress thread receives and drops it. The peer is then failed
// for this transport: later calls involving it raise at once, naming the first error,
// instead of waiting a whole timeout each (teardown after a dead peer).
#pragma once

#include <mpi.h>

#include <atomic>
#include <deque>
#include <memory>
#include <string>
#include <mutex>
#include <set>
#include <utility>
#include <thread>
#include <unordered_map>
#include <vector>

#include "bootstrap.hpp"
#include "mpi_given_up.hpp"
#include "transport.hpp"

namespace meshmem::detail {

class MpiTransport final : public Transport {
 public:
  explicit MpiTransport(const CommContext& ctx);
  ~MpiTransport() override;  // stops the progress thread; the Comm has quieted and agreed

  TransportKind kind() const override { return TransportKind::Mpi; }
  Capabilities capabilities() const override { return Capabilities{false, false, true, false}; }
  bool serves(Memory memory) const override { return memory == Memory::Host; }
  Reach reach(int rank, Memory memory) const override;
  // Collective: checks MPI_THREAD_MULTIPLE (on every rank), duplicates the communicator
  // twice and starts the progress thread.
  void connect(const std::vector<bool>& routed) override;
  // Registers the window with the progress thread (before any peer can learn of it: the
  // Comm agrees after attaching); the attachment unregisters it.
  std::unique_ptr<WindowAttachment> attach(WindowState& win, const std::vector<bool>& routed,
                                           const std::string& what) override;
  void put(const WindowState& win, int target, std::size_t offset, const void* src,
           std::size_t bytes, const SignalUpdate& signal, Stream stream) override;
  void get(void* dst, const WindowState& win, int target, std::size_t offset,
           std::size_t bytes, Stream stream) override;
  void quiet(Stream stream) override;
  bool progress() override { return serve_one(); }
  std::optional<std::chrono::microseconds> progress_sleep() const override { return idle_sleep_; }
  void waiter_begins() override { waiting_servers_.fetch_add(1, std::memory_order_acq_rel); }
  void waiter_ends() override { waiting_servers_.fetch_sub(1, std::memory_order_acq_rel); }

  // Windows the progress thread may serve, by id.
  void register_window(const WindowState& win);
  // Gives up the transfers into or out of window `id` still under way; where MPI may still
  // use the window's memory for them, they keep `memory` (if given) until they end.
  void unregister_window(std::uint64_t id, const std::shared_ptr<WindowMemory>& memory);

  // Stops the progress thread; also called when MPI_Finalize starts (MPI_COMM_SELF
  // attribute), so that the thread never calls MPI after it.
  void stop() noexcept override;

  // Tests the transfers in flight and takes at most one new request, unless another thread is
  // serving; true if a request was taken or a transfer ended.
  // Threads that wait (wait_until, the transport's own waits) call it: handing each request
  // to the progress thread instead costs scheduler round trips when ranks share few cores
  // (12 us one way measured on 2 cores, against about 1 us served by the waiter).
  bool serve_one();

 private:
  // While one of these lives, a thread is waiting and serving (serve_one) itself, and the
  // progress thread stands aside: two servers would hand requests back and forth.
  class ServingWait {
   public:
    explicit ServingWait(MpiTransport* t) : t_(t) {
      if (t_) t_->waiter_begins();
    }
    ~ServingWait() {
      if (t_) t_->waiter_ends();
    }
    ServingWait(const ServingWait&) = delete;
    ServingWait& operator=(const ServingWait&) = delete;

   private:
    MpiTransport* t_;
  };

  struct Region {
    char* base;
    std::size_t bytes;
  };
  struct Request;
  struct Transfer;  // a request's data in flight with its origin (transport_mpi.cpp)

  void serve();
  // Starts serving a request of `source`: applied at once, or left in flight as its origin's
  // transfer. `payload`: a small put's bytes, which came in the request's message (carries_bytes).
  void handle(const Request& req, const char* payload, int source);
  // Takes a request that came from `source`: handled now, or queued behind that origin's transfer.
  void take(const char* message, std::size_t bytes, int source);
  // Tests the transfers in flight; ends those complete or past their timeout, then starts what
  // their origins sent after them. True if any ended.
  bool advance();
  // Whether `source`'s transfer has ended (complete, failed or expired); ends it if so.
  bool settle(int source);
  // Gives the transfer of `source` up: cancels its requests (kept while MPI may still use
  // them) and drops anything its origin still sends with its tag. `peer_failed`: later calls
  // with `source` raise at once (it stalled or died), as after any timeout with it.
  void give_up(int source, const std::string& why, bool peer_failed = true);
  void apply_signal_of(const Request& req, int source);
  void put_inline(const Request& req, int target, const void* src, const std::string& what);
  void revoke(int target, int tag);
  Region find(std::uint64_t id, std::size_t offset, std::size_t bytes, int source) const;
  // Waits for `req`. With `serve`, serves incoming requests meanwhile (waits for a peer's
  // answer); waits for this rank's own sends do not, so as not to slow them down with probes.
  void wait(MPI_Request* req, const char* call, int peer, const std::string& what, bool serve = false);
  // Gives up on the requests of `reqs` not yet complete: each is cancelled; one that has not
  // ended after a short grace is kept, with `keep` (the memory it uses), until it does.
  // Returns how many were kept (MPI may still use their memory); `*completed`, if given,
  // counts those that ended by completing instead of being cancelled (a send's data left).
  int abandon(std::vector<MPI_Request>& reqs, const std::shared_ptr<void>& keep, int* completed = nullptr);
  void take_revocations();  // the progress thread
  int next_tag();
  // Raises at once if an earlier call with `peer` timed out.
  void check_peer(int peer, const std::string& what) const;

  CommContext ctx_;
  MpiComm requests_;  // origin -> target's progress thread
  MpiComm replies_;   // target's progress thread -> origin's calling thread
  int rank_ = 0;
  std::chrono::milliseconds timeout_;
  std::chrono::microseconds idle_sleep_;  // MESHMEM_MPI_IDLE_SLEEP: the longest sleep between two polls
  std::vector<char> unflushed_;  // per target: puts or signals sent since the last quiet
  std::vector<char> inbox_;      // the request being served (under serving_)

  int tag_limit_ = 32767;                  // MPI_TAG_UB
  std::atomic<std::uint64_t> next_tag_{0};  // unique tags of payloads and answers
  mutable std::mutex failed_mutex_;
  std::vector<std::string> failed_;       // per peer: the first timeout with it ("" none)
  GivenUpRequests given_up_;  // requests and messages of calls given up on
  std::set<std::pair<int, int>> revoked_;  // (origin, tag) of puts revoked (progress thread, under serving_)
  // Under serving_: per origin, its transfer in flight (or null) and the requests it sent
  // after it (each a header and a small put's bytes); `busy_`: the origins with either.
  std::vector<std::unique_ptr<Transfer>> in_flight_;
  std::vector<std::deque<std::vector<char>>> queued_;
  std::vector<int> busy_;

  mutable std::mutex regions_mutex_;
  std::unordered_map<std::uint64_t, Region> regions_;

  std::mutex serving_;  // one thread at a time probes and handles requests
  std::atomic<int> waiting_servers_{0};
  std::atomic<bool> stop_{false};
  std::thread progress_;
  int finalize_keyval_ = MPI_KEYVAL_INVALID;
};

std::unique_ptr<Transport> make_mpi_transport(const CommContext& ctx);

}  // namespace meshmem::detail
