// staged_bench: meshmem's `staged` transport (device windows of GPUs without peer access,
// carried through the node's pinned staging pool), forced with
// MESHMEM_TRANSPORTS=staged,shm,mpi where peer access works, against the copies it is made of
// and the driver's own host staging, all measured on rank 0 in one run:
//   meshmem            comm.put into / comm.get from rank 1's device window, device buffer
//   meshmem-2-streams  the same puts and gets taking turns on two streams of rank 0 (the loop
//                      ends when both passed their last): each stream waits for its own
//                      transfer's end at the target, so one transfer's pipeline fill and drain
//                      can overlap the other's. What a caller gets today from overlapping
//                      transfers, against meshmem's one-stream rows (each waits for the one before)
//   meshmem-host-call  the host time spent inside those calls, the mean of a loop's (latency
//                      column only)
//   meshmem-host-call-first  the same, of a loop's first call alone (nothing of meshmem's in
//                      flight then: the later calls share the CPU and the driver with the
//                      staging thread enqueueing the earlier transfers' chunks)
//   meshmem-host-call-median  the median of a loop's calls (a loop at 1 GiB has 4: the mean
//                      is one slow call's)
//   meshmem-host-call-later-median  the median of every loop's calls after its first two, all
//                      loops pooled: the same calls at every size (a loop's first two pay for
//                      the pause before it, and at 1 GiB they are half a loop's calls)
//   d2h-host-call-first  the control of meshmem-host-call-first: the host time of the d2h
//                      loop's first cudaMemcpyAsync, made after the same kind of pause
//   driver-staged      cudaMemcpyPeerAsync between rank 0's GPU and another GPU of its process
//                      with peer access off, so that the driver stages through host memory
//   d2h, h2d           cudaMemcpyAsync between rank 0's GPU and pinned host memory
//   both-ways          the staged pipeline's two halves at once: d2h on one GPU and h2d on the
//                      other (rank 0's process drives both), each on its own stream; where rank
//                      0 sees one GPU, both on that GPU (its one link both ways at once, the
//                      ceiling of any pipeline through one GPU, below min(d2h, h2d))
//   staged_put_signal meshmem-pingpong-one-way: rank 0 put_signals to rank 1, whose stream
//                      waits for the signal and put_signals back, stream-ordered on both sides;
//                      half the round trip (sizes up to 64 MiB); meshmem-host-call and
//                      meshmem-wait-host-call: rank 0's host time in one put_signal and in one
//                      wait_until of that loop (staged_bench_pingpong.cu)
// Benchmarks staged_put (rank 0 -> rank 1; driver-staged this GPU -> the other) and
// staged_get (the reverse), then staged_put_signal. Prints an OSU-style table and the target
// ratios; --csv appends the rows in the bench/results format.
//   mpirun -np 2 staged_bench [--csv FILE --commit C --machine M --date D]
//                             [--min-bytes N] [--max-bytes N] [--iters N] [--reps N] [--call-times]
//     --call-times: also prints each meshmem call's host time, of every timed loop
//   mpirun -np 2 staged_bench --idle SECONDS
//     instead: what a CUDA graph of a captured staged put costs while it exists (its owner
//     thread polls the doorbells, docs/semantics.md "CUDA graphs"): each process's CPU time while
//     nothing runs, without the graph, with it, after it; and its replay time back to back
//     against after a quiet spell.
#include <cuda_runtime_api.h>
#include <mpi.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <numeric>
#include <meshmem/meshmem.hpp>
#include <string>
#include <thread>
#include <vector>

#include <sys/resource.h>

#include "bench_check.hpp"
#include "results_csv.hpp"
#include "staged_bench_data.cuh"
#include "staged_bench_pingpong.hpp"

namespace {

int g_rank = 0;
using Clock = std::chrono::steady_clock;

constexpr std::size_t kKiB = std::size_t{1} << 10;
constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;
using staged_data::kGuard;
using staged_data::kPoison;
constexpr std::size_t kLoopBytes = 4 * kGiB;      // a timed loop moves at most this much (at least 3 ops)
constexpr std::size_t kRatioFrom = 64 * kMiB;     // the summary's ratios: sizes from here up

using staged_data::compare;
using staged_data::count_mismatches;
using staged_data::fill;
using staged_data::fill_pattern;
using staged_data::Mismatch;

// ---- command line ----

bool parse_count(const std::string& text, int* out) {
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0' || v < 1 || v > 1000000) return false;
  *out = static_cast<int>(v);
  return true;
}

void usage(std::FILE* f) {
  std::fprintf(f,
               "usage: mpirun -np 2 staged_bench [--csv FILE] [--commit C] [--machine M] [--date D]\n"
               "                                 [--min-bytes N] [--max-bytes N] [--iters N] [--reps N] [--call-times]\n"
               "  --max-bytes N  largest size (default 1G; K/M/G suffixes); sizes 4K, 16K, ... up to it\n"
               "  --min-bytes N  leaves out the sizes below N (default 4K)\n"
               "  --iters N      operations per timed loop (default 100; fewer where a loop would move\n"
               "                 more than 4 GiB, at least 3)\n"
               "  --reps N       timed loops per size and variant, taking turns; the fastest is reported\n"
               "                 (default 3)\n"
               "  --call-times   also print each meshmem call's host time, loop by loop\n"
               "  --idle S       instead of the table: CPU time of each process over S seconds of nothing\n"
               "                 without, with and after a graph of one captured staged put, and its replay time\n"
               "Sets MESHMEM_TRANSPORTS=staged,shm,mpi unless it is set already.\n");
}

// ---- rows ----

std::vector<bench::ResultRow> g_rows;

void print_row(const bench::ResultRow& r) {
  char lat[32] = "-", bw[32] = "-";
  if (r.latency_us >= 0) std::snprintf(lat, sizeof(lat), "%.2f", r.latency_us);
  if (r.bandwidth_gbps >= 0) std::snprintf(bw, sizeof(bw), "%.3f", r.bandwidth_gbps);
  std::printf("  %-10s %-17s %12lld %14s %16s\n", r.benchmark.c_str(), r.variant.c_str(), r.size_bytes, lat, bw);
  std::fflush(stdout);
}

void record(const std::string& bench, const std::string& variant, std::size_t size, double lat_us, double bw_gbps) {
  g_rows.push_back({bench, variant, 2, static_cast<long long>(size), lat_us, bw_gbps});
  print_row(g_rows.back());
}

double find_bw(const std::string& bench, const std::string& variant, std::size_t size) {
  for (const auto& r : g_rows)
    if (r.benchmark == bench && r.variant == variant && r.size_bytes == static_cast<long long>(size)) return r.bandwidth_gbps;
  return -1;
}

double find_lat(const std::string& bench, const std::string& variant, std::size_t size) {
  for (const auto& r : g_rows)
    if (r.benchmark == bench && r.variant == variant && r.size_bytes == static_cast<long long>(size)) return r.latency_us;
  return -1;
}

// Peer access from `from` to `to` off, if the driver could grant it at all (it is never
// enabled here; this undoes it if something else did).
void disable_peer_access(int from, int to, int home) {
  int can = 0;
  CK(cudaDeviceCanAccessPeer(&can, from, to));
  if (!can) return;
  CK(cudaSetDevice(from));
  const cudaError_t rc = cudaDeviceDisablePeerAccess(to);
  if (rc == cudaSuccess) {
    std::printf("# peer access GPU %d -> GPU %d was enabled: disabled for driver-staged\n", from, to);
  } else if (rc == cudaErrorPeerAccessNotEnabled) {
    (void)cudaGetLastError();  // the expected answer: clear it
  } else {
    bench::fail("cudaDeviceDisablePeerAccess(to)", cudaGetErrorString(rc), __FILE__, __LINE__);
  }
  CK(cudaSetDevice(home));
}

struct Setup {
  std::size_t max_bytes;
  int iters, reps;
  int idle_seconds;  // --idle
  bool call_times;   // --call-times
  int device, devices;
  bool transports_from_user;
  std::string transports;
  std::size_t min_bytes = 4096;  // --min-bytes
};

// ---- --idle ----

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

// The process's CPU time per second of wall time (1.0 = one core busy) over cfg.idle_seconds
// in which this program does nothing (both ranks, after a barrier).
double idle_cpu(const Setup& cfg) {
  MK(MPI_Barrier(MPI_COMM_WORLD));
  const double c0 = cpu_seconds();
  const auto t0 = Clock::now();
  std::this_thread::sleep_for(std::chrono::seconds(cfg.idle_seconds));
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  return (cpu_seconds() - c0) / wall;
}

int idle_cost(const Setup& cfg) {
  constexpr std::size_t kBytes = 4 * kKiB;
  constexpr int kReplays = 20;
  meshmem::Comm comm(MPI_COMM_WORLD);
  meshmem::Window win = comm.alloc(kBytes);
  void* src = nullptr;
  CK(cudaMalloc(&src, kBytes));
  CK(cudaMemset(src, 1, kBytes));
  cudaStream_t s = nullptr;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const int peer = 1 - g_rank;
  double cpu[3] = {};
  cpu[0] = idle_cpu(cfg);
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  comm.put(win, peer, 0, src, kBytes, s);
  cudaGraph_t graph = nullptr;
  CK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec = nullptr;
  CK(cudaGraphInstantiate(&exec, graph, 0));
  CK(cudaGraphDestroy(graph));
  CK(cudaGraphLaunch(exec, s));
  CK(cudaStreamSynchronize(s));
  cpu[1] = idle_cpu(cfg);
  // Replays: back to back, then each after 50 ms without one (the owner's poll slowed down).
  auto replay_us = [&](std::chrono::milliseconds quiet) {
    std::vector<double> us;
    for (int i = 0; i < kReplays; ++i) {
      if (quiet.count() > 0) std::this_thread::sleep_for(quiet);
      const auto t0 = Clock::now();
      CK(cudaGraphLaunch(exec, s));
      CK(cudaStreamSynchronize(s));
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
  };
  MK(MPI_Barrier(MPI_COMM_WORLD));
  const double back_to_back = replay_us(std::chrono::milliseconds(0));
  MK(MPI_Barrier(MPI_COMM_WORLD));
  const double after_quiet = replay_us(std::chrono::milliseconds(50));
  comm.quiet(s);
  CK(cudaStreamSynchronize(s));
  MK(MPI_Barrier(MPI_COMM_WORLD));
  CK(cudaGraphExecDestroy(exec));
  cpu[2] = idle_cpu(cfg);
  double all[2][5] = {};
  const double mine[5] = {cpu[0], cpu[1], cpu[2], back_to_back, after_quiet};
  MK(MPI_Gather(mine, 5, MPI_DOUBLE, all, 5, MPI_DOUBLE, 0, MPI_COMM_WORLD));
  if (g_rank == 0) {
    std::printf("# staged_bench --idle %d: MESHMEM_TRANSPORTS=%s, 2 ranks, GPU %d of %d each\n", cfg.idle_seconds,
                cfg.transports.c_str(), cfg.device, cfg.devices);
    std::printf("# process CPU time per second while this program does nothing (1.00 = one core)\n");
    std::printf("%-46s %12s %12s\n", "# state", "rank 0", "rank 1");
    const char* states[3] = {"Comm and a window, no graph", "+ a graph of one captured staged put (4 KiB)",
                             "the graph destroyed"};
    for (int i = 0; i < 3; ++i) std::printf("%-46s %12.3f %12.3f\n", states[i], all[0][i], all[1][i]);
    std::printf("# replay of that graph (launch to stream synchronised), median of %d, us\n", kReplays);
    std::printf("%-46s %12.1f %12.1f\n", "back to back", all[0][3], all[1][3]);
    std::printf("%-46s %12.1f %12.1f\n", "each after 50 ms without a replay", all[0][4], all[1][4]);
  }
  CK(cudaStreamDestroy(s));
  CK(cudaFree(src));
  return 0;
}

// Everything that holds a Comm or device memory; returns the exit status.
int measure(const Setup& cfg) {
  const bool origin = g_rank == 0;
  std::vector<std::size_t> sizes;
  for (std::size_t s = 4 * kKiB; s <= std::min(cfg.max_bytes, kGiB); s *= 4)
    if (s >= cfg.min_bytes) sizes.push_back(s);
  if (sizes.empty()) sizes.push_back(cfg.max_bytes);  // --max-bytes below 4 KiB: that size alone
  const std::size_t max_size = sizes.back();

  // Both ranks: their GPU's PCI bus id, for the header.
  char mine[32] = {}, bus[2][32] = {};
  CK(cudaDeviceGetPCIBusId(mine, sizeof(mine), cfg.device));
  MK(MPI_Gather(mine, sizeof(mine), MPI_CHAR, bus, sizeof(mine), MPI_CHAR, 0, MPI_COMM_WORLD));
  const bool shared_gpu = std::strcmp(bus[0], bus[1]) == 0;

  // Load the check kernels now: under CUDA's lazy loading a first launch while a staged
  // transfer's wait is in flight may wait for the context to go idle (transport_staged.hpp).
  cudaFuncAttributes attr{};
  CK(cudaFuncGetAttributes(&attr, fill_pattern));
  CK(cudaFuncGetAttributes(&attr, count_mismatches));

  meshmem::Comm comm(MPI_COMM_WORLD);
  const meshmem::TransportKind route = comm.transport(origin ? 1 : 0, meshmem::Memory::Device);
  int staged_here = route == meshmem::TransportKind::Staged ? 1 : 0, staged = 0;
  MK(MPI_Allreduce(&staged_here, &staged, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
  int status = 0;
  if (origin) {
    cudaDeviceProp prop{};
    CK(cudaGetDeviceProperties(&prop, cfg.device));
    std::printf("# meshmem staged_bench: 2 ranks, %d GPU(s) visible (%s); rank 0 on %s, rank 1 on %s%s\n", cfg.devices,
                prop.name, bus[0], bus[1], shared_gpu ? " (one GPU shared)" : "");
    if (const char* completion = std::getenv("MESHMEM_STAGED_COMPLETION"))
      std::printf("# MESHMEM_STAGED_COMPLETION=%s (each timed loop ends with comm.quiet: its puts landed)\n", completion);
    std::printf("# MESHMEM_TRANSPORTS=%s (%s)\n", cfg.transports.c_str(),
                cfg.transports_from_user ? "set by the user" : "set by staged_bench");
    std::printf("# rank 0 reaches rank 1's device window through: %s\n", meshmem::to_string(route));
    std::printf("# device setup: %s\n", comm.device_info().c_str());
    if (route == meshmem::TransportKind::None)
      std::fprintf(stderr, "staged_bench: no transport reaches rank 1: %s\n",
                   comm.unreachable_reason(1, meshmem::Memory::Device).c_str());
    if (!staged)
      std::fprintf(stderr,
                   "staged_bench: rank 1 is not reached through the staged transport (%s): no meshmem rows; "
                   "the baselines are still measured\n",
                   meshmem::to_string(route));
  }
  if (!staged) status = 1;

  meshmem::Window win = comm.alloc(max_size + kGuard);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  unsigned long long* counters = nullptr;
  CK(cudaMalloc(&counters, 2 * sizeof(unsigned long long)));

  // Rank 0's buffers: meshmem's source / destination (+ guard), the baselines' device buffer,
  // pinned host memory, and a buffer on another GPU of this process for driver-staged.
  void* mbuf = nullptr;
  void* cbuf = nullptr;
  void* hbuf = nullptr;
  void* obuf = nullptr;
  void* hbuf2 = nullptr;      // both-ways: the other GPU's side of the host memory
  cudaStream_t so = nullptr;  // both-ways: a stream on the other GPU
  cudaEvent_t both_fork = nullptr, both_join = nullptr;
  cudaStream_t s2 = nullptr;  // meshmem-2-streams: the second stream (rank 0's GPU)
  cudaEvent_t s2_join = nullptr;
  CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  CK(cudaEventCreateWithFlags(&s2_join, cudaEventDisableTiming));
  int other = -1;     // driver-staged: another GPU of this process
  int both_dev = -1;  // both-ways: the GPU of its h2d half (other, or this one)
  if (origin) {
    CK(cudaMalloc(&mbuf, max_size + kGuard));
    CK(cudaMalloc(&cbuf, max_size));
    CK(cudaMallocHost(&hbuf, max_size));
    CK(cudaMemset(cbuf, 0x5a, max_size));
    std::memset(hbuf, 0xa5, max_size);
    if (cfg.devices >= 2) {
      other = (cfg.device + 1) % cfg.devices;
      disable_peer_access(cfg.device, other, cfg.device);
      disable_peer_access(other, cfg.device, cfg.device);
    }
    both_dev = other >= 0 ? other : cfg.device;
    CK(cudaSetDevice(both_dev));
    CK(cudaMalloc(&obuf, max_size));
    CK(cudaMemset(obuf, 0x3c, max_size));
    CK(cudaStreamCreateWithFlags(&so, cudaStreamNonBlocking));
    CK(cudaEventCreateWithFlags(&both_join, cudaEventDisableTiming));
    CK(cudaDeviceSynchronize());
    CK(cudaSetDevice(cfg.device));
    CK(cudaMallocHost(&hbuf2, max_size));
    std::memset(hbuf2, 0x96, max_size);
    CK(cudaEventCreateWithFlags(&both_fork, cudaEventDisableTiming));
    if (other >= 0) {
      int can = 0;
      CK(cudaDeviceCanAccessPeer(&can, cfg.device, other));
      std::printf("# driver-staged: cudaMemcpyPeerAsync GPU %d <-> GPU %d, peer access not enabled (the driver %s grant it)\n",
                  cfg.device, other, can ? "could" : "could not");
    } else {
      std::printf("# driver-staged: skipped: rank 0 sees only one GPU (needs two visible to one process)\n");
    }
    CK(cudaDeviceSynchronize());
    std::printf("# sizes %zu .. %zu bytes; up to %d operations per timed loop (a loop moves at most %zu MiB), fastest of %d "
                "loops; latency = time / operations, bandwidth = bytes x operations / time (GB/s = 1e9 B/s), host-timed "
                "from the first enqueue to cudaStreamSynchronize\n",
                sizes.front(), max_size, cfg.iters, kLoopBytes / kMiB, cfg.reps);
    std::printf("# %-10s %-17s %12s %14s %16s\n", "benchmark", "variant", "size", "latency(us)", "bandwidth(GB/s)");
    std::fflush(stdout);
  }
  MK(MPI_Barrier(MPI_COMM_WORLD));

  bool failed = false;
  for (const char* bench_name : {"staged_put", "staged_get"}) {
    const bool put = bench_name[7] == 'p';
    for (std::size_t size : sizes) {
      const int iters = static_cast<int>(std::max<std::size_t>(3, std::min<std::size_t>(cfg.iters, kLoopBytes / size)));
      const int warm = static_cast<int>(std::max<std::size_t>(2, std::min<std::size_t>(10, kGiB / size)));
      const unsigned long long seed = (put ? 0x1000ull : 0x2000ull) + size;
      const std::size_t checked = size + kGuard;  // the buffers have kGuard bytes past max_size

      // The operations of rank 0, each enqueued on s; calls_ns: the host time inside each comm
      // call of the loop, in order (the first made with nothing of meshmem's in flight).
      std::vector<double> calls_ns;
      calls_ns.reserve(static_cast<std::size_t>(iters) + 2 * static_cast<std::size_t>(warm));
      auto meshmem_op = [&] {
        const auto t0 = Clock::now();
        if (put) comm.put(win, 1, 0, mbuf, size, s);
        else comm.get(mbuf, win, 1, 0, size, s);
        calls_ns.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count());
      };
      // Odd operations of a loop on s2; the loop's end joins s2 into s (join_s2).
      int turn = 0;
      auto meshmem_two_op = [&] {
        cudaStream_t on = (turn++ % 2 == 0) ? s : s2;
        const auto t0 = Clock::now();
        if (put) comm.put(win, 1, 0, mbuf, size, on);
        else comm.get(mbuf, win, 1, 0, size, on);
        calls_ns.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count());
      };
      // With MESHMEM_STAGED_COMPLETION=source a put's stream passes it before it landed: the
      // loop's end waits for the landing (a no-op with target completion).
      auto quiet_s = [&] { comm.quiet(s); };
      auto join_s2 = [&] {
        comm.quiet(s2);
        comm.quiet(s);
        CK(cudaEventRecord(s2_join, s2));
        CK(cudaStreamWaitEvent(s, s2_join, 0));
        turn = 0;
      };
      auto driver_op = [&] {
        if (put) CK(cudaMemcpyPeerAsync(obuf, other, cbuf, cfg.device, size, s));
        else CK(cudaMemcpyPeerAsync(cbuf, cfg.device, obuf, other, size, s));
      };
      auto d2h_op = [&] { CK(cudaMemcpyAsync(hbuf, cbuf, size, cudaMemcpyDeviceToHost, s)); };
      auto h2d_op = [&] { CK(cudaMemcpyAsync(cbuf, hbuf, size, cudaMemcpyHostToDevice, s)); };
      // The staged pipeline's two halves at once, each on its own GPU's copy engine: put, this
      // GPU to host and host to the other GPU; get, the reverse. What the pipeline can reach
      // when both directions share the host's memory and links (d2h and h2d run alone).
      // (The other GPU's stream is driven with that GPU current; both_join is one of its events.)
      auto both_op = [&] {
        CK(cudaEventRecord(both_fork, s));
        CK(cudaMemcpyAsync(put ? hbuf : cbuf, put ? cbuf : hbuf, size, put ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, s));
        CK(cudaSetDevice(both_dev));
        CK(cudaStreamWaitEvent(so, both_fork, 0));
        CK(cudaMemcpyAsync(put ? obuf : hbuf2, put ? hbuf2 : obuf, size, put ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, so));
        CK(cudaEventRecord(both_join, so));
        CK(cudaSetDevice(cfg.device));
        CK(cudaStreamWaitEvent(s, both_join, 0));
      };
      struct Variant {
        const char* name;
        bool active;
        std::function<void()> op;
        double best_s = 1e30, best_host_ns = 1e30, best_first_ns = 1e30, best_median_ns = 1e30;
        double best_first_op_ns = 1e30;  // the loop's first op, timed around it (any variant)
        std::function<void()> finish = [] {};  // after the loop's last op, before s is synchronised
        std::vector<double> later_ns;           // every loop's calls after its first two
      };
      Variant variants[] = {{"meshmem", staged != 0, meshmem_op, 1e30, 1e30, 1e30, 1e30, 1e30, quiet_s},
                            {"meshmem-2-streams", staged != 0, meshmem_two_op, 1e30, 1e30, 1e30, 1e30, 1e30, join_s2},
                            {"driver-staged", other >= 0, driver_op},
                            {"d2h", true, d2h_op},
                            {"h2d", true, h2d_op},
                            {"both-ways", both_dev >= 0, both_op}};

      // 1. The data: put: rank 0's source; get: rank 1's window.
      if (put && origin) fill(mbuf, size, seed, s);
      if (!put && !origin) fill(win.local(), size, seed, s);
      comm.barrier();
      // 2. Warm-up (rank 0; rank 1 waits in the barrier).
      if (origin) {
        for (auto& v : variants)
          if (v.active) {
            for (int w = 0; w < warm; ++w) v.op();
            v.finish();
          }
        CK(cudaStreamSynchronize(s));
      }
      comm.barrier();
      // 3. Poison the destination and the guard behind it.
      if (put && !origin) {
        CK(cudaMemsetAsync(win.local(), kPoison, checked, s));
        CK(cudaStreamSynchronize(s));
      }
      if (!put && origin) {
        CK(cudaMemsetAsync(mbuf, kPoison, checked, s));
        CK(cudaStreamSynchronize(s));
      }
      comm.barrier();
      // 4. The timed loops, the variants taking turns.
      if (origin) {
        for (int rep = 0; rep < cfg.reps; ++rep) {
          for (auto& v : variants) {
            if (!v.active) continue;
            CK(cudaStreamSynchronize(s));
            calls_ns.clear();
            const auto t0 = Clock::now();
            v.op();
            v.best_first_op_ns =
                std::min(v.best_first_op_ns, std::chrono::duration<double, std::nano>(Clock::now() - t0).count());
            for (int i = 1; i < iters; ++i) v.op();
            v.finish();
            CK(cudaStreamSynchronize(s));
            const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
            v.best_s = std::min(v.best_s, secs);
            if (!calls_ns.empty()) {
              const double total_ns = std::accumulate(calls_ns.begin(), calls_ns.end(), 0.0);
              v.best_host_ns = std::min(v.best_host_ns, total_ns / iters);
              v.best_first_ns = std::min(v.best_first_ns, calls_ns.front());
              if (calls_ns.size() > 2) v.later_ns.insert(v.later_ns.end(), calls_ns.begin() + 2, calls_ns.end());
              if (cfg.call_times) {
                std::printf("# %s %zu B rep %d host time per call (us):", bench_name, size, rep);
                for (double ns : calls_ns) std::printf(" %.1f", ns / 1e3);
                std::printf("\n");
              }
              std::nth_element(calls_ns.begin(), calls_ns.begin() + calls_ns.size() / 2, calls_ns.end());
              v.best_median_ns = std::min(v.best_median_ns, calls_ns[calls_ns.size() / 2]);
            }
          }
        }
      }
      comm.barrier();
      // 5. Every byte of the destination, and the guard behind it (still poison).
      unsigned long long bad[2] = {0, 0};
      if (staged && (put ? !origin : origin)) {
        const void* dst = put ? win.local() : mbuf;
        const Mismatch data = compare(dst, size, seed, -1, counters, s);
        const std::size_t guard = checked - size;
        const Mismatch tail = guard ? compare(static_cast<const char*>(dst) + size, guard, 0, kPoison, counters, s) : Mismatch{};
        bad[0] = data.count;
        bad[1] = tail.count;
        if (data.count != 0)
          std::fprintf(stderr, "rank %d: %s %zu B: CHECK FAILED: %llu of %zu bytes wrong, the first at offset %llu\n", g_rank,
                       bench_name, size, data.count, size, data.first);
        if (tail.count != 0)
          std::fprintf(stderr, "rank %d: %s %zu B: CHECK FAILED: %llu bytes written past the end (first at +%llu)\n", g_rank,
                       bench_name, size, tail.count, tail.first);
      }
      unsigned long long bad_all[2] = {0, 0};
      MK(MPI_Allreduce(bad, bad_all, 2, MPI_UNSIGNED_LONG_LONG, MPI_SUM, MPI_COMM_WORLD));
      const bool ok = bad_all[0] == 0 && bad_all[1] == 0;
      if (!ok) failed = true;

      if (origin) {
        for (auto& v : variants) {
          if (!v.active) continue;
          const bool is_meshmem = std::strcmp(v.name, "meshmem") == 0;
          if (std::strncmp(v.name, "meshmem", 7) == 0 && !ok) {
            std::printf("  %-10s %-17s %12zu   (left out: the data check failed)\n", bench_name, v.name, size);
            continue;
          }
          record(bench_name, v.name, size, v.best_s * 1e6 / iters, static_cast<double>(size) * iters / v.best_s / 1e9);
          if (is_meshmem) {
            record(bench_name, "meshmem-host-call", size, v.best_host_ns / 1e3, -1);
            record(bench_name, "meshmem-host-call-first", size, v.best_first_ns / 1e3, -1);
            record(bench_name, "meshmem-host-call-median", size, v.best_median_ns / 1e3, -1);
            if (!v.later_ns.empty()) {
              std::vector<double>& later = v.later_ns;
              std::nth_element(later.begin(), later.begin() + later.size() / 2, later.end());
              record(bench_name, "meshmem-host-call-later-median", size, later[later.size() / 2] / 1e3, -1);
            }
          }
          if (std::strcmp(v.name, "d2h") == 0) record(bench_name, "d2h-host-call-first", size, v.best_first_op_ns / 1e3, -1);
        }
      }
    }
  }

  // The put_signal ping-pong (sizes up to 64 MiB): one way, and each call's host time.
  if (staged) {
    std::vector<std::size_t> pingpong_sizes;
    for (std::size_t size : sizes)
      if (size <= 64 * kMiB) pingpong_sizes.push_back(size);
    if (!pingpong_sizes.empty()) {
      const auto rows = staged_pingpong::put_signal_pingpong(comm, win, pingpong_sizes, cfg.iters, cfg.reps, s, counters, g_rank);
      for (const auto& r : rows) {
        if (!r.ok) failed = true;
        if (!origin) continue;
        if (!r.ok) {
          std::printf("  %-10s %-17s %12zu   (left out: the data check failed)\n", "staged_put_signal", "meshmem-pingpong", r.size);
          continue;
        }
        record("staged_put_signal", "meshmem-pingpong-one-way", r.size, r.one_way_us, static_cast<double>(r.size) / r.one_way_us / 1e3);
        record("staged_put_signal", "meshmem-host-call", r.size, r.put_signal_call_us, -1);
        record("staged_put_signal", "meshmem-wait-host-call", r.size, r.wait_call_us, -1);
      }
    }
  }

  if (origin) {
    std::printf("\n# summary (ratios within this run; bandwidth)\n");
    bool any = false;
    for (const char* bench_name : {"staged_put", "staged_get"}) {
      for (std::size_t size : sizes) {
        if (size < kRatioFrom) continue;
        any = true;
        const double m = find_bw(bench_name, "meshmem", size), d2h = find_bw(bench_name, "d2h", size),
                     h2d = find_bw(bench_name, "h2d", size), drv = find_bw(bench_name, "driver-staged", size),
                     both = find_bw(bench_name, "both-ways", size), m2 = find_bw(bench_name, "meshmem-2-streams", size);
        const double link = std::min(d2h, h2d);
        char r1[32] = "n/a", r2[32] = "n/a", r3[32] = "n/a", r4[32] = "n/a";
        if (m > 0 && link > 0) std::snprintf(r1, sizeof(r1), "%.3f", m / link);
        if (m2 > 0 && link > 0) std::snprintf(r4, sizeof(r4), "%.3f", m2 / link);
        if (m > 0 && drv > 0) std::snprintf(r2, sizeof(r2), "%.3f", m / drv);
        if (m > 0 && both > 0) std::snprintf(r3, sizeof(r3), "%.3f", m / both);
        std::printf("%s %5zu MiB: meshmem %7.2f GB/s, d2h %7.2f, h2d %7.2f, driver-staged %7.2f, both-ways %7.2f; "
                    "meshmem/min(d2h,h2d) %s (target >= 0.9), meshmem/driver-staged %s (target >= 1.3), "
                    "meshmem/both-ways %s; meshmem-2-streams %7.2f GB/s, /min(d2h,h2d) %s\n",
                    bench_name, size / kMiB, m, d2h, h2d, drv, both, r1, r2, r3, m2, r4);
        if (drv > 0 && link > 0 && drv > 1.2 * std::max(d2h, h2d))
          std::printf("  note: driver-staged is faster than the host link: the driver took a direct path, so it is not a "
                      "host-staged baseline here\n");
      }
    }
    if (!any) std::printf("no size >= %zu MiB measured (--max-bytes): no bandwidth ratios\n", kRatioFrom / kMiB);
    for (const char* bench_name : {"staged_put", "staged_get"})
      for (const char* variant :
           {"meshmem-host-call", "meshmem-host-call-first", "meshmem-host-call-median", "meshmem-host-call-later-median",
            "d2h-host-call-first"}) {
        double lo = 1e30, hi = -1;
        std::size_t lo_size = 0, hi_size = 0;
        for (std::size_t size : sizes) {
          const double t = find_lat(bench_name, variant, size);
          if (t < 0) continue;
          if (t < lo) {
            lo = t;
            lo_size = size;
          }
          if (t > hi) {
            hi = t;
            hi_size = size;
          }
        }
        if (hi >= 0)
          std::printf("%s %s: %.2f us (%zu B) .. %.2f us (%zu B), max/min %.2f (%s)\n", bench_name, variant, lo, lo_size,
                      hi, hi_size, hi / lo,
                      std::strncmp(variant, "d2h", 3) == 0 ? "control: a CUDA call after the same pause"
                                                           : "target: independent of size");
      }
    if (failed) std::printf("DATA CHECK FAILED (see stderr): the failed sizes' meshmem rows are left out\n");
    if (!staged) std::printf("NOT STAGED: rank 1 was reached through %s, no meshmem rows\n", meshmem::to_string(route));
    std::fflush(stdout);
  }
  if (failed) status = 1;

  CK(cudaStreamSynchronize(s));
  CK(cudaStreamSynchronize(s2));
  CK(cudaStreamDestroy(s));
  CK(cudaStreamDestroy(s2));
  CK(cudaEventDestroy(s2_join));
  CK(cudaFree(counters));
  if (origin) {
    CK(cudaFree(mbuf));
    CK(cudaFree(cbuf));
    CK(cudaFreeHost(hbuf));
    if (obuf != nullptr) {
      CK(cudaFreeHost(hbuf2));
      CK(cudaEventDestroy(both_fork));
      CK(cudaSetDevice(both_dev));
      CK(cudaEventDestroy(both_join));
      CK(cudaStreamDestroy(so));
      CK(cudaFree(obuf));
      CK(cudaSetDevice(cfg.device));
    }
  }
  return status;  // win, then comm, go here (collective on both ranks)
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) {
    std::fprintf(stderr, "staged_bench: MPI_Init_thread failed\n");
    return 1;
  }
  MK(MPI_Comm_rank(MPI_COMM_WORLD, &g_rank));
  bench::check_rank() = g_rank;
  int nranks = 0;
  MK(MPI_Comm_size(MPI_COMM_WORLD, &nranks));

  bench::RunInfo run;
  run.date = bench::utc_now();
  Setup cfg{kGiB, 100, 3, 0, false, 0, 0, false, ""};
  bool bad = false, help = false;
  for (int i = 1; i < argc; ++i) {
    if (run.parse(argc, argv, i)) continue;
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    bool ok = true;
    if (a == "--help" || a == "-h") help = true;
    else if (a == "--max-bytes" && has_value) ok = bench::parse_bytes(argv[++i], &cfg.max_bytes);
    else if (a == "--min-bytes" && has_value) ok = bench::parse_bytes(argv[++i], &cfg.min_bytes);
    else if (a == "--iters" && has_value) ok = parse_count(argv[++i], &cfg.iters);
    else if (a == "--reps" && has_value) ok = parse_count(argv[++i], &cfg.reps);
    else if (a == "--idle" && has_value) ok = parse_count(argv[++i], &cfg.idle_seconds);
    else if (a == "--call-times") cfg.call_times = true;
    else {
      if (g_rank == 0) std::fprintf(stderr, "staged_bench: unknown or incomplete argument '%s'\n", a.c_str());
      bad = true;
    }
    if (!ok) {
      if (g_rank == 0) std::fprintf(stderr, "staged_bench: bad value for %s: '%s'\n", a.c_str(), argv[i]);
      bad = true;
    }
  }
  if (help || bad) {
    if (g_rank == 0) usage(help ? stdout : stderr);
    MPI_Finalize();
    return bad ? 2 : 0;
  }
  if (nranks != 2) {
    if (g_rank == 0) std::fprintf(stderr, "staged_bench needs exactly 2 ranks (mpirun -np 2), got %d\n", nranks);
    MPI_Finalize();
    return 2;
  }

  // Force the staged route where peer access would give ipc, before any Comm reads it.
  cfg.transports_from_user = std::getenv("MESHMEM_TRANSPORTS") != nullptr;
  if (setenv("MESHMEM_TRANSPORTS", "staged,shm,mpi", 0) != 0)
    bench::fail("setenv(\"MESHMEM_TRANSPORTS\", \"staged,shm,mpi\", 0)", std::strerror(errno), __FILE__, __LINE__);
  cfg.transports = std::getenv("MESHMEM_TRANSPORTS");

  // Every rank must have a GPU; they agree, so that none waits for the other.
  std::string why;
  int have_gpu = meshmem::gpu_available(&why) ? 1 : 0, all_have_gpu = 0;
  MK(MPI_Allreduce(&have_gpu, &all_have_gpu, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
  if (!all_have_gpu) {
    if (!have_gpu) std::printf("staged_bench (rank %d): no CUDA device: nothing measured (%s)\n", g_rank, why.c_str());
    MPI_Finalize();
    return 0;
  }

  // GPU = node-local rank % visible GPUs (as device_bench).
  MPI_Comm node;
  MK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int local = 0;
  MK(MPI_Comm_rank(node, &local));
  CK(cudaGetDeviceCount(&cfg.devices));
  cfg.device = local % cfg.devices;
  CK(cudaSetDevice(cfg.device));
  CK(cudaFree(nullptr));

  int status = 0;
  try {
    status = cfg.idle_seconds > 0 ? idle_cost(cfg) : measure(cfg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: staged_bench: %s\n", g_rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  if (g_rank == 0 && !run.csv.empty() &&
      !bench::write_results_csv(run.csv, bench::CsvMode::Append, run.date, run.commit, run.machine, g_rows, "staged_bench"))
    status = 1;
  MK(MPI_Comm_free(&node));
  MPI_Finalize();
  return status;
}
