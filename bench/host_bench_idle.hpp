// host_bench (host_bench.cpp): the measurements after idle time (host_get_idle,
// host_idle_cpu) and how busy the machine was meanwhile.
#pragma once

#include <mpi.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <string>
#include <thread>
#include <vector>

#include <meshmem/meshmem.hpp>

#include "host_bench_common.hpp"

namespace host_bench {

// ---- how busy the machine was ----

inline int cpus_usable() {
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

inline CpuTimes machine_cpu_times() {
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
inline double own_cpu_seconds() {
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
inline void report_busyness(const Busyness& start, int rank) {
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

inline void sleep_seconds(double s) {
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
    const bool want_get = selected(ctx_.args.benchmarks, "host_get_idle");
    const bool want_cpu = selected(ctx_.args.benchmarks, "host_idle_cpu");
    const bool remote = selected(ctx_.args.variants, "meshmem-remote");
    const bool mpi = selected(ctx_.args.variants, "mpi-sendrecv");
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
    if (selected(ctx_.args.variants, "meshmem")) {
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

inline void print_idle_summary(const IdleRunner& idle, const std::vector<int>& idle_ms) {
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

}  // namespace host_bench
