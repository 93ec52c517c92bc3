#include "cuda/halo/halo_watch.hpp"

#include <cuda.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>

#include "backoff.hpp"
#include "log.hpp"
#include "cuda/runtime/block_pool.hpp"
#include "cuda/agent/captured_handoff.hpp"
#include "cuda/runtime/cuda_owners.hpp"
#include "cuda/runtime/device_sync.hpp"
#include "cuda/runtime/event_pool.hpp"
#include "cuda/runtime/gpu_queues.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

struct HaloWatch::Shared {
  using Clock = std::chrono::steady_clock;
  struct Exchange {
    cudaStream_t stream;
    cudaEvent_t began, passed;
    std::uint64_t epoch;
    std::optional<Clock::time_point> began_at;  // when the thread first saw `began` done
  };

  int device;
  std::optional<std::chrono::milliseconds> limit;  // none: MESHMEM_TIMEOUT=0
  cuda::DeviceFault* fault;
  std::uint64_t window;
  std::vector<const std::uint64_t*> words;
  std::vector<int> ranks;
  std::string what;
  EventPool events;

  std::mutex m;
  std::condition_variable wake;
  std::deque<Exchange> listed;
  bool running = false, owner_gone = false;
  bool releasing = false;                 // release() runs: the owner waits for its end
  std::string released;                   // HaloWatch::released
  cudaStream_t release_stream = nullptr;  // for the releases (made with the watch)
  PooledBlock seen_memory;                // the words, as read at a release (made with the watch)

  ~Shared() {
    if (release_stream != nullptr) (void)cudaStreamDestroy(release_stream);
  }

  // Holds its own reference: the thread may outlive the plan (exchanges still listed).
  static void serve(std::shared_ptr<Shared> self) { self->loop(); }

  void loop() {
    (void)cudaSetDevice(device);
    relax_capture_mode_of_this_thread();
    std::unique_lock<std::mutex> lock(m);
    for (;;) {
      wake.wait(lock, [&] { return !listed.empty() || owner_gone; });
      if (listed.empty()) return;  // the owner is gone and nothing is left to watch
      std::vector<cudaStream_t> behind;  // a later exchange of such a stream cannot have passed
      std::optional<Exchange> late;
      for (auto it = listed.begin(); it != listed.end();) {
        if (std::find(behind.begin(), behind.end(), it->stream) != behind.end()) {
          ++it;
          continue;
        }
        // An error other than "not ready" ends the watch of that exchange: its events will
        // never report success (the error itself reaches the caller's next CUDA call).
        const cudaError_t passed = cudaEventQuery(it->passed);
        if (passed != cudaErrorNotReady) {
          events.give_back(it->began);
          events.give_back(it->passed);
          it = listed.erase(it);
          if (owner_gone) wake.notify_all();  // the owner may wait for the list to empty
          continue;
        }
        if (!it->began_at) {
          if (cudaEventQuery(it->began) == cudaSuccess) it->began_at = Clock::now();
        } else if (!late && limit && Clock::now() - *it->began_at >= *limit) {
          late = *it;
          it = listed.erase(it);
          continue;
        }
        if (it->stream != cudaStreamPerThread) behind.push_back(it->stream);  // one handle, many streams
        ++it;
      }
      (void)cudaGetLastError();  // cudaErrorNotReady is not sticky; nothing else to keep
      if (late) {
        releasing = true;
        lock.unlock();  // the caller's next exchange is not held up by the release
        try {
          release(*late);
        } catch (const std::exception& e) {  // a message's allocation: nothing else throws
          log(LogLevel::Error, what + ": releasing exchange " + std::to_string(late->epoch) + " failed: " + e.what());
        }
        lock.lock();
        releasing = false;
        wake.notify_all();
        lock.unlock();
        events.give_back(late->began);
        events.give_back(late->passed);
        lock.lock();
        continue;
      }
      // A few milliseconds of precision are enough for a limit of seconds.
      wake.wait_for(lock, std::chrono::milliseconds(5), [&] { return owner_gone && listed.empty(); });
    }
  }

  // Whether the release stream ends within a second (its work may sit in a GPU hardware queue
  // behind the very stream it is meant to release: docs/semantics.md "GPU queues"); an error counts as no.
  bool release_stream_ends_soon() const {
    try {
      return stream_ends_by(release_stream, Deadline(std::chrono::seconds(1)), "cudaStreamQuery (halo exchange watch)",
                            what);
    } catch (const Error&) {
      (void)cudaGetLastError();
      return false;
    }
  }

  // released() says so before the fault is recorded and the stream goes on: a caller that
  // sees either finds the exchange failed.
  void mark_released(const std::string& text) {
    std::lock_guard<std::mutex> lock(m);
    if (released.empty()) released = text;
  }

  // The Halo fault naming the first short neighbour, then every short word set to the exchange
  // number so that the stream goes on.
  void release(const Exchange& x) {
    const std::string outcome = "exchange " + std::to_string(x.epoch) + " of this halo exchange did not get its halos within " +
                                "MESHMEM_TIMEOUT and its stream was released";
    // Pinned, from meshmem's block pool: a pageable copy waits on the calling thread, and
    // cudaFreeHost would wait for the GPU's work while holding up the process's CUDA calls.
    auto* seen = static_cast<std::uint64_t*>(seen_memory.get());
    bool read = true;
    for (std::size_t i = 0; read && i < words.size(); ++i)
      read = cudaMemcpyAsync(seen + i, words[i], sizeof(std::uint64_t), cudaMemcpyDeviceToHost, release_stream) ==
             cudaSuccess;
    read = read && release_stream_ends_soon();  // unread: every word counts as short
    if (!read) (void)cudaGetLastError();
    const auto short_of = [&](std::size_t i) { return !read || seen[i] < x.epoch; };
    std::size_t first = words.size();
    for (std::size_t i = 0; i < words.size() && first == words.size(); ++i)
      if (short_of(i)) first = i;
    if (first == words.size()) return;  // every halo came between the limit and the read
    mark_released(outcome + " (rank " + std::to_string(ranks[first]) + " was late)");
    record_fault_from_host(fault, cuda::FaultKind::Halo, ranks[first], static_cast<std::uint64_t>(ranks[first]),
                           read ? seen[first] : 0, x.epoch, window);
    for (std::size_t i = 0; i < words.size(); ++i) {
      if (!short_of(i)) continue;
      const CUresult rc = ipc::cuda_driver().cuStreamWriteValue64(
          reinterpret_cast<CUstream>(release_stream), reinterpret_cast<CUdeviceptr>(words[i]), x.epoch, 0);
      if (rc != CUDA_SUCCESS)
        log(LogLevel::Error, what + ": cuStreamWriteValue64 (releasing exchange " + std::to_string(x.epoch) +
                                 "'s wait for rank " + std::to_string(ranks[i]) + ") failed (CUresult " +
                                 std::to_string(static_cast<int>(rc)) + "); the stream stays waiting");
    }
    if (!release_stream_ends_soon())
      log(LogLevel::Error, what + ": the release of exchange " + std::to_string(x.epoch) +
                               "'s waits has not run after 1 s (held in a GPU queue behind a waiting stream?); "
                               "the stream may stay waiting" + gpu_queue_hint());
  }
};

HaloWatch::HaloWatch(int device, std::chrono::milliseconds limit, cuda::DeviceFault* fault, std::uint64_t window,
                     std::vector<const std::uint64_t*> words, std::vector<int> ranks, std::string what)
    : shared_(std::make_shared<Shared>()) {
  shared_->device = device;
  if (limit.count() > 0) shared_->limit = limit;
  shared_->fault = fault;
  shared_->window = window;
  shared_->words = std::move(words);
  shared_->ranks = std::move(ranks);
  shared_->what = std::move(what);
  // Made here, not at a release: creating them may wait on the driver's lock, which a free on
  // another thread holds while the GPU waits for the very words a release would write.
  ipc::check_cuda(cudaStreamCreateWithFlags(&shared_->release_stream, cudaStreamNonBlocking),
                  "cudaStreamCreateWithFlags (halo exchange watch)", shared_->what);
  shared_->seen_memory =
      take_block(BlockMemory::MappedHost, device, shared_->words.size() * sizeof(std::uint64_t), shared_->what);
}

HaloWatch::~HaloWatch() {
  if (began_ != nullptr) shared_->events.give_back(began_);
  // The listed exchanges end first (each passes or is released within its limit): a release
  // reads and writes the signal words, which the owner gives back after this. Bounded (the
  // limit and 3 s more; 0: for ever, as MESHMEM_TIMEOUT=0 asks of every wait).
  std::unique_lock<std::mutex> lock(shared_->m);
  shared_->owner_gone = true;
  shared_->wake.notify_all();
  const auto ended = [&] { return shared_->listed.empty() && !shared_->releasing; };
  if (!shared_->limit) {
    shared_->wake.wait(lock, ended);
  } else if (!shared_->wake.wait_for(lock, *shared_->limit + std::chrono::seconds(3), ended)) {
    log(LogLevel::Error, shared_->what + ": " + std::to_string(shared_->listed.size()) +
                             " exchange(s) still waiting when the halo exchange went, past their time limit; their "
                             "release may write signal words that are given back");
  }
}

std::string HaloWatch::released() const {
  std::lock_guard<std::mutex> lock(shared_->m);
  return shared_->released;
}

void HaloWatch::began(cudaStream_t stream) {
  if (began_ == nullptr) began_ = shared_->events.take(shared_->what);
  ipc::check_cuda(cudaEventRecord(began_, stream), "cudaEventRecord (halo exchange watch)", shared_->what);
}

void HaloWatch::enqueued(cudaStream_t stream, std::uint64_t epoch) {
  cudaEvent_t passed = shared_->events.take(shared_->what);
  const cudaError_t rc = cudaEventRecord(passed, stream);
  if (rc != cudaSuccess) {
    shared_->events.give_back(passed);
    ipc::check_cuda(rc, "cudaEventRecord (halo exchange watch)", shared_->what);
  }
  bool start = false;
  {
    std::lock_guard<std::mutex> lock(shared_->m);
    shared_->listed.push_back(Shared::Exchange{stream, began_, passed, epoch, std::nullopt});
    began_ = nullptr;
    start = !shared_->running;
    shared_->running = true;
  }
  if (start) {
    try {
      std::thread(&Shared::serve, shared_).detach();
    } catch (const std::system_error& e) {
      std::lock_guard<std::mutex> lock(shared_->m);
      shared_->running = false;
      throw Error(ErrorCode::System, shared_->what + ": cannot start the halo exchange's watch thread: " + e.what());
    }
  }
  shared_->wake.notify_all();
}

}  // namespace meshmem::detail
