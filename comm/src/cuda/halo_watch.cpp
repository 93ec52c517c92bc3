#include "halo_watch.hpp"

#include <cuda.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>

#include "../log.hpp"
#include "captured_handoff.hpp"
#include "event_pool.hpp"
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
  std::chrono::milliseconds limit;
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
  cudaStream_t release_stream = nullptr;  // the thread's

  ~Shared() {
    if (release_stream != nullptr) (void)cudaStreamDestroy(release_stream);
  }

  // Holds its own reference: the thread may outlive the plan (exchanges still listed).
  static void serve(std::shared_ptr<Shared> self) { self->loop(); }

  void loop() {
    (void)cudaSetDevice(device);
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
        if (cudaEventQuery(it->passed) == cudaSuccess) {
          events.give_back(it->began);
          events.give_back(it->passed);
          it = listed.erase(it);
          continue;
        }
        if (!it->began_at) {
          if (cudaEventQuery(it->began) == cudaSuccess) it->began_at = Clock::now();
        } else if (!late && Clock::now() - *it->began_at >= limit) {
          late = *it;
          it = listed.erase(it);
          continue;
        }
        behind.push_back(it->stream);
        ++it;
      }
      (void)cudaGetLastError();  // cudaErrorNotReady is not sticky; nothing else to keep
      if (late) {
        lock.unlock();  // the caller's next exchange is not held up by the release
        release(*late);
        events.give_back(late->began);
        events.give_back(late->passed);
        lock.lock();
        continue;
      }
      // A few milliseconds of precision are enough for a limit of seconds.
      wake.wait_for(lock, std::chrono::milliseconds(5), [&] { return owner_gone && listed.empty(); });
    }
  }

  // The Halo fault naming the first short neighbour, then every short word set to the exchange
  // number so that the stream goes on.
  void release(const Exchange& x) {
    if (release_stream == nullptr &&
        cudaStreamCreateWithFlags(&release_stream, cudaStreamNonBlocking) != cudaSuccess) {
      (void)cudaGetLastError();
      log(LogLevel::Error, what + ": cannot create a stream to release exchange " + std::to_string(x.epoch) +
                               "'s waits after their time limit; the stream stays waiting for its neighbours");
      return;
    }
    std::vector<std::uint64_t> seen(words.size(), 0);
    bool read = true;
    for (std::size_t i = 0; i < words.size(); ++i)
      read = read && cudaMemcpyAsync(&seen[i], words[i], sizeof(std::uint64_t), cudaMemcpyDeviceToHost,
                                     release_stream) == cudaSuccess;
    read = read && cudaStreamSynchronize(release_stream) == cudaSuccess;
    if (!read) (void)cudaGetLastError();
    bool recorded = false;
    for (std::size_t i = 0; i < words.size(); ++i) {
      if (read && seen[i] >= x.epoch) continue;
      if (!recorded) {
        record_fault_from_host(fault, cuda::FaultKind::Halo, ranks[i], static_cast<std::uint64_t>(ranks[i]), seen[i],
                               x.epoch, window);
        recorded = true;
      }
      const CUresult rc = ipc::cuda_driver().cuStreamWriteValue64(
          reinterpret_cast<CUstream>(release_stream), reinterpret_cast<CUdeviceptr>(words[i]), x.epoch, 0);
      if (rc != CUDA_SUCCESS)
        log(LogLevel::Error, what + ": cuStreamWriteValue64 (releasing exchange " + std::to_string(x.epoch) +
                                 "'s wait for rank " + std::to_string(ranks[i]) + ") failed (CUresult " +
                                 std::to_string(static_cast<int>(rc)) + "); the stream stays waiting");
    }
  }
};

HaloWatch::HaloWatch(int device, std::chrono::milliseconds limit, cuda::DeviceFault* fault, std::uint64_t window,
                     std::vector<const std::uint64_t*> words, std::vector<int> ranks, std::string what)
    : shared_(std::make_shared<Shared>()) {
  shared_->device = device;
  shared_->limit = limit.count() > 0 ? limit : std::chrono::milliseconds::max() / 2;
  shared_->fault = fault;
  shared_->window = window;
  shared_->words = std::move(words);
  shared_->ranks = std::move(ranks);
  shared_->what = std::move(what);
}

HaloWatch::~HaloWatch() {
  if (began_ != nullptr) shared_->events.give_back(began_);
  {
    std::lock_guard<std::mutex> lock(shared_->m);
    shared_->owner_gone = true;
  }
  shared_->wake.notify_all();
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
