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

#include "host_bench_common.hpp"
#include "host_bench_idle.hpp"
#include "host_bench_variants.hpp"

namespace {

using namespace host_bench;

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
    for (const char* b : kBenchmarks) tables = tables || selected(ctx.args.benchmarks, b);
    for (const auto& phase : phases) {
      if (!tables) break;
      std::vector<std::unique_ptr<Variant>> owned;
      for (int vi : phase) {
        if (!selected(ctx.args.variants, kVariants[vi])) continue;
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
