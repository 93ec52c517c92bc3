// WindowReleaser: frees device window memory (transport attachments, then this rank's part)
// once the work issued on the device before the free has ended, without holding the caller
// behind work that is still running.
//
// The free records an event of the whole context (cuCtxRecordEvent: every stream's work issued
// so far) on the caller's thread, so no later graph capture is touched by it; a thread of its
// own polls that event in relaxed capture mode and then detaches and unmaps (VMM unmapping
// waits for no kernel, and neither touches a capture open on another thread:
// studies/release_lab). A free whose event is ready at once releases on the caller's thread,
// so alloc/free cycles leave nothing behind; one behind running work returns, and work that
// has not ended a timeout after its free is reported, once, by the next free. Where the event
// cannot be recorded:
// * a graph capture open on the device (CUDA refused the event and invalidated the capture):
//   the free says so at once, and the release waits for the next event recorded outside a
//   capture (the next free, an allocation that needs the memory, ~Comm), not for a device
//   synchronisation, which would invalidate the application's next capture too;
// * a driver before CUDA 12.5, or no event to be had: the thread synchronises the device,
//   and the free waits for that (bounded by the caller's timeout).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "window_state.hpp"
#include "cuda/runtime/cuda_owners.hpp"

namespace meshmem::detail {

class WindowReleaser {
 public:
  WindowReleaser(int device, std::chrono::milliseconds bound);
  // Blocks given back before this (the Comm's barrier, transports, fault record) are freed
  // once the device's work before it has ended. Waits for every release at most `bound` (not
  // at all after a release that timed out), then leaves the thread be: it frees the memory
  // once the device's work allows.
  ~WindowReleaser();
  WindowReleaser(const WindowReleaser&) = delete;
  WindowReleaser& operator=(const WindowReleaser&) = delete;

  // What the caller of hand_over does next.
  enum class Then {
    Return,         // released already, or released by the thread once the work ends
    Wait,           // no event: the thread synchronises the device; wait for the ticket
    CaptureRefused  // a graph capture is open on the device (CUDA refused the event and
                    // invalidated the capture): kept for the next event (release_refused)
  };
  struct Handed {
    std::uint64_t ticket = 0;  // 0: released on the caller's thread
    Then then = Then::Return;
  };
  // Takes the memory out of `state` (the ranks have met); `what` names the call for messages.
  // Where the device's earlier work has ended, the memory is released on this thread before
  // it returns; otherwise the thread of this releaser releases it.
  Handed hand_over(WindowState& state, const std::string& what);
  // Whether every one of `tickets` is released within `timeout` (0: waits for ever).
  bool wait(const std::vector<std::uint64_t>& tickets, std::chrono::milliseconds timeout);
  // After a wait for `tickets` that timed out and was reported: they are not reported again,
  // and while one of them is not released, waiting for the device's work would time out
  // again: gave_up() says so.
  void give_up(const std::vector<std::uint64_t>& tickets);
  bool gave_up();
  // How long the oldest release whose earlier work has not ended has waited, where that is
  // `bound` or more and it was not reported before (0 otherwise); reported once.
  std::chrono::milliseconds take_overdue();
  // Releases kept from frees during a capture go behind an event recorded now; false where
  // none can be recorded (a capture is still open): they stay kept.
  bool release_refused(const std::string& what);
  // At ~Comm, where release_refused could not: the thread synchronises the device for them
  // once the capture has ended; not waited for (gave_up() says so).
  void synchronise_refused();
  // Whether releases wait for the device's work, or for an event (kept ones).
  bool pending();
  // Every ticket handed out and not yet released.
  std::vector<std::uint64_t> all_pending();

 private:
  struct Job {
    std::vector<std::unique_ptr<WindowAttachment>> attachments;
    std::unique_ptr<WindowMemory> storage;
    std::shared_ptr<OwnedEvent> after;  // the context's work before the free; null: synchronise
    std::uint64_t mark = 0;             // block_pool.hpp's quiescence mark (with `after`)
    std::uint64_t ticket = 0;
  };
  struct Waiting {
    std::chrono::steady_clock::time_point since;
    bool work_ended = false;  // its event is ready: only the detaching is left
  };
  struct Shared {
    std::mutex mutex;
    std::condition_variable wake, done;
    std::deque<Job> jobs;
    std::map<std::uint64_t, Waiting> waiting;  // by ticket: submitted, not yet released
    std::uint64_t submitted = 0;
    bool stop = false, finished = false;
  };
  enum class Armed { Ready, Pending, Synchronise, CaptureRefused };
  // Gives `job` an event that records the context's work so far (none where that cannot be
  // recorded: the thread synchronises the device). Ready: that work has ended already.
  Armed arm(Job& job, const std::string& what);
  std::uint64_t submit(Job job);
  std::vector<Job> take_refused();  // the kept releases, none left kept
  // Gives the kept releases `armed`'s event (and mark): released here where it is ready.
  void follow(const Job& armed, bool ready);
  static void serve(std::shared_ptr<Shared> shared, int device);
  static void release_job(Job& job, int device);
  int device_;
  std::chrono::milliseconds bound_;
  std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
  std::thread thread_;
  std::uint64_t reported_ = 0;  // tickets up to this were reported overdue
  std::vector<std::uint64_t> given_up_;  // (under shared_->mutex)
  std::mutex refused_mutex_;
  std::vector<Job> refused_;  // freed during a capture: waiting for an event (under refused_mutex_)
};

}  // namespace meshmem::detail
