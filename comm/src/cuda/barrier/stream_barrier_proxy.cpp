#include "cuda/barrier/stream_barrier_proxy.hpp"

#include <cstring>
#include <system_error>

#include "backoff.hpp"
#include "helper_cpus.hpp"
#include "log.hpp"
#include "cuda/agent/captured_handoff.hpp"
#include "cuda/runtime/gpu_device.hpp"
#include "cuda/runtime/device_sync.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

namespace {

// How a captured barrier runs on every replay (CapturedHandoff): the proxy queues it as
// reached and returns its number; the kernel waits for the released word to reach it. A
// doorbell, not a host node: the proxy's thread makes no CUDA call, but a graph whose barrier
// host nodes wait behind transfers of meshmem's threads (staged, nccl) would hold those
// threads' CUDA calls until it ran them (captured_handoff.hpp).
struct BarrierHandoff {
  using Owner = StreamBarrierProxy;
  struct Request {};
  static std::uint64_t submit(StreamBarrierProxy& proxy, const Request&) { return proxy.arrive_captured(); }
  static void release(StreamBarrierProxy&, const Request&) {}
};

}  // namespace

StreamBarrierProxy::StreamBarrierProxy(MPI_Comm parent, int device, std::chrono::milliseconds timeout,
                                       const std::string& what, std::function<void(const std::string&)> on_failure,
                                       const GpuDevice& device_facts)
    : boot_(parent, timeout),
      device_(device),
      timeout_(timeout),
      on_failure_(std::move(on_failure)),
      device_facts_(device_facts),
      board_(std::make_shared<HandoffBoard<StreamBarrierProxy>>()) {
  agreed_step(boot_, what, [&] {
    int provided = MPI_THREAD_SINGLE;
    MPI_Query_thread(&provided);
    if (provided < MPI_THREAD_MULTIPLE)
      throw Error(ErrorCode::Unsupported,
                  "barrier(stream) between ranks that cannot map each other's GPU memory meets them from a "
                  "proxy thread and needs MPI_THREAD_MULTIPLE, but MPI was initialised with thread level " +
                      std::to_string(provided) + "; call MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...)");
    // The released word, then (64 bytes on) the doorbells of captured barriers.
    const std::size_t doorbells = HandoffBoard<StreamBarrierProxy>::bytes_for(kCapturedBarriers);
    shared_->memory = take_block(BlockMemory::MappedHost, device, 64 + doorbells, what);
    shared_->released = static_cast<std::uint64_t*>(shared_->memory.get());  // zeroed
    // The board keeps the whole block (and the rest of Shared) while graphs exist.
    board_->set_doorbells(std::shared_ptr<void>(shared_, static_cast<char*>(shared_->memory.get()) + 64), doorbells);
    released_device_ = reinterpret_cast<std::uint64_t>(shared_->released);  // one address for CPU and GPU
  });
  board_->open(this);
  thread_ = std::thread([this] { serve(); });
  place_helper_thread(thread_, "proxy barrier");  // off a caller bound to one core (helper_cpus.hpp)
}

namespace {

// cudaDeviceSynchronize on a thread of its own, which keeps `keep` alive until it returned.
// Whether it returned, and succeeded, within `limit` (0: waits for ever). A synchronisation
// that failed (refused while a graph capture is open on the device, or a device error) says
// nothing about the streams: not idle.
template <class Keep>
bool device_idle_within(int device, std::chrono::milliseconds limit, std::shared_ptr<Keep> keep) {
  struct Done {
    std::mutex m;
    std::condition_variable cv;
    bool done = false, idle = false;
  };
  auto done = std::make_shared<Done>();
  try {
    std::thread([device, done, keep = std::move(keep)]() mutable {
      const bool idle = cudaSetDevice(device) == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess;
      if (idle) {
        QuiescedRelease covered(device);  // the synchronisation covered the word's last use
        keep.reset();
      }
      keep.reset();  // quarantined (block_pool.hpp) where the synchronisation failed
      std::lock_guard<std::mutex> lock(done->m);
      done->done = true;
      done->idle = idle;
      done->cv.notify_all();
    }).detach();
  } catch (const std::system_error&) {
    return false;  // no thread: the caller releases the streams instead of waiting
  }
  std::unique_lock<std::mutex> lock(done->m);
  auto ended = [&] { return done->done; };
  if (limit.count() == 0)
    done->cv.wait(lock, ended);
  else if (!done->cv.wait_for(lock, limit, ended))
    return false;
  return done->idle;
}

}  // namespace

StreamBarrierProxy::~StreamBarrierProxy() {
  // Streams may still wait for barriers that this rank's proxy must meet: let them pass.
  // Graphs launched before are among that work; graphs replayed later find the proxy gone.
  // The proxy thread keeps meeting meanwhile; each meeting is bounded by MESHMEM_TIMEOUT.
  const bool idle = device_idle_within(device_, 2 * timeout_, shared_);
  // Captured barriers waiting now, and later replays, end unmet without a report, as the
  // released word below lets the others pass: the Comm is going.
  board_->close(cuda::HandoffClosed::Retired);
  std::size_t unmet = 0;
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    stop_ = true;
    unmet = shared_->pending.size();
  }
  shared_->wake.notify_all();
  if (thread_.joinable()) thread_.join();
  if (idle) return;
  // The device's work did not end (a stream that waits for ever, or a kernel that runs on):
  // no barrier given to this proxy may keep a stream waiting from now on. The thread above
  // frees the shared state once the device is idle; host functions still to run touch only it.
  __atomic_store_n(shared_->released, UINT64_MAX, __ATOMIC_RELEASE);
  log(LogLevel::Warn, "barrier(stream) proxy: this device's work did not end within " +
                          describe_timeout(2 * timeout_) +
                          " (twice MESHMEM_TIMEOUT), or could not be waited for (a graph capture open on this GPU), "
                          "at ~Comm; " +
                          std::to_string(unmet) +
                          " barrier(s) given to the proxy and not met were released unmet, and its mapped word is "
                          "freed once the device's work ends");
}

void CUDART_CB StreamBarrierProxy::reached(void* arrival) {
  auto* a = static_cast<Arrival*>(arrival);
  Shared* shared = a->shared;
  {
    std::lock_guard<std::mutex> lock(shared->mutex);
    a->reached = true;
  }
  shared->wake.notify_all();
}

void StreamBarrierProxy::serve() {
  relax_capture_mode_of_this_thread();
  Shared& sh = *shared_;
  std::unique_lock<std::mutex> lock(sh.mutex);
  auto ready = [&] { return stop_ || (!sh.pending.empty() && sh.pending.front().reached); };
  // Outside the mutex: a replay's hand-off queues its barrier (which takes it).
  auto poll_doorbells = [&] {
    lock.unlock();
    const bool rung = board_->poll();
    lock.lock();
    return rung;
  };
  for (;;) {
    // Barriers come in bursts: poll for a while (a condition variable's wake-up costs
    // microseconds on every barrier), then sleep until a host function wakes us, or, while
    // captured barriers exist, look at their doorbells every 200 us.
    Backoff backoff;
    const auto poll_until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
    while (!ready() && std::chrono::steady_clock::now() < poll_until) {
      if (!poll_doorbells()) {
        lock.unlock();
        backoff.pause();
        lock.lock();
      }
    }
    while (!ready()) {
      if (board_->live()) {
        sh.wake.wait_for(lock, std::chrono::microseconds(200), ready);
        poll_doorbells();
      } else {
        // A capture wakes it (capture()).
        sh.wake.wait(lock, [&] { return ready() || board_->live(); });
      }
    }
    if (stop_ || sh.pending.empty() || !sh.pending.front().reached) return;  // stopping
    const std::uint64_t number = sh.pending.front().number;
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
    __atomic_store_n(sh.released, number, __ATOMIC_RELEASE);
    lock.lock();
    if (!failed.empty() && failure_.empty()) failure_ = failed;
    sh.pending.pop_front();
  }
}

void StreamBarrierProxy::raise_failure(const std::string& what) {
  std::string failed;
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
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
    std::lock_guard<std::mutex> lock(shared_->mutex);
    shared_->pending.push_back(Arrival{shared_.get(), ++enqueued_});
    arrival = &shared_->pending.back();
  }
  const cudaError_t rc = cudaLaunchHostFunc(stream, &StreamBarrierProxy::reached, arrival);
  if (rc != cudaSuccess) {
    {
      std::lock_guard<std::mutex> lock(shared_->mutex);
      shared_->pending.pop_back();  // never handed to the stream
      --enqueued_;
    }
    ipc::check_cuda(rc, "cudaLaunchHostFunc", what);
  }
  ipc::check_cu(ipc::cuda_driver().cuStreamWaitValue64(stream, static_cast<CUdeviceptr>(released_device_), enqueued_,
                                                       CU_STREAM_WAIT_VALUE_GEQ),
                "cuStreamWaitValue64", what);
}

std::uint64_t StreamBarrierProxy::arrive_captured() {
  std::uint64_t number = 0;
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    shared_->pending.push_back(Arrival{shared_.get(), ++enqueued_, true});  // the doorbell rings once the stream reached it
    number = enqueued_;
  }
  shared_->wake.notify_all();
  return number;
}

void StreamBarrierProxy::capture(cudaStream_t stream, cudaGraph_t graph, const std::string& what) {
  raise_failure(what);
  boot_.ensure_usable(what);
  // peer -1: the proxy's meeting names the late ranks (FaultKind::HostBarrier).
  TicketWait wait = TicketWait::on(device_facts_, reinterpret_cast<const std::uint64_t*>(released_device_),
                                   cuda::FaultKind::ProxyRelease, -1);
  // Twice the device's limit: the proxy's meeting, bounded by MESHMEM_TIMEOUT from a little
  // later on, reports first and names the ranks that never came.
  wait.limit.timeout_ns *= 2;
  CapturedHandoff<BarrierHandoff>::capture(board_, BarrierHandoff::Request{}, wait, graph, stream, what);
  // Under the mutex: the thread either sees the live doorbell when it next decides to sleep,
  // or sleeps already and gets the notification.
  { std::lock_guard<std::mutex> lock(shared_->mutex); }
  shared_->wake.notify_all();
}

}  // namespace meshmem::detail
