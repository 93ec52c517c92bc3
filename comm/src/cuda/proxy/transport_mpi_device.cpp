#define MESHMEM_DEFINING_GPU_PART
#include "cuda/proxy/transport_mpi_device.hpp"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <utility>

#include "backoff.hpp"
#include "gpu_part.hpp"
#include "log.hpp"
#include "topology.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

namespace {

constexpr int kTagData = 1;

// Pinned slots that MPI has sent from or received into are never unmapped while the process
// lives: an MPI library may keep its registration of their pages, found by address, after
// the messages ended (UCX's and Open MPI's registration caches; UCX hooks cuMemUnmap only since
// openucx/ucx#9857 of 2024, cudaFreeHost, munmap and the like long before), and memory
// mapped later at the same address would be read and written through that stale
// registration. So a wire's slots, once every message and copy of theirs ended, wait here for
// the next wire of the process on that device (a later Comm's), not in the block pool. Slots
// MPI may still hold are abandoned instead (MpiWire::stop). Leaked on purpose: nothing of it
// runs at exit.
class RegisteredSlots {
 public:
  static RegisteredSlots& instance() {
    static RegisteredSlots* slots = new RegisteredSlots;
    return *slots;
  }
  // A kept block of `device` of at least `bytes` (the smallest), else a new one.
  PooledBlock take(int device, std::size_t bytes, const std::string& what) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = kept_.lower_bound({device, bytes});
      if (it != kept_.end() && it->first.first == device) {
        PooledBlock block = std::move(it->second);
        kept_.erase(it);
        return block;
      }
    }
    return take_block(BlockMemory::MappedHost, device, bytes, what);
  }
  // Takes `block` (left as it was where this raises).
  void keep(int device, PooledBlock& block) {
    if (!block) return;
    std::lock_guard<std::mutex> lock(mutex_);
    kept_.emplace(std::make_pair(device, block.size()), std::move(block));
  }

 private:
  std::mutex mutex_;
  std::multimap<std::pair<int, std::size_t>, PooledBlock> kept_;
};

// Chunked MPI messages through pinned host slots (transport_mpi_device.hpp). All but
// pending() run on the proxy thread (and stop() once it has ended).
class MpiWire final : public ProxyWire {
 public:
  // `peers`: the ranks this wire talks to.
  MpiWire(MpiComm data, const std::vector<int>& peers, int device, std::chrono::milliseconds timeout,
          const std::string& what)
      : data_(std::move(data)), timeout_(timeout), device_(device) {
    const std::size_t send_slots = MpiDeviceTransport::kSlots;
    const std::size_t recv_slots = std::max<std::size_t>(MpiDeviceTransport::kSlots, peers.size());
    for (int p : peers) recv_held_[p] = 0;
    const std::size_t count = send_slots + recv_slots;
    slot_memory_ = RegisteredSlots::instance().take(device, count * MpiDeviceTransport::kChunk, what + " (slots)");
    memory_ = static_cast<char*>(slot_memory_.get());
    slots_.resize(count);
    for (std::size_t i = 0; i < count; ++i) {
      Slot& s = slots_[i];
      s.buf = memory_ + i * MpiDeviceTransport::kChunk;
      const cudaError_t rc = cudaEventCreateWithFlags(&s.event, cudaEventDisableTiming);
      if (rc != cudaSuccess) {
        release();
        ipc::check_cuda(rc, "cudaEventCreateWithFlags", what);
      }
      (i < send_slots ? send_free_ : recv_free_).push_back(&s);
    }
  }
  MpiWire(const MpiWire&) = delete;
  MpiWire& operator=(const MpiWire&) = delete;
  ~MpiWire() override { stop(true); }

  void send(int peer, const void* src, std::size_t bytes, cudaStream_t stream, std::function<void()> after_read,
            const std::string& what) override {
    sends_[peer].push_back(SendJob{static_cast<const char*>(src), bytes, 0, stream, std::move(after_read), what});
    ++pending_;
  }
  void recv(int peer, void* dst, std::size_t bytes, cudaStream_t stream, std::function<void()> then,
            const std::string& what) override {
    recvs_[peer].push_back(RecvJob{static_cast<char*>(dst), bytes, 0, 0, stream, std::move(then), {}, what});
    ++pending_;
  }
  std::size_t pending() const override { return pending_.load(); }
  bool progress() override {
    bool moved = stage_sends();
    moved = post_sends() || moved;
    moved = post_recvs() || moved;
    moved = land_recvs() || moved;
    return free_drained() || moved;
  }

  // After the proxy thread ended. Without `abort` every transfer ended (acknowledged), so
  // only completions are left to collect; with it, what MPI still holds keeps its memory
  // (leaked: MPI may yet write or read it).
  void stop(bool abort) noexcept override {
    if (memory_ == nullptr) return;
    bool leak = false;
    const Deadline deadline(abort ? std::chrono::milliseconds(1) : timeout_);
    for (auto& [peer, list] : outbound_)
      for (Outbound& o : list) {
        if (!o.posted) continue;
        int done = 0;
        Backoff backoff;
        while (MPI_Test(&o.slot->request, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done && !deadline.expired())
          backoff.pause();
        if (!done) {
          MPI_Request_free(&o.slot->request);
          leak = true;
        }
      }
    for (auto& [peer, jobs] : recvs_)
      for (RecvJob& j : jobs)
        for (Slot* s : j.slots) {
          MPI_Cancel(&s->request);
          int done = 0;
          Backoff backoff;
          while (MPI_Test(&s->request, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done && !deadline.expired())
            backoff.pause();
          if (!done) {
            MPI_Request_free(&s->request);
            leak = true;
          }
        }
    for (Slot& s : slots_)
      if (s.event != nullptr) (void)cudaEventSynchronize(s.event);  // copies of the proxy's streams
    if (leak) {
      log(LogLevel::Warn, "mpi-device transport: MPI still held messages at stop; their pinned slots are kept");
      slot_memory_.abandon();
      memory_ = nullptr;
    }
    release();
    // What was never sent or received is dropped (a broken job); nothing waits for it now.
    for (auto& [peer, jobs] : sends_)
      for (SendJob& j : jobs)
        if (j.after_read) j.after_read();  // gives back a bounce buffer
    sends_.clear();
    recvs_.clear();
    outbound_.clear();
    draining_.clear();
    pending_ = 0;
  }

 private:
  struct Slot {
    char* buf = nullptr;
    cudaEvent_t event = nullptr;  // its copy (device to host before a send, host to device after a receive)
    MPI_Request request = MPI_REQUEST_NULL;
    std::size_t bytes = 0;
    int peer = -1;  // a receive slot's, while held
  };
  struct SendJob {
    const char* src;
    std::size_t bytes, staged;
    cudaStream_t stream;
    std::function<void()> after_read;
    std::string what;
  };
  struct Outbound {  // a chunk on its way out, in the order of the wire
    Slot* slot;
    bool posted;  // its MPI_Isend is posted (else its copy out may still run)
  };
  struct RecvJob {
    char* dst;
    std::size_t bytes, posted, landed;
    cudaStream_t stream;
    std::function<void()> then;
    std::deque<Slot*> slots;  // chunks being received, in order
    std::string what;
  };

  // Every message and copy of the slots ended (or the slots were abandoned).
  void release() noexcept {
    for (Slot& s : slots_)
      if (s.event != nullptr) (void)cudaEventDestroy(std::exchange(s.event, nullptr));
    try {
      RegisteredSlots::instance().keep(device_, slot_memory_);
    } catch (...) {  // no memory for the list's node: the block is never given back either
      slot_memory_.abandon();
    }
    memory_ = nullptr;
  }
  static std::size_t chunk(std::size_t left) { return std::min(left, MpiDeviceTransport::kChunk); }

  // Copies out the next chunks of each peer's sends, in order, into free send slots.
  bool stage_sends() {
    bool moved = false;
    for (auto& [peer, jobs] : sends_) {
      while (!jobs.empty()) {
        SendJob& j = jobs.front();
        while (j.staged < j.bytes && !send_free_.empty()) {
          Slot* s = send_free_.back();
          const std::size_t n = chunk(j.bytes - j.staged);
          ipc::check_cuda(cudaMemcpyAsync(s->buf, j.src + j.staged, n, cudaMemcpyDefault, j.stream),
                          "cudaMemcpyAsync (device to pinned slot)", j.what);
          ipc::check_cuda(cudaEventRecord(s->event, j.stream), "cudaEventRecord", j.what);
          send_free_.pop_back();
          s->bytes = n;
          outbound_[peer].push_back(Outbound{s, false});
          j.staged += n;
          moved = true;
        }
        if (j.staged < j.bytes) break;
        std::function<void()> after_read = std::move(j.after_read);
        jobs.pop_front();  // read by its stream's copies (remove_window waits for the streams)
        if (after_read) after_read();
        --pending_;
      }
    }
    return moved;
  }

  // Posts each peer's copied chunks in order, and frees the slots of completed sends.
  bool post_sends() {
    bool moved = false;
    for (auto& [peer, list] : outbound_) {
      bool blocked = false;  // an earlier chunk's copy still runs: later ones wait (wire order)
      for (auto it = list.begin(); it != list.end();) {
        if (!it->posted && !blocked) {
          const cudaError_t rc = cudaEventQuery(it->slot->event);
          if (rc == cudaErrorNotReady) {
            blocked = true;
          } else {
            ipc::check_cuda(rc, "cudaEventQuery (copy to pinned slot)", "mpi-device wire to rank " + std::to_string(peer));
            check_mpi(MPI_Isend(it->slot->buf, static_cast<int>(it->slot->bytes), MPI_BYTE, peer, kTagData, data_.get(),
                                &it->slot->request),
                      "MPI_Isend (mpi-device chunk)", "mpi-device wire to rank " + std::to_string(peer));
            it->posted = true;
            moved = true;
          }
        }
        if (it->posted) {
          int done = 0;
          check_mpi(MPI_Test(&it->slot->request, &done, MPI_STATUS_IGNORE), "MPI_Test (mpi-device send)",
                    "mpi-device wire to rank " + std::to_string(peer));
          if (done) {
            send_free_.push_back(it->slot);
            it = list.erase(it);
            moved = true;
            continue;
          }
        }
        if (blocked) break;
        ++it;
      }
    }
    return moved;
  }

  // Whether `peer` may take a receive slot now. A sender's MPI_Isend of a chunk holds its
  // slot until the receiver posts the matching receive; were one peer to hold every receive
  // slot here, senders of different ranks could wait for each other in a cycle (each one's
  // slots sent to a rank whose receive slots all wait for another). So a slot is left for every
  // peer that holds none (there are at least as many receive slots as peers).
  bool may_take_recv_slot(int peer) const {
    if (recv_free_.empty()) return false;
    if (recv_held_.at(peer) == 0) return true;
    std::size_t without = 0;
    for (const auto& [p, held] : recv_held_) without += held == 0 ? 1 : 0;
    return recv_free_.size() > without;
  }

  // Posts receives for each peer's expected chunks, in order, into free receive slots.
  bool post_recvs() {
    bool moved = false;
    for (auto& [peer, jobs] : recvs_) {
      for (RecvJob& j : jobs) {
        while (j.posted < j.bytes && may_take_recv_slot(peer)) {
          Slot* s = recv_free_.back();
          const std::size_t n = chunk(j.bytes - j.posted);
          check_mpi(MPI_Irecv(s->buf, static_cast<int>(n), MPI_BYTE, peer, kTagData, data_.get(), &s->request),
                    "MPI_Irecv (mpi-device chunk)", j.what);
          recv_free_.pop_back();
          ++recv_held_[peer];
          s->peer = peer;
          s->bytes = n;
          j.slots.push_back(s);
          j.posted += n;
          moved = true;
        }
        if (j.posted < j.bytes) break;
      }
    }
    return moved;
  }

  // Copies arrived chunks to their places, in order; a transfer whose chunks are all on their
  // way in gets its follow-up enqueued behind them.
  bool land_recvs() {
    bool moved = false;
    for (auto& [peer, jobs] : recvs_) {
      while (!jobs.empty()) {
        RecvJob& j = jobs.front();
        while (!j.slots.empty()) {
          Slot* s = j.slots.front();
          int done = 0;
          check_mpi(MPI_Test(&s->request, &done, MPI_STATUS_IGNORE), "MPI_Test (mpi-device receive)", j.what);
          if (!done) break;
          ipc::check_cuda(cudaMemcpyAsync(j.dst + j.landed, s->buf, s->bytes, cudaMemcpyDefault, j.stream),
                          "cudaMemcpyAsync (pinned slot to device)", j.what);
          ipc::check_cuda(cudaEventRecord(s->event, j.stream), "cudaEventRecord", j.what);
          j.landed += s->bytes;
          j.slots.pop_front();
          draining_.push_back(s);
          moved = true;
        }
        if (j.landed < j.bytes) break;
        std::function<void()> then = std::move(j.then);
        jobs.pop_front();
        then();  // the proxy's: enqueues what follows on the same stream, never throws
        --pending_;
        moved = true;
      }
    }
    return moved;
  }

  // Receive slots whose copy to the device ran are free again.
  bool free_drained() {
    bool moved = false;
    for (auto it = draining_.begin(); it != draining_.end();) {
      const cudaError_t rc = cudaEventQuery((*it)->event);
      if (rc == cudaErrorNotReady) {
        ++it;
        continue;
      }
      ipc::check_cuda(rc, "cudaEventQuery (copy from pinned slot)", "mpi-device wire");
      --recv_held_[(*it)->peer];
      recv_free_.push_back(*it);
      it = draining_.erase(it);
      moved = true;
    }
    return moved;
  }

  MpiComm data_;
  std::chrono::milliseconds timeout_;
  int device_;
  PooledBlock slot_memory_;  // mapped host memory, from RegisteredSlots and back there
  char* memory_ = nullptr;   // kSlots chunks each way, in slot_memory_
  std::vector<Slot> slots_;
  std::vector<Slot*> send_free_, recv_free_;
  std::map<int, std::deque<SendJob>> sends_;
  std::map<int, std::list<Outbound>> outbound_;
  std::map<int, std::deque<RecvJob>> recvs_;
  std::list<Slot*> draining_;
  std::map<int, std::size_t> recv_held_;  // receive slots held (posted or copying out) per peer
  std::atomic<std::size_t> pending_{0};
};

}  // namespace

std::unique_ptr<Transport> make_mpi_device_transport(const CommContext& ctx) {
  return std::make_unique<MpiDeviceTransport>(ctx);
}

MpiDeviceTransport::MpiDeviceTransport(const CommContext& ctx) : ProxyTransport(ctx, "mpi-device") {}

void MpiDeviceTransport::connect(const std::vector<bool>& routed) {
  const std::string what = "meshmem::Comm (mpi-device transport) on rank " + std::to_string(ctx_.topo.rank);
  require_thread_multiple("moves device windows' bytes as MPI messages");
  MpiComm control = MpiComm::dup(ctx_.boot.comm(), what, ctx_.options.timeout);
  MpiComm data = MpiComm::dup(ctx_.boot.comm(), what, ctx_.options.timeout);
  agreed_step(ctx_.boot, "meshmem::Comm (mpi-device transport)", [&] {
    std::map<int, PeerStreams> streams;
    for (int r = 0; r < ctx_.topo.size; ++r)
      if (routed[r]) streams[r] = PeerStreams{std::make_unique<OwnedStream>(what), std::make_unique<OwnedStream>(what)};
    if (streams.empty()) return;  // some other ranks use it, this one does not
    std::vector<int> peers;
    for (const auto& [r, st] : streams) peers.push_back(r);
    auto wire = std::make_unique<MpiWire>(std::move(data), peers, device_->device(), ctx_.options.timeout, what);
    start_proxy(std::move(control), std::move(streams), std::move(wire));
  });
  if (proxy_) log(LogLevel::Info, "mpi-device transport: " + describe());
}

std::string MpiDeviceTransport::describe() const {
  if (!proxy_) return "";
  return "MPI messages through pinned host memory (" + std::to_string(kSlots) + " x " + std::to_string(kChunk >> 20) +
         " MiB each way per rank)";
}

}  // namespace meshmem::detail
