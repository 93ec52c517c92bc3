#include "cuda/runtime/window_releaser.hpp"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <system_error>
#include <utility>

#include "backoff.hpp"
#include "log.hpp"
#include "cuda/runtime/block_pool.hpp"
#include "cuda/runtime/device_sync.hpp"
#include "cuda/runtime/relaxed_capture_mode.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

namespace {
// How often the thread looks at events not yet ready: a release a little late costs nothing,
// a busy thread beside the user's would.
constexpr std::chrono::microseconds kFirstLook{50}, kSlowestLook{2000};

bool capture_refused(CUresult rc) {
  switch (rc) {
    case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED:
    case CUDA_ERROR_STREAM_CAPTURE_INVALIDATED:
    case CUDA_ERROR_STREAM_CAPTURE_MERGE:
    case CUDA_ERROR_STREAM_CAPTURE_UNMATCHED:
    case CUDA_ERROR_STREAM_CAPTURE_UNJOINED:
    case CUDA_ERROR_STREAM_CAPTURE_ISOLATION:
    case CUDA_ERROR_STREAM_CAPTURE_IMPLICIT:
    case CUDA_ERROR_CAPTURED_EVENT:
    case CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD:
      return true;
    default:
      return false;
  }
}
}  // namespace

WindowReleaser::WindowReleaser(int device, std::chrono::milliseconds bound) : device_(device), bound_(bound) {}

WindowReleaser::Armed WindowReleaser::arm(Job& job, const std::string& what) {
  job.after.reset();  // none: the thread synchronises the device instead
  const ipc::CudaDriver& driver = ipc::cuda_driver();
  if (driver.cuCtxRecordEvent == nullptr) return Armed::Synchronise;  // a driver before 12.5
  RelaxedCaptureMode relaxed;  // another thread may capture in global mode meanwhile
  CurrentDevice on(device_);
  CUcontext context = nullptr;
  if (driver.cuCtxGetCurrent(&context) != CUDA_SUCCESS || context == nullptr) return Armed::Synchronise;
  try {
    job.after = std::make_unique<OwnedEvent>(what);
  } catch (const std::exception&) {
    return Armed::Synchronise;  // no event: synchronise (the memory is still released)
  }
  job.mark = device_quiescence_began(device_);
  // Refused, and the capture invalidated, while a stream of the context captures a graph
  // (studies/release_lab: in every capture mode of either thread).
  const CUresult recorded = driver.cuCtxRecordEvent(context, job.after->get());
  if (recorded != CUDA_SUCCESS) {
    job.after.reset();
    return capture_refused(recorded) ? Armed::CaptureRefused : Armed::Synchronise;
  }
  // An error the application has not read yet stays its own: the query (which may replace
  // it) and the detaching (which clears the thread's error) are left to the releasing thread.
  if (cudaPeekAtLastError() != cudaSuccess) return Armed::Pending;
  const cudaError_t now = cudaEventQuery(job.after->get());
  if (now != cudaSuccess) (void)cudaGetLastError();
  // An error of the device's: its work is over either way.
  return now != cudaErrorNotReady ? Armed::Ready : Armed::Pending;
}

std::uint64_t WindowReleaser::submit(Job job) {
  std::uint64_t ticket = 0;
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    ticket = job.ticket = ++shared_->submitted;
    shared_->waiting[ticket] = Waiting{std::chrono::steady_clock::now(), false};
    shared_->jobs.push_back(std::move(job));
  }
  if (!thread_.joinable()) thread_ = std::thread(&WindowReleaser::serve, shared_, device_);
  shared_->wake.notify_all();
  return ticket;
}

WindowReleaser::Handed WindowReleaser::hand_over(WindowState& state, const std::string& what) {
  Job job;
  job.attachments = std::move(state.attachments);  // first: nothing below leaves them to ~WindowState
  for (auto& attachment : job.attachments) attachment->freed();
  job.storage = std::move(state.storage);
  state.release_memory();  // the rest: the peer table, pointers
  Armed armed = Armed::Synchronise;
  try {
    armed = arm(job, what);
  } catch (const std::exception&) {
    job.after.reset();  // synchronise on the thread
  }
  Handed handed;
  switch (armed) {
    case Armed::Ready: {
      // Released here, not behind other releases on the thread (their detaching may take long).
      RelaxedCaptureMode relaxed;
      follow(job, true);
      release_job(job, device_);
      return handed;
    }
    case Armed::Pending:
      follow(job, false);
      handed.then = Then::Return;
      break;
    case Armed::Synchronise:
      handed.then = Then::Wait;
      break;
    case Armed::CaptureRefused: {
      std::lock_guard<std::mutex> lock(refused_mutex_);
      refused_.push_back(std::move(job));
      handed.then = Then::CaptureRefused;
      return handed;
    }
  }
  handed.ticket = submit(std::move(job));
  return handed;
}

std::vector<WindowReleaser::Job> WindowReleaser::take_refused() {
  std::lock_guard<std::mutex> lock(refused_mutex_);
  return std::exchange(refused_, {});
}

void WindowReleaser::follow(const Job& armed, bool ready) {
  std::vector<Job> kept = take_refused();
  // The event covers every stream's work before it, so the work before those frees too.
  for (Job& job : kept) {
    job.after = armed.after;
    job.mark = armed.mark;
    if (ready) {
      RelaxedCaptureMode relaxed;
      release_job(job, device_);
    } else {
      submit(std::move(job));
    }
  }
}

bool WindowReleaser::release_refused(const std::string& what) {
  {
    std::lock_guard<std::mutex> lock(refused_mutex_);
    if (refused_.empty()) return true;
  }
  Job probe;
  Armed armed = Armed::Synchronise;
  try {
    armed = arm(probe, what);
  } catch (const std::exception&) {
    return false;
  }
  if (armed != Armed::Ready && armed != Armed::Pending) return false;
  follow(probe, armed == Armed::Ready);
  return true;
}

void WindowReleaser::synchronise_refused() {
  std::vector<Job> kept = take_refused();
  std::vector<std::uint64_t> tickets;
  for (Job& job : kept) {
    job.after.reset();
    tickets.push_back(submit(std::move(job)));
  }
  if (!tickets.empty()) give_up(tickets);
}

bool WindowReleaser::wait(const std::vector<std::uint64_t>& tickets, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(shared_->mutex);
  auto done = [&] {
    for (std::uint64_t t : tickets)
      if (t != 0 && shared_->waiting.count(t) != 0) return false;
    return true;
  };
  if (timeout.count() == 0) {
    shared_->done.wait(lock, done);
    return true;
  }
  return shared_->done.wait_for(lock, timeout, done);
}

void WindowReleaser::give_up(const std::vector<std::uint64_t>& tickets) {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  for (std::uint64_t t : tickets) {
    reported_ = std::max(reported_, t);  // raised by the caller: not again
    if (shared_->waiting.count(t) != 0) given_up_.push_back(t);
  }
}

bool WindowReleaser::gave_up() {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  given_up_.erase(std::remove_if(given_up_.begin(), given_up_.end(),
                                 [&](std::uint64_t t) { return shared_->waiting.count(t) == 0; }),
                  given_up_.end());
  return !given_up_.empty();
}

std::vector<std::uint64_t> WindowReleaser::all_pending() {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  std::vector<std::uint64_t> out;
  for (const auto& [ticket, w] : shared_->waiting) out.push_back(ticket);
  return out;
}

std::chrono::milliseconds WindowReleaser::take_overdue() {
  if (bound_.count() == 0) return std::chrono::milliseconds(0);  // no timeout: never overdue
  std::lock_guard<std::mutex> lock(shared_->mutex);
  const auto now = std::chrono::steady_clock::now();
  for (const auto& [ticket, w] : shared_->waiting) {
    if (ticket <= reported_ || w.work_ended) continue;
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - w.since);
    if (waited < bound_) break;  // younger ones follow
    reported_ = shared_->submitted;  // one report for every release waiting behind the same work
    return waited;
  }
  return std::chrono::milliseconds(0);
}

bool WindowReleaser::pending() {
  {
    std::lock_guard<std::mutex> lock(refused_mutex_);
    if (!refused_.empty()) return true;
  }
  std::lock_guard<std::mutex> lock(shared_->mutex);
  return !shared_->waiting.empty();
}

WindowReleaser::~WindowReleaser() {
  try {
    synchronise_refused();  // where ~Comm could not give them an event
  } catch (const std::exception&) {
    // No thread: the memory stays mapped until the process ends.
  }
  // The blocks that the Comm's objects gave back after the last window went.
  if (blocks_in_quarantine(device_)) {
    try {
      Job job;
      (void)arm(job, "meshmem::Comm (releasing meshmem's GPU memory)");
      submit(std::move(job));
    } catch (const std::exception&) {
      // No event or thread: the blocks stay quarantined until another release of this device.
    }
  }
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    shared_->stop = true;
  }
  shared_->wake.notify_all();
  if (!thread_.joinable()) return;
  const bool stuck = gave_up();
  std::unique_lock<std::mutex> lock(shared_->mutex);
  auto finished = [&] { return shared_->finished; };
  if (stuck) {
    // A synchronisation waits for a stream that never finishes: waiting would hang the
    // caller; the thread keeps the memory (and itself) until the device's work ends.
  } else if (bound_.count() == 0) {
    shared_->done.wait(lock, finished);
  } else if (!shared_->done.wait_for(lock, bound_, finished)) {
    log(LogLevel::Warn, "meshmem: work issued on GPU " + std::to_string(device_) + " has not finished after " +
                            describe_timeout(bound_) + "; the Comm's GPU memory is released once that work ends");
  }
  const bool done = shared_->finished;
  lock.unlock();
  if (done)
    thread_.join();
  else
    thread_.detach();
}

void WindowReleaser::release_job(Job& job, int device) {
  std::uint64_t mark = job.mark;
  if (job.after == nullptr) {
    mark = device_quiescence_began(device);
    // The memory stays mapped until a capture open on the device ends, or the caller's bound
    // reports it.
    const cudaError_t rc = synchronize_device_between_captures();
    if (rc != cudaSuccess)
      log(LogLevel::Error, std::string("releasing window memory: cudaDeviceSynchronize: ") + cudaGetErrorString(rc) +
                               "; unmapping anyway");
  }
  {
    QuiescedRelease covered(device);  // the job's own blocks: its work has ended
    while (!job.attachments.empty()) job.attachments.pop_back();  // last attached first
    job.storage.reset();
    job.after.reset();
  }
  device_quiescence_ended(device, mark);
}

void WindowReleaser::serve(std::shared_ptr<Shared> shared, int device) {
  relax_capture_mode_of_this_thread();
  (void)cudaSetDevice(device);
  std::vector<Job> mine;  // taken from the queue, released in any order as their work ends
  std::chrono::microseconds look = kFirstLook;
  std::unique_lock<std::mutex> lock(shared->mutex);
  for (;;) {
    while (!shared->jobs.empty()) {
      mine.push_back(std::move(shared->jobs.front()));
      shared->jobs.pop_front();
    }
    if (mine.empty()) {
      if (shared->stop) break;
      shared->wake.wait(lock, [&] { return shared->stop || !shared->jobs.empty(); });
      look = kFirstLook;
      continue;
    }
    lock.unlock();
    // Every event first, then the releases: one whose detaching takes long does not leave
    // another's ended work looking overdue meanwhile.
    std::vector<Job> waiting_still, to_release;
    for (Job& job : mine) {
      if (job.after != nullptr) {
        const cudaError_t rc = cudaEventQuery(job.after->get());
        if (rc == cudaErrorNotReady) {
          waiting_still.push_back(std::move(job));
          continue;
        }
        if (rc != cudaSuccess) {
          (void)cudaGetLastError();
          log(LogLevel::Error, std::string("releasing window memory: cudaEventQuery: ") + cudaGetErrorString(rc) +
                                   "; unmapping anyway");
        }
      }
      to_release.push_back(std::move(job));  // without an event: its device synchronisation waits
    }
    mine = std::move(waiting_still);
    if (!to_release.empty()) {
      std::lock_guard<std::mutex> mark(shared->mutex);  // the waiting call may look meanwhile
      for (const Job& job : to_release)
        if (job.after != nullptr) shared->waiting[job.ticket].work_ended = true;
    }
    for (Job& job : to_release) {
      release_job(job, device);
      {
        std::lock_guard<std::mutex> gone(shared->mutex);
        shared->waiting.erase(job.ticket);
      }
      shared->done.notify_all();
    }
    lock.lock();
    if (!to_release.empty()) {
      look = kFirstLook;
    } else if (!mine.empty()) {
      shared->wake.wait_for(lock, look, [&] { return !shared->jobs.empty(); });
      look = std::min(look * 2, kSlowestLook);
    }
  }
  shared->finished = true;
  shared->done.notify_all();
}

}  // namespace meshmem::detail
