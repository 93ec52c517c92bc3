// host_bench (host_bench.cpp): the ways of moving the bytes (memcpy, meshmem over shm or the
// mpi transport, MPI send/recv, MPI RMA), each a Variant.
#pragma once

#include <mpi.h>

#include <cstring>
#include <memory>
#include <string>

#include <meshmem/meshmem.hpp>

#include "host_bench_common.hpp"

namespace host_bench {

// ---- variants ----

// One way of moving the bytes. Every method is called on both ranks, which each play
// their part (rank 0 the origin, rank 1 the target); a part may be empty.
class Variant {
 public:
  explicit Variant(Ctx& ctx) : ctx_(ctx), dst_(ctx.rank == 0 ? page_buffer(ctx.region_bytes) : nullptr) {}
  virtual ~Variant() = default;
  Variant(const Variant&) = delete;
  Variant& operator=(const Variant&) = delete;

  virtual const char* name() const = 0;
  int index() const {
    for (int i = 0; i < 5; ++i)
      if (std::strcmp(kVariants[i], name()) == 0) return i;
    return -1;
  }
  unsigned char* get_dst() { return dst_.get(); }  // where this variant's gets land (rank 0)
  virtual bool supports(Bench) const { return true; }
  virtual std::string path() const = 0;          // how rank 0 reaches rank 1, for the header
  virtual std::string how(Bench b) const = 0;    // what one iteration does, for the header
  virtual void sync() = 0;                       // a barrier of this variant's own kind

  // The rank that holds the memory puts land in and gets read from.
  virtual int owner() const { return 1; }
  virtual unsigned char* put_target() = 0;       // on owner()
  virtual unsigned char* get_source() { return put_target(); }  // on owner()
  virtual unsigned char* pingpong_target() { return put_target(); }  // on each rank
  virtual void wrote_locally() {}     // after this rank wrote its own target memory directly
  virtual void will_read_locally() {}

  virtual void put_once(std::size_t size) = 0;
  virtual void put_window(std::size_t size, int window) = 0;
  virtual void get_once(std::size_t size) = 0;
  virtual void get_window(std::size_t size, int window) = 0;
  virtual void pingpong(std::size_t) {}
  // Collective teardown with every call checked (the destructors cannot report errors).
  virtual void finish() {}

 protected:
  Ctx& ctx_;
  Buffer dst_;
  std::size_t at(int i, std::size_t size) const { return static_cast<std::size_t>(i) * size; }
};

// Plain memcpy in rank 0: the ceiling for a same-node put. Rank 1 only waits.
class MemcpyVariant final : public Variant {
 public:
  explicit MemcpyVariant(Ctx& ctx)
      : Variant(ctx),
        target_(ctx.rank == 0 ? page_buffer(ctx.region_bytes) : nullptr),
        source_(ctx.rank == 0 ? page_buffer(ctx.region_bytes) : nullptr) {}
  const char* name() const override { return "memcpy"; }
  bool supports(Bench b) const override { return b != Bench::PutSignal; }
  std::string path() const override { return "memcpy between two private buffers of rank 0"; }
  std::string how(Bench b) const override {
    return b == Bench::Put ? "latency: 1 memcpy src->target; bandwidth: W memcpys to W offsets"
                           : "latency: 1 memcpy source->dst; bandwidth: W memcpys from W offsets";
  }
  void sync() override { MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD)); }
  int owner() const override { return 0; }
  unsigned char* put_target() override { return target_.get(); }
  unsigned char* get_source() override { return source_.get(); }

  void put_once(std::size_t size) override {
    if (ctx_.rank != 0) return;
    std::memcpy(target_.get(), ctx_.src.get(), size);
    clobber(target_.get());
  }
  void put_window(std::size_t size, int window) override {
    if (ctx_.rank != 0) return;
    for (int i = 0; i < window; ++i) {
      std::memcpy(target_.get() + at(i, size), ctx_.src.get(), size);
      clobber(target_.get());
    }
  }
  void get_once(std::size_t size) override {
    if (ctx_.rank != 0) return;
    std::memcpy(dst_.get(), source_.get(), size);
    clobber(dst_.get());
  }
  void get_window(std::size_t size, int window) override {
    if (ctx_.rank != 0) return;
    for (int i = 0; i < window; ++i) {
      std::memcpy(dst_.get() + at(i, size), source_.get() + at(i, size), size);
      clobber(dst_.get());
    }
  }

 private:
  Buffer target_;
  Buffer source_;
};

// meshmem host windows. `remote`: a Comm whose two ranks sit on two simulated nodes, so
// that rank 1 is reached through the mpi transport and its progress thread.
class MeshmemVariant final : public Variant {
 public:
  MeshmemVariant(Ctx& ctx, bool remote)
      : Variant(ctx),
        remote_(remote),
        comm_(make_comm(remote)),
        win_(comm_.alloc(ctx.region_bytes, meshmem::Memory::Host)),
        sig_(comm_.alloc_signals(1, meshmem::Memory::Host)) {
    const int peer = 1 - comm_.rank();
    kind_ = comm_.transport(peer, meshmem::Memory::Host);
    const meshmem::TransportKind want = remote ? meshmem::TransportKind::Mpi : meshmem::TransportKind::Shm;
    if (kind_ != want)
      throw std::runtime_error(std::string(name()) + ": comm.transport(" + std::to_string(peer) +
                               ", Memory::Host) is " + meshmem::to_string(kind_) + ", expected " +
                               meshmem::to_string(want) + " (check MESHMEM_TRANSPORTS / MESHMEM_SIMULATE_NODES)");
    std::memset(win_.local(), 0, ctx.region_bytes);  // the owner's first touch, outside any timing
  }

  const char* name() const override { return remote_ ? "meshmem-remote" : "meshmem"; }
  std::string path() const override {
    std::string p = std::string("comm.transport(1, Memory::Host) == ") + meshmem::to_string(kind_) +
                    " (checked on both ranks); rank 0 on node " + std::to_string(comm_.node_of(0)) +
                    ", rank 1 on node " + std::to_string(comm_.node_of(1)) + " of " +
                    std::to_string(comm_.node_count());
    if (remote_) p += " (simulate_nodes = 2)";
    else p += ", fd passing " + std::string(meshmem::to_string(comm_.fd_passing()));
    return p;
  }
  std::string how(Bench b) const override {
    switch (b) {
      case Bench::Put: return "latency: put + quiet; bandwidth: W puts to W offsets + quiet";
      case Bench::Get: return "latency: 1 get (complete on return); bandwidth: W gets from W offsets";
      case Bench::PutSignal:
        return "ping-pong: put_signal(Set, i) -> wait_until(GE, i) -> put_signal back; one way = round trip / 2";
    }
    return "";
  }
  void sync() override { comm_.barrier(); }
  void finish() override {
    sig_.free();
    win_.free();
  }
  unsigned char* put_target() override { return static_cast<unsigned char*>(win_.local()); }

  void put_once(std::size_t size) override {
    if (comm_.rank() != 0) return;
    comm_.put(win_, 1, 0, ctx_.src.get(), size);
    comm_.quiet();
  }
  void put_window(std::size_t size, int window) override {
    if (comm_.rank() != 0) return;
    for (int i = 0; i < window; ++i) comm_.put(win_, 1, at(i, size), ctx_.src.get(), size);
    comm_.quiet();
  }
  void get_once(std::size_t size) override {
    if (comm_.rank() != 0) return;
    comm_.get(dst_.get(), win_, 1, 0, size);
  }
  void get_window(std::size_t size, int window) override {
    if (comm_.rank() != 0) return;
    for (int i = 0; i < window; ++i) comm_.get(dst_.get() + at(i, size), win_, 1, at(i, size), size);
  }
  void pingpong(std::size_t size) override {
    ++seq_;
    using meshmem::Cmp;
    using meshmem::SignalOp;
    if (comm_.rank() == 0) {
      comm_.put_signal(win_, 1, 0, ctx_.src.get(), size, sig_, 0, seq_, SignalOp::Set);
      comm_.wait_until(sig_, 0, Cmp::GE, seq_);
    } else {
      comm_.wait_until(sig_, 0, Cmp::GE, seq_);
      comm_.put_signal(win_, 0, 0, ctx_.src.get(), size, sig_, 0, seq_, SignalOp::Set);
    }
  }

 private:
  static meshmem::Comm make_comm(bool remote) {
    if (!remote) return meshmem::Comm(MPI_COMM_WORLD);  // default options (MESHMEM_* of the environment)
    // Built the same way on both ranks, so the Comm's option fingerprints agree.
    meshmem::Options options = meshmem::Options::from_environment();
    options.simulate_nodes = 2;
    return meshmem::Comm(MPI_COMM_WORLD, options);
  }

  bool remote_;
  meshmem::Comm comm_;       // declared before the windows: they are freed first
  meshmem::Window win_;
  meshmem::Signals sig_;
  meshmem::TransportKind kind_ = meshmem::TransportKind::None;
  std::uint64_t seq_ = 0;
};

// Two-sided MPI on a communicator of its own.
class MpiSendrecvVariant final : public Variant {
 public:
  explicit MpiSendrecvVariant(Ctx& ctx) : Variant(ctx), buf_(page_buffer(ctx.region_bytes)) {
    MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm_));
    MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    reqs_.assign(static_cast<std::size_t>(ctx.args.window), MPI_REQUEST_NULL);
  }
  ~MpiSendrecvVariant() override {
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }
  const char* name() const override { return "mpi-sendrecv"; }
  std::string path() const override { return "MPI_Send/MPI_Recv (Isend/Irecv for windows), MPI_COMM_WORLD dup"; }
  std::string how(Bench b) const override {
    switch (b) {
      case Bench::Put:
        return "latency: Send(size) + 0-byte ack back; bandwidth: W Isend / W Irecv + Waitall + ack (OSU bw)";
      case Bench::Get:
        return "latency: 0-byte request, Send(size) reply; bandwidth: 1 request, W Isend replies";
      case Bench::PutSignal: return "ping-pong: Send / Recv, one way = round trip / 2 (OSU latency)";
    }
    return "";
  }
  void sync() override { MPI_CHECK(MPI_Barrier(comm_)); }
  void finish() override { MPI_CHECK(MPI_Comm_free(&comm_)); }
  unsigned char* put_target() override { return buf_.get(); }

  void put_once(std::size_t size) override {
    const int n = static_cast<int>(size);
    if (ctx_.rank == 0) {
      MPI_CHECK(MPI_Send(ctx_.src.get(), n, MPI_BYTE, 1, kData, comm_));
      MPI_CHECK(MPI_Recv(nullptr, 0, MPI_BYTE, 1, kAck, comm_, MPI_STATUS_IGNORE));
    } else {
      MPI_CHECK(MPI_Recv(buf_.get(), n, MPI_BYTE, 0, kData, comm_, MPI_STATUS_IGNORE));
      MPI_CHECK(MPI_Send(nullptr, 0, MPI_BYTE, 0, kAck, comm_));
    }
  }
  void put_window(std::size_t size, int window) override {
    const int n = static_cast<int>(size);
    if (ctx_.rank == 0) {
      for (int i = 0; i < window; ++i)
        MPI_CHECK(MPI_Isend(ctx_.src.get(), n, MPI_BYTE, 1, kData, comm_, &reqs_[i]));
      MPI_CHECK(MPI_Waitall(window, reqs_.data(), MPI_STATUSES_IGNORE));
      MPI_CHECK(MPI_Recv(&ack_, 1, MPI_INT, 1, kAck, comm_, MPI_STATUS_IGNORE));
    } else {
      for (int i = 0; i < window; ++i)
        MPI_CHECK(MPI_Irecv(buf_.get() + at(i, size), n, MPI_BYTE, 0, kData, comm_, &reqs_[i]));
      MPI_CHECK(MPI_Waitall(window, reqs_.data(), MPI_STATUSES_IGNORE));
      MPI_CHECK(MPI_Send(&ack_, 1, MPI_INT, 0, kAck, comm_));
    }
  }
  void get_once(std::size_t size) override {
    const int n = static_cast<int>(size);
    if (ctx_.rank == 0) {
      MPI_Request r = MPI_REQUEST_NULL;
      MPI_CHECK(MPI_Irecv(dst_.get(), n, MPI_BYTE, 1, kReply, comm_, &r));
      MPI_CHECK(MPI_Send(nullptr, 0, MPI_BYTE, 1, kRequest, comm_));
      MPI_CHECK(MPI_Wait(&r, MPI_STATUS_IGNORE));
    } else {
      MPI_CHECK(MPI_Recv(nullptr, 0, MPI_BYTE, 0, kRequest, comm_, MPI_STATUS_IGNORE));
      MPI_CHECK(MPI_Send(buf_.get(), n, MPI_BYTE, 0, kReply, comm_));
    }
  }
  void get_window(std::size_t size, int window) override {
    const int n = static_cast<int>(size);
    if (ctx_.rank == 0) {
      for (int i = 0; i < window; ++i)
        MPI_CHECK(MPI_Irecv(dst_.get() + at(i, size), n, MPI_BYTE, 1, kReply, comm_, &reqs_[i]));
      MPI_CHECK(MPI_Send(nullptr, 0, MPI_BYTE, 1, kRequest, comm_));
      MPI_CHECK(MPI_Waitall(window, reqs_.data(), MPI_STATUSES_IGNORE));
    } else {
      MPI_CHECK(MPI_Recv(nullptr, 0, MPI_BYTE, 0, kRequest, comm_, MPI_STATUS_IGNORE));
      for (int i = 0; i < window; ++i)
        MPI_CHECK(MPI_Isend(buf_.get() + at(i, size), n, MPI_BYTE, 0, kReply, comm_, &reqs_[i]));
      MPI_CHECK(MPI_Waitall(window, reqs_.data(), MPI_STATUSES_IGNORE));
    }
  }
  void pingpong(std::size_t size) override {
    const int n = static_cast<int>(size);
    if (ctx_.rank == 0) {
      MPI_CHECK(MPI_Send(ctx_.src.get(), n, MPI_BYTE, 1, kData, comm_));
      MPI_CHECK(MPI_Recv(buf_.get(), n, MPI_BYTE, 1, kData, comm_, MPI_STATUS_IGNORE));
    } else {
      MPI_CHECK(MPI_Recv(buf_.get(), n, MPI_BYTE, 0, kData, comm_, MPI_STATUS_IGNORE));
      MPI_CHECK(MPI_Send(ctx_.src.get(), n, MPI_BYTE, 0, kData, comm_));
    }
  }

 private:
  static constexpr int kData = 1, kAck = 2, kRequest = 3, kReply = 4;
  Buffer buf_;  // region_bytes on both ranks: where puts and ping-pong data land / gets come from
  MPI_Comm comm_ = MPI_COMM_NULL;
  std::vector<MPI_Request> reqs_;
  int ack_ = 0;
};

// MPI-3 RMA: MPI_Win_allocate, one passive-target epoch (MPI_Win_lock_all) for the whole run.
class MpiPutVariant final : public Variant {
 public:
  explicit MpiPutVariant(Ctx& ctx) : Variant(ctx) {
    flag_disp_ = (ctx.region_bytes + 63) / 64 * 64;
    MPI_CHECK(MPI_Win_allocate(static_cast<MPI_Aint>(flag_disp_ + 64), 1, MPI_INFO_NULL, MPI_COMM_WORLD,
                               &base_, &win_));
    MPI_CHECK(MPI_Win_set_errhandler(win_, MPI_ERRORS_RETURN));
    std::memset(base_, 0, flag_disp_ + 64);
    osc_ = detect_osc();
    ctx.osc = osc_;
    MPI_CHECK(MPI_Win_lock_all(MPI_MODE_NOCHECK, win_));
  }
  ~MpiPutVariant() override {
    if (win_ == MPI_WIN_NULL) return;  // finish() ran
    MPI_Win_unlock_all(win_);
    MPI_Win_free(&win_);
  }
  const char* name() const override { return "mpi-put"; }
  std::string path() const override {
    return "MPI_Win_allocate + MPI_Win_lock_all; osc component: " + osc_ + ", memory model " + model_;
  }
  std::string how(Bench b) const override {
    switch (b) {
      case Bench::Put: return "latency: MPI_Put + MPI_Win_flush; bandwidth: W MPI_Puts to W offsets + MPI_Win_flush";
      case Bench::Get: return "latency: MPI_Get + MPI_Win_flush; bandwidth: W MPI_Gets from W offsets + MPI_Win_flush";
      case Bench::PutSignal:
        return "ping-pong: MPI_Put + flush, MPI_Accumulate(REPLACE) of a flag + flush; the target polls the "
               "flag with MPI_Fetch_and_op(NO_OP) on itself, then MPI_Win_sync; one way = round trip / 2";
    }
    return "";
  }
  void sync() override { MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD)); }
  void finish() override {
    MPI_CHECK(MPI_Win_unlock_all(win_));
    MPI_CHECK(MPI_Win_free(&win_));  // sets win_ to MPI_WIN_NULL
  }
  unsigned char* put_target() override { return static_cast<unsigned char*>(base_); }
  void wrote_locally() override { MPI_CHECK(MPI_Win_sync(win_)); }
  void will_read_locally() override { MPI_CHECK(MPI_Win_sync(win_)); }

  void put_once(std::size_t size) override {
    if (ctx_.rank != 0) return;
    const int n = static_cast<int>(size);
    MPI_CHECK(MPI_Put(ctx_.src.get(), n, MPI_BYTE, 1, 0, n, MPI_BYTE, win_));
    MPI_CHECK(MPI_Win_flush(1, win_));
  }
  void put_window(std::size_t size, int window) override {
    if (ctx_.rank != 0) return;
    const int n = static_cast<int>(size);
    for (int i = 0; i < window; ++i)
      MPI_CHECK(MPI_Put(ctx_.src.get(), n, MPI_BYTE, 1, static_cast<MPI_Aint>(at(i, size)), n, MPI_BYTE, win_));
    MPI_CHECK(MPI_Win_flush(1, win_));
  }
  void get_once(std::size_t size) override {
    if (ctx_.rank != 0) return;
    const int n = static_cast<int>(size);
    MPI_CHECK(MPI_Get(dst_.get(), n, MPI_BYTE, 1, 0, n, MPI_BYTE, win_));
    MPI_CHECK(MPI_Win_flush(1, win_));
  }
  void get_window(std::size_t size, int window) override {
    if (ctx_.rank != 0) return;
    const int n = static_cast<int>(size);
    for (int i = 0; i < window; ++i)
      MPI_CHECK(MPI_Get(dst_.get() + at(i, size), n, MPI_BYTE, 1, static_cast<MPI_Aint>(at(i, size)), n,
                        MPI_BYTE, win_));
    MPI_CHECK(MPI_Win_flush(1, win_));
  }
  void pingpong(std::size_t size) override {
    ++seq_;
    if (ctx_.rank == 0) {
      send(1, size);
      wait();
    } else {
      wait();
      send(0, size);
    }
  }

 private:
  // MPI orders neither two puts nor a put and an accumulate: the data is flushed before
  // the flag goes out. The flag is written with an accumulate, atomic per element.
  void send(int peer, std::size_t size) {
    const int n = static_cast<int>(size);
    MPI_CHECK(MPI_Put(ctx_.src.get(), n, MPI_BYTE, peer, 0, n, MPI_BYTE, win_));
    MPI_CHECK(MPI_Win_flush(peer, win_));
    flag_out_ = seq_;
    MPI_CHECK(MPI_Accumulate(&flag_out_, 1, MPI_UINT64_T, peer, static_cast<MPI_Aint>(flag_disp_), 1,
                             MPI_UINT64_T, MPI_REPLACE, win_));
    MPI_CHECK(MPI_Win_flush(peer, win_));
  }
  // Reading the flag with an accumulate-class call (atomic with respect to the writer's
  // accumulate), then MPI_Win_sync so that the data read afterwards is the public copy.
  void wait() {
    const auto start = Clock::now();
    std::uint64_t value = 0;
    const std::uint64_t none = 0;
    for (unsigned polls = 0;; ++polls) {
      MPI_CHECK(MPI_Fetch_and_op(&none, &value, MPI_UINT64_T, ctx_.rank, static_cast<MPI_Aint>(flag_disp_),
                                 MPI_NO_OP, win_));
      MPI_CHECK(MPI_Win_flush_local(ctx_.rank, win_));
      if (value >= seq_) break;
      if (polls % 4096 == 4095 && Clock::now() - start > std::chrono::seconds(60))
        throw std::runtime_error("mpi-put ping-pong: flag " + std::to_string(value) + " never reached " +
                                 std::to_string(seq_) + " in 60 s");
    }
    MPI_CHECK(MPI_Win_sync(win_));
  }

  // Open MPI 4.x names a window after its osc component ("rdma window 3", "pt2pt window 3");
  // osc sm leaves it unnamed.
  std::string detect_osc() {
    char name[MPI_MAX_OBJECT_NAME] = {};
    int len = 0;
    MPI_CHECK(MPI_Win_get_name(win_, name, &len));
    int* model = nullptr;
    int found = 0;
    MPI_CHECK(MPI_Win_get_attr(win_, MPI_WIN_MODEL, &model, &found));
    model_ = !found ? "unknown" : *model == MPI_WIN_UNIFIED ? "unified" : "separate";
    const std::string n(name, static_cast<std::size_t>(len));
    const std::size_t cut = n.find(" window");
    if (n.empty()) return "probably sm (the window is unnamed)";
    if (cut == std::string::npos) return "unknown (window name '" + n + "')";
    return n.substr(0, cut) + " (window name '" + n + "')";
  }

  void* base_ = nullptr;
  MPI_Win win_ = MPI_WIN_NULL;
  std::size_t flag_disp_ = 0;
  std::uint64_t seq_ = 0;
  std::uint64_t flag_out_ = 0;
  std::string osc_;
  std::string model_;
};

inline std::unique_ptr<Variant> make_variant(const std::string& name, Ctx& ctx) {
  if (name == "memcpy") return std::make_unique<MemcpyVariant>(ctx);
  if (name == "meshmem") return std::make_unique<MeshmemVariant>(ctx, false);
  if (name == "meshmem-remote") return std::make_unique<MeshmemVariant>(ctx, true);
  if (name == "mpi-sendrecv") return std::make_unique<MpiSendrecvVariant>(ctx);
  if (name == "mpi-put") return std::make_unique<MpiPutVariant>(ctx);
  throw std::invalid_argument("unknown variant " + name);
}

}  // namespace host_bench
