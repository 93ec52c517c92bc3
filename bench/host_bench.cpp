// host_bench: meshmem's host-memory windows between exactly 2 ranks, against MPI and memcpy.
//
// Benchmarks (rank 0 is the origin, rank 1 the target):
//   host_put         latency: one put + completion per iteration; bandwidth: a window of W puts
//                    to W different offsets, then completion, per iteration (OSU put_latency /
//                    put_bw style)
//   host_get         latency: one get per iteration; bandwidth: W gets from W offsets
//   host_put_signal  ping-pong of put + signal; latency is one way (round trip / 2)
// Variants (same run, same tables): memcpy, meshmem (shm), meshmem-remote (mpi transport through
// a simulated second node), mpi-sendrecv, mpi-put (MPI-3 RMA, passive target).
//
// After those, two measurements of a target that has been idle (issue 13, item 6):
//   host_get_idle    the latency of one 8-byte get to a target idle for 0, 10, 100, 1000 ms
//                    (--idle-ms): meshmem-remote (the target's progress thread serves it),
//                    meshmem-remote-waiting (the target's main thread waits in wait_until and
//                    serves it), mpi-sendrecv (request / reply; the target blocked in MPI_Recv)
//   host_idle_cpu    the CPU time a process uses while its main thread sleeps (getrusage)
//
// Rank 0 prints one OSU-style table per (benchmark, variant) and a summary with the target
// ratios; --csv FILE writes the rows in the bench/results schema. See bench/README.md.
#include <mpi.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <meshmem/meshmem.hpp>

#include "results_csv.hpp"

#ifndef MESHMEM_BENCH_BUILD_TYPE
#define MESHMEM_BENCH_BUILD_TYPE "unknown"
#endif

namespace {

using Clock = std::chrono::steady_clock;

// OSU's LARGE_MESSAGE_SIZE: above it the iteration and warm-up counts drop.
constexpr std::size_t kLargeMessage = 8192;

const char* const kBenchmarks[] = {"host_put", "host_get", "host_put_signal"};
const char* const kVariants[] = {"memcpy", "meshmem", "meshmem-remote", "mpi-sendrecv", "mpi-put"};
// Every name --benchmarks accepts: kBenchmarks, then the idle measurements (run after them).
const char* const kAllBenchmarks[] = {"host_put", "host_get", "host_put_signal", "host_get_idle", "host_idle_cpu"};

enum class Bench { Put, Get, PutSignal };

int g_rank = -1;

// ---- errors ----

std::string mpi_error_text(int rc) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(text, static_cast<std::size_t>(len));
}

void check_mpi(int rc, const char* call, int line) {
  if (rc != MPI_SUCCESS)
    throw std::runtime_error(std::string(call) + " failed (host_bench.cpp:" + std::to_string(line) +
                             "): " + mpi_error_text(rc));
}
#define MPI_CHECK(call) check_mpi((call), #call, __LINE__)

// A failure on one rank would leave the other waiting in a collective: abort the job.
[[noreturn]] void die(const std::string& message) {
  std::fflush(stdout);
  std::fprintf(stderr, "host_bench rank %d: %s\n", g_rank, message.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 2);
  std::abort();
}

// Keeps the compiler from merging or dropping copies whose result it cannot see used.
inline void clobber(const void* p) { __asm__ __volatile__("" : : "r"(p) : "memory"); }

// ---- options ----

struct Args {
  std::size_t min_size = 1;
  std::size_t max_size = std::size_t{4} << 20;
  int iters = 10000;       // timed iterations, sizes <= 8 KiB
  int iters_large = 1000;  // timed iterations, sizes > 8 KiB
  int warmup = 200;
  int warmup_large = 20;
  int min_iters = 5;
  int reps = 3;  // the timed iterations run as this many loops; the fastest one counts
  // Each measurement is capped at about this long; the iteration count comes from the
  // warm-up's time per iteration (rank 0 decides and broadcasts it).
  double seconds_per_size = 0.15;
  int window = 64;                              // puts / gets / sends per bandwidth iteration
  std::size_t window_bytes = std::size_t{64} << 20;  // cap on window * size (fewer above it)
  std::string csv;
  std::string commit = "unknown";
  std::string machine = "unknown";
  std::set<std::string> benchmarks;  // empty: all
  std::set<std::string> variants;    // empty: all
  // host_get_idle / host_idle_cpu
  std::vector<int> idle_ms = {0, 10, 100, 1000};
  int idle_samples = 9;
  double idle_cpu_seconds = 3;
};

const char* const kUsage =
    "usage: mpirun -np 2 host_bench [options]\n"
    "  --min-size N          smallest message (default 1); sizes are powers of two\n"
    "  --max-size N          largest message (default 4M); N may end in K, M or G (binary)\n"
    "  --iters N             timed iterations for sizes <= 8 KiB (default 10000)\n"
    "  --iters-large N       timed iterations for sizes > 8 KiB (default 1000)\n"
    "  --warmup N            warm-up iterations for sizes <= 8 KiB (default 200)\n"
    "  --warmup-large N      warm-up iterations for sizes > 8 KiB (default 20)\n"
    "  --min-iters N         at least this many timed iterations per loop (default 5)\n"
    "  --reps N              split the timed iterations into N loops, report the fastest\n"
    "                        loop's mean (default 3; 1: one loop, the plain OSU mean)\n"
    "  --time-per-size S     cap each measurement at about S seconds (default 0.15; 0: no cap)\n"
    "  --window N            operations per bandwidth iteration (default 64)\n"
    "  --window-bytes N      cap on window * size; fewer operations above it (default 64M)\n"
    "  --benchmarks A,B      subset of host_put,host_get,host_put_signal,host_get_idle,host_idle_cpu\n"
    "  --idle-ms A,B         host_get_idle: idle times in ms before the get (default 0,10,100,1000)\n"
    "  --idle-samples N      host_get_idle: gets per idle time and variant (default 9)\n"
    "  --idle-cpu-seconds S  host_idle_cpu: seconds measured per variant (default 3)\n"
    "  --variants A,B        subset of memcpy,meshmem,meshmem-remote,mpi-sendrecv,mpi-put\n"
    "  --csv FILE            also write the rows as CSV (overwrites FILE)\n"
    "  --commit ID           recorded in the header and the CSV (default unknown)\n"
    "  --machine NAME        recorded in the header and the CSV (default unknown)\n";

std::size_t parse_size(const std::string& text) {
  std::size_t pos = 0;
  unsigned long long v = 0;
  try {
    v = std::stoull(text, &pos, 10);
  } catch (const std::exception&) {
    throw std::invalid_argument("not a size: '" + text + "'");
  }
  std::string suffix = text.substr(pos);
  std::size_t shift = 0;
  if (suffix == "" || suffix == "B") shift = 0;
  else if (suffix == "K" || suffix == "KiB" || suffix == "k") shift = 10;
  else if (suffix == "M" || suffix == "MiB") shift = 20;
  else if (suffix == "G" || suffix == "GiB") shift = 30;
  else throw std::invalid_argument("not a size: '" + text + "' (suffixes: K, M, G)");
  if (v > (~0ull >> shift)) throw std::invalid_argument("size too large: '" + text + "'");
  return static_cast<std::size_t>(v << shift);
}

int parse_int(const std::string& text, int lo) {
  std::size_t pos = 0;
  long v = 0;
  try {
    v = std::stol(text, &pos, 10);
  } catch (const std::exception&) {
    throw std::invalid_argument("not a number: '" + text + "'");
  }
  if (pos != text.size() || v < lo || v > 1000000000L)
    throw std::invalid_argument("bad count: '" + text + "' (at least " + std::to_string(lo) + ")");
  return static_cast<int>(v);
}

std::set<std::string> parse_list(const std::string& text, const char* const* known, std::size_t n) {
  std::set<std::string> out;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t comma = text.find(',', start);
    const std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!item.empty()) {
      if (std::find(known, known + n, item) == known + n) {
        std::string names;
        for (std::size_t i = 0; i < n; ++i) names += std::string(i ? ", " : "") + known[i];
        throw std::invalid_argument("unknown name '" + item + "' (known: " + names + ")");
      }
      out.insert(item);
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

bool is_power_of_two(std::size_t v) { return v != 0 && (v & (v - 1)) == 0; }

// Throws std::invalid_argument; returns false for --help.
bool parse_args(int argc, char** argv, Args& a) {
  for (int i = 1; i < argc; ++i) {
    std::string opt = argv[i];
    std::string value;
    if (opt == "-h" || opt == "--help") return false;
    const std::size_t eq = opt.find('=');
    if (eq != std::string::npos) {
      value = opt.substr(eq + 1);
      opt = opt.substr(0, eq);
    } else {
      if (i + 1 >= argc) throw std::invalid_argument(opt + " needs a value");
      value = argv[++i];
    }
    if (opt == "--min-size") a.min_size = parse_size(value);
    else if (opt == "--max-size") a.max_size = parse_size(value);
    else if (opt == "--iters") a.iters = parse_int(value, 1);
    else if (opt == "--iters-large") a.iters_large = parse_int(value, 1);
    else if (opt == "--warmup") a.warmup = parse_int(value, 0);
    else if (opt == "--warmup-large") a.warmup_large = parse_int(value, 0);
    else if (opt == "--min-iters") a.min_iters = parse_int(value, 1);
    else if (opt == "--reps") a.reps = parse_int(value, 1);
    else if (opt == "--time-per-size") {
      try {
        a.seconds_per_size = std::stod(value);
      } catch (const std::exception&) {
        throw std::invalid_argument("not a number of seconds: '" + value + "'");
      }
      if (!(a.seconds_per_size >= 0)) throw std::invalid_argument("--time-per-size must be >= 0");
    } else if (opt == "--window") a.window = parse_int(value, 1);
    else if (opt == "--window-bytes") a.window_bytes = parse_size(value);
    else if (opt == "--benchmarks") a.benchmarks = parse_list(value, kAllBenchmarks, 5);
    else if (opt == "--idle-ms") {
      a.idle_ms.clear();
      std::size_t start = 0;
      while (start <= value.size()) {
        const std::size_t comma = value.find(',', start);
        const std::size_t len = comma == std::string::npos ? std::string::npos : comma - start;
        a.idle_ms.push_back(parse_int(value.substr(start, len), 0));
        if (comma == std::string::npos) break;
        start = comma + 1;
      }
    } else if (opt == "--idle-samples") a.idle_samples = parse_int(value, 1);
    else if (opt == "--idle-cpu-seconds") {
      try {
        a.idle_cpu_seconds = std::stod(value);
      } catch (const std::exception&) {
        throw std::invalid_argument("not a number of seconds: '" + value + "'");
      }
      if (!(a.idle_cpu_seconds > 0)) throw std::invalid_argument("--idle-cpu-seconds must be > 0");
    }
    else if (opt == "--variants") a.variants = parse_list(value, kVariants, 5);
    else if (opt == "--csv") a.csv = value;
    else if (opt == "--commit") a.commit = value;
    else if (opt == "--machine") a.machine = value;
    else throw std::invalid_argument("unknown option " + opt);
  }
  if (!is_power_of_two(a.min_size) || !is_power_of_two(a.max_size) || a.min_size > a.max_size)
    throw std::invalid_argument("--min-size and --max-size must be powers of two, min <= max");
  if (a.max_size > (std::size_t{1} << 30)) throw std::invalid_argument("--max-size is at most 1G");
  return true;
}

// ---- buffers and data checks ----

struct FreeDeleter {
  void operator()(unsigned char* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<unsigned char, FreeDeleter>;

// Page-aligned like a window mapping (malloc's large blocks start 16 bytes into a page,
// which changes memcpy's speed), and touched so that no measurement pays the first fault.
Buffer page_buffer(std::size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 4096, std::max<std::size_t>(bytes, 1)) != 0)
    throw std::runtime_error("posix_memalign of " + std::to_string(bytes) + " bytes failed");
  std::memset(p, 0, bytes);
  return Buffer(static_cast<unsigned char*>(p));
}

void fill_pattern(unsigned char* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t k = 0; k < n; ++k)
    p[k] = static_cast<unsigned char>((seed >> (k % 4 * 8)) + k * 131u + (k >> 10) + 1u);
}

// Every variant moves the same bytes at a size; the memory they land in is cleared before.
std::uint32_t seed_for(Bench b, std::size_t size) {
  return static_cast<std::uint32_t>(size * 2654435761u) ^ (static_cast<std::uint32_t>(b) << 24) ^ 0x5a5au;
}

// Index of the first of `count` consecutive `size`-byte regions that differs from ref, or -1.
long first_bad_region(const unsigned char* base, int count, std::size_t size, const unsigned char* ref) {
  for (int i = 0; i < count; ++i)
    if (std::memcmp(base + static_cast<std::size_t>(i) * size, ref, size) != 0) return i;
  return -1;
}

// ---- run context and results ----

struct Ctx {
  Args args;
  int rank = 0;
  int provided = 0;
  std::size_t region_bytes = 0;  // max over sizes of window_for(size) * size
  Buffer src;                    // max_size: what every put / send sends (both ranks)
  Buffer ref;                    // max_size: the expected pattern, for checks
  std::string osc;               // the osc component of the mpi-put window, once known

  int window_for(std::size_t size) const {
    const std::size_t cap = std::max<std::size_t>(1, args.window_bytes / size);
    return static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(args.window), cap));
  }
  std::vector<std::size_t> sizes() const {
    std::vector<std::size_t> out;
    for (std::size_t s = args.min_size; s <= args.max_size; s *= 2) out.push_back(s);
    return out;
  }
};

struct Row {
  int benchmark;  // index into kBenchmarks
  int variant;    // index into kVariants
  std::size_t size;
  double latency_us;
  double bandwidth_mbps;  // 1e6 bytes per second
  bool ok;                // the data check passed; rows that failed it are not recorded
};

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

std::unique_ptr<Variant> make_variant(const std::string& name, Ctx& ctx) {
  if (name == "memcpy") return std::make_unique<MemcpyVariant>(ctx);
  if (name == "meshmem") return std::make_unique<MeshmemVariant>(ctx, false);
  if (name == "meshmem-remote") return std::make_unique<MeshmemVariant>(ctx, true);
  if (name == "mpi-sendrecv") return std::make_unique<MpiSendrecvVariant>(ctx);
  if (name == "mpi-put") return std::make_unique<MpiPutVariant>(ctx);
  throw std::invalid_argument("unknown variant " + name);
}

// ---- timing ----

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int clamp_count(double x, int lo, int hi) {
  lo = std::min(lo, hi);
  if (!(x >= lo)) return lo;  // also NaN
  if (x >= hi) return hi;
  return static_cast<int>(x);
}

int bcast_from_0(int value) {
  MPI_CHECK(MPI_Bcast(&value, 1, MPI_INT, 0, MPI_COMM_WORLD));
  return value;
}

// One timed quantity (a latency or a bandwidth loop) of one variant at one size. The loop
// body is a lambda inlined into run(), so a virtual call is paid per loop, not per iteration.
struct Item {
  explicit Item(Variant& variant) : v(variant) {}
  virtual ~Item() = default;
  virtual void run(int n) = 0;
  Variant& v;
  int warm = 0;      // warm-up iterations
  int loop = 0;      // iterations per timed loop
  double best = 0;   // fastest loop's seconds per iteration (rank 0)
};

template <class F>
struct LoopItem final : Item {
  LoopItem(Variant& variant, F body) : Item(variant), f(std::move(body)) {}
  void run(int n) override {
    for (int i = 0; i < n; ++i) f();
  }
  F f;
};

template <class F>
std::unique_ptr<Item> make_item(Variant& v, F body) {
  return std::make_unique<LoopItem<F>>(v, std::move(body));
}

// First iteration (page faults, lazy connections), then a warm-up sized to take about a
// quarter of the time budget, then the count of timed iterations, capped by the budget and
// split into `reps` loops. Rank 0 decides the counts and broadcasts them, so both ranks run
// the same number; the variant's barrier comes before every broadcast, so a rank never
// busy-polls MPI while the other one is working.
void prepare(Ctx& ctx, Item& item, std::size_t size) {
  const Args& a = ctx.args;
  const bool large = size > kLargeMessage;
  const int max_iters = large ? a.iters_large : a.iters;
  const int max_warmup = large ? a.warmup_large : a.warmup;
  const double budget = a.seconds_per_size > 0 ? a.seconds_per_size : 1e30;
  Variant& v = item.v;

  v.sync();
  auto t0 = Clock::now();
  item.run(1);
  const double first = seconds_since(t0);
  v.sync();
  item.warm = bcast_from_0(clamp_count(0.25 * budget / first, 0, std::max(0, max_warmup - 1)));
  t0 = Clock::now();
  item.run(item.warm);
  const double warm_time = seconds_since(t0);
  v.sync();
  const double per = item.warm > 0 ? warm_time / item.warm : first;
  const int iters = bcast_from_0(clamp_count(budget / per, a.min_iters, max_iters));
  item.loop = std::max(std::min(a.min_iters, iters), iters / a.reps);
}

// One timed loop, after a short re-warm (another variant's loop may have run in between),
// each behind a barrier; timed with steady_clock on rank 0. Keeps the fastest loop's mean,
// as STREAM reports its best run: a loop that a neighbour on the host disturbed, or that ran
// while the VM's vCPUs sat further apart, does not count.
void timed_loop(Item& item, bool first) {
  Variant& v = item.v;
  v.sync();
  item.run(std::min(item.warm, std::max(1, item.loop / 8)));
  v.sync();
  const auto t0 = Clock::now();
  item.run(item.loop);
  const double mean = seconds_since(t0) / item.loop;
  v.sync();
  if (first || mean < item.best) item.best = mean;
}

// ---- the benchmarks ----

class Runner {
 public:
  explicit Runner(Ctx& ctx) : ctx_(ctx) {}

  static bool selected(const std::set<std::string>& set, const std::string& name) {
    return set.empty() || set.count(name) != 0;
  }

  // Runs every selected benchmark over `variants`, which are all alive. At each size the
  // variants' timed loops take turns (rep 1 of every variant, then rep 2, ...), so that
  // rows compared in the summary are measured within a fraction of a second of each other:
  // on a VM, memory bandwidth and the distance between the two vCPUs drift over seconds.
  void run(const std::vector<Variant*>& variants) {
    for (int b = 0; b < 3; ++b) {
      const Bench bench = static_cast<Bench>(b);
      if (!selected(ctx_.args.benchmarks, kBenchmarks[b])) continue;
      std::vector<Variant*> vs;
      for (Variant* v : variants)
        if (v->supports(bench)) vs.push_back(v);
      if (vs.empty()) continue;
      const std::size_t first_row = rows_.size();
      for (std::size_t size : ctx_.sizes()) run_size(vs, bench, size);
      if (ctx_.rank == 0)
        for (Variant* v : vs) print_table(*v, bench, first_row);
    }
  }

  std::vector<Row> rows() const {
    std::vector<Row> sorted = rows_;
    std::stable_sort(sorted.begin(), sorted.end(), [](const Row& x, const Row& y) {
      if (x.benchmark != y.benchmark) return x.benchmark < y.benchmark;
      if (x.variant != y.variant) return x.variant < y.variant;
      return x.size < y.size;
    });
    return sorted;
  }
  int failures() const { return failures_; }

 private:
  void run_size(const std::vector<Variant*>& vs, Bench bench, std::size_t size) {
    const int me = ctx_.rank;
    unsigned char* ref = ctx_.ref.get();
    fill_pattern(ctx_.src.get(), size, seed_for(bench, size));
    fill_pattern(ref, size, seed_for(bench, size));
    const int w = ctx_.window_for(size);
    const std::size_t span = static_cast<std::size_t>(w) * size;

    // The memory each variant writes is cleared first, so only this size's data can pass.
    std::vector<std::unique_ptr<Item>> lat, bw;  // bw stays empty for put_signal
    for (Variant* pv : vs) {
      Variant& v = *pv;
      switch (bench) {
        case Bench::Put:
          if (me == v.owner()) {
            std::memset(v.put_target(), 0, span);
            v.wrote_locally();
          }
          lat.push_back(make_item(v, [&v, size] { v.put_once(size); }));
          bw.push_back(make_item(v, [&v, size, w] { v.put_window(size, w); }));
          break;
        case Bench::Get:
          if (me == v.owner()) {
            for (int i = 0; i < w; ++i) std::memcpy(v.get_source() + static_cast<std::size_t>(i) * size, ref, size);
            v.wrote_locally();
          }
          if (me == 0) std::memset(v.get_dst(), 0, span);
          lat.push_back(make_item(v, [&v, size] { v.get_once(size); }));
          bw.push_back(make_item(v, [&v, size, w] { v.get_window(size, w); }));
          break;
        case Bench::PutSignal:
          std::memset(v.pingpong_target(), 0, size);
          v.wrote_locally();
          lat.push_back(make_item(v, [&v, size] { v.pingpong(size); }));
          break;
      }
    }
    std::vector<Item*> items;
    for (auto& i : lat) items.push_back(i.get());
    for (auto& i : bw) items.push_back(i.get());
    for (Item* item : items) prepare(ctx_, *item, size);
    for (int r = 0; r < ctx_.args.reps; ++r)
      for (Item* item : items) timed_loop(*item, r == 0);

    for (std::size_t k = 0; k < vs.size(); ++k) {
      Variant& v = *vs[k];
      long bad = -1;  // first region that failed the check, on the rank that checked
      const char* where = "";
      double latency = lat[k]->best;  // seconds
      double bandwidth = 0;           // bytes per second
      switch (bench) {
        case Bench::Put:
          bandwidth = static_cast<double>(span) / bw[k]->best;
          if (me == v.owner()) {
            v.will_read_locally();
            bad = first_bad_region(v.put_target(), w, size, ref);
            where = "put target region";
          }
          break;
        case Bench::Get:
          bandwidth = static_cast<double>(span) / bw[k]->best;
          if (me == 0) {
            bad = first_bad_region(v.get_dst(), w, size, ref);
            where = "get destination region";
          }
          break;
        case Bench::PutSignal:
          latency /= 2;  // one way = round trip / 2
          bandwidth = static_cast<double>(size) / latency;
          v.will_read_locally();
          bad = first_bad_region(v.pingpong_target(), 1, size, ref);
          where = "ping-pong target";
          break;
      }
      // Every rank learns whether the data arrived, so both count the failure.
      const int ok = bad < 0 ? 1 : 0;
      if (!ok)
        std::fprintf(stderr, "host_bench rank %d: %s / %s, size %zu: DATA CHECK FAILED (%s %ld differs)\n", me,
                     kBenchmarks[static_cast<int>(bench)], v.name(), size, where, bad);
      int all_ok = 0;
      MPI_CHECK(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
      if (me != 0) continue;
      if (!all_ok) ++failures_;
      rows_.push_back(Row{static_cast<int>(bench), v.index(), size, latency * 1e6, bandwidth / 1e6, all_ok != 0});
    }
  }

  void print_table(Variant& v, Bench bench, std::size_t first_row) const {
    const int b = static_cast<int>(bench);
    std::printf("\n# %s / %s: %s\n", kBenchmarks[b], v.name(), v.path().c_str());
    std::printf("#   %s\n", v.how(bench).c_str());
    if (bench != Bench::PutSignal)
      std::printf("#   W = %d operations per bandwidth iteration (fewer where W * size > %zu bytes)\n",
                  ctx_.args.window, ctx_.args.window_bytes);
    std::printf("# %-10s %18s %20s\n", "size", "latency(us)", "bandwidth(MB/s)");
    for (std::size_t i = first_row; i < rows_.size(); ++i) {
      const Row& r = rows_[i];
      if (r.benchmark != b || r.variant != v.index()) continue;
      if (r.ok)
        std::printf("%-12zu %18.3f %20.2f\n", r.size, r.latency_us, r.bandwidth_mbps);
      else
        std::printf("%-12zu %18s %20s   # data check failed: not recorded\n", r.size, "-", "-");
    }
    std::fflush(stdout);
  }

  Ctx& ctx_;
  std::vector<Row> rows_;  // in the order measured
  int failures_ = 0;
};

// ---- how busy the machine was ----

int cpus_usable() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  return CPU_COUNT(&set);
}


// All CPUs' time from /proc/stat, in seconds: busy (everything but idle and iowait) and
// stolen by the hypervisor. Zero where /proc/stat cannot be read.
struct CpuTimes {
  double busy = 0;
  double steal = 0;
  bool valid = false;
};

CpuTimes machine_cpu_times() {
  CpuTimes t;
  std::FILE* f = std::fopen("/proc/stat", "r");
  if (f == nullptr) return t;
  unsigned long long v[10] = {};
  const int n = std::fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3],
                            &v[4], &v[5], &v[6], &v[7], &v[8], &v[9]);
  std::fclose(f);
  if (n < 8) return t;
  const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
  // user nice system idle iowait irq softirq steal (guest time is counted in user already)
  t.busy = static_cast<double>(v[0] + v[1] + v[2] + v[5] + v[6]) / tick;
  t.steal = static_cast<double>(v[7]) / tick;
  t.valid = true;
  return t;
}

// CPU seconds of this process, all threads.
double own_cpu_seconds() {
  rusage u{};
  if (getrusage(RUSAGE_SELF, &u) != 0) return 0;
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

struct Busyness {
  CpuTimes machine;
  double own = 0;
  Clock::time_point wall = Clock::now();
  static Busyness now() { return Busyness{machine_cpu_times(), own_cpu_seconds(), Clock::now()}; }
};

// Both ranks call it. Other processes competing for the CPUs make busy-polling loops wait
// whole scheduler time slices (milliseconds): the run is only as good as the machine was quiet.
void report_busyness(const Busyness& start, int rank) {
  const Busyness end = Busyness::now();
  const double mine = end.own - start.own;
  double ours = 0;
  MPI_CHECK(MPI_Reduce(&mine, &ours, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD));
  if (rank != 0 || !start.machine.valid || !end.machine.valid) return;
  const double wall = std::chrono::duration<double>(end.wall - start.wall).count();
  const double capacity = wall * cpus_usable();
  const double others = std::max(0.0, end.machine.busy - start.machine.busy - ours);
  const double steal = end.machine.steal - start.machine.steal;
  std::printf("\nmachine during the run: %.1f s wall on %d CPUs; host_bench used %.1f CPU s, other processes "
              "%.1f CPU s (%.0f%% of the machine), hypervisor steal %.1f s\n",
              wall, cpus_usable(), ours, others, 100.0 * others / capacity, steal);
  if (wall < 2)
    std::printf("(too short a run for /proc/stat's 10 ms ticks to say whether the machine was quiet)\n");
  else if (others > 0.05 * capacity || steal > 0.05 * capacity)
    std::printf("WARNING: the machine was not quiet (other processes or steal above 5%%): the timings, "
                "latencies above all, are disturbed; run again on an idle machine\n");
}

// ---- after idle: the first request to a target that has been idle (issue 13, item 6) ----
//
// A busy-polling loop answers at once; one that sleeps between polls answers a request that
// comes while it sleeps when it wakes. These rows measure that: the latency of one small get
// after the target was idle for a while, and what the idleness costs in CPU time.

constexpr std::size_t kIdleGetBytes = 8;

struct IdleRow {
  std::string variant;
  int idle_ms = 0;
  int samples = 0;
  double median_us = 0, min_us = 0, max_us = 0;
};

struct CpuRow {
  std::string variant;
  double percent[2] = {0, 0};  // of one core, per rank (process)
  std::string what;
};

void sleep_seconds(double s) {
  if (s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(s));
}

// One idle spell per sample, on both ranks; rank 0 keeps the timings. Every variant's
// samples are interleaved (sample 1 of each, then sample 2, ...), so they see the same machine.
class IdleRunner {
 public:
  explicit IdleRunner(Ctx& ctx) : ctx_(ctx), dst_(page_buffer(kIdleGetBytes)) {
    MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &ctl_));
    MPI_CHECK(MPI_Comm_set_errhandler(ctl_, MPI_ERRORS_RETURN));
    fill_pattern(ctx_.ref.get(), kIdleGetBytes, 0x1d1eu);
  }
  ~IdleRunner() {
    if (ctl_ != MPI_COMM_NULL) MPI_Comm_free(&ctl_);
  }
  IdleRunner(const IdleRunner&) = delete;
  IdleRunner& operator=(const IdleRunner&) = delete;

  void run() {
    const bool want_get = Runner::selected(ctx_.args.benchmarks, "host_get_idle");
    const bool want_cpu = Runner::selected(ctx_.args.benchmarks, "host_idle_cpu");
    const bool remote = Runner::selected(ctx_.args.variants, "meshmem-remote");
    const bool mpi = Runner::selected(ctx_.args.variants, "mpi-sendrecv");
    if (!want_get && !want_cpu) return;
    if (remote) {
      // Built the same way on both ranks, so the Comm's option fingerprints agree.
      meshmem::Options options = meshmem::Options::from_environment();
      options.simulate_nodes = 2;
      meshmem::Comm comm(MPI_COMM_WORLD, options);
      meshmem::Window win = comm.alloc(4096, meshmem::Memory::Host);
      meshmem::Signals sig = comm.alloc_signals(1, meshmem::Memory::Host);
      const int peer = 1 - comm.rank();
      const meshmem::TransportKind kind = comm.transport(peer, meshmem::Memory::Host);
      if (kind != meshmem::TransportKind::Mpi)
        throw std::runtime_error(std::string("host_get_idle: comm.transport(") + std::to_string(peer) +
                                 ", Memory::Host) is " + meshmem::to_string(kind) +
                                 ", expected mpi (check MESHMEM_TRANSPORTS)");
      std::memset(win.local(), 0, 4096);
      if (ctx_.rank == 1) std::memcpy(win.local(), ctx_.ref.get(), kIdleGetBytes);
      comm.barrier();
      if (want_get) get_rows(&comm, &win, &sig, mpi);
      if (want_cpu) cpu_row("meshmem-remote", "a Comm whose peer is on another (simulated) node: mpi transport, "
                                              "progress thread polling",
                            [&] { sleep_seconds(ctx_.args.idle_cpu_seconds); });
      sig.free();
      win.free();
    } else if (want_get && mpi) {
      get_rows(nullptr, nullptr, nullptr, true);
    }
    if (!want_cpu) return;
    if (mpi) {
      // A plain MPI target waits for a request inside MPI_Recv; rank 0 only sleeps (MPI
      // initialised, no call: the floor of an MPI process), then sends the message.
      cpu_row("mpi-sendrecv", "rank 0 sleeps (MPI initialised, no call); rank 1 is blocked in MPI_Recv", [&] {
        char byte = 0;
        if (ctx_.rank == 0) {
          sleep_seconds(ctx_.args.idle_cpu_seconds);
          MPI_CHECK(MPI_Send(&byte, 1, MPI_BYTE, 1, kRequest, ctl_));
        } else {
          MPI_CHECK(MPI_Recv(&byte, 1, MPI_BYTE, 0, kRequest, ctl_, MPI_STATUS_IGNORE));
        }
      });
    }
    if (Runner::selected(ctx_.args.variants, "meshmem")) {
      meshmem::Comm comm(MPI_COMM_WORLD);  // both ranks on one node: shm, no progress thread
      comm.barrier();
      cpu_row("meshmem", std::string("a Comm of one node (") +
                             meshmem::to_string(comm.transport(1 - comm.rank(), meshmem::Memory::Host)) +
                             " transport, no progress thread)",
              [&] { sleep_seconds(ctx_.args.idle_cpu_seconds); });
    }
  }

  void print() const {
    if (ctx_.rank != 0) return;
    std::vector<std::string> variants;
    for (const IdleRow& r : get_)
      if (std::find(variants.begin(), variants.end(), r.variant) == variants.end()) variants.push_back(r.variant);
    for (const std::string& v : variants) {
      std::printf("\n# host_get_idle / %s: %s\n", v.c_str(), describe(v));
      std::printf("#   a sample: both ranks meet (MPI_Barrier), rank 0 makes 1 untimed request, sleeps the idle "
                  "time, then times 1 get of %zu B; idle 0: gets back to back. latency = median of the samples\n",
                  kIdleGetBytes);
      std::printf("# %-10s %8s %14s %12s %12s %8s\n", "idle(ms)", "size", "latency(us)", "min(us)", "max(us)",
                  "samples");
      for (const IdleRow& r : get_)
        if (r.variant == v)
          std::printf("%-12d %8zu %14.3f %12.3f %12.3f %8d\n", r.idle_ms, kIdleGetBytes, r.median_us, r.min_us,
                      r.max_us, r.samples);
    }
    if (!cpu_.empty()) {
      std::printf("\n# host_idle_cpu: CPU time of each process (getrusage RUSAGE_SELF, every thread) over %.1f s in "
                  "which its main thread does what the last column says, after %.1f s to settle; %% of one core\n",
                  ctx_.args.idle_cpu_seconds, kSettle);
      std::printf("# %-22s %12s %12s   %s\n", "variant", "rank 0 (%)", "rank 1 (%)", "what");
      for (const CpuRow& r : cpu_)
        std::printf("%-24s %12.3f %12.3f   %s\n", r.variant.c_str(), r.percent[0], r.percent[1], r.what.c_str());
    }
    std::fflush(stdout);
  }

  // The bench/results rows: host_get_idle_<ms>ms (latency_us = the median), host_idle_cpu
  // (latency_us = CPU microseconds per second of idleness of rank 1, the target; mpi-sleep:
  // rank 0 of mpi-sendrecv, a process that only sleeps).
  std::vector<bench::ResultRow> csv_rows() const {
    std::vector<bench::ResultRow> out;
    for (const IdleRow& r : get_)
      out.push_back({"host_get_idle_" + std::to_string(r.idle_ms) + "ms", r.variant, 2,
                     static_cast<long long>(kIdleGetBytes), r.median_us, -1});
    for (const CpuRow& r : cpu_) {
      out.push_back({"host_idle_cpu", r.variant, 2, -1, r.percent[1] * 1e4, -1});
      if (r.variant == "mpi-sendrecv") out.push_back({"host_idle_cpu", "mpi-sleep", 2, -1, r.percent[0] * 1e4, -1});
    }
    return out;
  }

  // For the summary.
  const IdleRow* find(const std::string& variant, int idle_ms) const {
    for (const IdleRow& r : get_)
      if (r.variant == variant && r.idle_ms == idle_ms) return &r;
    return nullptr;
  }
  const CpuRow* find_cpu(const std::string& variant) const {
    for (const CpuRow& r : cpu_)
      if (r.variant == variant) return &r;
    return nullptr;
  }
  int failures() const { return failures_; }

 private:
  static constexpr int kRequest = 1, kReply = 2, kDone = 3;
  static constexpr double kSettle = 0.5;  // s: the progress thread's backoff reaches its longest sleep after 0.2 s
  static constexpr double kMargin = 0.02;  // s: rank 1 sleeps this much past the idle time (the get comes before)

  static const char* describe(const std::string& v) {
    if (v == "meshmem-remote")
      return "comm.get from rank 1 over the mpi transport (simulate_nodes = 2); rank 1's main thread sleeps "
             "through the idle time and the get, so rank 1's progress thread serves it";
    if (v == "meshmem-remote-waiting")
      return "the same get; rank 1's main thread waits in comm.wait_until (host) through the idle time and "
             "serves it itself; rank 0 then releases it with a put_signal";
    return "MPI request / reply on a MPI_COMM_WORLD dup (0-byte request, 8-byte reply); rank 1 waits for the "
           "request in MPI_Recv through the idle time";
  }

  // Rank 0: a get of kIdleGetBytes from rank 1, timed in microseconds; checks the bytes.
  double timed_get(meshmem::Comm& comm, meshmem::Window& win) {
    std::memset(dst_.get(), 0, kIdleGetBytes);
    const auto t0 = Clock::now();
    comm.get(dst_.get(), win, 1, 0, kIdleGetBytes);
    const double us = seconds_since(t0) * 1e6;
    if (std::memcmp(dst_.get(), ctx_.ref.get(), kIdleGetBytes) != 0) ++bad_;
    return us;
  }
  double timed_request(int n) {
    std::memset(dst_.get(), 0, kIdleGetBytes);
    const auto t0 = Clock::now();
    MPI_Request r = MPI_REQUEST_NULL;
    MPI_CHECK(MPI_Irecv(dst_.get(), n, MPI_BYTE, 1, kReply, ctl_, &r));
    MPI_CHECK(MPI_Send(nullptr, 0, MPI_BYTE, 1, kRequest, ctl_));
    MPI_CHECK(MPI_Wait(&r, MPI_STATUS_IGNORE));
    const double us = seconds_since(t0) * 1e6;
    if (std::memcmp(dst_.get(), ctx_.ref.get(), kIdleGetBytes) != 0) ++bad_;
    return us;
  }
  void answer_request(int n) {
    MPI_CHECK(MPI_Recv(nullptr, 0, MPI_BYTE, 0, kRequest, ctl_, MPI_STATUS_IGNORE));
    MPI_CHECK(MPI_Send(ctx_.ref.get(), n, MPI_BYTE, 0, kReply, ctl_));
  }
  // Rank 1, sleeping through a sample: first the idle time and a margin (no wake-up of its
  // own meanwhile), then a poll every millisecond for rank 0's "done".
  void sleep_until_done(int idle_ms) {
    sleep_seconds(idle_ms * 1e-3 + kMargin);
    for (;;) {
      int flag = 0;
      MPI_CHECK(MPI_Iprobe(0, kDone, ctl_, &flag, MPI_STATUS_IGNORE));
      if (flag) break;
      sleep_seconds(1e-3);
    }
    MPI_CHECK(MPI_Recv(nullptr, 0, MPI_BYTE, 0, kDone, ctl_, MPI_STATUS_IGNORE));
  }

  // One sample of `variant`: an untimed request, so that the target's idle time starts there,
  // then `idle_ms`, then the timed request (idle 0: `burst` of them back to back).
  std::vector<double> sample(const std::string& variant, int idle_ms, int burst, meshmem::Comm* comm,
                             meshmem::Window* win, meshmem::Signals* sig) {
    std::vector<double> us;
    const int n = idle_ms == 0 ? burst : 1;
    MPI_CHECK(MPI_Barrier(ctl_));
    if (variant == "mpi-sendrecv") {
      if (ctx_.rank == 0) {
        timed_request(static_cast<int>(kIdleGetBytes));
        sleep_seconds(idle_ms * 1e-3);
        for (int i = 0; i < n; ++i) us.push_back(timed_request(static_cast<int>(kIdleGetBytes)));
      } else {
        for (int i = 0; i < n + 1; ++i) answer_request(static_cast<int>(kIdleGetBytes));
      }
    } else if (variant == "meshmem-remote") {
      if (ctx_.rank == 0) {
        timed_get(*comm, *win);
        sleep_seconds(idle_ms * 1e-3);
        for (int i = 0; i < n; ++i) us.push_back(timed_get(*comm, *win));
        MPI_CHECK(MPI_Send(nullptr, 0, MPI_BYTE, 1, kDone, ctl_));
      } else {
        sleep_until_done(idle_ms);
      }
    } else {  // meshmem-remote-waiting
      ++seq_;
      if (ctx_.rank == 0) {
        timed_get(*comm, *win);
        sleep_seconds(idle_ms * 1e-3);
        for (int i = 0; i < n; ++i) us.push_back(timed_get(*comm, *win));
        comm->put_signal(*win, 1, 64, ctx_.ref.get(), kIdleGetBytes, *sig, 0, seq_, meshmem::SignalOp::Set);
        comm->quiet();
      } else {
        comm->wait_until(*sig, 0, meshmem::Cmp::GE, seq_);
      }
    }
    return us;
  }

  void get_rows(meshmem::Comm* comm, meshmem::Window* win, meshmem::Signals* sig, bool mpi) {
    std::vector<std::string> variants;
    if (comm != nullptr) variants = {"meshmem-remote", "meshmem-remote-waiting"};
    if (mpi) variants.push_back("mpi-sendrecv");
    const int samples = ctx_.args.idle_samples;
    const int burst = std::max(samples, 100);
    for (const std::string& v : variants) sample(v, 0, 20, comm, win, sig);  // first use, outside the rows
    for (int idle : ctx_.args.idle_ms) {
      std::vector<std::vector<double>> us(variants.size());
      for (int s = 0; s < (idle == 0 ? 1 : samples); ++s)
        for (std::size_t k = 0; k < variants.size(); ++k) {
          const auto got = sample(variants[k], idle, burst, comm, win, sig);
          us[k].insert(us[k].end(), got.begin(), got.end());
        }
      if (ctx_.rank != 0) continue;
      for (std::size_t k = 0; k < variants.size(); ++k) {
        std::vector<double>& u = us[k];
        std::sort(u.begin(), u.end());
        IdleRow row;
        row.variant = variants[k];
        row.idle_ms = idle;
        row.samples = static_cast<int>(u.size());
        row.median_us = u.size() % 2 ? u[u.size() / 2] : 0.5 * (u[u.size() / 2 - 1] + u[u.size() / 2]);
        row.min_us = u.front();
        row.max_us = u.back();
        get_.push_back(row);
      }
    }
    int bad = bad_, all_bad = 0;
    MPI_CHECK(MPI_Allreduce(&bad, &all_bad, 1, MPI_INT, MPI_SUM, ctl_));
    if (all_bad > 0) {
      if (ctx_.rank == 0)
        std::fprintf(stderr, "host_bench: host_get_idle: %d get(s) returned wrong bytes (DATA CHECK FAILED)\n",
                     all_bad);
      ++failures_;
    }
    bad_ = 0;
  }

  template <class Idle>
  void cpu_row(const char* variant, const std::string& what, Idle&& idle) {
    MPI_CHECK(MPI_Barrier(ctl_));
    sleep_seconds(kSettle);
    MPI_CHECK(MPI_Barrier(ctl_));
    const double cpu0 = own_cpu_seconds();
    const auto t0 = Clock::now();
    idle();
    const double percent = 100.0 * (own_cpu_seconds() - cpu0) / seconds_since(t0);
    double both[2] = {0, 0};
    MPI_CHECK(MPI_Gather(&percent, 1, MPI_DOUBLE, both, 1, MPI_DOUBLE, 0, ctl_));
    if (ctx_.rank == 0) cpu_.push_back(CpuRow{variant, {both[0], both[1]}, what});
  }

  Ctx& ctx_;
  Buffer dst_;
  MPI_Comm ctl_ = MPI_COMM_NULL;  // the MPI variant's messages, barriers and "done"
  std::uint64_t seq_ = 0;
  int bad_ = 0;
  int failures_ = 0;
  std::vector<IdleRow> get_;
  std::vector<CpuRow> cpu_;
};

void print_idle_summary(const IdleRunner& idle, const std::vector<int>& idle_ms) {
  bool header = false;
  for (int ms : idle_ms) {
    const IdleRow* a = idle.find("meshmem-remote", ms);
    const IdleRow* w = idle.find("meshmem-remote-waiting", ms);
    const IdleRow* b = idle.find("mpi-sendrecv", ms);
    if (a == nullptr && b == nullptr) continue;
    if (!header) std::printf("host_get_idle, 8 B get after the target was idle (median):\n");
    header = true;
    std::printf("    %5d ms:", ms);
    const char* sep = "";
    for (const IdleRow* r : {a, w, b}) {
      if (r == nullptr) continue;
      std::printf("%s %s %.1f us", sep, r->variant.c_str(), r->median_us);
      sep = ",";
    }
    std::printf("\n");
  }
  const CpuRow* c = idle.find_cpu("meshmem-remote");
  const CpuRow* m = idle.find_cpu("mpi-sendrecv");
  if (c != nullptr || m != nullptr) {
    std::printf("host_idle_cpu, %% of one core while idle (rank 1):");
    if (c) std::printf(" meshmem-remote %.2f %%%s", c->percent[1], m ? "," : "");
    if (m) std::printf(" mpi-sendrecv (blocked in MPI_Recv) %.1f %%, an MPI process that sleeps %.2f %%", m->percent[1],
                       m->percent[0]);
    std::printf("\n");
  }
}

// ---- output ----

bool write_csv(const Ctx& ctx, const std::string& date, const std::vector<Row>& rows,
               const std::vector<bench::ResultRow>& extra) {
  std::vector<bench::ResultRow> out;
  for (const Row& r : rows)
    if (r.ok)
      out.push_back({kBenchmarks[r.benchmark], kVariants[r.variant], 2, static_cast<long long>(r.size), r.latency_us,
                     r.bandwidth_mbps / 1000.0});
  out.insert(out.end(), extra.begin(), extra.end());
  return bench::write_results_csv(ctx.args.csv, bench::CsvMode::Truncate, date, ctx.args.commit, ctx.args.machine, out,
                                  "host_bench");
}

const Row* find_row(const std::vector<Row>& rows, const char* bench, const char* variant, std::size_t size) {
  for (const Row& r : rows)
    if (r.ok && kBenchmarks[r.benchmark] == std::string(bench) && kVariants[r.variant] == std::string(variant) &&
        r.size == size)
      return &r;
  return nullptr;
}

// One ratio line of the summary; `higher_is_better` decides how the target reads.
void print_ratio(const std::vector<Row>& rows, const char* label, const char* bench, std::size_t size,
                 const char* num, const char* den, bool bandwidth, const char* target, double limit,
                 bool at_least) {
  const Row* a = find_row(rows, bench, num, size);
  const Row* b = find_row(rows, bench, den, size);
  if (a == nullptr || b == nullptr) {
    std::printf("%s: n/a (%s or %s at %zu bytes not measured in this run)\n", label, num, den, size);
    return;
  }
  const double x = bandwidth ? a->bandwidth_mbps : a->latency_us;
  const double y = bandwidth ? b->bandwidth_mbps : b->latency_us;
  const double ratio = x / y;
  std::printf("%s: %.3f", label, ratio);
  if (target != nullptr) {
    const bool met = at_least ? ratio >= limit : ratio <= limit;
    std::printf("  (target %s: %s)", target, met ? "met" : "MISSED");
  }
  if (bandwidth)
    std::printf("\n    %s %.1f MB/s, %s %.1f MB/s\n", num, x, den, y);
  else
    std::printf("\n    %s %.3f us, %s %.3f us\n", num, x, den, y);
}

void print_summary(const std::vector<Row>& rows) {
  const std::size_t mib = std::size_t{1} << 20;
  std::printf("\nsummary (ratios of rows of this run):\n");
  print_ratio(rows, "(a) host_put 1 MiB bandwidth, meshmem / memcpy", "host_put", mib, "meshmem", "memcpy", true,
              ">= 0.9", 0.9, true);
  print_ratio(rows, "(b) host_put_signal 8 B one-way latency, meshmem / mpi-sendrecv", "host_put_signal", 8, "meshmem",
              "mpi-sendrecv", false, "<= 1.0", 1.0, false);
  std::printf("for reference:\n");
  print_ratio(rows, "    host_put 1 MiB bandwidth, meshmem-remote / mpi-sendrecv", "host_put", mib, "meshmem-remote",
              "mpi-sendrecv", true, nullptr, 0, true);
  print_ratio(rows, "    host_put_signal 8 B one-way latency, meshmem-remote / mpi-sendrecv", "host_put_signal", 8,
              "meshmem-remote", "mpi-sendrecv", false, nullptr, 0, false);
  print_ratio(rows, "    host_put 1 MiB bandwidth, meshmem / mpi-put", "host_put", mib, "meshmem", "mpi-put", true,
              nullptr, 0, true);
  print_ratio(rows, "    host_put_signal 8 B one-way latency, meshmem / mpi-put", "host_put_signal", 8, "meshmem",
              "mpi-put", false, nullptr, 0, false);
}

void print_header(const Ctx& ctx, const std::string& date) {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "unknown");
  char lib[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  std::string mpi = "MPI library unknown";
  if (MPI_Get_library_version(lib, &len) == MPI_SUCCESS) mpi.assign(lib, static_cast<std::size_t>(len));
  mpi = mpi.substr(0, mpi.find_first_of(",\n"));
  const Args& a = ctx.args;
  std::printf("# meshmem host_bench: machine %s, host %s, nproc %d, date %s, commit %s\n", a.machine.c_str(), host,
              cpus_usable(), date.c_str(), a.commit.c_str());
  std::printf("# 2 ranks, %s, thread level %s, build %s\n", mpi.c_str(),
              ctx.provided >= MPI_THREAD_MULTIPLE ? "MPI_THREAD_MULTIPLE" : "below MPI_THREAD_MULTIPLE",
              MESHMEM_BENCH_BUILD_TYPE);
  std::printf("# sizes %zu..%zu B; timed iterations <= %d (<= %d above %zu B) in %d loop(s), the fastest "
              "loop's mean reported; warm-up <= %d (%d); each measurement capped near %.2f s\n",
              a.min_size, a.max_size, a.iters, a.iters_large, kLargeMessage, a.reps, a.warmup, a.warmup_large,
              a.seconds_per_size);
  std::printf("# latency in microseconds; bandwidth in MB/s (1e6 bytes/s; the CSV has GB/s = 1e9 bytes/s)\n");
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) {
    std::fprintf(stderr, "host_bench: MPI_Init_thread failed\n");
    return 2;
  }
  // Until the error handler is set, MPI errors abort the job (MPI_ERRORS_ARE_FATAL).
  int nranks = 0;
  if (MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN) != MPI_SUCCESS ||
      MPI_Comm_rank(MPI_COMM_WORLD, &g_rank) != MPI_SUCCESS || MPI_Comm_size(MPI_COMM_WORLD, &nranks) != MPI_SUCCESS) {
    std::fprintf(stderr, "host_bench: MPI_Comm_rank / MPI_Comm_size failed\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }

  Ctx ctx;
  ctx.rank = g_rank;
  ctx.provided = provided;
  try {
    if (!parse_args(argc, argv, ctx.args)) {
      if (g_rank == 0) std::fputs(kUsage, stdout);
      MPI_Finalize();
      return 0;
    }
  } catch (const std::exception& e) {
    if (g_rank == 0) std::fprintf(stderr, "host_bench: %s\n%s", e.what(), kUsage);
    MPI_Finalize();
    return 2;
  }
  if (nranks != 2) {
    if (g_rank == 0) std::fprintf(stderr, "host_bench: needs exactly 2 ranks, got %d (mpirun -np 2)\n", nranks);
    MPI_Finalize();
    return 2;
  }
  if (provided < MPI_THREAD_MULTIPLE) {
    if (g_rank == 0)
      std::fprintf(stderr, "host_bench: MPI provides thread level %d, below MPI_THREAD_MULTIPLE (the "
                           "meshmem-remote variant's progress thread needs it)\n", provided);
    MPI_Finalize();
    return 2;
  }

  std::string date;
  Busyness start;
  int failures = 0;
  std::vector<Row> rows;
  std::unique_ptr<IdleRunner> idle_runner;
  try {
    const auto sizes = ctx.sizes();
    for (std::size_t s : sizes)
      ctx.region_bytes = std::max(ctx.region_bytes, static_cast<std::size_t>(ctx.window_for(s)) * s);
    ctx.src = page_buffer(ctx.args.max_size);
    ctx.ref = page_buffer(ctx.args.max_size);
    date = bench::utc_now();
    if (g_rank == 0) print_header(ctx, date);
    start = Busyness::now();
    idle_runner = std::make_unique<IdleRunner>(ctx);

    // Phase 1: every variant without a progress thread, alive together and measured in turns.
    // Phase 2: meshmem-remote alone: its two progress threads wake up ~1000 times a second
    // each while idle, which would disturb the other variants' loops on a small machine.
    Runner runner(ctx);
    const std::vector<std::vector<int>> phases = {{0, 1, 3, 4}, {2}};
    bool tables = false;  // any of kBenchmarks selected
    for (const char* b : kBenchmarks) tables = tables || Runner::selected(ctx.args.benchmarks, b);
    for (const auto& phase : phases) {
      if (!tables) break;
      std::vector<std::unique_ptr<Variant>> owned;
      for (int vi : phase) {
        if (!Runner::selected(ctx.args.variants, kVariants[vi])) continue;
        try {
          owned.push_back(make_variant(kVariants[vi], ctx));
        } catch (const meshmem::Error& e) {
          die(std::string(kVariants[vi]) + ": setup failed: meshmem::Error (" + meshmem::to_string(e.code()) +
              "): " + e.what());
        } catch (const std::exception& e) {
          die(std::string(kVariants[vi]) + ": setup failed: " + e.what());
        }
      }
      if (owned.empty()) continue;
      std::vector<Variant*> vs;
      for (auto& v : owned) vs.push_back(v.get());
      if (g_rank == 0 && phase.size() == 1)
        std::printf("\n# %s runs on its own after the others (its progress threads would disturb them)\n",
                    kVariants[phase[0]]);
      // Abort before unwinding: the variants' destructors are collective and the other rank
      // may never get there.
      try {
        runner.run(vs);
        for (Variant* v : vs) v->finish();
      } catch (const meshmem::Error& e) {
        die(std::string("meshmem::Error (") + meshmem::to_string(e.code()) + "): " + e.what());
      } catch (const std::exception& e) {
        die(e.what());
      }
      owned.clear();  // collective (~Comm), in the same order on both ranks
    }
    rows = runner.rows();
    failures = runner.failures();
    // Phase 3: a target that has been idle (its own communicators, after the others).
    IdleRunner& idle = *idle_runner;
    try {
      idle.run();
    } catch (const meshmem::Error& e) {
      die(std::string("host_get_idle / host_idle_cpu: meshmem::Error (") + meshmem::to_string(e.code()) +
          "): " + e.what());
    } catch (const std::exception& e) {
      die(std::string("host_get_idle / host_idle_cpu: ") + e.what());
    }
    idle.print();
    failures += idle.failures();
    report_busyness(start, g_rank);
  } catch (const std::exception& e) {
    die(e.what());
  }

  int rc = failures > 0 ? 1 : 0;
  if (g_rank == 0) {
    print_summary(rows);
    print_idle_summary(*idle_runner, ctx.args.idle_ms);
    if (failures > 0) std::printf("\n%d measurement(s) failed their data check (see stderr)\n", failures);
    if (!ctx.args.csv.empty()) {
      const auto extra = idle_runner->csv_rows();
      if (write_csv(ctx, date, rows, extra))
        std::printf("\nwrote %zu rows to %s\n", rows.size() + extra.size(), ctx.args.csv.c_str());
      else
        rc = 1;
    }
    std::fflush(stdout);
  }
  if (MPI_Bcast(&rc, 1, MPI_INT, 0, MPI_COMM_WORLD) != MPI_SUCCESS) rc = 2;
  idle_runner.reset();  // frees its communicator
  if (MPI_Finalize() != MPI_SUCCESS) rc = 2;
  return rc;
}
