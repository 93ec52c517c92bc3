#include "stream_barrier_proxy.hpp"

#include "../backoff.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

StreamBarrierProxy::StreamBarrierProxy(MPI_Comm parent, std::chrono::milliseconds timeout, const std::string& what,
                                       std::function<void(const std::string&)> on_failure)
    : boot_(parent, timeout), on_failure_(std::move(on_failure)) {
  agreed_step(boot_, what, [&] {
    int provided = MPI_THREAD_SINGLE;
    MPI_Query_thread(&provided);
    if (provided < MPI_THREAD_MULTIPLE)
      throw Error(ErrorCode::Unsupported,
                  "barrier(stream) between ranks that cannot map each other's GPU memory meets them from a "
                  "proxy thread and needs MPI_THREAD_MULTIPLE, but MPI was initialised with thread level " +
                      std::to_string(provided) + "; call MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...)");
    void* word = nullptr;
    ipc::check_cuda(cudaHostAlloc(&word, sizeof(std::uint64_t), cudaHostAllocMapped | cudaHostAllocPortable),
                    "cudaHostAlloc", what);
    released_.reset(static_cast<std::uint64_t*>(word));
    *released_ = 0;
    void* device = nullptr;
    ipc::check_cuda(cudaHostGetDevicePointer(&device, word, 0), "cudaHostGetDevicePointer", what);
    released_device_ = reinterpret_cast<std::uint64_t>(device);
  });
  thread_ = std::thread([this] { serve(); });
}

StreamBarrierProxy::~StreamBarrierProxy() {
  // Streams may still wait for barriers that this rank's proxy must meet: let them pass.
  (void)cudaDeviceSynchronize();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void CUDART_CB StreamBarrierProxy::reached(void* arrival) {
  auto* a = static_cast<Arrival*>(arrival);
  {
    std::lock_guard<std::mutex> lock(a->proxy->mutex_);
    a->reached = true;
  }
  a->proxy->wake_.notify_all();
}

void StreamBarrierProxy::serve() {
  std::unique_lock<std::mutex> lock(mutex_);
  auto ready = [&] { return stop_ || (!pending_.empty() && pending_.front().reached); };
  for (;;) {
    // Barriers come in bursts: poll for a while (a condition variable's wake-up costs
    // microseconds on every barrier), then sleep until a host function wakes us.
    Backoff backoff;
    const auto poll_until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
    while (!ready() && std::chrono::steady_clock::now() < poll_until) {
      lock.unlock();
      backoff.pause();
      lock.lock();
    }
    wake_.wait(lock, ready);
    if (pending_.empty() || !pending_.front().reached) return;  // stopping
    const std::uint64_t number = pending_.front().number;
    lock.unlock();
    std::string failed;
    try {
      boot_.arrive("comm.barrier(stream)");
    } catch (const Error& e) {
      failed = e.message();  // the Bootstrap logged it
    } catch (const std::exception& e) {
      failed = e.what();
    }
    // Released even after a failure: a stream that waited forever would hang the user's
    // synchronisation without a word; the next call on the Comm raises the failure.
    if (!failed.empty() && on_failure_) on_failure_(failed);
    __atomic_store_n(released_.get(), number, __ATOMIC_RELEASE);
    lock.lock();
    if (!failed.empty() && failure_.empty()) failure_ = failed;
    pending_.pop_front();
  }
}

void StreamBarrierProxy::raise_failure(const std::string& what) {
  std::string failed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    failed.swap(failure_);
  }
  if (!failed.empty())
    throw Error(ErrorCode::Timeout, what + ": an earlier barrier(stream) failed; its stream was released so that it "
                                           "would not hang: " + failed);
}

void StreamBarrierProxy::enqueue(cudaStream_t stream, const std::string& what) {
  raise_failure(what);
  boot_.ensure_usable(what);
  Arrival* arrival = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_.push_back(Arrival{this, ++enqueued_});
    arrival = &pending_.back();
  }
  const cudaError_t rc = cudaLaunchHostFunc(stream, &StreamBarrierProxy::reached, arrival);
  if (rc != cudaSuccess) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      pending_.pop_back();  // never handed to the stream
      --enqueued_;
    }
    ipc::check_cuda(rc, "cudaLaunchHostFunc", what);
  }
  ipc::check_cu(ipc::cuda_driver().cuStreamWaitValue64(stream, static_cast<CUdeviceptr>(released_device_), enqueued_,
                                                       CU_STREAM_WAIT_VALUE_GEQ),
                "cuStreamWaitValue64", what);
}

}  // namespace meshmem::detail
