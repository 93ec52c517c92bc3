// HostAgentCore: what a transport's host helper thread stands on, apart from its protocol:
// the queue of requests handed over by the callers, the done words lent to transfers (one
// transfer's, or a captured graph's for its life), the count of transfers submitted and
// ended, the first error, and the stop flag. A transfer's done word reaches its ticket when
// it ends; the caller's stream waits for that (GpuDevice::wait_for_ticket).
//
// CUDA-free and MPI-free (the done words are memory its owner provides, mapped for the GPU),
// so its rules are unit-tested anywhere (tests/unit/test_host_agent.cpp). `Request` has the
// fields `std::size_t word` and `std::uint64_t ticket`.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "backoff.hpp"
#include "log.hpp"
#include "meshmem/error.hpp"

namespace meshmem::detail {

template <class Request>
class HostAgentCore {
 public:
  // `words`: `count` done words, zeroed, alive as long as this. `timeout`: how long a caller
  // waits for a free word and drain() for the transfers (0: for ever).
  HostAgentCore(std::uint64_t* words, std::size_t count, std::chrono::milliseconds timeout)
      : words_(words), count_(count), timeout_(timeout) {
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
  // A word taken and not used (the transfer failed before it was submitted).
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
  // Queues a transfer; returns the ticket its done word reaches at its end.
  std::uint64_t submit(Request r) {
    std::lock_guard<std::mutex> lock(m_);
    r.ticket = ++submitted_;
    const auto graph = graph_words_.find(r.word);
    if (graph != graph_words_.end()) ++graph->second.in_flight;
    queue_.push_back(r);
    return r.ticket;
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
    std::lock_guard<std::mutex> lock(m_);
    stop_ = true;
  }

  // ---- the agent thread's side ----
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
    cv_.notify_all();
  }
  // Records the first error (logged once, where it is detected); transfers still end (their
  // streams go on), and the callers' next call raises it.
  void note_error(const std::string& e, ErrorCode code = ErrorCode::Cuda) {
    log(LogLevel::Error, e);
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
  std::uint64_t* words_;
  std::size_t count_;
  std::chrono::milliseconds timeout_;
  std::mutex m_;  // everything below
  std::condition_variable cv_;
  std::deque<Request> queue_;
  std::vector<std::size_t> free_words_;
  std::map<std::size_t, GraphWord> graph_words_;  // held by captured graphs
  std::uint64_t submitted_ = 0;
  std::uint64_t ended_ = 0;
  std::string error_;
  ErrorCode error_code_ = ErrorCode::Cuda;
  bool stop_ = false;
};

}  // namespace meshmem::detail
