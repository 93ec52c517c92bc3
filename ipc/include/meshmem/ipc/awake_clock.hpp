// A steady clock that stands still while this whole process is stopped: SIGSTOP, a
// debugger's all-stop, a job suspended by its scheduler (SLURM's `scontrol suspend`). Every
// meshmem timeout is measured with it, so a timeout means "the peer did not answer while this
// process was able to see it". Without it, a whole job suspended for longer than
// MESHMEM_TIMEOUT and resumed failed with a Timeout that no peer caused, and the Comm was
// broken. A peer stopped alone still times out: this process keeps running, and so does its
// clock.
//
// How: a watcher thread wakes every 50 ms. A wake later than 250 ms after the previous one
// means that the process did not run in between (or was starved of the CPU as long), and the
// excess is not counted. While the watcher is late and has not woken yet the clock stands
// still, so the first waiter to run after a resume sees no jump. The watcher starts on the
// first call to now() in each process (again in a child after fork).
#pragma once

#include <chrono>
#include <cstdint>

namespace meshmem::ipc {

struct AwakeClock {
  using duration = std::chrono::steady_clock::duration;
  using rep = duration::rep;
  using period = duration::period;
  using time_point = std::chrono::time_point<AwakeClock>;
  static constexpr bool is_steady = true;

  static time_point now() noexcept;
  // Time not counted so far in this process (for reports and tests).
  static std::chrono::nanoseconds not_counted() noexcept;

  // Keeps *word at now() in nanoseconds, written by the watcher at each wake (every 50 ms)
  // with an 8-byte store: for readers that cannot call now(), such as GPU kernels reading
  // pinned host memory. False (nothing written) where no watcher runs: such a word would
  // never move. unpublish() returns once the watcher no longer writes to `word`.
  static bool publish(std::int64_t* word) noexcept;
  static void unpublish(std::int64_t* word) noexcept;
};

}  // namespace meshmem::ipc
