// StreamPath (stream_path.hpp): small staged transfers as the caller's stream work.
#include "cuda/staged/stream_path.hpp"

#include <algorithm>
#include <vector>

#include "backoff.hpp"
#include "log.hpp"
#include "cuda/runtime/kernels.hpp"
#include "cuda/runtime/relaxed_capture_mode.hpp"
#include "cuda/runtime/stream_ops.hpp"
#include "cuda/staged/channel_counts.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

StreamPath::StreamPath(const Setup& setup) : setup_(setup), slots_(setup.slots) {
  const std::string what = "staged stream path of rank " + std::to_string(setup_.rank);
  CurrentDevice current(setup_.device);
  std::vector<int> devices = setup_.peer_devices;
  devices.push_back(setup_.device);
  std::sort(devices.begin(), devices.end());
  devices.erase(std::unique(devices.begin(), devices.end()), devices.end());
  stride_ = (setup_.slot_bytes + 255) / 256 * 256;
  const std::size_t bytes = stride_ * setup_.slots;
  if (const int numa = ipc::host_numa_node_of(setup_.device); numa >= 0) {
    const std::size_t grain = ipc::host_numa_granularity(numa);
    pinned_.vmm = ipc::SharedHostMemory::create((bytes + grain - 1) / grain * grain, numa, devices);
    pinned_.base = pinned_.vmm.data();
  } else {
    pinned_.block = take_block(BlockMemory::MappedHost, setup_.device, bytes, what);
    pinned_.base = pinned_.block.get();
  }
  for (std::size_t i = 0; i < setup_.slots; ++i) {
    own_done_.push_back(std::make_unique<OwnedEvent>(what));
    ready_.push_back(std::make_unique<OwnedEvent>(what));
  }
  signal_ready_ = std::make_unique<OwnedEvent>(what);
  own_signalled_ = std::make_unique<OwnedEvent>(what);
}

StreamPath::~StreamPath() {
  if (!drain()) {
    // A copy may still read or write the slots: they stay mapped (a leak, not a fault).
    log(LogLevel::Error, "staged stream path of rank " + std::to_string(setup_.rank) +
                             ": transfers still running at its end; its pinned slots are left mapped");
    (void)new ipc::SharedHostMemory(std::move(pinned_.vmm));
    pinned_.block.abandon();
  }
}

StreamPath::StreamKey StreamPath::key_of(cudaStream_t stream) {
  if (stream == cudaStreamLegacy) stream = nullptr;
  return {stream, stream == cudaStreamPerThread ? std::this_thread::get_id() : std::thread::id()};
}

// Under m_: the caller stream's lane on `device`, made on its first transfer there; null where
// the device's lanes are all taken by other streams.
StreamPath::Lane* StreamPath::lane_for(int device, const StreamKey& key, const std::string& what) {
  const auto it = lanes_.find({device, key});
  if (it != lanes_.end()) return &it->second;
  std::size_t on_device = 0;
  for (const auto& [k, lane] : lanes_) on_device += k.first == device;
  if (on_device >= setup_.lanes_per_device) return nullptr;
  RelaxedCaptureMode relaxed;  // the caller's stream may be capturing in global mode
  CurrentDevice on(device);
  Lane lane;
  lane.device = device;
  lane.stream = std::make_unique<OwnedStream>(what);
  for (std::size_t i = 0; i < setup_.slots; ++i) lane.done.push_back(std::make_unique<OwnedEvent>(what));
  lane.signalled = std::make_unique<OwnedEvent>(what);
  return &lanes_.emplace(std::make_pair(device, key), std::move(lane)).first->second;
}

bool StreamPath::run(const Transfer& t, cudaStream_t stream, const std::string& what) {
  const StreamKey key = key_of(stream);
  const bool one_stream = t.peer_device == setup_.device && !setup_.split;
  std::lock_guard<std::mutex> lock(m_);
  Lane* lane = one_stream ? nullptr : lane_for(t.peer_device, key, what);
  if (!one_stream && lane == nullptr) return false;
  if (t.bytes() == 0) {  // a signal alone: no slot
    signal_alone(t, stream, lane, what);
    return true;
  }
  std::size_t slot = 0;
  const auto ended = [](cudaEvent_t e) {
    RelaxedCaptureMode relaxed;
    return cudaEventQuery(e) == cudaSuccess;  // not ready, or an error its stream reports: not free
  };
  if (!slots_.choose(key, ended, &slot)) return false;
  Touched touched;
  cudaEvent_t after = nullptr;
  try {
    after = one_stream ? run_on_one_stream(t, slot, stream, touched, what)
                       : run_split(t, slot, stream, *lane, touched, what);
  } catch (...) {
    guard(slot, stream, touched, key);
    throw;
  }
  slots_.used(slot, key, {after});
  return true;
}

// Ranks sharing a GPU: both copies and the signal in the caller's stream order.
cudaEvent_t StreamPath::run_on_one_stream(const Transfer& t, std::size_t slot, cudaStream_t stream,
                                          Touched& touched, const std::string& what) {
  CurrentDevice current(setup_.device);
  char* staging = static_cast<char*>(pinned_.base) + slot * stride_;
  for (cudaEvent_t e : slots_.last(slot))
    ipc::check_cuda(cudaStreamWaitEvent(stream, e, 0), "cudaStreamWaitEvent (the slot's last use)", what);
  ipc::check_cuda(copy_rows(staging, t.width, t.src, t.src_pitch, t.width, t.rows, stream),
                  "cudaMemcpyAsync (to the staging slot)", what);
  touched.caller = true;
  ipc::check_cuda(copy_rows(t.dst, t.dst_pitch, staging, t.width, t.width, t.rows, stream),
                  "cudaMemcpyAsync (from the staging slot)", what);
  if (t.signal != nullptr) signal(t, stream, what);
  cudaEvent_t done = own_done_[slot]->get();
  ipc::check_cuda(cudaEventRecord(done, stream), "cudaEventRecord", what);
  return done;
}

// The peer's GPU is another: its step on the caller stream's lane there, between two events.
cudaEvent_t StreamPath::run_split(const Transfer& t, std::size_t slot, cudaStream_t stream, Lane& lane,
                                  Touched& touched, const std::string& what) {
  char* staging = static_cast<char*>(pinned_.base) + slot * stride_;
  cudaEvent_t ready = ready_[slot]->get();
  cudaEvent_t there = lane.done[slot]->get();
  const cudaStream_t peer = lane.stream->get();
  const bool put = t.kind == Transfer::Kind::Put;
  {
    CurrentDevice current(setup_.device);
    if (put) {
      for (cudaEvent_t e : slots_.last(slot))
        ipc::check_cuda(cudaStreamWaitEvent(stream, e, 0), "cudaStreamWaitEvent (the slot's last use)", what);
      ipc::check_cuda(copy_rows(staging, t.width, t.src, t.src_pitch, t.width, t.rows, stream),
                      "cudaMemcpyAsync (to the staging slot)", what);
      touched.caller = true;
    }
    // A get's read comes after the caller's earlier work (its puts to that rank included).
    ipc::check_cuda(cudaEventRecord(ready, stream), "cudaEventRecord", what);
  }
  {
    CurrentDevice current(lane.device);
    ipc::check_cuda(cudaStreamWaitEvent(peer, ready, 0), "cudaStreamWaitEvent (the caller's stream)", what);
    if (!put)
      for (cudaEvent_t e : slots_.last(slot))
        ipc::check_cuda(cudaStreamWaitEvent(peer, e, 0), "cudaStreamWaitEvent (the slot's last use)", what);
    if (put)
      ipc::check_cuda(copy_rows(t.dst, t.dst_pitch, staging, t.width, t.width, t.rows, peer),
                      "cudaMemcpyAsync (from the staging slot)", what);
    else
      ipc::check_cuda(copy_rows(staging, t.width, t.src, t.src_pitch, t.width, t.rows, peer),
                      "cudaMemcpyAsync (to the staging slot)", what);
    touched.lane = &lane;
    if (put && t.signal != nullptr) signal(t, peer, what);
    ipc::check_cuda(cudaEventRecord(there, peer), "cudaEventRecord", what);
  }
  CurrentDevice current(setup_.device);
  ipc::check_cuda(cudaStreamWaitEvent(stream, there, 0), "cudaStreamWaitEvent (the peer GPU's step)", what);
  if (put) return there;
  touched.caller = true;  // the caller's stream now waits for the lane: an event there covers both
  ipc::check_cuda(copy_rows(t.dst, t.dst_pitch, staging, t.width, t.width, t.rows, stream),
                  "cudaMemcpyAsync (from the staging slot)", what);
  cudaEvent_t done = own_done_[slot]->get();
  ipc::check_cuda(cudaEventRecord(done, stream), "cudaEventRecord", what);
  return done;
}

// A put_signal of no bytes: the signal on the caller's stream, or on its lane between events.
void StreamPath::signal_alone(const Transfer& t, cudaStream_t stream, Lane* lane, const std::string& what) {
  CurrentDevice current(setup_.device);
  if (lane == nullptr) {
    signal(t, stream, what);
    ipc::check_cuda(cudaEventRecord(own_signalled_->get(), stream), "cudaEventRecord", what);
    return;
  }
  ipc::check_cuda(cudaEventRecord(signal_ready_->get(), stream), "cudaEventRecord", what);
  {
    CurrentDevice on(lane->device);
    ipc::check_cuda(cudaStreamWaitEvent(lane->stream->get(), signal_ready_->get(), 0),
                    "cudaStreamWaitEvent (the caller's stream)", what);
    signal(t, lane->stream->get(), what);
    ipc::check_cuda(cudaEventRecord(lane->signalled->get(), lane->stream->get()), "cudaEventRecord", what);
  }
  ipc::check_cuda(cudaStreamWaitEvent(stream, lane->signalled->get(), 0), "cudaStreamWaitEvent (the peer GPU's step)",
                  what);
}

// A set is a stream write (fenced: the data before it lands first); an add needs the atomic of
// a kernel, as on the agent's path.
void StreamPath::signal(const Transfer& t, cudaStream_t stream, const std::string& what) {
  if (t.op == SignalOp::Add) {
    ipc::check_cuda(cuda::launch_copy(nullptr, nullptr, 0, t.signal, t.value, t.op, stream, false), "signal kernel launch",
                    what);
    return;
  }
  std::vector<CUstreamBatchMemOpParams> ops{stream_write_op(t.signal, t.value)};
  run_stream_batch(ops, reinterpret_cast<Stream>(stream), "staged stream path signal", setup_.rank);
}

// Under m_, after a failed step: the slot's next use and drain() wait for what was enqueued;
// where even that cannot be recorded, the slot is never taken again.
void StreamPath::guard(std::size_t slot, cudaStream_t stream, const Touched& touched, const StreamKey& key) noexcept {
  bool covered = true;
  std::vector<cudaEvent_t> after;
  try {
    if (touched.lane != nullptr) {
      CurrentDevice on(touched.lane->device);
      cudaEvent_t e = touched.lane->done[slot]->get();
      if (cudaEventRecord(e, touched.lane->stream->get()) == cudaSuccess)
        after.push_back(e);
      else
        covered = false;
    }
    if (touched.caller) {
      CurrentDevice on(setup_.device);
      cudaEvent_t e = own_done_[slot]->get();
      if (cudaEventRecord(e, stream) == cudaSuccess)
        after.push_back(e);
      else
        covered = false;
    }
    // Nothing touched: the slot's earlier last use still covers it.
    if (covered && !after.empty()) {
      std::vector<cudaEvent_t> keep = slots_.last(slot);  // a lane's failed step waited for them, or not
      keep.insert(keep.end(), after.begin(), after.end());
      slots_.used(slot, key, std::move(keep));
    }
  } catch (...) {
    covered = false;
  }
  if (!covered) {
    slots_.retire(slot);
    log(LogLevel::Error, "staged stream path of rank " + std::to_string(setup_.rank) + ": slot " + std::to_string(slot) +
                             " is left out from now on (a transfer through it failed midway)");
  }
}

// The events are taken under m_ and polled outside it (a later record of one only adds work
// that is waited for too); events and lanes live as long as the object.
bool StreamPath::drain() noexcept {
  std::vector<cudaEvent_t> pending;
  bool stuck = false;
  try {
    std::lock_guard<std::mutex> lock(m_);
    pending = slots_.all_last();
    pending.push_back(own_signalled_->get());
    for (const auto& [key, lane] : lanes_) pending.push_back(lane.signalled->get());
    stuck = stuck_;
  } catch (const std::exception&) {
    return false;  // no memory for the list: say it did not drain
  }
  // Once a drain timed out, the next ones only look: teardown waits one timeout, not one per window.
  const Deadline deadline(stuck ? std::chrono::milliseconds(1) : setup_.timeout);
  RelaxedCaptureMode relaxed;
  Backoff backoff;
  for (cudaEvent_t e : pending) {
    cudaError_t q;
    while ((q = cudaEventQuery(e)) == cudaErrorNotReady && !deadline.expired()) backoff.pause();
    if (q == cudaErrorNotReady) {
      std::lock_guard<std::mutex> lock(m_);
      stuck_ = true;
      return false;
    }
    // An error of the stream's work is the stream's to report; the copies are over either way.
  }
  return true;
}

std::string StreamPath::describe() const {
  return "stream path up to " + std::to_string(setup_.slot_bytes) + " bytes (" + std::to_string(setup_.slots) +
         " slots" + (setup_.split ? ", split" : "") + ")";
}

}  // namespace meshmem::detail
