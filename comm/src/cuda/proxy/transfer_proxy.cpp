#include "cuda/proxy/transfer_proxy.hpp"

#include <cstring>
#include <utility>

#include "backoff.hpp"
#include "helper_cpus.hpp"
#include "log.hpp"
#include "topology.hpp"
#include "cuda/agent/captured_handoff.hpp"
#include "cuda/runtime/device_sync.hpp"
#include "cuda/runtime/gpu_queues.hpp"
#include "cuda/runtime/kernels.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

TransferProxy::TransferProxy(const char* name, MpiComm control, std::map<int, PeerStreams> streams,
                             std::unique_ptr<ProxyWire> wire, int rank, int device, std::chrono::milliseconds timeout, bool watchdog, FaultPlan faults,
                             std::shared_ptr<HandoffBoard<TransferProxy>> captured)
    : captured_(std::move(captured)),
      name_(name),
      words_memory_(take_block(BlockMemory::MappedHost, device, kDoneWords * sizeof(std::uint64_t),
                               "meshmem::Comm (" + std::string(name) + " transport) on rank " + std::to_string(rank))),
      core_(static_cast<std::uint64_t*>(words_memory_.get()), kDoneWords, timeout),
      control_(std::move(control)),
      streams_(std::move(streams)),
      wire_(std::move(wire)),
      rank_(rank),
      device_(device),
      timeout_(timeout),
      watchdog_(watchdog && timeout.count() > 0),
      faults_(std::move(faults)) {
  thread_ = std::thread([this] { run(); });
  place_helper_thread(thread_, "transfer proxy");  // off a caller bound to one core (helper_cpus.hpp)
}

void TransferProxy::stop(bool abort) noexcept {
  core_.request_stop();
  if (thread_.joinable()) thread_.join();
  if (wire_) wire_->stop(abort);
}

void TransferProxy::add_window(std::uint64_t id, void* local, std::size_t bytes) { windows_.add(id, local, bytes); }

bool TransferProxy::remove_window(std::uint64_t id) {
  windows_.erase(id);
  const Deadline deadline(timeout_);
  Backoff backoff;
  while (wire_->pending() > 0 && !deadline.expired()) backoff.pause();
  return wire_->pending() == 0 && wait_streams();
}

bool TransferProxy::wait_streams() {
  StreamMarks marks;
  for (auto& [peer, streams] : streams_)
    for (cudaStream_t s : {streams.in->get(), streams.out->get()}) marks.add(s, device_);
  return marks.ended_by(Deadline(timeout_));
}

void TransferProxy::send_header(int peer, const Message& m) {
  outgoing_.push_back(Outgoing{m, MPI_REQUEST_NULL});
  Outgoing& o = outgoing_.back();
  const int rc = MPI_Isend(&o.message, sizeof(Message), MPI_BYTE, peer, kTagMessage, control_.get(), &o.request);
  if (rc != MPI_SUCCESS) {
    outgoing_.pop_back();
    throw Error(ErrorCode::Mpi, where() + ": MPI_Isend of a header to rank " + std::to_string(peer) +
                                    " failed (code " + std::to_string(rc) + ")");
  }
}

void TransferProxy::release_bounce(const ProxyRequest& r) noexcept {
  if (r.bounce == nullptr) return;
  const cudaError_t rc = cudaFreeAsync(r.bounce, streams_.at(r.peer).out->get());
  if (rc != cudaSuccess) log(LogLevel::Error, where() + ": cudaFreeAsync of a bounce buffer failed: " + cudaGetErrorString(rc));
}

void TransferProxy::start(ProxyRequest r) {
  PeerStreams& streams = streams_.at(r.peer);
  const std::uint64_t id = next_id_[r.peer]++;
  r.started = std::chrono::steady_clock::now();
  if (r.is_get) {
    gets_[r.peer][id] = r;
    send_header(r.peer, Message{MessageKind::GetRequest, 0, id, r.window, r.offset, r.bytes, 0, 0, 0});
    return;
  }
  const std::uint32_t flags = r.has_signal ? (1u | (static_cast<std::uint32_t>(r.op) << 8)) : 0u;
  puts_[r.peer][id] = PutInFlight{r.word, r.ticket, r.started};
  send_header(r.peer, Message{MessageKind::Put, flags, id, r.window, r.offset, r.bytes, r.signal_window,
                              r.signal_index, r.value, r.dst_pitch, r.width});
  if (r.bytes > 0) {
    try {
      wire_->send(r.peer, r.src, r.bytes, streams.out->get(), [this, r] { release_bounce(r); },
                  where() + " to rank " + std::to_string(r.peer));
    } catch (...) {
      puts_[r.peer].erase(id);  // ended by the caller of start(); its acknowledgement never comes
      throw;
    }
  }
}

void TransferProxy::receive(int peer, void* into, std::size_t bytes, Incoming in, std::function<void()> then, const std::string& from) {
  cudaStream_t s = streams_.at(peer).in->get();
  std::deque<Incoming>& list = incoming_[peer];
  const bool behind = std::any_of(list.begin(), list.end(), [](const Incoming& e) { return !e.settled; });
  list.push_back(in);
  Incoming* entry = &list.back();  // a deque keeps it in place until it is popped (finished)
  // A failure of `then` still records the event, so that the answer waits for what was
  // enqueued before (the bytes may still be landing).
  auto finish = [this, entry, s, then = std::move(then), from] {
    try {
      if (then) then();
    } catch (const std::exception& e) {
      note_error(e.what());
      entry->refused = true;
    }
    try {
      cudaEvent_t done = events_.take(from);
      const cudaError_t rc = cudaEventRecord(done, s);
      if (rc != cudaSuccess) {
        events_.give_back(done);
        ipc::check_cuda(rc, "cudaEventRecord", from);
      }
      entry->done = done;
    } catch (const std::exception& e) {
      note_error(e.what());
      entry->refused = true;
    }
    entry->settled = true;
  };
  if (bytes == 0) {
    // No bytes (a signal alone): behind a transfer from this peer still on the wire it waits
    // for its turn, so that a signal never lands before data sent ahead of it.
    if (!behind) return finish();
    entry->deferred = std::move(finish);
    return;
  }
  try {
    wire_->recv(peer, into, bytes, s, [this, peer, finish = std::move(finish)] {
      finish();
      run_deferred(peer);
    }, from);
  } catch (...) {
    entry->refused = true;
    entry->settled = true;
    throw;
  }
}

void TransferProxy::run_deferred(int peer) {
  for (Incoming& e : incoming_[peer]) {
    if (e.settled) continue;
    if (!e.deferred) return;
    std::function<void()> f = std::move(e.deferred);
    e.deferred = nullptr;
    f();
  }
}

void TransferProxy::drop(int peer, std::size_t bytes, Incoming in, const std::string& from) {
  cudaStream_t s = streams_.at(peer).in->get();
  void* scratch = nullptr;
  ipc::check_cuda(cudaMallocAsync(&scratch, bytes, s), "cudaMallocAsync (dropped bytes)", from);
  in.refused = true;
  receive(peer, scratch, bytes, in, [scratch, s, from] {
    ipc::check_cuda(cudaFreeAsync(scratch, s), "cudaFreeAsync", from);
  }, from);
}

void TransferProxy::handle(int peer, const Message& m) {
  const auto found = streams_.find(peer);
  if (found == streams_.end()) {
    note_error(where() + ": a header from rank " + std::to_string(peer) + ", which this rank does not reach through " +
               name_);
    return;
  }
  PeerStreams& streams = found->second;
  const std::string from = where() + ", from rank " + std::to_string(peer);
  switch (m.kind) {
    case MessageKind::Put: {
      const auto lock = windows_.lock();
      std::string problem;
      std::uint64_t span = 0;
      char* dst = nullptr;
      if (put_span(m, &span))
        dst = windows_.resolve(m.window, m.offset, span, 1, 0, &problem);
      else
        problem = "a strided put of " + std::to_string(m.bytes) + " bytes in rows of " + std::to_string(m.width) +
                  ", " + std::to_string(m.pitch) + " apart, is malformed";
      std::uint64_t* signal = nullptr;
      if (dst != nullptr && (m.flags & 1u))
        signal = reinterpret_cast<std::uint64_t*>(
            windows_.resolve(m.signal_window, m.signal_index * sizeof(std::uint64_t), sizeof(std::uint64_t), 1, 0, &problem));
      const bool refused = dst == nullptr || ((m.flags & 1u) && signal == nullptr);
      cudaStream_t s = streams.in->get();
      // The data must be received wherever it goes, or every later transfer of the pair
      // would stall behind this one: refused data lands in scratch memory. A strided put's
      // packed rows land there too, then go to their places.
      const bool packed = m.bytes > 0 && (refused || m.width > 0);
      void* into = dst;
      if (packed) ipc::check_cuda(cudaMallocAsync(&into, m.bytes, s), "cudaMallocAsync (packed or refused put)", from);
      if (refused) note_error(from + ": a put was refused: " + problem);
      Incoming in;
      in.is_put = true;
      in.id = m.id;
      in.refused = refused;
      // What follows the bytes on the in-stream: unpacking, the scratch memory's release,
      // the signal (the window stays while the wire holds this: remove_window).
      auto then = [=] {
        if (!refused && m.width > 0)
          ipc::check_cuda(cudaMemcpy2DAsync(dst, m.pitch, into, m.width, m.width, m.bytes / m.width,
                                            cudaMemcpyDeviceToDevice, s),
                          "cudaMemcpy2DAsync (unpacking a strided put)", from);
        if (packed) ipc::check_cuda(cudaFreeAsync(into, s), "cudaFreeAsync", from);
        if (!refused && signal != nullptr)
          ipc::check_cuda(cuda::launch_copy(nullptr, nullptr, 0, signal, m.value,
                                            static_cast<SignalOp>((m.flags >> 8) & 0xff), s, false),
                          "signal kernel launch", from);
      };
      receive(peer, into, m.bytes, in, then, from);
      return;
    }
    case MessageKind::GetRequest: {
      const auto lock = windows_.lock();
      std::string problem;
      const char* src = windows_.resolve(m.window, m.offset, m.bytes, 1, 0, &problem);
      if (src == nullptr) {
        note_error(from + ": a get was refused: " + problem);
        send_header(peer, Message{MessageKind::Refused, 1, m.id, 0, 0, 0, 0, 0, 0});
        return;
      }
      send_header(peer, Message{MessageKind::GetData, 0, m.id, 0, 0, m.bytes, 0, 0, 0});
      if (m.bytes > 0) wire_->send(peer, src, m.bytes, streams.out->get(), nullptr, from);
      return;
    }
    case MessageKind::GetData: {
      const auto it = gets_[peer].find(m.id);
      if (it == gets_[peer].end()) {
        note_error(from + ": data for get #" + std::to_string(m.id) + ", which is not in flight");
        if (m.bytes > 0) {
          Incoming in;
          in.is_put = false;
          in.dropped = true;
          drop(peer, m.bytes, in, from);
        }
        return;
      }
      const ProxyRequest r = it->second;
      gets_[peer].erase(it);
      Incoming in;
      in.is_put = false;
      in.word = r.word;
      in.ticket = r.ticket;
      in.started = r.started;
      receive(peer, r.dst, m.bytes, in, nullptr, from);
      return;
    }
    case MessageKind::Ack:
    case MessageKind::Refused: {
      if (m.flags & 1u) {  // the answer to a get
        const auto it = gets_[peer].find(m.id);
        if (it == gets_[peer].end()) break;
        const ProxyRequest r = it->second;
        gets_[peer].erase(it);
        note_error(where() + ": a get of " + std::to_string(r.bytes) + " bytes from rank " + std::to_string(peer) +
                   " was refused there (see its log)");
        end(r.word, r.ticket);
        return;
      }
      const auto it = puts_[peer].find(m.id);
      if (it == puts_[peer].end()) {
        if (abandoned_puts_[peer].erase(m.id) > 0) return;  // the watchdog ended it already
        break;
      }
      const PutInFlight p = it->second;
      puts_[peer].erase(it);
      if (m.kind == MessageKind::Refused)
        note_error(where() + ": a put to rank " + std::to_string(peer) + " was refused there (see its log)");
      end(p.word, p.ticket);
      return;
    }
  }
  note_error(from + ": an unexpected header (kind " + std::to_string(static_cast<unsigned>(m.kind)) + ", id " +
             std::to_string(m.id) + ")");
}

void TransferProxy::watch() {
  const auto now = std::chrono::steady_clock::now();
  if (now < next_watch_) return;
  next_watch_ = now + std::chrono::milliseconds(50);
  const auto late = [&](std::chrono::steady_clock::time_point t) { return now - t > timeout_; };
  // Built for a late transfer only: this runs every 50 ms.
  const auto after = [&] {
    return " did not end within " + describe_timeout(timeout_) +
           "; its stream was released (its data may be incomplete)" + gpu_queue_hint();
  };
  for (auto& [peer, list] : puts_)
    for (auto it = list.begin(); it != list.end();) {
      if (!late(it->second.started)) {
        ++it;
        continue;
      }
      note_error(where() + ": a put to rank " + std::to_string(peer) + after(), ErrorCode::Timeout);
      end(it->second.word, it->second.ticket);
      abandoned_puts_[peer].insert(it->first);
      it = list.erase(it);
    }
  for (auto& [peer, list] : gets_)
    for (auto it = list.begin(); it != list.end();) {
      if (!late(it->second.started)) {
        ++it;
        continue;
      }
      note_error(where() + ": a get of " + std::to_string(it->second.bytes) + " bytes from rank " +
                     std::to_string(peer) + after(),
                 ErrorCode::Timeout);
      end(it->second.word, it->second.ticket);
      it = list.erase(it);
    }
  // Gets whose answer came but whose bytes are still on the wire (a peer that died midway):
  // ended the same way; the entry stays until the wire gives it up.
  for (auto& [peer, list] : incoming_)
    for (Incoming& in : list) {
      if (in.is_put || in.dropped || in.ended || in.settled || !late(in.started)) continue;
      note_error(where() + ": a get from rank " + std::to_string(peer) + after(), ErrorCode::Timeout);
      end(in.word, in.ticket);
      in.ended = true;
    }
}

bool TransferProxy::finish_incoming() {
  bool any = false;
  for (auto& [peer, list] : incoming_) {
    while (!list.empty()) {
      if (!list.front().settled) break;  // its bytes are still on the wire
      const cudaError_t rc = list.front().done != nullptr ? cudaEventQuery(list.front().done) : cudaSuccess;
      if (rc == cudaErrorNotReady) break;
      Incoming in = list.front();
      list.pop_front();
      if (in.done != nullptr) events_.give_back(in.done);
      any = true;
      if (rc != cudaSuccess)
        note_error(where() + ": a transfer with rank " + std::to_string(peer) + " failed on the GPU: " +
                   cudaGetErrorString(rc));
      if (in.dropped) continue;
      if (in.is_put)
        send_header(peer, Message{in.refused || rc != cudaSuccess ? MessageKind::Refused : MessageKind::Ack, 0, in.id,
                                  0, 0, 0, 0, 0, 0});
      else if (!in.ended)
        end(in.word, in.ticket);
    }
  }
  return any;
}

void TransferProxy::run() {
  tighten_timer_slack();
  // Its cudaEventQuery of a copy was refused while the application captured a graph in
  // global mode (seen: mpi-device, "the wire failed"), and the transport stopped for good.
  relax_capture_mode_of_this_thread();
  if (cudaSetDevice(device_) != cudaSuccess) {
    note_error(where() + ": cudaSetDevice failed in the proxy thread");
    return;
  }
  Message in_message{};
  MPI_Request in_request = MPI_REQUEST_NULL;
  auto post = [&] {
    return MPI_Irecv(&in_message, sizeof(Message), MPI_BYTE, MPI_ANY_SOURCE, kTagMessage, control_.get(), &in_request);
  };
  if (post() != MPI_SUCCESS) {
    note_error(where() + ": MPI_Irecv of headers failed");
    return;
  }
  ReadyQueue<ProxyRequest> waiting;
  Backoff backoff(std::chrono::microseconds(200));
  for (;;) {
    // Outside the core's lock: a replay's hand-off submits (which takes it).
    bool busy = captured_ != nullptr && captured_->poll();
    if (!core_.take_requests(waiting)) break;
    try {
      // Transfers whose source is ready, each stream's in its order (ReadyQueue: only the
      // oldest waiting transfer of each stream is asked).
      if (waiting.take_ready([](const ProxyRequest& r) { return cudaEventQuery(r.ready); },
                             [&](const ProxyRequest& r, cudaError_t rc) {
            if (r.ready) events_.give_back(r.ready);
            if (rc != cudaSuccess) {
              note_error(where() + ": the stream of a transfer to rank " + std::to_string(r.peer) + " failed: " +
                         cudaGetErrorString(rc));
              release_bounce(r);
              end(r.word, r.ticket);
              return;
            }
            try {
              start(r);
            } catch (const std::exception& e) {
              note_error(e.what());
              release_bounce(r);  // start() hands it over only with the wire's send
              end(r.word, r.ticket);
            }
          }))
        busy = true;
      for (;;) {
        int flag = 0;
        MPI_Status status;
        if (MPI_Test(&in_request, &flag, &status) != MPI_SUCCESS) throw Error(ErrorCode::Mpi, where() + ": MPI_Test failed");
        if (!flag) break;
        busy = true;
        const Message m = in_message;
        if (post() != MPI_SUCCESS) throw Error(ErrorCode::Mpi, where() + ": MPI_Irecv of headers failed");
        faults_.hit(FaultPoint::ProxyHeader);
        try {
          handle(status.MPI_SOURCE, m);
        } catch (const Error& e) {
          note_error(e.what());
        }
      }
      if (!wire_failed_) {
        try {
          busy = wire_->progress() || busy;
        } catch (const std::exception& e) {
          // The wire cannot go on (a CUDA or MPI call failed): its transfers never end, and
          // their callers' waits time out; every later call on the Comm raises this.
          wire_failed_ = true;
          note_error(where() + ": the wire failed; no transfer with a peer of this transport ends from now on: " +
                     e.what());
        }
      }
      busy = finish_incoming() || busy;
      if (watchdog_) watch();
      for (auto it = outgoing_.begin(); it != outgoing_.end();) {
        int flag = 0;
        MPI_Test(&it->request, &flag, MPI_STATUS_IGNORE);
        it = flag ? outgoing_.erase(it) : std::next(it);
      }
    } catch (const std::exception& e) {
      note_error(e.what());
    }
    if (busy)
      backoff.reset();
    else
      backoff.pause();
  }
  // Stopping: every rank settled first, so what is left belongs to a broken job.
  MPI_Cancel(&in_request);
  MPI_Wait(&in_request, MPI_STATUS_IGNORE);
  for (Outgoing& o : outgoing_) {
    int flag = 0;
    MPI_Test(&o.request, &flag, MPI_STATUS_IGNORE);
    if (!flag) MPI_Request_free(&o.request);  // completes (or not) without us
  }
  waiting.take_all([&](ProxyRequest& r) {
    if (r.ready) events_.give_back(r.ready);
    release_bounce(r);
  });
}

}  // namespace meshmem::detail
