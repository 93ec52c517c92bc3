#include "meshmem/ipc/awake_clock.hpp"

#include <pthread.h>
#include <signal.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

namespace meshmem::ipc {
namespace {

using std::chrono::nanoseconds;
using Steady = std::chrono::steady_clock;

constexpr nanoseconds kTick = std::chrono::milliseconds(50);
// A wake this long after the previous one is normal (the tick plus scheduling delay on a
// loaded node); only what lies beyond it is not counted.
constexpr nanoseconds kAllowed = std::chrono::milliseconds(250);

enum : int { kNotStarted = 0, kStarting = 1, kRunning = 2, kUnavailable = 3 };

// One per process, never destroyed: the detached watcher may run while statics are torn down.
// The watcher is the only writer of the two times; readers take a consistent pair through
// the sequence count (odd while a write is under way).
struct Watch {
  std::atomic<int> state{kNotStarted};
  std::atomic<std::uint64_t> seq{0};
  std::atomic<std::int64_t> last_wake_ns{0};
  std::atomic<std::int64_t> not_counted_ns{0};
  std::mutex published_m;  // held around fork, so that a child finds it free
  std::vector<std::int64_t*> published;
};

Watch& watch() {
  static Watch* const w = new Watch;
  return *w;
}

std::int64_t steady_ns() {
  return std::chrono::duration_cast<nanoseconds>(Steady::now().time_since_epoch()).count();
}

// count_gap: false for the first wake of a watcher (nothing before it was watched).
void record_wake(Watch& w, std::int64_t now, bool count_gap = true) {
  const std::int64_t last = w.last_wake_ns.load(std::memory_order_relaxed);
  const std::int64_t excess = count_gap ? now - last - kAllowed.count() : 0;
  const std::uint64_t s = w.seq.load(std::memory_order_relaxed);
  w.seq.store(s + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  if (excess > 0) w.not_counted_ns.fetch_add(excess, std::memory_order_relaxed);
  w.last_wake_ns.store(now, std::memory_order_relaxed);
  w.seq.store(s + 2, std::memory_order_release);
}

void write_published(Watch& w) {
  const std::int64_t now = std::chrono::duration_cast<nanoseconds>(AwakeClock::now().time_since_epoch()).count();
  std::lock_guard<std::mutex> lock(w.published_m);
  for (std::int64_t* word : w.published) __atomic_store_n(word, now, __ATOMIC_RELAXED);
}

void watcher_loop() {
  Watch& w = watch();
  const timespec tick{0, static_cast<long>(kTick.count())};
  for (;;) {
    timespec left = tick;
    while (clock_nanosleep(CLOCK_MONOTONIC, 0, &left, &left) != 0) {
    }
    record_wake(w, steady_ns());
    write_published(w);
  }
}

void before_fork() { watch().published_m.lock(); }
void after_fork_in_parent() { watch().published_m.unlock(); }

// In a child after fork the watcher is gone (only the forking thread survives): the child
// starts its own on its first now(). What was not counted before the fork stays not counted.
void after_fork_in_child() {
  Watch& w = watch();
  w.published_m.unlock();
  w.published.clear();  // pinned memory is not inherited (CUDA maps it MADV_DONTFORK)
  const std::uint64_t s = w.seq.load(std::memory_order_relaxed);
  w.seq.store((s | 1) + 1, std::memory_order_relaxed);  // even: a write cut by the fork is over
  w.last_wake_ns.store(steady_ns(), std::memory_order_relaxed);
  w.state.store(kNotStarted, std::memory_order_release);
}

void start_watcher(Watch& w) {
  int expected = kNotStarted;
  if (!w.state.compare_exchange_strong(expected, kStarting, std::memory_order_acq_rel)) return;
  static const bool fork_handler = pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child) == 0;
  record_wake(w, steady_ns(), false);
  // The watcher takes no signals meant for the application's threads.
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int next = kRunning;
  try {
    std::thread(watcher_loop).detach();
  } catch (...) {
    next = kUnavailable;  // every wait then counts all of its time, as a steady clock does
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  if (!fork_handler) next = kUnavailable;  // a child could not restart it: keep it simple
  w.state.store(next, std::memory_order_release);
}

struct Reading {
  std::int64_t now;
  std::int64_t not_counted;
};

Reading read() {
  Watch& w = watch();
  int state = w.state.load(std::memory_order_acquire);
  if (state == kNotStarted) {
    start_watcher(w);
    state = w.state.load(std::memory_order_acquire);
  }
  for (;;) {
    const std::uint64_t s1 = w.seq.load(std::memory_order_acquire);
    if ((s1 & 1) != 0) continue;
    const std::int64_t last = w.last_wake_ns.load(std::memory_order_relaxed);
    std::int64_t gone = w.not_counted_ns.load(std::memory_order_relaxed);
    // Read inside the section: a wake recorded after `now` was read makes this reading retry.
    const std::int64_t now = steady_ns();
    std::atomic_thread_fence(std::memory_order_acquire);
    if (w.seq.load(std::memory_order_relaxed) != s1) continue;
    // The watcher is late and has not woken yet: the clock stands still meanwhile.
    if (state == kRunning && now - last > kAllowed.count()) gone += now - last - kAllowed.count();
    return Reading{now, gone};
  }
}

}  // namespace

AwakeClock::time_point AwakeClock::now() noexcept {
  const Reading r = read();
  return time_point(std::chrono::duration_cast<duration>(nanoseconds(r.now - r.not_counted)));
}

std::chrono::nanoseconds AwakeClock::not_counted() noexcept { return nanoseconds(read().not_counted); }

bool AwakeClock::publish(std::int64_t* word) noexcept {
  (void)read();  // starts the watcher
  Watch& w = watch();
  while (w.state.load(std::memory_order_acquire) == kStarting) std::this_thread::yield();  // another thread starts it
  if (w.state.load(std::memory_order_acquire) != kRunning) return false;
  const std::int64_t now = std::chrono::duration_cast<nanoseconds>(AwakeClock::now().time_since_epoch()).count();
  __atomic_store_n(word, now, __ATOMIC_RELAXED);
  std::lock_guard<std::mutex> lock(w.published_m);
  w.published.push_back(word);
  return true;
}

void AwakeClock::unpublish(std::int64_t* word) noexcept {
  Watch& w = watch();
  std::lock_guard<std::mutex> lock(w.published_m);
  w.published.erase(std::remove(w.published.begin(), w.published.end(), word), w.published.end());
}

}  // namespace meshmem::ipc
