// Events that mark when a caller's stream reached a transfer (its source or destination is
// ready), for a proxy thread that starts the transfer then: the staging agent, the NCCL proxy.
// Reused rather than created per transfer (an event creation costs microseconds); every
// event the pool made is destroyed with it. ReadyQueue: where such a thread keeps the
// transfers handed to it until their marks (these events, or words the streams write) say so.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <deque>
#include <iterator>
#include <list>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace meshmem::detail {

class EventPool {
 public:
  EventPool() = default;
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;
  ~EventPool();

  // A spare event, or a new one (on the current device: each pool serves one device); `what`
  // names the caller in errors.
  cudaEvent_t take(const std::string& what);
  void give_back(cudaEvent_t e);

 private:
  std::mutex m_;
  std::vector<cudaEvent_t> spare_;
};

// Transfers handed to a worker thread (the staging agent, a transfer proxy) whose sources
// become ready on their callers' streams (T has `ready`, what says so: an event, a word the
// stream writes, or null for ready at hand-over, and `stream`), kept per stream in
// submission order. Marks of one stream are reached in that stream's order,
// so a transfer behind one that is not ready cannot be ready either and is not queried: a
// caller that runs far ahead of its GPU hands over thousands of transfers, and querying each
// on every poll cost the staged Jacobi 2.6 x its time per iteration; even stepping over them
// in one list cost the staging agent about 3 us per turn of its loop (Jacobi 4096^2, 4 x
// H200, the host 350 iterations ahead), so each turn looks at the oldest of each stream only.
template <class T>
class ReadyQueue {
 public:
  void push(T t) {
    ++size_;
    if (t.ready == nullptr)
      now_.push_back(std::move(t));  // handed over by a captured doorbell once rung: ready
    else if (t.stream == cudaStreamPerThread)
      per_thread_.push_back(std::move(t));
    else
      by_stream_[t.stream].push_back(std::move(t));
  }
  bool empty() const { return size_ == 0; }
  std::size_t size() const { return size_; }

  // Hands every transfer whose source is ready to take(t, rc), oldest first within each
  // stream; query(t) says whether it is: cudaSuccess, cudaErrorNotReady, or the error of its
  // stream (then rc). A transfer leaves the queue before take sees it. True if any was taken.
  template <class Query, class Take>
  bool take_ready(Query query, Take take) {
    bool any = false;
    while (!now_.empty()) {
      T t = std::move(now_.front());
      now_.pop_front();
      --size_;
      any = true;
      take(std::move(t), cudaSuccess);
    }
    for (auto it = by_stream_.begin(); it != by_stream_.end();) {
      std::deque<T>& fifo = it->second;
      while (!fifo.empty()) {
        const cudaError_t rc = query(fifo.front());
        if (rc == cudaErrorNotReady) break;
        T t = std::move(fifo.front());
        fifo.pop_front();
        --size_;
        any = true;
        take(std::move(t), rc);
      }
      it = fifo.empty() ? by_stream_.erase(it) : std::next(it);
    }
    // The per-thread default stream is one handle for as many streams as there are threads:
    // its transfers are in no one order, each is asked.
    for (auto it = per_thread_.begin(); it != per_thread_.end();) {
      const cudaError_t rc = query(*it);
      if (rc == cudaErrorNotReady) {
        ++it;
        continue;
      }
      T t = std::move(*it);
      it = per_thread_.erase(it);
      --size_;
      any = true;
      take(std::move(t), rc);
    }
    return any;
  }

  // Hands every transfer still waiting to f, then holds none.
  template <class F>
  void take_all(F f) {
    for (T& t : now_) f(t);
    for (auto& [stream, fifo] : by_stream_)
      for (T& t : fifo) f(t);
    for (T& t : per_thread_) f(t);
    now_.clear();
    by_stream_.clear();
    per_thread_.clear();
    size_ = 0;
  }

 private:
  std::deque<T> now_;
  std::map<cudaStream_t, std::deque<T>> by_stream_;
  std::list<T> per_thread_;
  std::size_t size_ = 0;
};

}  // namespace meshmem::detail
