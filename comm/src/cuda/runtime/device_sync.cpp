#include "cuda/runtime/device_sync.hpp"

#include <system_error>

#include "backoff.hpp"
#include "log.hpp"
#include "worker_pulse.hpp"
#include "cuda/runtime/gpu_queues.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/awake_clock.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

namespace {
const char* cmp_text(unsigned cmp) {
  static const char* const names[] = {"==", "!=", ">", ">=", "<", "<="};
  return cmp < 6 ? names[cmp] : "?";
}
}  // namespace

namespace {
// The fault record, then (on its own cache line) the AwakeClock word of the device waits.
constexpr std::size_t kAwakeOffset = (sizeof(cuda::DeviceFault) + 63) / 64 * 64;
}  // namespace

DeviceFaultRecord::DeviceFaultRecord(int device, std::chrono::milliseconds timeout, const std::string& what)
    : memory_(take_block(BlockMemory::MappedHost, device, kAwakeOffset + sizeof(std::int64_t), what)),
      timeout_(timeout),
      timeout_ns_(static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count())) {
  void* p = memory_.get();  // one address for the CPU and the GPU
  host_ = static_cast<cuda::DeviceFault*>(p);
  *host_ = cuda::DeviceFault{};
  device_ = host_;
  // Without a watcher (it could not start) the waits keep the GPU's clock.
  auto* awake = reinterpret_cast<std::int64_t*>(static_cast<char*>(p) + kAwakeOffset);
  if (ipc::AwakeClock::publish(awake)) {
    awake_host_ = awake;
    awake_device_ = awake;
  }
}

DeviceFaultRecord::~DeviceFaultRecord() {
  if (awake_host_ != nullptr) ipc::AwakeClock::unpublish(awake_host_);  // before the memory goes
}

void DeviceFaultRecord::report_host_barrier(const std::string& failure) {
  if (__atomic_exchange_n(&host_->claimed, 1u, __ATOMIC_ACQ_REL) != 0u) return;
  {
    std::lock_guard<std::mutex> lock(host_failure_m_);
    host_failure_ = failure;
  }
  __atomic_store_n(&host_->code, static_cast<unsigned>(cuda::FaultKind::HostBarrier), __ATOMIC_RELEASE);
}

void DeviceFaultRecord::raise(const std::string& where) {
  const cuda::DeviceFault f = *host_;
  const auto kind = static_cast<cuda::FaultKind>(__atomic_load_n(&host_->code, __ATOMIC_ACQUIRE));
  *host_ = cuda::DeviceFault{};  // the next timeout is reported on its own
  const std::string after = " after " + describe_timeout(timeout_) + " on the GPU; the stream went on past the wait";
  std::string msg = where + ": ";
  ErrorCode code = ErrorCode::Timeout;  // every kind but HandoffStopped is a wait that ran out
  // Handoff kinds: every captured step a thread of meshmem carries out, staged and nccl /
  // mpi-device transfers (with a peer), barriers across nodes met by the proxy (none).
  const auto captured_step = [&] {
    return "replay " + std::to_string(f.expected) + " of a captured " +
           (f.peer >= 0 ? "staged, nccl or mpi-device put or get with rank " + std::to_string(f.peer)
                        : std::string("barrier(stream) across nodes (the proxy's)"));
  };
  switch (kind) {
    case cuda::FaultKind::Barrier:
      msg += "an earlier barrier(stream) waited for rank " + std::to_string(f.peer) + " (its barrier count is " +
             std::to_string(f.seen) + ", this rank was at barrier " + std::to_string(f.expected) + ")" + after;
      break;
    case cuda::FaultKind::NodeBarrier:
      // The hierarchical barrier's node kernels count two per barrier(stream).
      msg += "an earlier barrier(stream) across nodes (barrier " + std::to_string((f.expected + 1) / 2) +
             " of this rank), in its node part " + (f.expected % 2 == 1 ? "before" : "after") +
             " the node leaders' all-reduce, waited for rank " + std::to_string(f.peer) +
             " of this node (at barrier " + std::to_string((f.seen + 1) / 2) +
             (f.expected % 2 == 0 ? "; if it leads this node, it waits for the leaders of other nodes" : "") + ")" +
             after;
      break;
    case cuda::FaultKind::LeadersFailed:
      msg += "an earlier barrier(stream) across nodes (barrier " + std::to_string((f.expected + 1) / 2) +
             " of this rank) did not wait for the other nodes: rank " + std::to_string(f.peer) +
             ", which leads this node, gave up its all-reduce among the node leaders (its error names the leader "
             "that did not come) and its NCCL communicator is gone, so this rank's later barriers across nodes "
             "fail too; the stream went on";
      break;
    case cuda::FaultKind::Halo:
      msg += "the halos of exchange " + std::to_string(f.expected) + " from rank " + std::to_string(f.peer) +
             " did not arrive (its signal word is at exchange " + std::to_string(f.seen) + ", signals window #" +
             std::to_string(f.window) + ")" + after;
      break;
    case cuda::FaultKind::HostBarrier: {
      std::lock_guard<std::mutex> lock(host_failure_m_);
      msg += "an earlier barrier(stream) across nodes timed out (its stream was released so that it would not "
             "hang): " + host_failure_;
      break;
    }
    case cuda::FaultKind::ProxyRelease:
      msg += "an earlier captured barrier(stream) across nodes (barrier " + std::to_string(f.expected) +
             " of this rank) was not released by its proxy thread (it had released barrier " + std::to_string(f.seen) +
             ")" + after;
      break;
    case cuda::FaultKind::Handoff:
      msg += captured_step() + " was not taken up by the thread of meshmem that carries it out (it took up replay " +
             std::to_string(f.seen) + " of it)" + after + " (nothing of it was done, or it was done late)" +
             describe_worker_pulses();
      break;
    case cuda::FaultKind::HandoffStopped:
      code = ErrorCode::Unsupported;
      msg += captured_step() + (f.index != 0 ? " was taken up but did not end" : " was not carried out") +
             ": the thread of meshmem that carries it out had stopped (it stops at MPI_Finalize, or when the Comm "
             "is destroyed); the stream went on past it at once";
      break;
    case cuda::FaultKind::Transfer: {
      const std::string hint = gpu_queue_hint();
      msg += "an earlier staged or nccl put or get with rank " + std::to_string(f.peer) + " (transfer " +
             std::to_string(f.expected) + "; the last one finished is " + std::to_string(f.seen) +
             ") did not finish" + after + " (its data may be incomplete)" +
             (hint.empty() ? "; if the peer is alive, a waiting stream (a replayed graph's too) that shares a GPU queue "
                             "with meshmem's transfer streams may have held it back (README \"GPU queues\")"
                           : hint) +
             describe_worker_pulses();
      break;
    }
    default:
      msg += "an earlier wait_until(stream) on signal " + std::to_string(f.index) + " of signals window #" +
             std::to_string(f.window) + " for a value " + cmp_text(f.cmp) + " " + std::to_string(f.expected) +
             " timed out (the word is " + std::to_string(f.seen) + ")" + after;
      break;
  }
  log(LogLevel::Error, msg);
  throw Error(code, msg);
}

StreamSequence::StreamSequence(const std::string& what) {
  ipc::check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags", what);
}

StreamSequence::~StreamSequence() {
  if (event_ != nullptr) (void)cudaEventDestroy(event_);
}

void StreamSequence::before(cudaStream_t stream, bool capturing, const char* call, int rank) {
  // The per-thread stream's handle is one for every thread's own stream: it always waits.
  if (capturing || !recorded_ || (stream == last_ && stream != cudaStreamPerThread)) return;
  const cudaError_t rc = cudaStreamWaitEvent(stream, event_, 0);
  if (rc != cudaSuccess) ipc::check_cuda(rc, "cudaStreamWaitEvent", std::string(call) + " on rank " + std::to_string(rank));
}

void StreamSequence::after(cudaStream_t stream, bool capturing, const char* call, int rank) {
  if (capturing) return;
  const cudaError_t rc = cudaEventRecord(event_, stream);
  if (rc != cudaSuccess) ipc::check_cuda(rc, "cudaEventRecord", std::string(call) + " on rank " + std::to_string(rank));
  last_ = stream;
  recorded_ = true;
}

void relax_capture_mode_of_this_thread() noexcept {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  (void)cudaThreadExchangeStreamCaptureMode(&mode);
}

cudaError_t synchronize_device_between_captures() {
  cudaError_t rc = cudaDeviceSynchronize();
  while (rc == cudaErrorStreamCaptureUnsupported || rc == cudaErrorStreamCaptureImplicit) {
    (void)cudaGetLastError();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    rc = cudaDeviceSynchronize();
  }
  return rc;
}

}  // namespace meshmem::detail
