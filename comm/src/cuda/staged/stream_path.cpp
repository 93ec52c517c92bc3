// StreamPath (stream_path.hpp): small staged transfers as the caller's stream work.
#include "cuda/staged/stream_path.hpp"

#include <algorithm>
#include <vector>

#include "backoff.hpp"
#include "log.hpp"
#include "cuda/runtime/kernels.hpp"
#include "cuda/runtime/stream_ops.hpp"
#include "cuda/staged/channel_counts.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

StreamPath::StreamPath(const Setup& setup) : setup_(setup), last_(setup.slots, nullptr) {
  const std::string what = "staged stream path of rank " + std::to_string(setup_.rank);
  CurrentDevice current(setup_.device);
  std::vector<int> devices = setup_.peer_devices;
  devices.push_back(setup_.device);
  std::sort(devices.begin(), devices.end());
  devices.erase(std::unique(devices.begin(), devices.end()), devices.end());
  const std::size_t bytes = setup_.slot_bytes * setup_.slots;
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
  lanes_.reserve(devices.size());
  for (int d : devices) {
    if (d == setup_.device && !setup_.split) continue;  // this GPU's steps run on the caller's stream
    CurrentDevice on(d);
    Lane lane;
    lane.device = d;
    lane.stream = std::make_unique<OwnedStream>(what);
    for (std::size_t i = 0; i < setup_.slots; ++i) lane.done.push_back(std::make_unique<OwnedEvent>(what));
    lanes_.push_back(std::move(lane));
  }
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

StreamPath::Lane& StreamPath::lane_of(int device, const std::string& what) {
  for (Lane& l : lanes_)
    if (l.device == device) return l;
  throw Error(ErrorCode::Internal, what + ": GPU " + std::to_string(device) + " has no stream of the stream path");
}

void StreamPath::run(const Transfer& t, cudaStream_t stream, const std::string& what) {
  std::lock_guard<std::mutex> lock(m_);
  const std::size_t slot = next_;
  next_ = (next_ + 1) % setup_.slots;
  if (t.peer_device == setup_.device && !setup_.split)
    run_on_one_stream(t, slot, stream, what);
  else
    run_split(t, slot, stream, lane_of(t.peer_device, what), what);
  ++transfers_;
}

// Ranks sharing a GPU: both copies and the signal in the caller's stream order.
void StreamPath::run_on_one_stream(const Transfer& t, std::size_t slot, cudaStream_t stream, const std::string& what) {
  CurrentDevice current(setup_.device);
  char* staging = static_cast<char*>(pinned_.base) + slot * setup_.slot_bytes;
  if (last_[slot] != nullptr)
    ipc::check_cuda(cudaStreamWaitEvent(stream, last_[slot], 0), "cudaStreamWaitEvent (the slot's last use)", what);
  if (t.bytes() > 0) {
    ipc::check_cuda(copy_rows(staging, t.width, t.src, t.src_pitch, t.width, t.rows, stream, cudaMemcpyDefault),
                    "cudaMemcpyAsync (to the staging slot)", what);
    ipc::check_cuda(copy_rows(t.dst, t.dst_pitch, staging, t.width, t.width, t.rows, stream, cudaMemcpyDefault),
                    "cudaMemcpyAsync (from the staging slot)", what);
  }
  if (t.signal != nullptr) signal(t, stream, what);
  cudaEvent_t done = own_done_[slot]->get();
  ipc::check_cuda(cudaEventRecord(done, stream), "cudaEventRecord", what);
  last_[slot] = done;
}

// The peer's GPU is another: its step on this process's stream of it, between two events.
void StreamPath::run_split(const Transfer& t, std::size_t slot, cudaStream_t stream, Lane& lane,
                           const std::string& what) {
  char* staging = static_cast<char*>(pinned_.base) + slot * setup_.slot_bytes;
  cudaEvent_t ready = ready_[slot]->get();
  cudaEvent_t there = lane.done[slot]->get();
  const cudaStream_t peer = lane.stream->get();
  const bool put = t.kind == Transfer::Kind::Put;
  {
    CurrentDevice current(setup_.device);
    if (put && last_[slot] != nullptr)
      ipc::check_cuda(cudaStreamWaitEvent(stream, last_[slot], 0), "cudaStreamWaitEvent (the slot's last use)", what);
    if (put && t.bytes() > 0)
      ipc::check_cuda(copy_rows(staging, t.width, t.src, t.src_pitch, t.width, t.rows, stream, cudaMemcpyDefault),
                      "cudaMemcpyAsync (to the staging slot)", what);
    // A get's read comes after the caller's earlier work (its puts to that rank included).
    ipc::check_cuda(cudaEventRecord(ready, stream), "cudaEventRecord", what);
  }
  {
    CurrentDevice current(lane.device);
    ipc::check_cuda(cudaStreamWaitEvent(peer, ready, 0), "cudaStreamWaitEvent (the caller's stream)", what);
    if (!put && last_[slot] != nullptr)
      ipc::check_cuda(cudaStreamWaitEvent(peer, last_[slot], 0), "cudaStreamWaitEvent (the slot's last use)", what);
    if (t.bytes() > 0) {
      if (put)
        ipc::check_cuda(
            copy_rows(t.dst, t.dst_pitch, staging, t.width, t.width, t.rows, peer, cudaMemcpyDefault),
            "cudaMemcpyAsync (from the staging slot)", what);
      else
        ipc::check_cuda(copy_rows(staging, t.width, t.src, t.src_pitch, t.width, t.rows, peer, cudaMemcpyDefault),
                        "cudaMemcpyAsync (to the staging slot)", what);
    }
    if (put && t.signal != nullptr) signal(t, peer, what);
    ipc::check_cuda(cudaEventRecord(there, peer), "cudaEventRecord", what);
  }
  CurrentDevice current(setup_.device);
  ipc::check_cuda(cudaStreamWaitEvent(stream, there, 0), "cudaStreamWaitEvent (the peer GPU's step)", what);
  if (put) {
    last_[slot] = there;
    return;
  }
  if (t.bytes() > 0)
    ipc::check_cuda(copy_rows(t.dst, t.dst_pitch, staging, t.width, t.width, t.rows, stream, cudaMemcpyDefault),
                    "cudaMemcpyAsync (from the staging slot)", what);
  cudaEvent_t done = own_done_[slot]->get();
  ipc::check_cuda(cudaEventRecord(done, stream), "cudaEventRecord", what);
  last_[slot] = done;
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

bool StreamPath::drain() noexcept {
  std::vector<cudaEvent_t> pending;
  {
    std::lock_guard<std::mutex> lock(m_);
    for (cudaEvent_t e : last_)
      if (e != nullptr) pending.push_back(e);
  }
  const Deadline deadline(setup_.timeout);
  Backoff backoff;
  for (cudaEvent_t e : pending) {
    cudaError_t q;
    while ((q = cudaEventQuery(e)) == cudaErrorNotReady && !deadline.expired()) backoff.pause();
    if (q == cudaErrorNotReady) return false;
    // An error of the stream's work is the stream's to report; the copies are over either way.
    if (q != cudaSuccess) (void)cudaGetLastError();
  }
  return true;
}

std::string StreamPath::describe() const {
  return "stream path up to " + std::to_string(setup_.slot_bytes) + " bytes (" + std::to_string(setup_.slots) +
         " slots" + (setup_.split ? ", split" : "") + ")";
}

}  // namespace meshmem::detail
