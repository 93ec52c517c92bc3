// MpiTransport: reaches any rank, on this node or another. Each rank runs a progress thread
// that serves one-sided requests (put, get, signal, flush) over two-sided MPI on a
// communicator of its own, so a put completes without the target making any call. Needs
// MPI_THREAD_MULTIPLE. The thread polls with backoff: it never spins without yielding.
#pragma once

#include <mpi.h>

#include <atomic>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "bootstrap.hpp"
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
  void waiter_begins() override { waiting_servers_.fetch_add(1, std::memory_order_acq_rel); }
  void waiter_ends() override { waiting_servers_.fetch_sub(1, std::memory_order_acq_rel); }

  // Windows the progress thread may serve, by id.
  void register_window(const WindowState& win);
  void unregister_window(std::uint64_t id);

  // Stops the progress thread; also called when MPI_Finalize starts (MPI_COMM_SELF
  // attribute), so that the thread never calls MPI after it.
  void stop() noexcept override;

  // Serves at most one waiting request, unless another thread is serving; true if it did.
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

  void serve();
  void handle(const Request& req, int source);
  Region find(std::uint64_t id, std::size_t offset, std::size_t bytes, int source) const;
  // Waits for `req`. With `serve`, serves incoming requests meanwhile (waits for a peer's
  // answer); waits for this rank's own sends do not, so as not to slow them down with probes.
  void wait(MPI_Request* req, const char* call, int peer, const std::string& what, bool serve = false);

  CommContext ctx_;
  MpiComm requests_;  // origin -> target's progress thread
  MpiComm replies_;   // target's progress thread -> origin's calling thread
  int rank_ = 0;
  std::chrono::milliseconds timeout_;
  std::vector<char> unflushed_;  // per target: puts or signals sent since the last quiet

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
