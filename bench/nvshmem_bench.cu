// nvshmem_bench: the NVSHMEM peer of meshmem's GPU benchmarks, run in the same session so that
// every claim is a ratio of rows of one run (bench/README.md).
//
// Benchmarks (variant always "nvshmem"; rank 0 -> rank 1 unless said):
//   put         N back-to-back nvshmemx_putmem_on_stream into PE 1, then an event; bandwidth =
//               N * size / time, latency (sizes <= 64 KiB) = time / N. Timed on the GPU with
//               cudaEvents on the stream, after a warm-up. ranks = 2.
//   get         the same with nvshmemx_getmem_on_stream from PE 1. ranks = 2.
//   put_signal  ping-pong: rank 0 putmem_signal_on_stream(SET, i) to PE 1 then
//               signal_wait_until_on_stream(GE, i); rank 1 the mirror; all N iterations enqueued;
//               one-way latency = rank 0's event time / (2N), bandwidth = size / that latency.
//               Sizes 8, 64, 4 KiB, 64 KiB. ranks = 2.
//   barrier     every rank: 100 x { nvshmemx_barrier_all_on_stream; cudaStreamSynchronize },
//               host-timed; latency = per iteration (max over ranks). ranks = job size.
//   barrier200  every rank: 200 nvshmemx_barrier_all_on_stream then one cudaStreamSynchronize,
//               host-timed; latency = total / 200 (max over ranks). ranks = job size.
//   barrier_busy, barrier200_busy
//               the two barrier patterns behind a 20 us kernel on the stream (bench/busy_work.cuh),
//               as in device_bench: the barrier is met on the GPU. ranks = job size.
//   alloc       nvshmem_malloc of 1 GiB, host-timed between an MPI_Barrier before and the return
//               (max over ranks), 3 repeats held at once (so every repeat has to grow the symmetric
//               heap rather than reuse a freed block), median reported. ranks = job size.
//
// Bootstrap: MPI only broadcasts the NVSHMEM unique id (NVSHMEMX_INIT_WITH_UNIQUEID), so the ABI
// of NVSHMEM's MPI plugin does not matter. NVLink multicast stays off (NVSHMEM_DISABLE_NVLS=1).
//
// usage: mpirun -np 2|4 nvshmem_bench [--csv FILE] [--commit ID] [--machine NAME] [--date D]
//                                     [--benchmarks a,b] [--max-size N] [--iters N]
#include <mpi.h>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "busy_work.cuh"
#include "results_csv.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <set>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::size_t kKiB = std::size_t{1} << 10;
constexpr std::size_t kGiB = std::size_t{1} << 30;
constexpr std::size_t kLatencyMax = 64 * kKiB;          // put/get rows carry latency up to here
constexpr int kLatencyReps = 5;  // put/get latency: best of this many timed loops (as device_bench)
constexpr std::size_t kBytesPerMeasurement = 4 * kGiB;  // large sizes: iterations ~ this / size
constexpr int kMinIters = 10;
constexpr const char* kVariant = "nvshmem";

const char* const kBenchmarks[] = {"put", "get", "put_signal", "barrier", "barrier200", "barrier_busy", "barrier200_busy", "alloc"};

int g_rank = -1;

// ---- errors: print the call, this rank and the error text, then take the whole job down ----

[[noreturn]] void fail(const char* call, const char* file, int line, const std::string& what) {
  std::fflush(stdout);
  std::fprintf(stderr, "nvshmem_bench rank %d: %s failed (%s:%d): %s\n", g_rank, call, file, line, what.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

std::string mpi_error_text(int rc) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(text, static_cast<std::size_t>(len));
}

#define CUDA_CHECK(call)                                                                  \
  do {                                                                                    \
    const cudaError_t e_ = (call);                                                        \
    if (e_ != cudaSuccess)                                                                \
      fail(#call, __FILE__, __LINE__,                                                     \
           std::string(cudaGetErrorName(e_)) + ": " + cudaGetErrorString(e_));            \
  } while (0)

#define MPI_CHECK(call)                                                      \
  do {                                                                       \
    const int e_ = (call);                                                   \
    if (e_ != MPI_SUCCESS) fail(#call, __FILE__, __LINE__, mpi_error_text(e_)); \
  } while (0)

// NVSHMEM host calls that return an int status (0 is success).
#define NVSHMEM_CHECK(call)                                                                      \
  do {                                                                                           \
    const int e_ = (call);                                                                       \
    if (e_ != 0) fail(#call, __FILE__, __LINE__, "NVSHMEM status " + std::to_string(e_));        \
  } while (0)

#define CHECK_THAT(cond, message)                                    \
  do {                                                               \
    if (!(cond)) fail(#cond, __FILE__, __LINE__, (message));         \
  } while (0)

// ---- options ----

struct Args {
  std::string csv;
  std::string commit = "unknown";
  std::string machine = "unknown";
  std::string date;  // default: now, UTC
  std::set<std::string> benchmarks;  // empty: all
  std::size_t max_size = kGiB;
  int iters = 1000;  // timed iterations for sizes <= 64 KiB (fewer above)
};

const char* const kUsage =
    "usage: mpirun -np 2|4 nvshmem_bench [options]   (at least 2 ranks, one GPU each)\n"
    "  --csv FILE         append the rows to FILE (header written only if FILE is new or empty)\n"
    "  --commit ID        recorded in the header and the CSV (default unknown)\n"
    "  --machine NAME     recorded in the header and the CSV (default unknown)\n"
    "  --date D           recorded in the CSV (default: now, UTC, YYYY-MM-DDTHH:MM:SSZ)\n"
    "  --benchmarks A,B   subset of put,get,put_signal,barrier,barrier200,barrier_busy,\n"
    "                     barrier200_busy,alloc (default all)\n"
    "  --max-size N       largest put/get size, a power of two >= 8, suffix K/M/G (default 1G)\n"
    "  --iters N          timed iterations for small sizes (default 1000)\n";

bool parse_size(const std::string& text, std::size_t& out) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (errno != 0 || end == text.c_str()) return false;
  const std::string suffix(end);
  unsigned shift = 0;
  if (suffix.empty() || suffix == "B") shift = 0;
  else if (suffix == "K" || suffix == "k" || suffix == "KiB") shift = 10;
  else if (suffix == "M" || suffix == "MiB") shift = 20;
  else if (suffix == "G" || suffix == "GiB") shift = 30;
  else return false;
  if (v > (~0ull >> shift)) return false;
  out = static_cast<std::size_t>(v << shift);
  return true;
}

bool is_known_benchmark(const std::string& name) {
  for (const char* b : kBenchmarks)
    if (name == b) return true;
  return false;
}

// Returns false (with a message in `error`, or none for --help) when the program should stop.
bool parse_args(int argc, char** argv, Args& a, std::string& error) {
  for (int i = 1; i < argc; ++i) {
    std::string opt = argv[i];
    if (opt == "-h" || opt == "--help") return false;
    std::string value;
    const std::size_t eq = opt.find('=');
    if (eq != std::string::npos) {
      value = opt.substr(eq + 1);
      opt = opt.substr(0, eq);
    } else {
      if (i + 1 >= argc) {
        error = opt + " needs a value";
        return false;
      }
      value = argv[++i];
    }
    if (opt == "--csv") a.csv = value;
    else if (opt == "--commit") a.commit = value;
    else if (opt == "--machine") a.machine = value;
    else if (opt == "--date") a.date = value;
    else if (opt == "--benchmarks") {
      std::size_t start = 0;
      while (start <= value.size()) {
        const std::size_t comma = value.find(',', start);
        const std::string item = value.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        if (!item.empty()) {
          if (!is_known_benchmark(item)) {
            error = "unknown benchmark '" + item + "'";
            return false;
          }
          a.benchmarks.insert(item);
        }
        if (comma == std::string::npos) break;
        start = comma + 1;
      }
    } else if (opt == "--max-size") {
      std::size_t v = 0;
      if (!parse_size(value, v) || v < 8 || (v & (v - 1)) != 0 || v > 16 * kGiB) {
        error = "--max-size must be a power of two between 8 and 16G, got '" + value + "'";
        return false;
      }
      a.max_size = v;
    } else if (opt == "--iters") {
      char* end = nullptr;
      const long v = std::strtol(value.c_str(), &end, 10);
      if (end == value.c_str() || *end != '\0' || v < 1 || v > 10000000) {
        error = "--iters must be a positive number, got '" + value + "'";
        return false;
      }
      a.iters = static_cast<int>(v);
    } else {
      error = "unknown option " + opt;
      return false;
    }
  }
  return true;
}

// ---- results ----

struct Row {
  std::string benchmark;
  int ranks;
  long long size;     // < 0: empty cell
  double latency_us;  // < 0: empty cell
  double bandwidth_gbps;  // 1e9 bytes/s; < 0: empty cell
};

bool append_csv(const Args& a, const std::string& date, const std::vector<Row>& rows) {
  std::vector<bench::ResultRow> out;
  for (const Row& r : rows) out.push_back({r.benchmark, kVariant, r.ranks, r.size, r.latency_us, r.bandwidth_gbps});
  return bench::write_results_csv(a.csv, bench::CsvMode::Append, date, a.commit, a.machine, out, "nvshmem_bench");
}

void print_table_head(const char* benchmark, const std::string& how) {
  std::printf("\n# nvshmem %s: %s\n", benchmark, how.c_str());
  std::printf("# %-12s %14s %16s\n", "size", "latency(us)", "bandwidth(GB/s)");
}

void print_row(const Row& r) {
  char size[32] = "-", lat[32] = "-", bw[32] = "-";
  if (r.size >= 0) std::snprintf(size, sizeof(size), "%lld", r.size);
  if (r.latency_us >= 0) std::snprintf(lat, sizeof(lat), "%.3f", r.latency_us);
  if (r.bandwidth_gbps >= 0) std::snprintf(bw, sizeof(bw), "%.3f", r.bandwidth_gbps);
  std::printf("  %-12s %14s %16s\n", size, lat, bw);
  std::fflush(stdout);
}

// ---- context ----

struct Ctx {
  Args args;
  int rank = 0;
  int nranks = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  std::vector<Row> rows;

  void add(const Row& r) {
    if (rank == 0) print_row(r);
    rows.push_back(r);
  }
  bool wants(const char* name) const { return args.benchmarks.empty() || args.benchmarks.count(name) != 0; }
};

void mpi_barrier() { MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD)); }

double max_over_ranks(double v) {
  double out = 0;
  MPI_CHECK(MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
  return out;
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int iters_for(const Ctx& ctx, std::size_t size) {
  if (size <= kLatencyMax) return ctx.args.iters;
  const std::size_t n = kBytesPerMeasurement / size;
  return static_cast<int>(std::max<std::size_t>(kMinIters, std::min<std::size_t>(n, ctx.args.iters)));
}
int warmup_for(int iters) { return std::min(100, std::max(2, iters / 10)); }

unsigned char pattern_for(std::size_t size, int salt) {
  unsigned v = 0;
  for (std::size_t s = size; s > 1; s >>= 1) ++v;  // log2(size)
  return static_cast<unsigned char>(1 + (v * 37u + static_cast<unsigned>(salt) * 101u) % 254u);
}

// Compares the first and last 8 bytes of a device buffer with `expected` (synchronous).
void check_bytes(const char* what, const unsigned char* dptr, std::size_t size, unsigned char expected) {
  const std::size_t n = std::min<std::size_t>(8, size);
  unsigned char head[8], tail[8];
  CUDA_CHECK(cudaMemcpy(head, dptr, n, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(tail, dptr + size - n, n, cudaMemcpyDeviceToHost));
  for (std::size_t i = 0; i < n; ++i) {
    if (head[i] != expected || tail[i] != expected) {
      char msg[256];
      std::snprintf(msg, sizeof(msg), "%s, %zu bytes: expected byte 0x%02x, found 0x%02x at the start, 0x%02x at the end",
                    what, size, expected, head[i], tail[i]);
      fail("data check", __FILE__, __LINE__, msg);
    }
  }
}

// ---- put / get ----

void bench_put_get(Ctx& ctx, bool is_put, unsigned char* a, unsigned char* b) {
  // put: rank 0's a -> rank 1's b.   get: rank 1's a -> rank 0's b.
  const char* name = is_put ? "put" : "get";
  if (ctx.rank == 0)
    print_table_head(name, std::string(is_put ? "N x nvshmemx_putmem_on_stream(PE 1)" : "N x nvshmemx_getmem_on_stream(PE 1)") +
                               " back to back between two cudaEvents; latency = time / N (sizes <= 64 KiB), "
                               "bandwidth = N * size / time");
  const int source_rank = is_put ? 0 : 1;
  int salt = is_put ? 1 : 2;
  for (std::size_t size = 8; size <= ctx.args.max_size; size *= 2) {
    const int iters = iters_for(ctx, size);
    const int warmup = warmup_for(iters);
    const unsigned char pattern = pattern_for(size, salt);
    if (ctx.rank == source_rank) {
      CUDA_CHECK(cudaMemsetAsync(a, pattern, size, ctx.stream));
      CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
    }
    mpi_barrier();
    double seconds = 0;
    if (ctx.rank == 0) {
      for (int i = 0; i < warmup; ++i) {
        if (is_put) nvshmemx_putmem_on_stream(b, a, size, 1, ctx.stream);
        else nvshmemx_getmem_on_stream(b, a, size, 1, ctx.stream);
      }
      // Latency sizes: the best of kLatencyReps loops (GPU clocks and the host wander).
      const int reps = size <= kLatencyMax ? kLatencyReps : 1;
      for (int rep = 0; rep < reps; ++rep) {
        CUDA_CHECK(cudaEventRecord(ctx.start, ctx.stream));
        for (int i = 0; i < iters; ++i) {
          if (is_put) nvshmemx_putmem_on_stream(b, a, size, 1, ctx.stream);
          else nvshmemx_getmem_on_stream(b, a, size, 1, ctx.stream);
        }
        CUDA_CHECK(cudaEventRecord(ctx.stop, ctx.stream));
        CUDA_CHECK(cudaEventSynchronize(ctx.stop));
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, ctx.start, ctx.stop));
        seconds = rep == 0 ? ms * 1e-3 : std::min(seconds, ms * 1e-3);
      }
      nvshmemx_quiet_on_stream(ctx.stream);  // outside the timing: puts complete at PE 1
      CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
    }
    mpi_barrier();
    if (ctx.rank == 1 - source_rank) check_bytes(is_put ? "put: PE 1's destination" : "get: PE 0's destination", b, size, pattern);
    if (ctx.rank == 0) {
      Row r{name, 2, static_cast<long long>(size), -1, -1};
      if (size <= kLatencyMax) r.latency_us = seconds * 1e6 / iters;
      r.bandwidth_gbps = static_cast<double>(size) * iters / seconds / 1e9;
      ctx.add(r);
    }
  }
}

// ---- put_signal ping-pong ----

void bench_put_signal(Ctx& ctx, unsigned char* a, unsigned char* b, std::uint64_t* sig, std::uint64_t& counter) {
  if (ctx.rank == 0)
    print_table_head("put_signal", "ping-pong, rank 0: putmem_signal_on_stream(SET i, PE 1) + signal_wait_until_on_stream(GE i); "
                                   "rank 1 the mirror; N iterations enqueued; latency = time / (2N), one way; "
                                   "bandwidth = size / one-way latency");
  const std::size_t sizes[] = {8, 64, 4 * kKiB, 64 * kKiB};
  for (std::size_t size : sizes) {
    if (size > ctx.args.max_size) continue;
    const int iters = ctx.args.iters;
    const int warmup = warmup_for(iters);
    const unsigned char pattern = pattern_for(size, 3 + ctx.rank);
    const bool active = ctx.rank <= 1;
    if (active) {
      CUDA_CHECK(cudaMemsetAsync(a, pattern, size, ctx.stream));
      CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
    }
    mpi_barrier();
    double seconds = 0;
    if (active) {
      const int peer = 1 - ctx.rank;
      auto one = [&](std::uint64_t v) {
        if (ctx.rank == 0) {
          nvshmemx_putmem_signal_on_stream(b, a, size, sig, v, NVSHMEM_SIGNAL_SET, peer, ctx.stream);
          nvshmemx_signal_wait_until_on_stream(sig, NVSHMEM_CMP_GE, v, ctx.stream);
        } else {
          nvshmemx_signal_wait_until_on_stream(sig, NVSHMEM_CMP_GE, v, ctx.stream);
          nvshmemx_putmem_signal_on_stream(b, a, size, sig, v, NVSHMEM_SIGNAL_SET, peer, ctx.stream);
        }
      };
      // The signal values only grow, over warm-up, timing and sizes alike, so that no reset
      // can race with a peer's late signal.
      for (int i = 0; i < warmup; ++i) one(++counter);
      CUDA_CHECK(cudaEventRecord(ctx.start, ctx.stream));
      for (int i = 0; i < iters; ++i) one(++counter);
      CUDA_CHECK(cudaEventRecord(ctx.stop, ctx.stream));
      CUDA_CHECK(cudaEventSynchronize(ctx.stop));
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, ctx.start, ctx.stop));
      seconds = ms * 1e-3;
      CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
    }
    mpi_barrier();
    if (active) {
      const unsigned char peer_pattern = pattern_for(size, 3 + (1 - ctx.rank));
      check_bytes("put_signal: destination", b, size, peer_pattern);
      std::uint64_t got = 0;
      CUDA_CHECK(cudaMemcpy(&got, sig, sizeof(got), cudaMemcpyDeviceToHost));
      if (got != counter)
        fail("signal check", __FILE__, __LINE__,
             "signal word is " + std::to_string(got) + ", expected " + std::to_string(counter));
    }
    if (ctx.rank == 0) {
      const double one_way_s = seconds / (2.0 * iters);
      ctx.add(Row{"put_signal", 2, static_cast<long long>(size), one_way_s * 1e6, static_cast<double>(size) / one_way_s / 1e9});
    }
  }
}

// ---- barriers ----

void bench_barrier(Ctx& ctx) {
  const int n = 100;
  if (ctx.rank == 0)
    print_table_head("barrier", std::to_string(ctx.nranks) + " ranks, " + std::to_string(n) +
                                    " x { nvshmemx_barrier_all_on_stream; cudaStreamSynchronize }, host-timed; "
                                    "latency = per iteration, max over ranks");
  for (int i = 0; i < 10; ++i) {
    nvshmemx_barrier_all_on_stream(ctx.stream);
    CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
  }
  mpi_barrier();
  const Clock::time_point t0 = Clock::now();
  for (int i = 0; i < n; ++i) {
    nvshmemx_barrier_all_on_stream(ctx.stream);
    CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
  }
  const double s = max_over_ranks(seconds_since(t0));
  ctx.add(Row{"barrier", ctx.nranks, -1, s * 1e6 / n, -1});
}

void bench_barrier200(Ctx& ctx) {
  const int n = 200;
  if (ctx.rank == 0)
    print_table_head("barrier200", std::to_string(ctx.nranks) + " ranks, " + std::to_string(n) +
                                       " x nvshmemx_barrier_all_on_stream back to back, then one "
                                       "cudaStreamSynchronize, host-timed; latency = total / 200, max over ranks");
  for (int i = 0; i < 20; ++i) nvshmemx_barrier_all_on_stream(ctx.stream);
  CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
  mpi_barrier();
  const Clock::time_point t0 = Clock::now();
  for (int i = 0; i < n; ++i) nvshmemx_barrier_all_on_stream(ctx.stream);
  CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
  const double s = max_over_ranks(seconds_since(t0));
  ctx.add(Row{"barrier200", ctx.nranks, -1, s * 1e6 / n, -1});
}

void bench_barrier_busy(Ctx& ctx, bool burst) {
  const int n = burst ? 200 : 100;
  const char* name = burst ? "barrier200_busy" : "barrier_busy";
  if (ctx.rank == 0)
    print_table_head(name, std::to_string(ctx.nranks) + " ranks, " + std::to_string(n) +
                               (burst ? " x { 20 us kernel; nvshmemx_barrier_all_on_stream }, then one cudaStreamSynchronize"
                                      : " x { 20 us kernel; nvshmemx_barrier_all_on_stream; cudaStreamSynchronize }") +
                               ", host-timed; latency = per iteration, max over ranks");
  for (int i = 0; i < 10; ++i) nvshmemx_barrier_all_on_stream(ctx.stream);
  CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
  mpi_barrier();
  const Clock::time_point t0 = Clock::now();
  for (int i = 0; i < n; ++i) {
    CUDA_CHECK(bench::launch_busy(ctx.stream));
    nvshmemx_barrier_all_on_stream(ctx.stream);
    if (!burst) CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
  }
  CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
  const double s = max_over_ranks(seconds_since(t0));
  ctx.add(Row{name, ctx.nranks, -1, s * 1e6 / n, -1});
}

// ---- alloc ----

void bench_alloc(Ctx& ctx) {
  const int repeats = 3;
  const std::size_t bytes = kGiB;
  if (ctx.rank == 0)
    print_table_head("alloc", std::to_string(ctx.nranks) + " ranks, nvshmem_malloc(1 GiB) timed on the host from an "
                                  "MPI_Barrier to its return, max over ranks; " + std::to_string(repeats) +
                                  " repeats held at once, median");
  // One-time costs of the first allocation stay out of the timing.
  void* warm = nvshmem_malloc(4096);
  CHECK_THAT(warm != nullptr, "nvshmem_malloc(4096) returned NULL");
  nvshmem_free(warm);
  std::vector<void*> held;
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) {
    mpi_barrier();
    const Clock::time_point t0 = Clock::now();
    void* p = nvshmem_malloc(bytes);
    const double s = seconds_since(t0);
    if (p == nullptr)
      fail("nvshmem_malloc(1 GiB)", __FILE__, __LINE__,
           "returned NULL (repeat " + std::to_string(i + 1) + "; symmetric heap limits: NVSHMEM_SYMMETRIC_SIZE, "
           "NVSHMEM_MAX_MEMORY_PER_GPU, NVSHMEM_DISABLE_CUDA_VMM)");
    held.push_back(p);
    times.push_back(max_over_ranks(s));
  }
  mpi_barrier();
  const Clock::time_point tf = Clock::now();
  for (void* p : held) nvshmem_free(p);
  const double free_s = max_over_ranks(seconds_since(tf));
  if (ctx.rank == 0) {
    std::printf("#   repeats (us):");
    for (double t : times) std::printf(" %.1f", t * 1e6);
    std::printf("; nvshmem_free of all %d: %.1f us\n", repeats, free_s * 1e6);
  }
  std::vector<double> sorted = times;
  std::sort(sorted.begin(), sorted.end());
  ctx.add(Row{"alloc", ctx.nranks, static_cast<long long>(bytes), sorted[sorted.size() / 2] * 1e6, -1});
}

// ---- setup ----

// NVSHMEM dlopen()s its UID bootstrap plugin by bare name ("nvshmem_bootstrap_uid.so.3"). The
// wheel's libnvshmem_host.so.3 carries DT_RPATH $ORIGIN, so that finds the plugin next to it, but
// an install without it would depend on LD_LIBRARY_PATH (the executable's RUNPATH does not apply
// to a library's dlopen): pin the plugin of the NVSHMEM we were built against unless told otherwise.
void point_at_uid_plugin() {
#ifdef MESHMEM_NVSHMEM_LIBDIR
  if (std::getenv("NVSHMEM_BOOTSTRAP_UID_PLUGIN") != nullptr) return;
  const std::string path = std::string(MESHMEM_NVSHMEM_LIBDIR) + "/nvshmem_bootstrap_uid.so.3";
  if (access(path.c_str(), R_OK) == 0) setenv("NVSHMEM_BOOTSTRAP_UID_PLUGIN", path.c_str(), 1);
#endif
}

int select_device(int rank) {
  MPI_Comm local;
  MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local));
  int local_rank = 0, local_size = 0;
  MPI_CHECK(MPI_Comm_rank(local, &local_rank));
  MPI_CHECK(MPI_Comm_size(local, &local_size));
  MPI_CHECK(MPI_Comm_free(&local));
  int count = 0;
  CUDA_CHECK(cudaGetDeviceCount(&count));
  if (local_size > count && local_rank == 0)
    std::fprintf(stderr, "nvshmem_bench: warning: %d ranks on this node share %d GPU(s); NVSHMEM wants one GPU per PE\n",
                 local_size, count);
  const int device = local_rank % count;
  CUDA_CHECK(cudaSetDevice(device));
  CUDA_CHECK(cudaFree(nullptr));  // create the primary context before NVSHMEM looks for it
  return device;
}

void init_nvshmem(int rank, int nranks) {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (rank == 0) NVSHMEM_CHECK(nvshmemx_get_uniqueid(&id));
  MPI_CHECK(MPI_Bcast(&id, static_cast<int>(sizeof(id)), MPI_BYTE, 0, MPI_COMM_WORLD));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  NVSHMEM_CHECK(nvshmemx_set_attr_uniqueid_args(rank, nranks, &id, &attr));
  NVSHMEM_CHECK(nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr));
  if (nvshmem_my_pe() != rank || nvshmem_n_pes() != nranks)
    fail("nvshmemx_init_attr", __FILE__, __LINE__,
         "PE " + std::to_string(nvshmem_my_pe()) + " of " + std::to_string(nvshmem_n_pes()) + ", expected " +
             std::to_string(rank) + " of " + std::to_string(nranks));
}

void print_header(const Ctx& ctx, const std::string& date, int device, bool p2p) {
  std::vector<int> devices(static_cast<std::size_t>(ctx.nranks), -1);
  MPI_CHECK(MPI_Gather(&device, 1, MPI_INT, devices.data(), 1, MPI_INT, 0, MPI_COMM_WORLD));
  if (ctx.rank != 0) return;
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "unknown");
  char name[NVSHMEM_MAX_NAME_LEN + 1] = {};
  nvshmem_info_get_name(name);
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  int runtime = 0, driver = 0;
  CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  CUDA_CHECK(cudaDriverGetVersion(&driver));
  const Args& a = ctx.args;
  std::printf("# nvshmem_bench: machine %s, host %s, date %s, commit %s\n", a.machine.c_str(), host, date.c_str(),
              a.commit.c_str());
  std::printf("# %s (headers %d.%d.%d), CUDA runtime %d, driver %d, %s\n", name, NVSHMEM_VENDOR_MAJOR_VERSION,
              NVSHMEM_VENDOR_MINOR_VERSION, NVSHMEM_VENDOR_PATCH_VERSION, runtime, driver, prop.name);
  std::printf("# %d ranks (PEs), devices:", ctx.nranks);
  for (int d : devices) std::printf(" %d", d);
  std::printf("; PE 1 %s from PE 0 (nvshmem_ptr)\n", p2p ? "is load/store reachable (P2P)" : "is NOT P2P reachable");
  const char* nvls = std::getenv("NVSHMEM_DISABLE_NVLS");
  const char* plugin = std::getenv("NVSHMEM_BOOTSTRAP_UID_PLUGIN");
  std::printf("# NVSHMEM_DISABLE_NVLS=%s, UID bootstrap plugin %s\n", nvls ? nvls : "(unset)",
              plugin ? plugin : "(default name)");
  std::printf("# put/get sizes 8 B .. %zu B (powers of two), %d timed iterations up to 64 KiB, fewer above "
              "(~%zu GiB per measurement, at least %d); latency in us, bandwidth in GB/s (1e9 bytes/s)\n",
              a.max_size, a.iters, kBytesPerMeasurement / kGiB, kMinIters);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  if (MPI_Init(&argc, &argv) != MPI_SUCCESS) {
    std::fprintf(stderr, "nvshmem_bench: MPI_Init failed\n");
    return 2;
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int nranks = 0;
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &g_rank));
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &nranks));

  Ctx ctx;
  ctx.rank = g_rank;
  ctx.nranks = nranks;
  std::string error;
  if (!parse_args(argc, argv, ctx.args, error)) {
    if (g_rank == 0) {
      if (!error.empty()) std::fprintf(stderr, "nvshmem_bench: %s\n", error.c_str());
      std::fputs(kUsage, error.empty() ? stdout : stderr);
    }
    MPI_Finalize();
    return error.empty() ? 0 : 2;
  }
  if (nranks < 2) {
    if (g_rank == 0) std::fprintf(stderr, "nvshmem_bench: needs at least 2 ranks, got %d\n%s", nranks, kUsage);
    MPI_Finalize();
    return 2;
  }
  // Every rank records the same date: rank 0's clock.
  std::string date = ctx.args.date.empty() ? bench::utc_now() : ctx.args.date;
  {
    char buf[64] = {};
    std::snprintf(buf, sizeof(buf), "%s", date.c_str());
    MPI_CHECK(MPI_Bcast(buf, sizeof(buf), MPI_CHAR, 0, MPI_COMM_WORLD));
    date = buf;
  }

  setenv("NVSHMEM_DISABLE_NVLS", "1", 0);  // never NVLink multicast (GPU_MACHINE.md)
  point_at_uid_plugin();
  const int device = select_device(g_rank);
  init_nvshmem(g_rank, nranks);

  CUDA_CHECK(cudaStreamCreateWithFlags(&ctx.stream, cudaStreamNonBlocking));
  CUDA_CHECK(cudaEventCreate(&ctx.start));
  CUDA_CHECK(cudaEventCreate(&ctx.stop));

  const bool need_buffers = ctx.wants("put") || ctx.wants("get") || ctx.wants("put_signal");
  // A probe allocation for the header (is PE 1 P2P reachable?).
  auto* probe = static_cast<unsigned char*>(nvshmem_malloc(4096));
  CHECK_THAT(probe != nullptr, "nvshmem_malloc(4096) returned NULL");
  const bool p2p = nvshmem_ptr(probe, 1) != nullptr;
  nvshmem_free(probe);
  print_header(ctx, date, device, p2p);

  // The heap is still fresh here: alloc first, so that its repeats have to grow it rather than
  // reuse the blocks that put/get freed.
  if (ctx.wants("alloc")) bench_alloc(ctx);

  if (need_buffers) {
    const std::size_t bytes = std::max<std::size_t>(ctx.args.max_size, 64 * kKiB);
    auto* a = static_cast<unsigned char*>(nvshmem_malloc(bytes));
    auto* b = static_cast<unsigned char*>(nvshmem_malloc(bytes));
    auto* sig = static_cast<std::uint64_t*>(nvshmem_malloc(sizeof(std::uint64_t)));
    if (a == nullptr || b == nullptr || sig == nullptr)
      fail("nvshmem_malloc", __FILE__, __LINE__,
           "returned NULL for 2 x " + std::to_string(bytes) + " bytes + a signal word (lower --max-size, or raise "
           "NVSHMEM_SYMMETRIC_SIZE / NVSHMEM_MAX_MEMORY_PER_GPU)");
    // First touch outside every timing; zero signal word before any peer can signal it.
    CUDA_CHECK(cudaMemsetAsync(a, 0, bytes, ctx.stream));
    CUDA_CHECK(cudaMemsetAsync(b, 0, bytes, ctx.stream));
    CUDA_CHECK(cudaMemsetAsync(sig, 0, sizeof(std::uint64_t), ctx.stream));
    CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
    mpi_barrier();
    std::uint64_t counter = 0;
    if (ctx.wants("put")) bench_put_get(ctx, true, a, b);
    if (ctx.wants("get")) bench_put_get(ctx, false, a, b);
    if (ctx.wants("put_signal")) bench_put_signal(ctx, a, b, sig, counter);
    nvshmemx_barrier_all_on_stream(ctx.stream);
    CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
    nvshmem_free(sig);
    nvshmem_free(b);
    nvshmem_free(a);
  }
  if (ctx.wants("barrier")) bench_barrier(ctx);
  if (ctx.wants("barrier200")) bench_barrier200(ctx);
  if (ctx.wants("barrier_busy")) bench_barrier_busy(ctx, false);
  if (ctx.wants("barrier200_busy")) bench_barrier_busy(ctx, true);

  int status = 0;
  if (ctx.rank == 0 && !ctx.args.csv.empty()) {
    if (append_csv(ctx.args, date, ctx.rows)) std::printf("\nappended %zu rows to %s\n", ctx.rows.size(), ctx.args.csv.c_str());
    else status = 1;
  }
  MPI_CHECK(MPI_Bcast(&status, 1, MPI_INT, 0, MPI_COMM_WORLD));

  CUDA_CHECK(cudaEventDestroy(ctx.start));
  CUDA_CHECK(cudaEventDestroy(ctx.stop));
  CUDA_CHECK(cudaStreamDestroy(ctx.stream));
  nvshmem_finalize();
  MPI_Finalize();
  return status;
}
