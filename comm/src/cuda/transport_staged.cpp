#define MESHMEM_DEFINING_GPU_PART
#include "transport_staged.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <strings.h>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <thread>

#include "../backoff.hpp"
#include "../bootstrap.hpp"
#include "../fd_exchange.hpp"
#include "../gpu_part.hpp"
#include "../knobs.hpp"
#include "../log.hpp"
#include "../topology.hpp"
#include "device_runtime.hpp"
#include "device_window.hpp"
#include "kernels.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/cuda_driver.hpp"
#include "meshmem/ipc/vmm.hpp"
#include "staging_pool.hpp"

namespace meshmem::detail {

namespace {

std::size_t parse_slots(const char* name, const std::string& raw) {
  const std::size_t n = parse_bytes(name, raw);
  if (n < 2 || n > 64) bad_knob_value(name, raw, "a slot count from 2 to 64");
  return n;
}
std::size_t parse_chunk(const char* name, const std::string& raw) {
  const std::size_t n = parse_bytes(name, raw);
  if (n < 4096 || n > (std::size_t(1) << 30) || n % 4096 != 0)
    bad_knob_value(name, raw, "a byte count from 4096 to 2^30, a multiple of 4096");
  return n;
}

const TuningKnob<std::size_t> kStagingChunk{
    "staged", "MESHMEM_STAGING_CHUNK", std::size_t(4) << 20, parse_chunk, print_number,
    "staged transport (GPU pairs without peer access): bytes per chunk; a chunk goes device-to-host on the source "
    "GPU's copy engine while the previous one goes host-to-device on the target's"};
const TuningKnob<std::size_t> kStagingSlots{
    "staged", "MESHMEM_STAGING_SLOTS", 4, parse_slots, print_number,
    "staged transport: chunks in flight per rank; each rank's share of the node's pinned staging pool is "
    "slots x chunk plus 1 MiB of control words (rounded up to 2 MiB pages; meshmem-info prints it), made when some pair of the Comm routes through `staged`"};

// Sets `device` current for the life of the object (the agent and attach drive several GPUs).
class CurrentDevice {
 public:
  explicit CurrentDevice(int device) {
    (void)cudaGetDevice(&previous_);
    if (previous_ != device) (void)cudaSetDevice(device);
  }
  ~CurrentDevice() {
    int now = -1;
    (void)cudaGetDevice(&now);
    if (previous_ >= 0 && now != previous_) (void)cudaSetDevice(previous_);
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace

// One transfer, as the agent enqueues it: `rows` rows of `width` bytes, `src_pitch` /
// `dst_pitch` apart (a contiguous transfer is one row).
struct StagedRequest {
  cudaEvent_t ready = nullptr;  // recorded on the caller's stream: the source is ready (null:
                                // handed over by a captured host node, which runs once it is)
  void* dst = nullptr;
  int dst_device = -1;
  const void* src = nullptr;
  int src_device = -1;
  std::size_t width = 0;
  std::size_t rows = 1;
  std::size_t src_pitch = 0;
  std::size_t dst_pitch = 0;
  std::uint64_t* signal = nullptr;  // on dst_device, or null
  std::uint64_t value = 0;
  SignalOp op = SignalOp::Set;
  // Its done word (ControlWords::transfer(word)) reaches `ticket` at its end; the caller's
  // stream waits for that. Tickets only grow, so a word reused later never moves backwards.
  std::size_t word = 0;
  std::uint64_t* done = nullptr;
  bool word_is_lent = false;  // an eager transfer's word: back to the free list after its end
  std::uint64_t ticket = 0;
  std::size_t bytes() const { return width * rows; }
};

// The control words after the slots in each rank's region of the pool: one done counter per
// lane (the host reads which transfers ended, to reuse their words), the barrier's flags (one
// per rank of the Comm), then one done word per transfer in flight or captured.
struct ControlWords {
  static constexpr std::size_t kBytes = std::size_t(1) << 20;
  static constexpr std::size_t kWords = kBytes / sizeof(std::uint64_t);
  static constexpr std::size_t kLanes = 64;
  std::uint64_t* base = nullptr;
  std::size_t ranks = 0;
  std::uint64_t* lane_done(std::size_t lane) const { return base + lane; }
  std::uint64_t* barrier_flags() const { return base + kLanes; }
  std::size_t transfer_count() const { return kWords - kLanes - (ranks + 7) / 8 * 8; }
  std::uint64_t* transfer(std::size_t i) const { return base + kLanes + (ranks + 7) / 8 * 8 + i; }
};

// The thread that turns transfers into chunked copies on streams of its own: a lane (stream
// and per-slot events) per GPU it touches. It owns this rank's share of the staging pool
// (its slots and control words): in-flight copies use them until the agent is gone, and
// window attachments and captured graphs may keep it after the transport itself.
//
// Transfers start in the order their sources become ready, not in call order: the agent
// polls each one's ready event and enqueues only transfers whose source is ready, so its lanes
// never wait on a caller's stream. (Enqueued in call order with a stream wait on the event, an
// eager transfer behind a graph launch holding a staged transfer, or one stream waiting on a
// peer, held every later transfer of the rank until MESHMEM_TIMEOUT.)
class StagingAgent {
 public:
  StagingAgent(std::unique_ptr<StagingPool> pool, const std::vector<int>& devices, std::size_t chunk, int nslots,
               int rank, int ranks, std::chrono::milliseconds timeout)
      : pool_(std::move(pool)),
        slots_(static_cast<char*>(pool_->region(rank))),
        chunk_(chunk),
        nslots_(nslots),
        control_{nullptr, static_cast<std::size_t>(ranks)},
        rank_(rank),
        timeout_(timeout) {
    const std::string what = "staged transport on rank " + std::to_string(rank);
    control_ = control_of(rank);
    std::memset(control_.base, 0, ControlWords::kBytes);
    for (std::size_t i = control_.transfer_count(); i-- > 0;) free_words_.push_back(i);
    for (int d : devices) {
      if (lanes_.count(d)) continue;
      if (lanes_.size() == ControlWords::kLanes)
        throw Error(ErrorCode::Unsupported, what + ": more than " + std::to_string(ControlWords::kLanes) + " GPUs to drive");
      CurrentDevice current(d);
      // The signal kernel may run on this GPU from the agent's thread: loaded now, not at a
      // first launch behind a polling kernel (kernels.hpp, preload_kernels).
      ipc::check_cuda(cuda::preload_kernels(), "cudaFuncGetAttributes (loading meshmem's kernels)", what);
      Lane& lane = lanes_[d];
      lane.ordinal = lanes_.size() - 1;
      ipc::check_cuda(cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", what);
      lane.copied.resize(static_cast<std::size_t>(nslots), nullptr);
      lane.freed.resize(static_cast<std::size_t>(nslots), nullptr);
      for (int s = 0; s < nslots; ++s) {
        ipc::check_cuda(cudaEventCreateWithFlags(&lane.copied[s], cudaEventDisableTiming), "cudaEventCreateWithFlags", what);
        ipc::check_cuda(cudaEventCreateWithFlags(&lane.freed[s], cudaEventDisableTiming), "cudaEventCreateWithFlags", what);
      }
    }
    slot_free_.assign(static_cast<std::size_t>(nslots), nullptr);
    thread_ = std::thread([this] { run(); });
  }
  StagingAgent(const StagingAgent&) = delete;
  StagingAgent& operator=(const StagingAgent&) = delete;

  ~StagingAgent() {
    // Bounded: a transfer's source can sit behind a caller's stream that never moves on (a
    // wait for a signal that never comes). Streams and events with pending work may be
    // destroyed; CUDA releases them once that work is done.
    if (!drain()) log(LogLevel::Error, "staged transport: transfers still waiting or running at teardown");
    stop();
    for (cudaEvent_t e : spare_) (void)cudaEventDestroy(e);
    for (auto& [d, lane] : lanes_) {
      CurrentDevice current(d);
      for (cudaEvent_t e : lane.copied) (void)cudaEventDestroy(e);
      for (cudaEvent_t e : lane.freed) (void)cudaEventDestroy(e);
      if (lane.stream) (void)cudaStreamDestroy(lane.stream);
    }
  }

  void stop() noexcept {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  // An event of this rank's device for the caller to record (caller's thread).
  cudaEvent_t take_event() {
    {
      std::lock_guard<std::mutex> lock(m_);
      if (!spare_.empty()) {
        cudaEvent_t e = spare_.back();
        spare_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    ipc::check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags",
                    "staged transport on rank " + std::to_string(rank_));
    return e;
  }
  void give_back(cudaEvent_t e) {
    std::lock_guard<std::mutex> lock(m_);
    spare_.push_back(e);
  }

  // A done word for one transfer (ControlWords::transfer), or false when every word is in
  // use. Words of ended transfers are taken back first.
  bool try_take_word(std::size_t* word) {
    std::lock_guard<std::mutex> lock(m_);
    reclaim_words();  // every time, not only when none is left: words are reused at once (and so tested)
    if (free_words_.empty()) return false;
    *word = free_words_.back();
    free_words_.pop_back();
    return true;
  }
  // As try_take_word, but with every word in use (that many transfers waiting or running)
  // the caller waits for the oldest to end, as a full CUDA launch queue makes it wait;
  // bounded by MESHMEM_TIMEOUT.
  std::size_t take_word(const std::string& what) {
    Deadline deadline(timeout_);
    Backoff backoff;
    std::size_t word = 0;
    while (!try_take_word(&word)) {
      if (deadline.expired())
        throw Error(ErrorCode::Timeout, what + ": " + std::to_string(control_.transfer_count()) +
                                            " staged transfers of this rank are waiting or running (or captured) and "
                                            "none ended within " + describe_timeout(timeout_) + "; nothing was enqueued");
      backoff.pause();
    }
    return word;
  }
  void release_word(std::size_t word) {
    std::lock_guard<std::mutex> lock(m_);
    free_words_.push_back(word);
  }

  // Queues a transfer (its done word set); returns its ticket: the value its done word reaches
  // at its end.
  std::uint64_t submit(StagedRequest r) {
    std::lock_guard<std::mutex> lock(m_);
    r.ticket = ++submitted_;
    queue_.push_back(r);
    cv_.notify_all();
    return r.ticket;
  }

  const ControlWords& control() const { return control_; }
  // Rank r's control words, in its region of the pool as mapped here.
  ControlWords control_of(int rank) const {
    return ControlWords{reinterpret_cast<std::uint64_t*>(static_cast<char*>(pool_->region(rank)) +
                                                         chunk_ * static_cast<std::size_t>(nslots_)),
                        control_.ranks};
  }
  const StagingPool& pool() const { return *pool_; }

  // The first error the agent met, once ("" if none).
  std::string take_error() {
    std::lock_guard<std::mutex> lock(m_);
    return std::exchange(error_, std::string());
  }

  // Waits until every transfer handed over was enqueued (its source ready) and the lanes are
  // idle; bounded by MESHMEM_TIMEOUT (0: no bound, as everywhere); false if not.
  bool drain() noexcept {
    const auto deadline = std::chrono::steady_clock::now() + (timeout_.count() == 0 ? std::chrono::hours(24 * 365) : timeout_);
    {
      std::unique_lock<std::mutex> lock(m_);
      if (!cv_.wait_until(lock, deadline, [&] { return handled_ == submitted_ || stop_; })) return false;
    }
    Backoff backoff;
    for (auto& [d, lane] : lanes_) {
      for (;;) {
        const cudaError_t rc = cudaStreamQuery(lane.stream);
        if (rc != cudaErrorNotReady) {
          (void)cudaGetLastError();
          break;
        }
        if (std::chrono::steady_clock::now() > deadline) return false;
        backoff.pause();
      }
    }
    return true;
  }

 private:
  struct Lane {
    std::size_t ordinal = 0;          // its done counter: ControlWords::lane_done(ordinal)
    cudaStream_t stream = nullptr;
    std::vector<cudaEvent_t> copied;  // per slot: the device-to-host copy into it is done
    std::vector<cudaEvent_t> freed;   // per slot: the host-to-device copy out of it is done
    std::uint64_t ended = 0;          // transfers enqueued to end on this lane (its counter's goal)
    std::deque<std::pair<std::uint64_t, std::size_t>> lent;  // (count at its end, word) of eager transfers
  };

  // Under m_: words of transfers whose end a lane's counter has passed go back to the free list.
  void reclaim_words() {
    for (auto& [d, lane] : lanes_) {
      const std::uint64_t done = __atomic_load_n(control_.lane_done(lane.ordinal), __ATOMIC_ACQUIRE);
      while (!lane.lent.empty() && lane.lent.front().first <= done) {
        free_words_.push_back(lane.lent.front().second);
        lane.lent.pop_front();
      }
    }
  }

  void run() {
    // The application may capture a graph in global mode on another thread meanwhile; this
    // thread's calls touch only its own streams and must not be refused (nor invalidate it).
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    (void)cudaThreadExchangeStreamCaptureMode(&mode);
    tighten_timer_slack();
    std::list<StagedRequest> waiting;  // handed over; sources not known to be ready yet
    // Polls ready events while some source is not ready: sleeps at most 20 us between polls,
    // so a transfer starts at most that late after the kernel before it.
    Backoff backoff(std::chrono::microseconds(20));
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(m_);
        if (waiting.empty()) cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        while (!queue_.empty()) {
          waiting.push_back(queue_.front());
          queue_.pop_front();
        }
        if (waiting.empty()) return;  // stopping, nothing left
      }
      bool started = false;
      for (auto it = waiting.begin(); it != waiting.end();) {
        const cudaError_t rc = it->ready == nullptr ? cudaSuccess : cudaEventQuery(it->ready);
        if (rc == cudaErrorNotReady) {
          ++it;
          continue;
        }
        const StagedRequest r = *it;
        it = waiting.erase(it);
        if (r.ready != nullptr) give_back(r.ready);
        if (rc != cudaSuccess) {
          (void)cudaGetLastError();
          fail(r, std::string("staged transfer of rank ") + std::to_string(rank_) +
                      ": cudaEventQuery on the caller's stream failed: " + cudaGetErrorString(rc));
        } else {
          try {
            execute(r);
          } catch (const std::exception& e) {
            fail(r, e.what());
          }
        }
        {
          std::lock_guard<std::mutex> lock(m_);
          ++handled_;
        }
        cv_.notify_all();
        started = true;
      }
      if (started) {
        backoff.reset();
        continue;
      }
      {
        std::lock_guard<std::mutex> lock(m_);
        // Stopping (after drain gave up) with sources that never became ready: their callers'
        // waits time out.
        if (stop_) return;
        if (!queue_.empty()) continue;
      }
      backoff.pause();
    }
  }

  // A transfer that could not be enqueued: the error goes to the caller's next call, and its
  // done word is set from the host so that its stream is not held for a whole timeout
  // (earlier transfers of that stream ended before its source was ready: stream order).
  void fail(const StagedRequest& r, const std::string& message) {
    log(LogLevel::Error, message);
    {
      std::lock_guard<std::mutex> lock(m_);
      if (error_.empty()) error_ = message;
    }
    __atomic_store_n(r.done, r.ticket, __ATOMIC_RELEASE);
    if (r.word_is_lent) release_word(r.word);
  }

  void execute(const StagedRequest& r) {
    const std::string what = "staged transfer " + std::to_string(r.ticket) + " of rank " + std::to_string(rank_);
    Lane& from = lanes_.at(r.src_device);
    Lane& to = lanes_.at(r.dst_device);
    // Pieces of at most a chunk: whole rows where a row fits (packed in the slot), otherwise
    // a chunk of one row.
    const std::size_t rows_per = r.width == 0 ? 1 : r.width <= chunk_ ? chunk_ / r.width : 1;
    const std::size_t cut = r.width <= chunk_ ? r.width : chunk_;
    for (std::size_t row = 0; row < r.rows && r.width > 0; row += rows_per) {
      const std::size_t rows = std::min(rows_per, r.rows - row);
      for (std::size_t col = 0; col < r.width; col += cut) {
        const std::size_t width = std::min(cut, r.width - col);
        const char* src = static_cast<const char*>(r.src) + row * r.src_pitch + col;
        char* dst = static_cast<char*>(r.dst) + row * r.dst_pitch + col;
        const std::size_t s = next_slot_;
        next_slot_ = (next_slot_ + 1) % static_cast<std::size_t>(nslots_);
        char* slot = slots_ + s * chunk_;
        {
          CurrentDevice current(r.src_device);
          if (slot_free_[s] != nullptr)
            ipc::check_cuda(cudaStreamWaitEvent(from.stream, slot_free_[s], 0), "cudaStreamWaitEvent", what);
          ipc::check_cuda(rows == 1 ? cudaMemcpyAsync(slot, src, width, cudaMemcpyDefault, from.stream)
                                    : cudaMemcpy2DAsync(slot, width, src, r.src_pitch, width, rows, cudaMemcpyDefault,
                                                        from.stream),
                          "cudaMemcpyAsync (to the staging slot)", what);
          ipc::check_cuda(cudaEventRecord(from.copied[s], from.stream), "cudaEventRecord", what);
        }
        CurrentDevice current(r.dst_device);
        ipc::check_cuda(cudaStreamWaitEvent(to.stream, from.copied[s], 0), "cudaStreamWaitEvent", what);
        ipc::check_cuda(rows == 1 ? cudaMemcpyAsync(dst, slot, width, cudaMemcpyDefault, to.stream)
                                  : cudaMemcpy2DAsync(dst, r.dst_pitch, slot, width, width, rows, cudaMemcpyDefault,
                                                      to.stream),
                        "cudaMemcpyAsync (from the staging slot)", what);
        ipc::check_cuda(cudaEventRecord(to.freed[s], to.stream), "cudaEventRecord", what);
        slot_free_[s] = to.freed[s];
      }
    }
    CurrentDevice current(r.dst_device);
    std::vector<CUstreamBatchMemOpParams> ops;
    if (r.signal != nullptr && r.op == SignalOp::Add) {
      ipc::check_cuda(cuda::launch_copy(nullptr, nullptr, 0, r.signal, r.value, r.op, to.stream, false),
                      "signal kernel launch", what);
    } else if (r.signal != nullptr) {
      // The default flags put a memory barrier before the write: the data lands first.
      CUstreamBatchMemOpParams op{};
      op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
      op.writeValue.address = reinterpret_cast<CUdeviceptr>(r.signal);
      op.writeValue.value64 = r.value;
      ops.push_back(op);
    }
    // The transfer's done word (the caller's stream waits for it), then the lane's counter
    // (the host takes the word back once it passed).
    CUstreamBatchMemOpParams done{};
    done.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
    done.writeValue.address = reinterpret_cast<CUdeviceptr>(r.done);
    done.writeValue.value64 = r.ticket;
    ops.push_back(done);
    CUstreamBatchMemOpParams counter = done;
    counter.writeValue.address = reinterpret_cast<CUdeviceptr>(control_.lane_done(to.ordinal));
    counter.writeValue.value64 = to.ended + 1;
    ops.push_back(counter);
    run_stream_batch(ops, to.stream, "staged transfer", rank_);
    std::lock_guard<std::mutex> lock(m_);
    ++to.ended;
    if (r.word_is_lent) to.lent.emplace_back(to.ended, r.word);
  }

  std::unique_ptr<StagingPool> pool_;  // first: destroyed last, after the lanes stopped using it
  char* slots_;
  std::size_t chunk_;
  int nslots_;
  ControlWords control_;
  int rank_;
  std::chrono::milliseconds timeout_;
  std::map<int, Lane> lanes_;
  std::vector<cudaEvent_t> slot_free_;  // per slot: the event of the copy that last read it
  std::size_t next_slot_ = 0;

  std::mutex m_;  // the queue, counters, free words, lanes' lent words, spare events, error
  std::condition_variable cv_;
  std::deque<StagedRequest> queue_;
  std::vector<cudaEvent_t> spare_;
  std::vector<std::size_t> free_words_;
  std::uint64_t submitted_ = 0;
  std::uint64_t handled_ = 0;  // transfers enqueued on the lanes or failed
  bool stop_ = false;
  std::string error_;
  std::thread thread_;
};

namespace {

// The node peers' parts of one device window, each mapped here for that peer's GPU. It keeps
// the agent: its release may run on the window releaser's thread after the Comm is gone.
class StagedAttachment final : public WindowAttachment {
 public:
  explicit StagedAttachment(std::shared_ptr<StagingAgent> a) : agent(std::move(a)) {}
  ~StagedAttachment() override {
    // No queued or running transfer may touch a mapping once it is gone.
    if (!agent->drain())
      log(LogLevel::Error, "staged transport: transfers still running when a window was freed; its mappings of "
                           "peers' memory are released anyway");
  }
  std::shared_ptr<StagingAgent> agent;
  std::vector<ipc::PeerMapping> parts;  // by rank
};

}  // namespace

// What captured transfers share with the transport: a CUDA graph may outlive the Comm, and
// its host nodes and destructor callbacks (threads of CUDA, which may not call CUDA) only
// touch this.
struct CaptureBoard {
  std::mutex m;
  StagingAgent* agent = nullptr;  // null once the transport stopped
};

namespace {

// One captured transfer: on every replay its host node hands the request to the agent and
// writes the ticket it got where the graph's wait kernel reads it. Its done word and ticket
// word are the graph's for its life.
struct CapturedTransfer {
  std::shared_ptr<CaptureBoard> board;
  StagedRequest request;
  std::size_t ticket_word = 0;
  std::uint64_t* ticket_at = nullptr;
};

void CUDART_CB submit_captured(void* p) {
  auto* c = static_cast<CapturedTransfer*>(p);
  std::lock_guard<std::mutex> lock(c->board->m);
  // After the transport stopped nothing is written (the pool may be gone): the wait then sees
  // the last replay's ticket and lets the stream pass with no data moved (replaying a graph
  // whose Comm and windows are gone is the caller's error, as on every route).
  if (c->board->agent == nullptr) return;
  __atomic_store_n(c->ticket_at, c->board->agent->submit(c->request), __ATOMIC_RELEASE);
}

void CUDART_CB release_captured(void* p) {
  auto* c = static_cast<CapturedTransfer*>(p);
  {
    std::lock_guard<std::mutex> lock(c->board->m);
    // The graph's launches are complete: its transfers' last writes to these words are done.
    if (c->board->agent != nullptr) {
      c->board->agent->release_word(c->request.word);
      c->board->agent->release_word(c->ticket_word);
    }
  }
  delete c;
}

}  // namespace

std::unique_ptr<Transport> make_staged_transport(const CommContext& ctx) {
  return std::make_unique<StagedTransport>(ctx);
}

StagedTransport::StagedTransport(const CommContext& ctx)
    : ctx_(ctx),
      device_(static_cast<CudaDeviceRuntime*>(ctx.device)),
      chunk_(kStagingChunk.get(ctx.options)),
      slots_(static_cast<int>(kStagingSlots.get(ctx.options))) {
  const Topology& topo = ctx_.topo;
  no_route_.assign(static_cast<std::size_t>(topo.size), std::string());
  peer_device_.assign(static_cast<std::size_t>(topo.size), -1);
  for (int r = 0; r < topo.size; ++r)
    if (!topo.same_node(r))
      no_route_[r] = "rank " + std::to_string(r) + " is on another node (staging is through the node's pinned memory)";
  if (device_ == nullptr) return;
  const std::vector<std::string>& bus = device_->bus_ids();
  for (int r : topo.node_ranks) {
    int d = -1;
    if (cudaDeviceGetByPCIBusId(&d, bus[r].c_str()) != cudaSuccess) {
      (void)cudaGetLastError();
      no_route_[r] = std::string("rank ") + std::to_string(r) + "'s GPU (" + bus[r] +
                     ") is not visible to this process (CUDA_VISIBLE_DEVICES isolation?): the staged transport drives "
                     "the target's copy engine from here (a target-side agent for hidden GPUs is not built yet)";
      continue;
    }
    peer_device_[r] = d;
  }
}

StagedTransport::~StagedTransport() { stop(); }

void StagedTransport::stop() noexcept {
  if (board_) {
    std::lock_guard<std::mutex> lock(board_->m);
    board_->agent = nullptr;
  }
  if (agent_) agent_->stop();
}

Reach StagedTransport::reach(int rank, Memory memory) const {
  if (memory != Memory::Device) return Reach::no("device windows only");
  if (device_ == nullptr) return Reach::no("device windows are unavailable");
  if (!no_route_[rank].empty()) return Reach::no(no_route_[rank]);
  return Reach::yes();
}

void StagedTransport::connect(const std::vector<bool>& routed) {
  const std::string what = "meshmem::Comm (staged transport)";
  std::vector<int> devices{device_->device()};
  for (int r = 0; r < ctx_.topo.size; ++r)
    if (routed[r] && peer_device_[r] >= 0 && std::find(devices.begin(), devices.end(), peer_device_[r]) == devices.end())
      devices.push_back(peer_device_[r]);
  // Slots first (2 MiB aligned), then the control words (ControlWords).
  const std::size_t slots_bytes = chunk_ * static_cast<std::size_t>(slots_);
  auto pool =
      std::make_unique<StagingPool>(ctx_.boot, ctx_.topo, ctx_.fds, slots_bytes + ControlWords::kBytes, device_->device(), devices, what);
  const std::string layout = pool->describe();
  agreed_step(ctx_.boot, what, [&] {
    agent_ = std::make_shared<StagingAgent>(std::move(pool), devices, chunk_, slots_, ctx_.topo.rank, ctx_.topo.size,
                                            ctx_.options.timeout);
  });
  board_ = std::make_shared<CaptureBoard>();
  board_->agent = agent_.get();
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  static bool warned = false;
  if ((loading == nullptr || strcasecmp(loading, "EAGER") != 0) && !std::exchange(warned, true))
    log(LogLevel::Warn,
        "staged transport with CUDA lazy module loading (CUDA_MODULE_LOADING is not EAGER): the first launch of an "
        "application kernel while a staged transfer is in flight can wait for the GPU to be idle, which the transfer's "
        "stream wait never is until MESHMEM_TIMEOUT; set CUDA_MODULE_LOADING=EAGER, or launch each kernel once "
        "before the first staged transfer");
  log(LogLevel::Info, "staged transport: pool " + layout + "; " + std::to_string(slots_) + " slots of " +
                          std::to_string(chunk_) + " bytes per rank");
}

std::unique_ptr<WindowAttachment> StagedTransport::attach(WindowState& win, const std::vector<bool>& routed,
                                                          const std::string& what) {
  const Topology& topo = ctx_.topo;
  const auto& memory = static_cast<const DeviceWindowMemory&>(*win.storage);
  std::vector<ipc::UniqueFd> received = exchange_part_fds(ctx_, win, what);
  auto attachment = std::make_unique<StagedAttachment>(agent_);
  attachment->parts.resize(static_cast<std::size_t>(topo.size));
  agreed_step(ctx_.boot, what, [&] {
    for (int r : topo.node_ranks) {
      if (!routed[r]) continue;
      if (r == topo.rank) continue;  // this rank's own part: win.local
      CurrentDevice current(peer_device_[r]);
      attachment->parts[r] = ipc::PeerMapping::import(received[r].get(), memory.bytes, peer_device_[r]);
    }
  });
  return attachment;
}

std::string StagedTransport::what(const char* op, int target) const {
  return std::string("staged ") + op + " between rank " + std::to_string(ctx_.topo.rank) + " and rank " +
         std::to_string(target);
}

void* StagedTransport::mapped_part(const WindowState& win, int rank, const char* op) const {
  if (rank == ctx_.topo.rank) return win.local;
  for (const auto& a : win.attachments)
    if (const auto* s = dynamic_cast<const StagedAttachment*>(a.get()))
      if (void* p = s->parts[static_cast<std::size_t>(rank)].data()) return p;
  throw Error(ErrorCode::Internal, what(op, rank) + ": window #" + std::to_string(win.id) + " is not attached here");
}

void StagedTransport::transfer(StagedRequest r, int peer, Stream stream, const char* name) {
  const std::string error = agent_->take_error();
  if (!error.empty()) throw Error(ErrorCode::Cuda, what(name, peer) + ": an earlier transfer failed: " + error);
  const auto s = static_cast<cudaStream_t>(stream);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaGraph_t graph = nullptr;
  ipc::check_cuda(cudaStreamGetCaptureInfo(s, &status, nullptr, &graph), "cudaStreamGetCaptureInfo", what(name, peer));
  if (status == cudaStreamCaptureStatusActive) {
    capture_transfer(r, graph, peer, s, name);
    return;
  }
  r.word = agent_->take_word(what(name, peer));
  r.done = agent_->control().transfer(r.word);
  r.word_is_lent = true;
  r.ready = agent_->take_event();
  const cudaError_t rc = cudaEventRecord(r.ready, s);
  if (rc != cudaSuccess) {
    agent_->give_back(r.ready);
    agent_->release_word(r.word);
    ipc::check_cuda(rc, "cudaEventRecord", what(name, peer));
  }
  std::uint64_t* done = r.done;
  const std::uint64_t ticket = agent_->submit(r);
  const cudaError_t k =
      cuda::launch_transfer_wait(done, ticket, nullptr, peer, device_->wait_limit(), s, device_->early_launch());
  if (k != cudaSuccess) ipc::check_cuda(k, "transfer wait kernel launch", what(name, peer));
}

// Under capture the graph gets a host node that hands the request to the agent on every
// replay (it runs once the caller's earlier work is done, so no ready event is needed), then
// the wait kernel for the ticket that node got. The request and its two words (done and
// ticket) live as long as the graph (a CUDA user object). Two instantiations of one graph
// running at once share them (a limit: the waits can then stall until MESHMEM_TIMEOUT).
void StagedTransport::capture_transfer(const StagedRequest& r, cudaGraph_t graph, int peer, cudaStream_t stream,
                                       const char* name) {
  auto captured = std::make_unique<CapturedTransfer>();
  captured->board = board_;
  captured->request = r;
  const auto all_in_use = [&] {
    return Error(ErrorCode::Unsupported, what(name, peer) + ": all " + std::to_string(agent_->control().transfer_count()) +
                                             " done words of this rank are held by staged transfers waiting, running "
                                             "or captured into CUDA graphs that still exist; nothing was enqueued");
  };
  std::size_t done_word = 0, ticket_word = 0;
  if (!agent_->try_take_word(&done_word)) throw all_in_use();
  if (!agent_->try_take_word(&ticket_word)) {
    agent_->release_word(done_word);
    throw all_in_use();
  }
  captured->request.word = done_word;
  captured->request.done = agent_->control().transfer(done_word);
  captured->ticket_word = ticket_word;
  captured->ticket_at = agent_->control().transfer(ticket_word);
  *captured->ticket_at = 0;
  cudaUserObject_t object = nullptr;
  const cudaError_t rc = cudaUserObjectCreate(&object, captured.get(), release_captured, 1, cudaUserObjectNoDestructorSync);
  if (rc != cudaSuccess) {
    agent_->release_word(done_word);
    agent_->release_word(ticket_word);
    ipc::check_cuda(rc, "cudaUserObjectCreate", what(name, peer));
  }
  CapturedTransfer* c = captured.release();  // the user object owns it now
  const cudaError_t kept = cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove);
  if (kept != cudaSuccess) {
    (void)cudaUserObjectRelease(object, 1);  // runs release_captured
    ipc::check_cuda(kept, "cudaGraphRetainUserObject", what(name, peer));
  }
  ipc::check_cuda(cudaLaunchHostFunc(stream, submit_captured, c), "cudaLaunchHostFunc (captured staged transfer)",
                  what(name, peer));
  const cudaError_t k = cuda::launch_transfer_wait(c->request.done, 0, c->ticket_at, peer, device_->wait_limit(), stream,
                                                   device_->early_launch());
  if (k != cudaSuccess) ipc::check_cuda(k, "transfer wait kernel launch", what(name, peer));
}

StagedRequest StagedTransport::request(void* dst, int dst_device, const void* src, int src_device, std::size_t width,
                                       std::size_t rows, std::size_t dst_pitch, std::size_t src_pitch) const {
  StagedRequest r;
  r.dst = dst;
  r.dst_device = dst_device;
  r.src = src;
  r.src_device = src_device;
  r.width = width;
  r.rows = rows;
  r.dst_pitch = dst_pitch;
  r.src_pitch = src_pitch;
  return r;
}

void StagedTransport::put(const WindowState& win, int target, std::size_t offset, const void* src, std::size_t bytes,
                          const SignalUpdate& signal, Stream stream) {
  char* dst = static_cast<char*>(mapped_part(win, target, "put")) + offset;
  StagedRequest r = request(dst, peer_device_[target], src, device_->device(), bytes, 1, bytes, bytes);
  if (signal.sig != nullptr) {
    r.signal = static_cast<std::uint64_t*>(mapped_part(*signal.sig, target, "put_signal")) + signal.index;
    r.value = signal.value;
    r.op = signal.op;
  }
  if (bytes == 0 && r.signal == nullptr) return;
  transfer(r, target, stream, r.signal != nullptr ? "put_signal" : "put");
}

void StagedTransport::put_strided(const WindowState& win, int target, std::size_t dst_offset, std::size_t dst_pitch,
                                  const void* src, std::size_t src_pitch, std::size_t width, std::size_t height,
                                  Stream stream) {
  if (width == 0 || height == 0) return;
  char* dst = static_cast<char*>(mapped_part(win, target, "put")) + dst_offset;
  transfer(request(dst, peer_device_[target], src, device_->device(), width, height, dst_pitch, src_pitch), target, stream,
           "put (strided)");
}

void StagedTransport::get(void* dst, const WindowState& win, int target, std::size_t offset, std::size_t bytes,
                          Stream stream) {
  if (bytes == 0) return;
  const char* src = static_cast<const char*>(mapped_part(win, target, "get")) + offset;
  transfer(request(dst, device_->device(), src, peer_device_[target], bytes, 1, bytes, bytes), target, stream, "get");
}

bool StagedTransport::drain() noexcept { return agent_ ? agent_->drain() : true; }

std::uint64_t* StagedTransport::barrier_flags(int rank) const { return agent_->control_of(rank).barrier_flags(); }

std::string StagedTransport::describe() const {
  return agent_ ? "staging pool " + agent_->pool().describe() + ", " + std::to_string(slots_) + " slots of " +
                      std::to_string(chunk_) + " bytes per rank"
                : std::string();
}

}  // namespace meshmem::detail
