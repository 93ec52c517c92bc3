// HostAgentCore: what a transport's host helper thread stands on, apart from its protocol:
// the queue of requests handed over by the callers, the done words lent to transfers (one
// transfer's, or a captured graph's for its life), the count of transfers submitted and
// ended, the first error, and the stop flag. A transfer's done word reaches its ticket when
// it ends; the caller's stream waits for that (GpuDevice::wait_for_ticket). The host ends a
// transfer (end: the transfer proxy), or the GPU or another process does, and the word goes
// back once a counter reaches a value (return_when: the staging agent's lanes and hidden peers).
//
// CUDA-free and MPI-free (the done words are memory its owner provides, mapped for the GPU),
// so its rules are unit-tested anywhere (tests/unit/test_host_agent.cpp). `Request` has the
// fields `std::size_t word` and `std::uint64_t ticket`.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "backoff.hpp"
#include "log.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/awake_clock.hpp"

namespace meshmem::detail {

template <class Request>
class HostAgentCore {
 public:
  // `words`: `count` done words, zeroed, alive as long as this. `timeout`: how long a caller
  // waits for a free word and drain() for the transfers (0: for ever). Tickets go up by
  // `ticket_step` (the staging agent's 2: a put's source read is ticket - 1). A word returned
  // by return_when(..., UnlessRetired) whose value carries one of `retired_bits` is never lent again.
  HostAgentCore(std::uint64_t* words, std::size_t count, std::chrono::milliseconds timeout,
                std::uint64_t ticket_step = 1, std::uint64_t retired_bits = 0)
      : words_(words), count_(count), timeout_(timeout), ticket_step_(ticket_step), retired_bits_(retired_bits) {
    for (std::size_t i = count; i-- > 0;) free_words_.push_back(i);
  }
  HostAgentCore(const HostAgentCore&) = delete;
  HostAgentCore& operator=(const HostAgentCore&) = delete;

  std::uint64_t* word(std::size_t i) const { return words_ + i; }
  std::size_t word_count() const { return count_; }

  // ---- callers' side ----
  // A done word; with all in use (that many transfers in flight) waits for one, bounded.
  std::size_t take_word(const std::string& what) {
    std::unique_lock<std::mutex> lock(m_);
    const auto has = [&] { return !free_words_.empty(); };
    if (timeout_.count() == 0)
      cv_.wait(lock, has);
    else if (!cv_.wait_for(lock, timeout_, has))
      throw Error(ErrorCode::Timeout, what + ": all " + std::to_string(count_) +
                                          " transfers of this rank are in flight and none ended within MESHMEM_TIMEOUT");
    const std::size_t w = free_words_.back();
    free_words_.pop_back();
    return w;
  }
  // A done word if one is free (after taking back those whose return_when counter got there);
  // false when every word is in use.
  bool try_take_word(std::size_t* w) {
    std::lock_guard<std::mutex> lock(m_);
    reclaim_locked();  // every time, not only when none is left: words are reused at once (and so tested)
    if (free_words_.empty()) return false;
    *w = free_words_.back();
    free_words_.pop_back();
    return true;
  }
  // A word taken and not used (the transfer failed before it was submitted), or one whose
  // transfer ended.
  void release_word(std::size_t w) {
    std::lock_guard<std::mutex> lock(m_);
    free_words_.push_back(w);
    cv_.notify_all();
  }
  // A done word that a CUDA graph holds for its life (a transfer's end does not free it);
  // false when all are in use.
  bool try_take_graph_word(std::size_t* w) {
    std::lock_guard<std::mutex> lock(m_);
    if (free_words_.empty()) return false;
    *w = free_words_.back();
    free_words_.pop_back();
    graph_words_[*w] = GraphWord{};
    return true;
  }
  // The graph is gone; a transfer of it still in flight (its wait gave up) frees the word
  // when it ends.
  void release_graph_word(std::size_t w) {
    std::lock_guard<std::mutex> lock(m_);
    const auto graph = graph_words_.find(w);
    if (graph == graph_words_.end()) return;
    if (graph->second.in_flight > 0) {
      graph->second.released = true;
      return;
    }
    graph_words_.erase(graph);
    free_words_.push_back(w);
    cv_.notify_all();
  }
  // Queues a transfer; returns the ticket its done word reaches at its end. `numbered(r)` runs
  // under the lock with the ticket set, before the thread can see r (a trace's order); it must
  // take no lock (callers hold others while they submit).
  template <class Numbered>
  std::uint64_t submit(Request r, Numbered numbered) {
    std::lock_guard<std::mutex> lock(m_);
    r.ticket = ticket_step_ * ++submitted_;
    open_.insert(r.ticket);
    numbered(static_cast<const Request&>(r));
    const auto graph = graph_words_.find(r.word);
    if (graph != graph_words_.end()) ++graph->second.in_flight;
    queue_.push_back(r);
    cv_.notify_all();
    return r.ticket;
  }
  std::uint64_t submit(Request r) {
    return submit(r, [](const Request&) {});
  }
  // Waits until every transfer submitted ended (bounded by the timeout); false if not, or
  // once stop() was asked.
  bool drain() {
    const Deadline deadline(timeout_);
    Backoff backoff;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(m_);
        if (ended_ >= submitted_) return true;
        if (stop_) return false;
      }
      if (deadline.expired()) return false;
      backoff.pause();
    }
  }
  // The ticket of the last transfer submitted (0: none yet).
  std::uint64_t last_ticket() {
    std::lock_guard<std::mutex> lock(m_);
    return ticket_step_ * submitted_;
  }
  enum class Ended { All, Stopping, TimedOut };
  // Waits until every transfer whose ticket is `mark` or less was counted ended (those
  // submitted later, or ending out of order, do not hold it), a stop was asked, or `deadline`
  // passed.
  Ended wait_through(std::uint64_t mark, ipc::AwakeClock::time_point deadline) {
    std::unique_lock<std::mutex> lock(m_);
    const auto through = [&] { return open_.empty() || *open_.begin() > mark; };
    const bool met = cv_.wait_until(lock, deadline, [&] { return through() || stop_; });
    if (!met) return Ended::TimedOut;
    return through() ? Ended::All : Ended::Stopping;
  }
  // Waits until every transfer submitted was counted ended (end, count_ended) and no outside
  // work is left, a stop was asked, or `deadline` passed.
  Ended wait_until_ended(ipc::AwakeClock::time_point deadline) {
    std::unique_lock<std::mutex> lock(m_);
    const bool met = cv_.wait_until(lock, deadline, [&] { return (ended_ >= submitted_ && outside_work_ == 0) || stop_; });
    if (!met) return Ended::TimedOut;
    return ended_ >= submitted_ && outside_work_ == 0 ? Ended::All : Ended::Stopping;
  }
  // The first error noted since the last call ("" if none), and its code.
  std::string take_error(ErrorCode* code) {
    std::lock_guard<std::mutex> lock(m_);
    std::string e;
    e.swap(error_);
    *code = error_code_;
    return e;
  }
  // The thread's loop ends at its next look (take_requests returns false).
  void request_stop() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    cv_.notify_all();
  }
  // Wakes a thread in wait_for_requests to look at its `also` again (taken under the lock,
  // so that it either sees what changed before it sleeps or is woken).
  void wake() {
    { std::lock_guard<std::mutex> lock(m_); }
    cv_.notify_all();
  }

  // ---- the agent thread's side ----
  // Waits until a request is queued, a stop was asked or `also()` holds (asked under the lock,
  // so it must take no lock), at most `most` (zero: no bound).
  template <class Also>
  void wait_for_requests(std::chrono::microseconds most, Also also) {
    std::unique_lock<std::mutex> lock(m_);
    const auto woken = [&] { return stop_ || !queue_.empty() || also(); };
    if (most.count() == 0)
      cv_.wait(lock, woken);
    else
      cv_.wait_for(lock, most, woken);
  }
  // Moves the queued requests, in submission order, to the back of `into`, also once a stop
  // was asked (the thread then ends them: no caller's stream waits for ever); true if one was.
  template <class Queue>
  bool take_requests_seeing_stop(Queue& into) {
    std::lock_guard<std::mutex> lock(m_);
    while (!queue_.empty()) {
      into.push(queue_.front());
      queue_.pop_front();
    }
    return stop_;
  }
  // Moves the queued requests, in submission order, to the back of `into`; false once a stop
  // was asked (nothing is moved then).
  template <class Queue>
  bool take_requests(Queue& into) {
    std::lock_guard<std::mutex> lock(m_);
    if (stop_) return false;
    while (!queue_.empty()) {
      into.push(queue_.front());
      queue_.pop_front();
    }
    return true;
  }
  // The transfer of word `w` ended: the word reaches `ticket` (a release store, for the
  // caller's stream), and goes back unless a graph still holds it. Under the lock from the
  // store on: a graph released meanwhile must not free the word twice.
  void end(std::size_t w, std::uint64_t ticket) {
    std::lock_guard<std::mutex> lock(m_);
    __atomic_store_n(words_ + w, ticket, __ATOMIC_RELEASE);
    const auto graph = graph_words_.find(w);
    if (graph == graph_words_.end()) {
      free_words_.push_back(w);
    } else if (--graph->second.in_flight == 0 && graph->second.released) {
      graph_words_.erase(graph);  // its graph is gone and this was its last transfer
      free_words_.push_back(w);
    }
    ++ended_;
    open_.erase(ticket);
    cv_.notify_all();
  }
  // Transfer `ticket` left the thread's hands without end() (its word goes back by
  // return_when, or was given back already): drain and wait_through count it.
  void count_ended(std::uint64_t ticket) {
    {
      std::lock_guard<std::mutex> lock(m_);
      ++ended_;
      open_.erase(ticket);
    }
    cv_.notify_all();
  }
  // Work of the thread's own that drain waits for too (the staging agent's answers to peers'
  // gets): begun, and ended.
  void add_outside_work() {
    std::lock_guard<std::mutex> lock(m_);
    ++outside_work_;
  }
  void outside_work_ended() {
    {
      std::lock_guard<std::mutex> lock(m_);
      --outside_work_;
    }
    cv_.notify_all();
  }
  enum class Return { Always, UnlessRetired };
  // Word `w` goes back once `*watched` (a done word or a lane's counter the GPU writes) reaches
  // `reaches`; UnlessRetired: not if that value then carries a retired bit. `ticket`: what its
  // transfer's end writes into the word (returns_on).
  void return_when(std::size_t w, const std::uint64_t* watched, std::uint64_t reaches, std::uint64_t ticket,
                   Return rule) {
    std::lock_guard<std::mutex> lock(m_);
    pending_returns_.push_back(PendingReturn{watched, reaches, ticket, w, rule});
  }
  // The pending return of word `w` for the transfer of `ticket` is dropped, if its counter has
  // not got there yet: the word is never lent again (the transfer is ended from the host, and
  // a late write of its own end must not move a reused word back). False if it had got there
  // (the transfer ended by itself) or none is pending.
  bool retire(std::size_t w, std::uint64_t ticket) {
    std::lock_guard<std::mutex> lock(m_);
    for (auto it = pending_returns_.begin(); it != pending_returns_.end(); ++it) {
      if (it->word != w || it->ticket != ticket) continue;
      if (__atomic_load_n(it->watched, __ATOMIC_ACQUIRE) >= it->reaches) return false;
      pending_returns_.erase(it);
      return true;
    }
    return false;
  }
  // The words, and their transfers' tickets, still waiting for `*watched`, oldest first.
  std::vector<std::pair<std::size_t, std::uint64_t>> returns_on(const std::uint64_t* watched) {
    std::lock_guard<std::mutex> lock(m_);
    std::vector<std::pair<std::size_t, std::uint64_t>> out;
    for (const PendingReturn& p : pending_returns_)
      if (p.watched == watched) out.emplace_back(p.word, p.ticket);
    return out;
  }
  // Takes back the words whose counter got there (try_take_word does it too).
  void reclaim() {
    std::lock_guard<std::mutex> lock(m_);
    reclaim_locked();
  }
  // Records the first error (logged once, where it is detected); transfers still end (their
  // streams go on), and the callers' next call raises it.
  void note_error(const std::string& e, ErrorCode code = ErrorCode::Cuda) {
    log(LogLevel::Error, e);
    keep_error(e, code);
  }
  // The same, where the caller logged it (or logs it otherwise).
  void keep_error(const std::string& e, ErrorCode code = ErrorCode::Cuda) {
    std::lock_guard<std::mutex> lock(m_);
    if (!error_.empty()) return;
    error_ = e;
    error_code_ = code;
  }

 private:
  struct GraphWord {
    std::size_t in_flight = 0;  // its transfers submitted and not yet ended
    bool released = false;      // its graph is gone
  };
  struct PendingReturn {
    const std::uint64_t* watched;
    std::uint64_t reaches;
    std::uint64_t ticket;
    std::size_t word;
    Return rule;
  };
  void reclaim_locked() {
    auto back = [&](const PendingReturn& p) {
      const std::uint64_t now = __atomic_load_n(p.watched, __ATOMIC_ACQUIRE);
      if (now < p.reaches) return false;
      if (p.rule == Return::Always || (now & retired_bits_) == 0) free_words_.push_back(p.word);
      return true;
    };
    if (pending_returns_.empty()) return;
    pending_returns_.erase(std::remove_if(pending_returns_.begin(), pending_returns_.end(), back), pending_returns_.end());
  }

  std::uint64_t* words_;
  std::size_t count_;
  std::chrono::milliseconds timeout_;
  std::uint64_t ticket_step_;
  std::uint64_t retired_bits_;
  std::mutex m_;  // everything below
  std::condition_variable cv_;
  std::deque<Request> queue_;
  std::vector<std::size_t> free_words_;
  std::map<std::size_t, GraphWord> graph_words_;  // held by captured graphs
  std::vector<PendingReturn> pending_returns_;     // lent words the GPU or a peer ends, in lending order
  std::uint64_t submitted_ = 0;
  std::uint64_t ended_ = 0;
  std::set<std::uint64_t> open_;  // tickets submitted and not yet counted ended
  std::uint64_t outside_work_ = 0;
  std::string error_;
  ErrorCode error_code_ = ErrorCode::Cuda;
  bool stop_ = false;
};

}  // namespace meshmem::detail
