#include "bootstrap.hpp"

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "backoff.hpp"
#include "log.hpp"
#include "meshmem/error.hpp"

namespace meshmem::detail {

namespace {
constexpr int kTagArrive = 101;
constexpr int kTagRelease = 102;

bool mpi_finalized() {
  int done = 0;
  MPI_Finalized(&done);
  return done != 0;
}

// Requests this process gave up on after a timeout, with the memory MPI may still write or read
// for them: a collective abandoned on timeout is completed by MPI when a late rank joins it,
// long after the call that posted it returned and its caller's buffers were freed. Kept until
// the request completes (tested whenever another is kept) or, for a request already freed
// (MPI_REQUEST_NULL here: a meeting's receive), for the life of the process.
void keep_for_mpi(MPI_Request request, std::shared_ptr<void> memory) {
  struct Kept {
    MPI_Request request;
    std::shared_ptr<void> memory;
  };
  static std::mutex mutex;
  static std::vector<Kept> kept;
  std::lock_guard<std::mutex> lock(mutex);
  kept.erase(std::remove_if(kept.begin(), kept.end(),
                            [](Kept& k) {
                              int done = 0;
                              return k.request != MPI_REQUEST_NULL &&
                                     MPI_Test(&k.request, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done;
                            }),
             kept.end());
  kept.push_back(Kept{request, std::move(memory)});
}

int to_int_count(std::size_t bytes, const std::string& what) {
  if (bytes > static_cast<std::size_t>(INT32_MAX))
    throw Error(ErrorCode::Internal, what + ": bootstrap message of " + std::to_string(bytes) +
                                         " bytes is too large for one MPI call");
  return static_cast<int>(bytes);
}
}  // namespace

void check_mpi(int rc, const char* call, const std::string& context) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error(ErrorCode::Mpi, context + ": " + call + " failed: " + std::string(text, len) +
                                  " (error " + std::to_string(rc) + ")");
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  const std::size_t shown = std::min<std::size_t>(ranks.size(), 64);
  for (std::size_t i = 0; i < shown; ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  if (ranks.size() > shown) s += " and " + std::to_string(ranks.size() - shown) + " more";
  return s;
}

MpiComm MpiComm::dup(MPI_Comm parent, const std::string& context, std::chrono::milliseconds timeout) {
  // Where MPI writes the new communicator: heap, so that an abandoned duplication (a rank
  // never joined) can be left to MPI; a nonblocking collective's request may not be freed.
  struct Pending {
    MPI_Comm comm = MPI_COMM_NULL;
    MPI_Request request = MPI_REQUEST_NULL;
  };
  auto pending = std::make_shared<Pending>();
  check_mpi(MPI_Comm_idup(parent, &pending->comm, &pending->request), "MPI_Comm_idup", context);
  Deadline deadline(timeout);
  Backoff backoff;
  for (;;) {
    int done = 0;
    check_mpi(MPI_Test(&pending->request, &done, MPI_STATUS_IGNORE), "MPI_Test (MPI_Comm_idup)", context);
    if (done) break;
    if (deadline.expired()) {
      keep_for_mpi(pending->request, pending);
      throw Error(ErrorCode::Timeout,
                  context + ": not every rank of the communicator entered it within " + describe_timeout(timeout) +
                      " (a rank is missing, late or dead, or failed before it: its own error says why); this rank "
                      "gives up, and ranks that come later time out likewise");
    }
    backoff.pause();
  }
  MPI_Comm c = pending->comm;
  MpiComm owner(c);
  check_mpi(MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", context);
  return owner;
}

MpiComm MpiComm::split(MPI_Comm parent, int color, int key, const std::string& context) {
  MPI_Comm c = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(parent, color, key, &c), "MPI_Comm_split", context);
  MpiComm owner(c);
  check_mpi(MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", context);
  return owner;
}

MpiComm& MpiComm::operator=(MpiComm&& other) noexcept {
  if (this != &other) {
    MpiComm old(comm_);
    old.kept_until_exit_ = kept_until_exit_;
    comm_ = other.comm_;
    kept_until_exit_ = other.kept_until_exit_;
    other.comm_ = MPI_COMM_NULL;
  }
  return *this;
}

MpiComm::~MpiComm() {
  if (comm_ == MPI_COMM_NULL || kept_until_exit_) return;
  if (mpi_finalized()) return;  // too late to free; MPI released everything
  // MPI_Comm_free is collective only in name for local teardown; it does not wait for peers.
  MPI_Comm_free(&comm_);
}

Bootstrap::Bootstrap(MPI_Comm parent, std::chrono::milliseconds timeout)
    : comm_(MpiComm::dup(parent, "meshmem::Comm", timeout)), timeout_(timeout) {
  check_mpi(MPI_Comm_rank(comm_.get(), &rank_), "MPI_Comm_rank", "meshmem::Comm");
  check_mpi(MPI_Comm_size(comm_.get(), &size_), "MPI_Comm_size", "meshmem::Comm");
  mail_ = std::make_shared<Mailbox>();
  mail_->arrivals.assign(static_cast<std::size_t>(size_), Arrival{});
}

void Bootstrap::ensure_usable(const std::string& what) const {
  if (broken_)
    throw Error(ErrorCode::Timeout,
                what + " on rank " + std::to_string(rank_) +
                    ": an earlier wait of this Comm timed out, so its ranks no longer agree on "
                    "where they are; the Comm cannot be used for collectives any more");
}

void Bootstrap::fail_timeout(const std::string& message) {
  if (!broken_) broken_because_ = message;
  broken_ = true;
  log(LogLevel::Error, message);
  throw Error(ErrorCode::Timeout, message);
}

void Bootstrap::abandon_collective(MPI_Request req, std::shared_ptr<void> memory, const std::string& message) {
  keep_for_mpi(req, std::move(memory));
  comm_.keep_until_exit();
  fail_timeout(message);
}

bool Bootstrap::wait(MPI_Request* req, const std::string& what) {
  Deadline deadline(timeout_);
  Backoff backoff;
  for (;;) {
    int done = 0;
    check_mpi(MPI_Test(req, &done, MPI_STATUS_IGNORE), "MPI_Test", what);
    if (done) return true;
    if (deadline.expired()) return false;
    backoff.pause();
  }
}

void Bootstrap::arrive(const std::string& what) { arrive(what, timeout_); }

void Bootstrap::arrive(const std::string& what, std::chrono::milliseconds budget) {
  ensure_usable(what);
  if (size_ == 1) return;
  if (timeout_.count() == 0 || budget > timeout_) budget = timeout_;
  const std::string where = what + " on rank " + std::to_string(rank_);
  const std::int64_t epoch = ++epoch_;
  Arrival mine;
  mine.epoch = epoch;
  std::strncpy(mine.call, what.c_str(), kNameBytes - 1);
  constexpr int kArrivalBytes = static_cast<int>(sizeof(Arrival));
  constexpr std::size_t kNameWords = kNameBytes / sizeof(std::int64_t);
  static_assert(2 + 1 + 2 * kNameWords <= 2 + kMaxNamed, "the release holds both names");
  auto out_of_order = [&](int other, const char* theirs, const char* rank0s) {
    apart_ = true;
    return Error(ErrorCode::InvalidArgument,
                 where + ": collective calls out of order: rank 0 is in " + rank0s + ", rank " + std::to_string(other) +
                     " in " + theirs + " (every rank must make the Comm's collective calls in the same order); "
                     "nothing was done, on every rank");
  };
  if (rank_ == 0) {
    // Gather arrivals, then release everyone; on timeout, release the ranks that did arrive
    // with the list of those that did not, so every rank reports the same culprits.
    std::vector<MPI_Request> reqs(static_cast<std::size_t>(size_), MPI_REQUEST_NULL);
    for (int r = 1; r < size_; ++r)
      check_mpi(MPI_Irecv(&mail_->arrivals[r], kArrivalBytes, MPI_BYTE, r, kTagArrive, comm_.get(), &reqs[r]),
                "MPI_Irecv", where);
    // Receives still posted when this rank gives up write into the mailbox whenever their
    // rank comes: it is kept, and the requests freed.
    const auto abandon_receives = [&] {
      for (auto& req : reqs)
        if (req != MPI_REQUEST_NULL) MPI_Request_free(&req);
      keep_for_mpi(MPI_REQUEST_NULL, mail_);
    };
    Deadline deadline(budget);
    Backoff backoff;
    int pending = size_ - 1;
    int differs = -1;  // the first rank that arrived from another call
    try {
      while (pending > 0 && !deadline.expired()) {
        int done = 0;
        int index = MPI_UNDEFINED;
        check_mpi(MPI_Testany(size_, reqs.data(), &index, &done, MPI_STATUS_IGNORE), "MPI_Testany", where);
        if (done && index != MPI_UNDEFINED) {
          if (mail_->arrivals[index].epoch != epoch)
            throw Error(ErrorCode::Internal, where + ": rank " + std::to_string(index) + " arrived at barrier epoch " +
                                                 std::to_string(mail_->arrivals[index].epoch) + ", expected " +
                                                 std::to_string(epoch));
          mail_->arrivals[index].call[kNameBytes - 1] = '\0';
          if (differs < 0 && std::strncmp(mail_->arrivals[index].call, mine.call, kNameBytes) != 0) differs = index;
          --pending;
          backoff.reset();
        } else {
          backoff.pause();
        }
      }
    } catch (...) {
      abandon_receives();
      throw;
    }
    std::vector<int> missing;
    for (int r = 1; r < size_; ++r)
      if (reqs[r] != MPI_REQUEST_NULL) missing.push_back(r);
    mail_->release.fill(0);
    mail_->release[0] = epoch;
    mail_->release[1] = static_cast<std::int64_t>(missing.size());
    for (std::size_t i = 0; i < missing.size() && i < kMaxNamed; ++i) mail_->release[2 + i] = missing[i];
    if (missing.empty() && differs >= 0) {
      mail_->release[1] = -1;
      mail_->release[2] = differs;
      std::memcpy(&mail_->release[3], mail_->arrivals[differs].call, kNameBytes);
      std::memcpy(&mail_->release[3 + kNameWords], mine.call, kNameBytes);
    }
    for (int r = 1; r < size_; ++r) {
      if (std::find(missing.begin(), missing.end(), r) != missing.end()) continue;
      check_mpi(MPI_Send(mail_->release.data(), static_cast<int>(mail_->release.size()), MPI_INT64_T, r,
                         kTagRelease, comm_.get()),
                "MPI_Send", where);
    }
    if (!missing.empty()) {
      // The missing ranks get the same verdict, sent without waiting for them to take it: one
      // that comes late finds it at once and raises naming the same ranks as the others.
      // Without it, a late rank waited for a release that never came, its whole timeout plus
      // the grace for rank 0 below (3.1 s with a 1 s timeout). The send completes whenever
      // that rank comes, or never (a dead rank); the mailbox it is sent from is kept.
      for (int r : missing) {
        MPI_Request verdict = MPI_REQUEST_NULL;
        if (MPI_Isend(mail_->release.data(), static_cast<int>(mail_->release.size()), MPI_INT64_T, r, kTagRelease,
                      comm_.get(), &verdict) == MPI_SUCCESS)
          MPI_Request_free(&verdict);  // best effort: without it the late rank times out alone
      }
      abandon_receives();
      fail_timeout(where + ": rank(s) " + rank_list(missing) + " did not arrive within " +
                   describe_timeout(budget));
    }
    if (differs >= 0) throw out_of_order(differs, mail_->arrivals[differs].call, mine.call);
    apart_ = false;
    return;
  }
  mail_->mine = mine;
  MPI_Request send_req = MPI_REQUEST_NULL;
  MPI_Request recv_req = MPI_REQUEST_NULL;
  check_mpi(MPI_Irecv(mail_->release.data(), static_cast<int>(mail_->release.size()), MPI_INT64_T, 0,
                      kTagRelease, comm_.get(), &recv_req),
            "MPI_Irecv", where);
  check_mpi(MPI_Isend(&mail_->mine, kArrivalBytes, MPI_BYTE, 0, kTagArrive, comm_.get(), &send_req),
            "MPI_Isend", where);
  // Rank 0 decides who is missing and tells every rank, those it gave up on too; give its
  // verdict time to arrive before deciding alone (rank 0 itself is late or dead then).
  // A shortened wait (teardown) gives rank 0 as long again, not the full grace: its one
  // timeout is mostly spent.
  const auto usual_grace = 2000 + timeout_.count() / 10;
  const auto grace = std::chrono::milliseconds(timeout_.count() == 0 ? 0
                                               : budget < timeout_ ? std::min<std::int64_t>(budget.count(), usual_grace)
                                                                   : usual_grace);
  Deadline deadline(budget + grace);
  Backoff backoff;
  for (;;) {
    int done = 0;
    check_mpi(MPI_Test(&recv_req, &done, MPI_STATUS_IGNORE), "MPI_Test", where);
    if (done) break;
    if (deadline.expired()) {
      // Rank 0's release may still come, into the mailbox: it is kept.
      MPI_Request_free(&recv_req);
      MPI_Request_free(&send_req);
      keep_for_mpi(MPI_REQUEST_NULL, mail_);
      fail_timeout(where + ": rank 0, which coordinates the wait, did not answer within " +
                   describe_timeout(deadline.timeout()) + " (it may have failed or not arrived)");
    }
    backoff.pause();
  }
  check_mpi(MPI_Wait(&send_req, MPI_STATUS_IGNORE), "MPI_Wait", where);
  if (mail_->release[0] != epoch)
    throw Error(ErrorCode::Internal, where + ": release for epoch " + std::to_string(mail_->release[0]) +
                                         ", expected " + std::to_string(epoch));
  if (mail_->release[1] < 0) {
    char theirs[kNameBytes] = {}, rank0s[kNameBytes] = {};
    std::memcpy(theirs, &mail_->release[3], kNameBytes);
    std::memcpy(rank0s, &mail_->release[3 + kNameWords], kNameBytes);
    theirs[kNameBytes - 1] = rank0s[kNameBytes - 1] = '\0';
    throw out_of_order(static_cast<int>(mail_->release[2]), theirs, rank0s);
  }
  if (mail_->release[1] > 0) {
    std::vector<int> missing;
    for (std::int64_t i = 0; i < mail_->release[1] && i < kMaxNamed; ++i)
      missing.push_back(static_cast<int>(mail_->release[2 + i]));
    if (mail_->release[1] > kMaxNamed) missing.push_back(-1);
    // This rank among them: it came after rank 0 had given up on it (the verdict was waiting).
    const bool me_late = std::find(missing.begin(), missing.end(), rank_) != missing.end();
    fail_timeout(where + ": " + (me_late ? "this rank arrived after rank 0 gave up: " : "") + "rank(s) " +
                 rank_list(missing) + " did not arrive within " + describe_timeout(timeout_) + " (reported by rank 0)");
  }
  apart_ = false;
}

// The collectives below run on buffers of their own, copied from and to the caller's: after a
// timeout MPI may still complete the collective (a late rank joins it) and write into them,
// long after the caller's buffers are gone. An abandoned collective keeps them (keep_for_mpi).
void Bootstrap::allgather(const void* mine, void* all, std::size_t bytes_each,
                          const std::string& what) {
  ensure_usable(what);
  const int count = to_int_count(bytes_each, what);
  to_int_count(bytes_each * static_cast<std::size_t>(size_), what);
  auto buffer = std::make_shared<std::vector<char>>(bytes_each * (static_cast<std::size_t>(size_) + 1));
  std::memcpy(buffer->data(), mine, bytes_each);
  char* gathered = buffer->data() + bytes_each;
  MPI_Request req = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallgather(buffer->data(), count, MPI_BYTE, gathered, count, MPI_BYTE, comm_.get(), &req),
            "MPI_Iallgather", what);
  if (!wait(&req, what)) {
    abandon_collective(req, buffer,
                       what + " on rank " + std::to_string(rank_) + ": MPI_Iallgather did not complete within " +
                           describe_timeout(timeout_));
  }
  std::memcpy(all, gathered, bytes_each * static_cast<std::size_t>(size_));
}

void Bootstrap::broadcast(void* data, std::size_t bytes, int root, const std::string& what) {
  ensure_usable(what);
  const int count = to_int_count(bytes, what);
  auto buffer = std::make_shared<std::vector<char>>(static_cast<const char*>(data), static_cast<const char*>(data) + bytes);
  MPI_Request req = MPI_REQUEST_NULL;
  check_mpi(MPI_Ibcast(buffer->data(), count, MPI_BYTE, root, comm_.get(), &req), "MPI_Ibcast", what);
  if (!wait(&req, what)) {
    abandon_collective(req, buffer,
                       what + " on rank " + std::to_string(rank_) + ": MPI_Ibcast did not complete within " +
                           describe_timeout(timeout_));
  }
  std::memcpy(data, buffer->data(), bytes);
}

std::uint64_t Bootstrap::allreduce_max(std::uint64_t value, const std::string& what) {
  ensure_usable(what);
  auto values = std::make_shared<std::array<std::uint64_t, 2>>(std::array<std::uint64_t, 2>{value, 0});
  MPI_Request req = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallreduce(&(*values)[0], &(*values)[1], 1, MPI_UINT64_T, MPI_MAX, comm_.get(), &req),
            "MPI_Iallreduce", what);
  if (!wait(&req, what)) {
    abandon_collective(req, values,
                       what + " on rank " + std::to_string(rank_) + ": MPI_Iallreduce did not complete within " +
                           describe_timeout(timeout_));
  }
  return (*values)[1];
}

void Bootstrap::agree(bool ok, ErrorCode code, const std::string& message, const std::string& what) {
  // A rank whose own step failed and that cannot agree (a peer is late or dead) raises its own
  // error, which says what went wrong and often with whom, not only the agreement's timeout.
  const auto agreeing = [&](auto&& step) {
    try {
      step();
    } catch (const Error& e) {
      if (ok) throw;
      throw Error(code, message + " (and the ranks could not agree on the outcome: " + e.message() + ")");
    }
  };
  std::int32_t mine[2] = {ok ? 1 : 0, static_cast<std::int32_t>(code)};
  std::vector<std::int32_t> all(2 * static_cast<std::size_t>(size_));
  agreeing([&] { allgather(mine, all.data(), sizeof(mine), what); });
  std::vector<int> failed;
  for (int r = 0; r < size_; ++r)
    if (all[2 * r] == 0) failed.push_back(r);
  if (failed.empty()) return;
  // The lowest failing rank's message goes to everyone.
  const int speaker = failed.front();
  std::uint64_t len = rank_ == speaker ? message.size() : 0;
  std::string text;
  agreeing([&] {
    broadcast(&len, sizeof(len), speaker, what);
    text.assign(len, '\0');
    if (rank_ == speaker) text = message;
    if (len > 0) broadcast(text.data(), len, speaker, what);
  });
  const auto speaker_code = static_cast<ErrorCode>(all[2 * speaker + 1]);
  std::string prefix = what + " failed on rank(s) " + rank_list(failed);
  if (rank_ != speaker) prefix += " (this is rank " + std::to_string(rank_) + ")";
  throw Error(speaker_code, prefix + "; rank " + std::to_string(speaker) + " reports: " + text);
}

}  // namespace meshmem::detail
