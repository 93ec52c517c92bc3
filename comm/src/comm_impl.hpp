// CommImpl: the state behind meshmem::Comm, and the argument checks of every API call.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backoff.hpp"
#include "bootstrap.hpp"
#include "device_interface.hpp"
#include "fault.hpp"
#include "fd_exchange.hpp"
#include "helper_cpus.hpp"
#include "log.hpp"
#include "meshmem/comm.hpp"
#include "meshmem/halo.hpp"
#include "topology.hpp"
#include "transport.hpp"
#include "transport_registry.hpp"
#include "window_state.hpp"

namespace meshmem::detail {

struct HaloState;

class CommImpl {
 public:
  // What a Comm makes first (start_comm in comm.cpp): this rank's injected faults, and the
  // Comm's Bootstrap once its ranks have met on it.
  struct Start {
    FaultPlan faults;
    Bootstrap boot;
  };
  CommImpl(MPI_Comm comm, const Options& options);
  CommImpl(Start start, const Options& options);
  // Comm(MPI_Comm): reads MESHMEM_* and agrees on the outcome on the Comm's own Bootstrap.
  static std::unique_ptr<CommImpl> from_environment(MPI_Comm comm);
  ~CommImpl();  // collective teardown; never throws

  std::shared_ptr<WindowState> alloc(std::size_t bytes, Memory memory, bool signals,
                                     const std::string& call);
  // Window::free (comm_teardown.cpp). `in_destructor`: an error of the meeting carries the
  // quiet's error along instead of logging it.
  void free_window(WindowState& state, bool in_destructor = false);
  // A window's destructor (`who` names it): frees as free_window does while the ranks meet,
  // else releases this rank's part; logs at most one line per Comm (tell_teardown_once).
  void free_in_destructor(WindowState& state, const char* who) noexcept;
  // The last Error a call of this Comm raised on this rank (the public handles note it): the
  // cause that teardown during its unwinding names first.
  void note_error(const Error& e);
  // A call that returned: no cause left behind, and a later teardown may say its line.
  void forget_error() {
    if (last_error_.empty()) return;
    last_error_.clear();
    teardown_told_ = false;
  }

  void put(const Window& win, int target, std::size_t offset, const void* src, std::size_t bytes,
           const Signals* sig, std::size_t index, std::uint64_t value, SignalOp op, Stream stream,
           const char* call);
  void get(void* dst, const Window& win, int target, std::size_t offset, std::size_t bytes,
           Stream stream);
  void signal(const Signals& sig, int target, std::size_t index, std::uint64_t value, SignalOp op,
              Stream stream);
  // `then`: each word is set to it once the wait is over (wait_until_all_then_set).
  void wait_until(const Signals& sig, std::size_t index, std::size_t count, Cmp cmp, std::uint64_t value,
                  Stream stream, const char* call, std::optional<std::uint64_t> then = std::nullopt);
  std::uint64_t read_signal(const WindowState& sig, std::size_t index);
  // `on_host`: also waits on the host until every put of this rank landed (Window::free, the
  // host barrier, ~Comm: Transport::complete_on_host).
  void quiet(Stream stream, const char* call, bool on_host = false);
  void barrier(Stream stream);
  void barrier_host();

  TransportKind transport(int rank, Memory memory, const char* call) const;
  std::string unreachable_reason(int rank, Memory memory, const char* call) const;
  std::string skipped_reason(int rank, Memory memory, const char* call) const;
  // This rank's device and barrier(stream) variant, or why device windows are unavailable.
  std::string device_info() const;
  void settle_helpers();

  // Host-side wait: polls `ready()` with backoff, letting the transports serve peers'
  // requests meanwhile (the awaited signal may be in one of them); after MESHMEM_TIMEOUT
  // logs and raises Error(Timeout) with `timeout_message()`.
  template <class Ready, class Message>
  void wait_host(Ready&& ready, Message&& timeout_message) {
    Deadline deadline(options.timeout);
    Backoff backoff(progress_sleep());
    WaitingThread waiting(transports);
    while (!ready()) {
      if (progress()) {
        backoff.reset();
        continue;
      }
      if (deadline.expired()) {
        const std::string msg = timeout_message();
        log(LogLevel::Error, msg);
        throw Error(ErrorCode::Timeout, msg);
      }
      backoff.pause();
    }
  }

  // meshmem/halo.hpp (comm/src/halo.cpp).
  std::unique_ptr<HaloState> make_halo(const Window& win, const std::vector<HaloRegion>& sends);
  void halo_exchange(HaloState& halo, Stream stream, bool copy);

  // "comm.put on rank 3: " etc.
  std::string where(const char* call) const;
  // Raises Error(InvalidArgument) naming `call` once MPI_Finalize has begun: nothing may reach
  // MPI then.
  void require_mpi_alive(const char* call) const;
  const WindowState& checked(const Window& win, const char* call) const;
  void check_rank(int rank, const char* call, const char* what) const;
  // The transport that reaches `target` for `win`, or Error(Unsupported) naming the pair and
  // every transport's reason.
  Transport& route(const WindowState& win, int target, const char* call) const;
  CommContext context() { return CommContext{boot, topo, *fds, options, device.get(), faults}; }

  Options options;
  FaultPlan faults;  // MESHMEM_FAULT's entries for this rank (tests)
  Bootstrap boot;
  Topology topo;
  std::unique_ptr<FdExchange> fds;
  HelperPlacement helpers;  // where this Comm's busy threads run (helper_cpus.hpp)
  std::unique_ptr<DeviceRuntime> device;  // null where device windows are unavailable
  std::string device_why;                 // why they are unavailable
  std::vector<std::unique_ptr<Transport>> transports;  // connected ones, in the order tried
  std::unique_ptr<RouteTable> routes;
  std::unique_ptr<StreamBarrier> stream_barrier;  // with `device`
  std::uint64_t uid;

 private:
  // While one lives, the transports know that a thread waits and calls progress() itself.
  class WaitingThread {
   public:
    explicit WaitingThread(const std::vector<std::unique_ptr<Transport>>& ts) : ts_(ts) {
      for (const auto& t : ts_) t->waiter_begins();
    }
    ~WaitingThread() {
      for (const auto& t : ts_) t->waiter_ends();
    }
    WaitingThread(const WaitingThread&) = delete;
    WaitingThread& operator=(const WaitingThread&) = delete;

   private:
    const std::vector<std::unique_ptr<Transport>>& ts_;
  };
  // The longest sleep of a host wait between two progress() calls: the shortest that a
  // transport asks for (MESHMEM_MPI_IDLE_SLEEP), else Backoff's.
  std::chrono::microseconds progress_sleep() const {
    std::optional<std::chrono::microseconds> longest;
    for (const auto& t : transports)
      if (const auto s = t->progress_sleep()) longest = longest ? std::min(*longest, *s) : *s;
    return longest.value_or(Backoff::kLongest);
  }
  bool progress() {
    bool served = false;
    for (const auto& t : transports) served = t->progress() || served;
    return served;
  }
  void select_transports();
  void check_range(const WindowState& win, int target, std::size_t offset, std::size_t bytes,
                   const char* call, const char* offset_name) const;
  void check_stream(const WindowState& win, Stream stream, const char* call) const;
  // The checks of put and get: window, rank, range, local buffer, stream.
  const WindowState& checked_transfer(const Window& win, int target, std::size_t offset, std::size_t bytes,
                                      const void* local, Stream stream, const char* call, const char* offset_name,
                                      const char* local_name) const;
  void check_index(const WindowState& sig, std::size_t index, const char* call) const;
  void release(WindowState& state);
  void release_here(WindowState& state, const char* call);
  // Whether the ranks still meet for teardown, and why not.
  bool ranks_meet() const;
  std::string apart_reason() const;
  void tell_teardown_once(const std::string& line);
  void tell_cause_if_unwinding();
  // Frees a window's memory here: device windows once the GPU's earlier work is done
  // (bounded by MESHMEM_TIMEOUT, Error(Timeout) past it).
  void retire(WindowState& state, const char* call);
  void wait_device_words(const WindowState& s, std::size_t index, std::size_t count, Cmp cmp, std::uint64_t value,
                         const char* call);

  std::uint64_t next_window_id_ = 1;
  std::string last_error_;
  bool teardown_told_ = false;
  bool teardown_apart_ = false;  // a destructor's free failed in its meeting: the others release alone
  std::map<std::uint64_t, std::weak_ptr<WindowState>> live_;
};

}  // namespace meshmem::detail
