// host_bench (host_bench.cpp): what its parts share: the benchmark and variant names, MPI
// checks, the options, page-aligned buffers and data patterns, the run context, the rows
// and the timing helpers.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace host_bench {


using Clock = std::chrono::steady_clock;

// OSU's LARGE_MESSAGE_SIZE: above it the iteration and warm-up counts drop.
constexpr std::size_t kLargeMessage = 8192;

const char* const kBenchmarks[] = {"host_put", "host_get", "host_put_signal"};
const char* const kVariants[] = {"memcpy", "meshmem", "meshmem-remote", "mpi-sendrecv", "mpi-put"};
// Every name --benchmarks accepts: kBenchmarks, then the idle measurements (run after them).
const char* const kAllBenchmarks[] = {"host_put", "host_get", "host_put_signal", "host_get_idle", "host_idle_cpu"};

enum class Bench { Put, Get, PutSignal };

inline int g_rank = -1;

// ---- errors ----

inline std::string mpi_error_text(int rc) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(text, static_cast<std::size_t>(len));
}

inline void check_mpi(int rc, const char* call, const char* file, int line) {
  if (rc != MPI_SUCCESS) {
    const char* slash = std::strrchr(file, '/');
    throw std::runtime_error(std::string(call) + " failed (" + (slash != nullptr ? slash + 1 : file) + ":" +
                             std::to_string(line) + "): " + mpi_error_text(rc));
  }
}
#define MPI_CHECK(call) check_mpi((call), #call, __FILE__, __LINE__)

// A failure on one rank would leave the other waiting in a collective: abort the job.
[[noreturn]] inline void die(const std::string& message) {
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

inline std::size_t parse_size(const std::string& text) {
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

inline int parse_int(const std::string& text, int lo) {
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

inline std::set<std::string> parse_list(const std::string& text, const char* const* known, std::size_t n) {
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

inline bool is_power_of_two(std::size_t v) { return v != 0 && (v & (v - 1)) == 0; }

// Throws std::invalid_argument; returns false for --help.
inline bool parse_args(int argc, char** argv, Args& a) {
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
inline Buffer page_buffer(std::size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 4096, std::max<std::size_t>(bytes, 1)) != 0)
    throw std::runtime_error("posix_memalign of " + std::to_string(bytes) + " bytes failed");
  std::memset(p, 0, bytes);
  return Buffer(static_cast<unsigned char*>(p));
}

inline void fill_pattern(unsigned char* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t k = 0; k < n; ++k)
    p[k] = static_cast<unsigned char>((seed >> (k % 4 * 8)) + k * 131u + (k >> 10) + 1u);
}

// Every variant moves the same bytes at a size; the memory they land in is cleared before.
inline std::uint32_t seed_for(Bench b, std::size_t size) {
  return static_cast<std::uint32_t>(size * 2654435761u) ^ (static_cast<std::uint32_t>(b) << 24) ^ 0x5a5au;
}

// Index of the first of `count` consecutive `size`-byte regions that differs from ref, or -1.
inline long first_bad_region(const unsigned char* base, int count, std::size_t size, const unsigned char* ref) {
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


// ---- timing ----

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

inline int clamp_count(double x, int lo, int hi) {
  lo = std::min(lo, hi);
  if (!(x >= lo)) return lo;  // also NaN
  if (x >= hi) return hi;
  return static_cast<int>(x);
}

inline int bcast_from_0(int value) {
  MPI_CHECK(MPI_Bcast(&value, 1, MPI_INT, 0, MPI_COMM_WORLD));
  return value;
}


// Whether `name` is chosen: every name where the set is empty (the option not given).
inline bool selected(const std::set<std::string>& set, const std::string& name) {
  return set.empty() || set.count(name) != 0;
}

}  // namespace host_bench
