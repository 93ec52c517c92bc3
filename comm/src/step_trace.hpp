// StepTrace: timestamps of a worker thread's steps, kept in memory and written to a file when
// the trace ends, to find where a transfer's time goes between threads and processes (the
// staging agent's: a transfer handed over, its source seen ready, its copy enqueued, its
// descriptor posted; a peer's descriptor seen, carried out). bench/agent_trace.py reads the
// files of all ranks and prints where the time went. Off unless asked for (the staging agent:
// MESHMEM_STAGED_TRACE): a step then costs one branch.
//
// Times are CLOCK_MONOTONIC in nanoseconds, one clock for every process of a host, so the
// steps of two ranks of a node line up. CUDA-free and MPI-free.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace meshmem::detail {

class StepTrace {
 public:
  StepTrace() = default;  // off
  // On: keeps up to `capacity` steps (later ones are counted, not kept) for `path`.
  StepTrace(std::string path, std::size_t capacity);
  StepTrace(const StepTrace&) = delete;
  StepTrace& operator=(const StepTrace&) = delete;

  bool on() const { return capacity_ != 0; }
  // One step: its letter, the peer rank, the transfer's number, one more value (bytes, a
  // rank). From any thread.
  void record(char step, int peer, std::uint64_t id, std::int64_t aux = 0) noexcept {
    if (capacity_ == 0) return;
    const std::size_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i < capacity_) steps_[i] = Step{now_ns(), id, aux, peer, step};
  }
  // Writes the steps kept so far, one line each ("ns step peer id aux", after a "#" line that
  // says how many were kept and dropped); "" where it wrote them, else why not. Call it once
  // no thread records any more.
  std::string write() const;
  std::size_t recorded() const { return next_.load(); }

  static std::int64_t now_ns() noexcept;

 private:
  struct Step {
    std::int64_t ns;
    std::uint64_t id;
    std::int64_t aux;
    std::int32_t peer;
    char step;
  };
  std::string path_;
  std::unique_ptr<Step[]> steps_;
  std::size_t capacity_ = 0;
  std::atomic<std::size_t> next_{0};
};

}  // namespace meshmem::detail
