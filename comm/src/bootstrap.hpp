// Bootstrap: the collectives meshmem itself runs over MPI, on a communicator of its own.
// Every wait is bounded by MESHMEM_TIMEOUT and says which ranks never arrived; a collective
// that fails on some ranks fails on all (agree()).
#pragma once

#include <mpi.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "meshmem/error.hpp"

namespace meshmem::detail {

// Raises Error(Mpi) naming the call and MPI's own message unless rc == MPI_SUCCESS.
void check_mpi(int rc, const char* call, const std::string& context);

// MPI_Comm_dup'd communicator owner, MPI_ERRORS_RETURN set. Freed on destruction, unless
// MPI was finalised already (then nothing can be freed).
class MpiComm {
 public:
  MpiComm() = default;
  // MPI_Comm_idup, waited for at most `timeout` (0: no bound): a rank that never joins (missing,
  // late, dead, or failed before) raises Error(Timeout) instead of a hang. The abandoned
  // request is kept for the life of the process (MPI may still complete it).
  static MpiComm dup(MPI_Comm parent, const std::string& context,
                     std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  static MpiComm split(MPI_Comm parent, int color, int key, const std::string& context);
  MpiComm(MpiComm&& other) noexcept : comm_(other.comm_), kept_until_exit_(other.kept_until_exit_) {
    other.comm_ = MPI_COMM_NULL;
  }
  MpiComm& operator=(MpiComm&& other) noexcept;
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;
  ~MpiComm();
  MPI_Comm get() const { return comm_; }
  // A collective on it was abandoned after a timeout and may still run when a late rank
  // joins: the communicator is not freed (Open MPI's nonblocking collectives crashed when
  // they progressed on a freed one: seen once in CI, an MPI_Iallreduce abandoned in a Comm's
  // construction under load).
  void keep_until_exit() { kept_until_exit_ = true; }

 private:
  explicit MpiComm(MPI_Comm c) : comm_(c) {}
  MPI_Comm comm_ = MPI_COMM_NULL;
  bool kept_until_exit_ = false;
};

class Bootstrap {
 public:
  Bootstrap(MPI_Comm parent, std::chrono::milliseconds timeout);

  int rank() const { return rank_; }
  int size() const { return size_; }
  MPI_Comm comm() const { return comm_.get(); }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // Waits until every rank has called arrive(); raises Error(Timeout) on every rank that
  // gets an answer, naming the ranks that did not arrive. `what` names the calling API: where
  // ranks arrive from different calls (collectives out of order: one rank in barrier(),
  // another in alloc), every rank raises Error(InvalidArgument) naming both, and the Comm
  // stays usable.
  void arrive(const std::string& what);
  // The same, rank 0 waiting at most `budget` for the others (a teardown whose earlier step
  // timed out spends only what is left of its one timeout; the others wait as long as
  // arrive(what) would).
  void arrive(const std::string& what, std::chrono::milliseconds budget);

  // Collectives with the same timeout (they follow an arrive(), so a rank that is absent
  // is named there; these time out only if MPI itself stalls).
  void allgather(const void* mine, void* all, std::size_t bytes_each, const std::string& what);
  void broadcast(void* data, std::size_t bytes, int root, const std::string& what);
  std::uint64_t allreduce_max(std::uint64_t value, const std::string& what);

  // Every rank passes whether its part succeeded. If any failed, every rank raises the
  // same Error: the lowest failing rank's code and message, and the list of failing ranks.
  // Where the agreement itself times out (a rank late or dead), a rank that failed raises its
  // own error with the agreement's added; the others raise the agreement's.
  void agree(bool ok, ErrorCode code, const std::string& message, const std::string& what);

  // Waits for `req` with backoff; false on timeout.
  bool wait(MPI_Request* req, const std::string& what);

  // After a timeout the ranks disagree on where they are: further collectives would hang.
  void ensure_usable(const std::string& what) const;
  bool usable() const { return !broken_; }
  // The first timeout that broke the Comm ("" while usable).
  const std::string& broken_because() const { return broken_because_; }
  // The last meeting found the ranks in different calls (cleared by the next that does not).
  bool apart() const { return apart_; }
  // Raises Error(Timeout) with `message`; the Comm refuses collectives from then on.
  [[noreturn]] void fail_timeout(const std::string& message);

 private:
  // A collective on comm_ that timed out: MPI may still complete it when a late rank joins,
  // so its request and memory are kept and comm_ is not freed; then fail_timeout(message).
  [[noreturn]] void abandon_collective(MPI_Request req, std::shared_ptr<void> memory, const std::string& message);

  MpiComm comm_;
  int rank_ = 0;
  int size_ = 1;
  std::chrono::milliseconds timeout_;
  bool broken_ = false;
  std::string broken_because_;
  bool apart_ = false;
  std::int64_t epoch_ = 0;
  static constexpr int kMaxNamed = 64;
  static constexpr std::size_t kNameBytes = 48;  // of the call's name, compared
  struct Arrival {
    std::int64_t epoch = 0;
    char call[kNameBytes] = {};
  };
  // What the meetings (arrive) receive and send. After a timeout a receive stays posted into
  // it (a late rank's arrival, rank 0's late release), possibly after this Bootstrap is gone
  // (the Comm was destroyed): it is then kept for the life of the process, never freed under MPI.
  struct Mailbox {
    std::vector<Arrival> arrivals;  // rank 0: one per rank
    // [0] epoch; [1] missing ranks (then their numbers from [2]), or -1 for calls out of
    // order: [2] the first rank that differs from rank 0, then its call's name and rank 0's.
    std::array<std::int64_t, 2 + kMaxNamed> release{};
    Arrival mine;
  };
  std::shared_ptr<Mailbox> mail_;
};

// Runs one local step of a collective, then agrees on its outcome, so that a failure on
// one rank fails the call on every rank instead of leaving the others waiting (a step that
// timed out with a peer raises its own error: the peers cannot agree any more).
template <class Step>
void agreed_step(Bootstrap& boot, const std::string& what, Step&& step) {
  bool ok = true;
  ErrorCode code = ErrorCode::Internal;
  std::string message;
  try {
    step();
  } catch (const Error& e) {
    // A wait of the step timed out and left the ranks no longer agreeing where they are:
    // agree() could only say that, hiding which wait expired and for whom. Its error goes on.
    if (!boot.usable()) throw;
    ok = false;
    code = e.code();
    message = e.message();
  }
  boot.agree(ok, code, message, what);
}

// "1, 3, 5" (at most 64 shown, then "and N more").
std::string rank_list(const std::vector<int>& ranks);

}  // namespace meshmem::detail
