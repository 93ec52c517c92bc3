#include "cuda/halo/device_halo_plan.hpp"

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "knobs.hpp"
#include "cuda/halo/device_halo_plan_knobs.hpp"
#include "cuda/halo/halo_watch.hpp"
#include "cuda/runtime/block_pool.hpp"
#include "cuda/runtime/cuda_owners.hpp"
#include "cuda/runtime/device_sync.hpp"
#include "cuda/runtime/gpu_device.hpp"
#include "cuda/runtime/kernels.hpp"
#include "cuda/runtime/stream_ops.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

namespace {

// MESHMEM_HALO_SENDS: device_halo_plan_knobs.hpp.

// The copies and the neighbours' signals in one kernel; the waits for this rank's halos in
// the same kernel, except where ranks share the GPU (MESHMEM_STREAM_WAIT memop) and the
// exchange is not captured: there a waiting kernel holds the time-sliced GPU from the
// neighbour it waits for (2.25 ms per exchange of the Jacobi example, against 0.26 ms for its
// put_signal + wait_until variant, 2 ranks on 1 x H100), so the stream waits with
// cuStreamWaitValue64 for the exchange number, which the host then knows, and a HaloWatch
// keeps the time limit. The kernel counts every exchange, graph replays too, which the host
// does not see: once the plan has been captured, the waits stay in the kernel.
class KernelHaloPlan final : public DeviceHaloPlan {
 public:
  KernelHaloPlan(const DeviceHaloSpec& spec, const GpuDevice& device, bool sends_at_once)
      : rank_(device.rank()), limit_(device.wait_limit()), early_(device.early_launch()), sequence_("halo exchange plan") {
    const std::string what = "halo exchange plan on rank " + std::to_string(rank_);
    if (!device.waits_with_kernel() && !spec.waits.empty()) {
      for (const std::uint64_t* word : spec.waits)
        memop_waits_.push_back(stream_wait_op(word, 0, CU_STREAM_WAIT_VALUE_GEQ | device.wait_flags()));
      watch_.emplace(device.device(), device.timeout(), limit_.fault, spec.signals_window,
                     std::vector<const std::uint64_t*>(spec.waits.begin(), spec.waits.end()), spec.wait_ranks,
                     "halo exchange on rank " + std::to_string(rank_));
    }
    std::vector<cuda::Copy2D> table;
    for (const DeviceCopy& c : spec.copies) {
      table.push_back({static_cast<char*>(c.dst), static_cast<const char*>(c.src), c.width, c.height, c.src_pitch, c.dst_pitch});
      largest_ = std::max<std::uint64_t>(largest_, c.width * c.height);
    }
    count_ = static_cast<int>(table.size());
    table_ = device_array(table_memory_, table, what);
    sync_.stores = device_array(stores_, spec.stores, what);
    sync_.waits = device_array(waits_, spec.waits, what);
    sync_.wait_ranks = device_array(wait_ranks_, spec.wait_ranks, what);
    sync_.nstores = static_cast<int>(spec.stores.size());
    sync_.nwaits = static_cast<int>(spec.waits.size());
    sync_.window = spec.signals_window;
    // The exchange number and the count of finished copy blocks: zero, on the device.
    std::uint64_t* p = device_array(counters_, std::vector<std::uint64_t>(2, 0), what);
    sync_.epoch = p;
    sync_.arrived = reinterpret_cast<unsigned*>(p + 1);
    // The lanes are made with the plan, not at an exchange, which may be under a capture.
    if (sends_at_once && spec.transport_neighbours > 1) {
      fork_.emplace(what + " (fork of its lanes)");
      for (std::size_t k = 1; k < spec.transport_neighbours; ++k)
        lanes_.push_back(std::make_unique<Lane>(what + " (lane " + std::to_string(k) + ")"));
    }
  }
  void begin(Stream stream, bool capturing, const char* call) override {
    if (!broken_.empty())
      throw Error(ErrorCode::Internal, std::string(call) + " on rank " + std::to_string(rank_) + ": an earlier exchange failed " +
                                           "part-way (" + broken_ + "), so its waits may be unwatched and the "
                                           "exchange numbers may disagree: make a new halo exchange; nothing was enqueued");
    if (watch_) {
      const std::string released = watch_->released();
      if (!released.empty())
        throw Error(ErrorCode::Timeout, std::string(call) + " on rank " + std::to_string(rank_) + ": " + released +
                                            "; its signal words were written by the watch, not by the late "
                                            "neighbour, so this halo exchange is failed: make a new one once every "
                                            "rank is back; nothing was enqueued");
    }
    sequence_.before(stream, capturing, call, rank_);
  }
  void run(Stream stream, bool copy, bool capturing, const char* call) override {
    if (capturing) captured_ = true;
    const bool memop = watch_ && !captured_;
    cuda::HaloSync sync = sync_;
    if (memop) sync.nwaits = 0;
    const cudaError_t rc = cuda::launch_halo(copy ? table_ : nullptr, copy ? count_ : 0, largest_, sync, limit_, stream,
                                             early_);
    if (rc != cudaSuccess) ipc::check_cuda(rc, "halo exchange kernel launch", std::string(call) + " on rank " + std::to_string(rank_));
    const std::uint64_t epoch = ++exchanges_;  // the kernel's number for this exchange (while not captured)
    if (memop) {
      // The kernel is enqueued: whatever fails now, the next exchange is still ordered after it.
      try {
        const auto s = static_cast<cudaStream_t>(stream);
        watch_->began(s);
        for (auto& op : memop_waits_) op.waitValue.value64 = epoch;
        run_stream_batch(memop_waits_, stream, call, rank_);
        watch_->enqueued(s, epoch);
      } catch (const std::exception& e) {
        broken_ = e.what();
        sequence_.after(stream, capturing, call, rank_);
        throw;
      }
    }
    sequence_.after(stream, capturing, call, rank_);
  }
  std::uint64_t next_exchange(bool capturing) const override { return capturing || captured_ ? 0 : exchanges_ + 1; }
  void fail(const std::string& why) override { broken_ = why; }
  Stream lane(Stream stream, std::size_t k, const char* call) override {
    if (lanes_.empty()) return stream;
    // Messages are built only on a failure: an exchange runs every iteration.
    const auto where = [&] { return std::string(call) + " on rank " + std::to_string(rank_); };
    if (k > lanes_.size())
      throw Error(ErrorCode::Internal, where() + ": lane " + std::to_string(k) + " of a halo plan with " +
                                           std::to_string(lanes_.size()) + " lanes besides the caller's stream");
    if (k == 0) {
      // The exchange's fork, before anything of lane 0 is enqueued: every lane starts after
      // the caller's work before the exchange, not after lane 0's.
      const auto s = static_cast<cudaStream_t>(stream);
      fork_capture_ = capture_of(s, where);
      const cudaError_t rc = cudaEventRecord(fork_->get(), s);
      if (rc != cudaSuccess) ipc::check_cuda(rc, "cudaEventRecord (fork of the halo lanes)", where());
      return stream;
    }
    Lane& lane = *lanes_[k - 1];
    // A lane stays in a capture it joined until that capture ends. While it is in another one
    // than the caller's stream (the plan captured twice at once, or an uncaptured exchange
    // during such a capture), waiting for the fork would fail or break that capture: this
    // neighbour goes on the caller's stream then, after the others, as under `serial`.
    if (const unsigned long long held = capture_of(lane.stream.get(), where); held != 0 && held != fork_capture_)
      return stream;
    const cudaError_t rc = cudaStreamWaitEvent(lane.stream.get(), fork_->get(), 0);
    if (rc != cudaSuccess) ipc::check_cuda(rc, "cudaStreamWaitEvent (halo lane)", where());
    lane.used = true;
    return lane.stream.get();
  }
  void join(Stream stream, const char* call) override {
    const auto s = static_cast<cudaStream_t>(stream);
    std::string failed;
    for (std::size_t k = 0; k < lanes_.size(); ++k) {
      Lane& lane = *lanes_[k];
      if (!lane.used) continue;
      lane.used = false;
      cudaError_t rc = cudaEventRecord(lane.end.get(), lane.stream.get());
      if (rc == cudaSuccess) rc = cudaStreamWaitEvent(s, lane.end.get(), 0);
      if (rc != cudaSuccess && failed.empty())
        failed = "joining halo lane " + std::to_string(k + 1) + ": " + cudaGetErrorName(rc) + " (" + cudaGetErrorString(rc) + ")";
    }
    if (!failed.empty())
      throw Error(ErrorCode::Cuda, std::string(call) + " on rank " + std::to_string(rank_) + ": " + failed);
  }

 private:
  // A stream of the plan's own for one transport neighbour's transfers, and the event that
  // marks its end for the caller's stream.
  struct Lane {
    explicit Lane(const std::string& what) : stream(what), end(what + " (its end)") {}
    OwnedStream stream;
    OwnedEvent end;
    bool used = false;  // since the last join
  };
  // The id of the capture `s` is in; ~0 for one that was invalidated, 0 for none.
  template <class Where>
  static unsigned long long capture_of(cudaStream_t s, const Where& where) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    const cudaError_t rc = cudaStreamGetCaptureInfo(s, &status, &id);
    if (rc != cudaSuccess) ipc::check_cuda(rc, "cudaStreamGetCaptureInfo (halo lanes)", where());
    if (status == cudaStreamCaptureStatusNone) return 0;
    return status == cudaStreamCaptureStatusActive ? id : ~0ull;
  }

  int rank_;
  cuda::WaitLimit limit_;
  bool early_;
  StreamSequence sequence_;
  PooledBlock table_memory_, stores_, waits_, wait_ranks_, counters_;
  const cuda::Copy2D* table_ = nullptr;
  int count_ = 0;
  std::uint64_t largest_ = 0;
  cuda::HaloSync sync_{};
  std::uint64_t exchanges_ = 0;
  bool captured_ = false;
  std::string broken_;  // why an exchange failed part-way (begin refuses then)
  std::vector<CUstreamBatchMemOpParams> memop_waits_;  // where the waits are stream operations
  std::optional<HaloWatch> watch_;                     // with them
  std::optional<OwnedEvent> fork_;                     // where there are lanes
  std::vector<std::unique_ptr<Lane>> lanes_;
  unsigned long long fork_capture_ = 0;                // capture_of the caller's stream at the fork
};

}  // namespace

bool halo_sends_at_once(const Options& options) { return kHaloSends.get(options) == HaloSends::Concurrent; }

std::unique_ptr<DeviceHaloPlan> make_device_halo_plan(const DeviceHaloSpec& spec, const GpuDevice& device,
                                                      bool sends_at_once) {
  return std::make_unique<KernelHaloPlan>(spec, device, sends_at_once);
}

}  // namespace meshmem::detail
