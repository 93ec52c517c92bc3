// device_bench: device windows between the GPUs of one node, against the baselines of the
// same run: cudaMemcpyAsync into a CUDA-IPC-mapped peer buffer (+ stream memory ops for
// signals), NCCL send/recv and all-reduce, and meshmem's two barrier variants. Rank 0 ->
// rank 1 for the pairwise figures; barriers with 2 ranks and with every rank of the job.
// Prints OSU-style tables; --csv appends rows in the bench/results format.
//   mpirun -np 4 device_bench [--csv FILE] [--commit C] [--machine M] [--date D] [--quick]
//                             [--only put,put_signal,barrier,alloc]
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <meshmem/ipc/cuda_driver.hpp>
#include <meshmem/meshmem.hpp>
#include <string>
#include <vector>

#ifdef MESHMEM_BENCH_HAVE_NCCL
#include <nccl.h>
#endif

#include "bench_check.hpp"
#include "busy_work.cuh"
#include "results_csv.hpp"

namespace {

int g_rank = 0;

#ifdef MESHMEM_BENCH_HAVE_NCCL
#define NK(call)                                                                                     \
  do {                                                                                               \
    ncclResult_t rc_ = (call);                                                                       \
    if (rc_ != ncclSuccess) {                                                                        \
      std::fprintf(stderr, "rank %d: %s failed: %s\n", g_rank, #call, ncclGetErrorString(rc_));      \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                                  \
    }                                                                                                \
  } while (0)
#endif

struct Row {
  std::string benchmark, variant;
  int ranks;
  long long size;  // -1: none
  double latency_us, bandwidth_gbps;  // <0: none
};
std::vector<Row> g_rows;

void record(const std::string& bench, const std::string& variant, int ranks, long long size, double lat_us, double bw) {
  if (g_rank == 0) g_rows.push_back({bench, variant, ranks, size, lat_us, bw});
}

// GPU time of `body` (enqueueing `iters` operations on `s`) per operation, in microseconds.
template <class F>
double stream_time_us(cudaStream_t s, int iters, F&& body) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(cudaEventRecord(a, s));
  for (int i = 0; i < iters; ++i) body(i);
  CK(cudaEventRecord(b, s));
  CK(cudaEventSynchronize(b));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return ms * 1e3 / iters;
}

int iterations_for(std::size_t bytes, bool quick) {
  const double budget = quick ? 2e8 : 2e9;  // bytes moved per measurement
  int n = static_cast<int>(std::min(1000.0, std::max(20.0, budget / static_cast<double>(bytes))));
  // Latency sizes keep every iteration (the same 1000 as nvshmem_bench): --quick trims bandwidth sizes only.
  return quick && bytes > (64u << 10) ? std::max(10, n / 5) : n;
}

std::vector<std::size_t> bw_sizes(bool quick) {
  std::vector<std::size_t> v;
  for (std::size_t s = 8; s <= (std::size_t{1} << 30); s *= 4) v.push_back(s);
  if (v.back() != (std::size_t{1} << 30)) v.push_back(std::size_t{1} << 30);
  if (quick) v.erase(std::remove_if(v.begin(), v.end(), [](std::size_t s) { return s > (64u << 20); }), v.end());
  return v;
}

meshmem::Options with(void (*edit)(meshmem::Options&)) {
  meshmem::Options o = meshmem::Options::from_environment();
  edit(o);
  return o;
}

// A cudaMalloc'd buffer of rank `owner`, mapped on rank `user` through CUDA IPC.
struct IpcBuffer {
  void* local = nullptr;   // on owner
  void* mapped = nullptr;  // on user
  bool opened = false;
  IpcBuffer(std::size_t bytes, int owner, int user, MPI_Comm comm) {
    cudaIpcMemHandle_t h{};
    if (g_rank == owner) {
      CK(cudaMalloc(&local, bytes));
      CK(cudaMemset(local, 0, bytes));
      CK(cudaDeviceSynchronize());
      CK(cudaIpcGetMemHandle(&h, local));
    }
    MK(MPI_Bcast(&h, sizeof(h), MPI_BYTE, owner, comm));
    if (g_rank == user) {
      CK(cudaIpcOpenMemHandle(&mapped, h, cudaIpcMemLazyEnablePeerAccess));
      opened = true;
    }
    MK(MPI_Barrier(comm));
  }
  ~IpcBuffer() {
    if (opened) cudaIpcCloseMemHandle(mapped);
    MPI_Barrier(MPI_COMM_WORLD);
    if (local) cudaFree(local);
  }
};

struct BarrierTimes {
  double single = 0, burst = 0, busy_single = 0, busy_burst = 0;  // us per barrier
};

// Times `barrier` (enqueues one barrier on s) on the ranks of gc in the four patterns.
template <class F>
BarrierTimes time_barrier(MPI_Comm gc, cudaStream_t s, F&& barrier) {
  using clock = std::chrono::steady_clock;
  auto us_since = [](clock::time_point t0) { return std::chrono::duration<double, std::micro>(clock::now() - t0).count(); };
  BarrierTimes t;
  for (int w = 0; w < 50; ++w) barrier();
  CK(cudaStreamSynchronize(s));
  for (int busy = 0; busy < 2; ++busy) {
    auto one = [&] {
      if (busy) CK(bench::launch_busy(s));
      barrier();
    };
    MK(MPI_Barrier(gc));
    const int iters = busy ? 200 : 500;
    auto t0 = clock::now();
    for (int i = 0; i < iters; ++i) {
      one();
      CK(cudaStreamSynchronize(s));
    }
    (busy ? t.busy_single : t.single) = us_since(t0) / iters;
    double best = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
      MK(MPI_Barrier(gc));
      t0 = clock::now();
      for (int i = 0; i < 200; ++i) one();
      CK(cudaStreamSynchronize(s));
      best = std::min(best, us_since(t0) / 200);
    }
    (busy ? t.busy_burst : t.burst) = best;
  }
  return t;
}

// The slowest rank's figures (as the NVSHMEM benchmark reports); ranks outside the group
// pass zeros. Collective over MPI_COMM_WORLD.
void record_barrier(const std::string& variant, int group, const BarrierTimes& mine, bool busy_only) {
  double in[4] = {mine.single, mine.burst, mine.busy_single, mine.busy_burst}, worst[4] = {0, 0, 0, 0};
  MK(MPI_Reduce(in, worst, 4, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD));
  if (!busy_only) {
    record("barrier", variant, group, -1, worst[0], -1);
    record("barrier200", variant, group, -1, worst[1], -1);
  }
  record("barrier_busy", variant, group, -1, worst[2], -1);
  record("barrier200_busy", variant, group, -1, worst[3], -1);
}

void print_tables() {
  std::map<std::pair<std::string, std::string>, std::vector<const Row*>> by;
  std::vector<std::pair<std::string, std::string>> order;
  for (const Row& r : g_rows) {
    auto key = std::make_pair(r.benchmark + (r.benchmark.rfind("barrier", 0) == 0 ? " (" + std::to_string(r.ranks) + " ranks)" : ""), r.variant);
    if (!by.count(key)) order.push_back(key);
    by[key].push_back(&r);
  }
  for (const auto& key : order) {
    std::printf("\n# %s, %s\n# %12s %14s %16s\n", key.first.c_str(), key.second.c_str(), "size", "latency(us)", "bandwidth(GB/s)");
    for (const Row* r : by[key]) {
      std::printf("  %12s %14s %16s\n", r->size < 0 ? "-" : std::to_string(r->size).c_str(),
                  r->latency_us < 0 ? "-" : std::to_string(r->latency_us).substr(0, 8).c_str(),
                  r->bandwidth_gbps < 0 ? "-" : std::to_string(r->bandwidth_gbps).substr(0, 8).c_str());
    }
  }
  std::fflush(stdout);
}

double find(const std::string& bench, const std::string& variant, long long size, int ranks, bool bw) {
  for (const Row& r : g_rows)
    if (r.benchmark == bench && r.variant == variant && r.size == size && (ranks < 0 || r.ranks == ranks))
      return bw ? r.bandwidth_gbps : r.latency_us;
  return -1;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  bench::check_rank() = g_rank;
  int nranks = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &nranks);
  std::string csv, commit = "unknown", machine = "unknown", date = bench::utc_now().substr(0, 10);
  bool quick = false;
  std::string only;  // comma-separated sections; empty: all
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--csv") csv = next();
    else if (a == "--commit") commit = next();
    else if (a == "--machine") machine = next();
    else if (a == "--date") date = next();
    else if (a == "--quick") quick = true;
    else if (a == "--only") only = "," + next() + ",";
  }
  auto wants = [&](const char* section) { return only.empty() || only.find("," + std::string(section) + ",") != std::string::npos; };
  if (nranks < 2) {
    if (g_rank == 0) std::fprintf(stderr, "device_bench needs at least 2 ranks\n");
    MPI_Finalize();
    return 2;
  }
  std::string why;
  if (!meshmem::gpu_available(&why)) {
    if (g_rank == 0) std::fprintf(stderr, "device_bench: no GPU: %s\n", why.c_str());
    MPI_Finalize();
    return 2;
  }
  MPI_Comm node;
  MK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int local = 0, devices = 0;
  MK(MPI_Comm_rank(node, &local));
  CK(cudaGetDeviceCount(&devices));
  CK(cudaSetDevice(local % devices));
  CK(cudaFree(nullptr));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const auto& drv = meshmem::ipc::cuda_driver();
  const bool pair = g_rank < 2;  // ranks 0 and 1 run the pairwise figures
  MPI_Comm pair_comm;
  MK(MPI_Comm_split(MPI_COMM_WORLD, pair ? 0 : 1, g_rank, &pair_comm));

  if (g_rank == 0) {
    cudaDeviceProp p{};
    CK(cudaGetDeviceProperties(&p, 0));
    std::printf("# meshmem device_bench: %d ranks, %d GPUs (%s), machine %s, commit %s, date %s\n", nranks, devices, p.name,
                machine.c_str(), commit.c_str(), date.c_str());
  }

  if (wants("put")) {
    // ---- put / get bandwidth and latency ----
    meshmem::Comm comm(MPI_COMM_WORLD);
    meshmem::Comm comm_ce(MPI_COMM_WORLD, with([](meshmem::Options& o) { o.set("MESHMEM_IPC_SM_COPY_MAX", "0"); }));
    meshmem::Comm comm_sm(MPI_COMM_WORLD, with([](meshmem::Options& o) { o.set("MESHMEM_IPC_SM_COPY_MAX", "1099511627776"); }));
    const std::size_t max = quick ? (64u << 20) : (std::size_t{1} << 30);
    void* src = nullptr;
    CK(cudaMalloc(&src, max));
    CK(cudaMemset(src, 0x5a, max));
    CK(cudaDeviceSynchronize());
    IpcBuffer peer(max, 1, 0, MPI_COMM_WORLD);
    struct V {
      const char* name;
      meshmem::Comm* comm;
    } variants[] = {{"meshmem", &comm}, {"meshmem-ce", &comm_ce}, {"meshmem-sm", &comm_sm}};
    for (const char* op : {"put", "get"}) {
      std::vector<meshmem::Window> wins;
      for (auto& v : variants) wins.push_back(v.comm->alloc(max));
      for (std::size_t size : bw_sizes(quick)) {
        const int iters = iterations_for(size, quick);
        for (std::size_t k = 0; k < 4; ++k) {
          MK(MPI_Barrier(MPI_COMM_WORLD));
          if (g_rank != 0) continue;
          std::string name = k < 3 ? variants[k].name : "cuda-memcpy-peer";
          auto one = [&](int) {
            if (k < 3) {
              if (op[0] == 'p') variants[k].comm->put(wins[k], 1, 0, src, size, s);
              else variants[k].comm->get(src, wins[k], 1, 0, size, s);
            } else {
              if (op[0] == 'p') CK(cudaMemcpyAsync(peer.mapped, src, size, cudaMemcpyDefault, s));
              else CK(cudaMemcpyAsync(src, peer.mapped, size, cudaMemcpyDefault, s));
            }
          };
          for (int w = 0; w < std::min(iters, 20); ++w) one(w);  // warm-up
          // Latency sizes: the best of 5 loops (as nvshmem_bench): GPU clocks and the host wander.
          double us = stream_time_us(s, iters, one);
          for (int rep = 1; size <= (64u << 10) && rep < 5; ++rep) us = std::min(us, stream_time_us(s, iters, one));
          record(op, name, 2, static_cast<long long>(size), size <= (64u << 10) ? us : -1, size / us / 1e3);
        }
      }
      MK(MPI_Barrier(MPI_COMM_WORLD));
    }
#ifdef MESHMEM_BENCH_HAVE_NCCL
    // NCCL send/recv bandwidth, rank 0 -> rank 1.
    {
      ncclUniqueId id;
      if (g_rank == 0) NK(ncclGetUniqueId(&id));
      MK(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, pair_comm));
      ncclComm_t nc = nullptr;
      if (pair) NK(ncclCommInitRank(&nc, 2, id, g_rank));
      void* dst = nullptr;
      CK(cudaMalloc(&dst, max));
      for (std::size_t size : bw_sizes(quick)) {
        const int iters = iterations_for(size, quick);
        MK(MPI_Barrier(MPI_COMM_WORLD));
        if (!pair) continue;
        auto one = [&](int) {
          if (g_rank == 0) NK(ncclSend(src, size, ncclChar, 1, nc, s));
          else NK(ncclRecv(dst, size, ncclChar, 0, nc, s));
        };
        for (int w = 0; w < std::min(iters, 20); ++w) one(w);
        const double us = stream_time_us(s, iters, one);
        record("put", "nccl", 2, static_cast<long long>(size), size <= (64u << 10) ? us : -1, size / us / 1e3);
      }
      MK(MPI_Barrier(MPI_COMM_WORLD));
      // put_signal peer: NCCL ping-pong one-way latency.
      for (std::size_t size : {std::size_t{8}, std::size_t{4096}, std::size_t{65536}}) {
        const int iters = 1000;
        MK(MPI_Barrier(MPI_COMM_WORLD));
        if (!pair) continue;
        auto one = [&](int) {
          NK(ncclGroupStart());
          if (g_rank == 0) NK(ncclSend(src, size, ncclChar, 1, nc, s));
          else NK(ncclRecv(dst, size, ncclChar, 0, nc, s));
          NK(ncclGroupEnd());
          NK(ncclGroupStart());
          if (g_rank == 1) NK(ncclSend(src, size, ncclChar, 0, nc, s));
          else NK(ncclRecv(dst, size, ncclChar, 1, nc, s));
          NK(ncclGroupEnd());
        };
        for (int w = 0; w < 100; ++w) one(w);
        MK(MPI_Barrier(pair_comm));
        const double us = stream_time_us(s, iters, one) / 2;
        record("put_signal", "nccl", 2, static_cast<long long>(size), us, size / us / 1e3);
      }
      MK(MPI_Barrier(MPI_COMM_WORLD));
      if (nc) NK(ncclCommDestroy(nc));
      CK(cudaFree(dst));
    }
#endif
    CK(cudaFree(src));
  }

  if (wants("put_signal")) {
    // ---- put_signal one-way latency: ping-pong / 2, all on the GPU ----
    void* src = nullptr;
    CK(cudaMalloc(&src, 1 << 20));
    CK(cudaMemset(src, 1, 1 << 20));
    CK(cudaDeviceSynchronize());
    std::uint64_t epoch = 0;
    // meshmem (defaults); memop-wait: waits in the stream's front end; fused: every size one
    // copy+signal kernel; ce: copy engine then a stream write, at every size.
    const struct {
      const char* name;
      const char* knob;
      const char* value;
    } ps_variants[] = {{"meshmem", nullptr, nullptr},
                       {"meshmem-memop-wait", "MESHMEM_STREAM_WAIT", "memop"},
                       {"meshmem-fused", "MESHMEM_IPC_FUSED_SIGNAL_MAX", "1048576"},
                       {"meshmem-ce", "MESHMEM_IPC_FUSED_SIGNAL_MAX", "0"}};
    for (const auto& variant : ps_variants) {
    meshmem::Options options = meshmem::Options::from_environment();
    if (variant.knob != nullptr) options.set(variant.knob, variant.value);
    meshmem::Comm comm(MPI_COMM_WORLD, options);
    if (g_rank == 0 && variant.knob == nullptr) std::printf("# default device setup: %s\n", comm.device_info().c_str());
    meshmem::Window win = comm.alloc(1 << 20);
    meshmem::Signals sig = comm.alloc_signals(1);
    epoch = 0;
    for (std::size_t size : {std::size_t{8}, std::size_t{64}, std::size_t{4096}, std::size_t{16384},
                              std::size_t{32768}, std::size_t{65536}, std::size_t{262144}}) {
      const int iters = 1000;
      auto one = [&](int) {
        ++epoch;
        if (g_rank == 0) {
          comm.put_signal(win, 1, 0, src, size, sig, 0, epoch, meshmem::SignalOp::Set, s);
          comm.wait_until(sig, 0, meshmem::Cmp::GE, epoch, s);
        } else if (g_rank == 1) {
          comm.wait_until(sig, 0, meshmem::Cmp::GE, epoch, s);
          comm.put_signal(win, 0, 0, src, size, sig, 0, epoch, meshmem::SignalOp::Set, s);
        }
      };
      for (int w = 0; w < 100; ++w) one(w);
      CK(cudaStreamSynchronize(s));
      MK(MPI_Barrier(MPI_COMM_WORLD));
      const double us = (pair ? stream_time_us(s, iters, one) : 0) / 2;
      record("put_signal", variant.name, 2, static_cast<long long>(size), us, size / us / 1e3);
      MK(MPI_Barrier(MPI_COMM_WORLD));
    }
    }
    // The baseline of the issue: cudaMemcpyAsync into a CUDA-IPC-mapped buffer, then
    // cuStreamWriteValue64 on the peer's flag; cuStreamWaitValue64 on one's own.
    {
      IpcBuffer to1((1 << 20) + 64, 1, 0, MPI_COMM_WORLD);
      IpcBuffer to0((1 << 20) + 64, 0, 1, MPI_COMM_WORLD);
      void* remote = g_rank == 0 ? to1.mapped : to0.mapped;  // the peer's buffer, mapped here
      void* mine = g_rank == 0 ? to0.local : to1.local;
      for (std::size_t size : {std::size_t{8}, std::size_t{64}, std::size_t{4096}, std::size_t{16384},
                              std::size_t{32768}, std::size_t{65536}, std::size_t{262144}}) {
        const int iters = 1000;
        auto send = [&](std::uint64_t e) {
          CK(cudaMemcpyAsync(static_cast<char*>(remote) + 64, src, size, cudaMemcpyDefault, s));
          CU(drv.cuStreamWriteValue64(s, reinterpret_cast<CUdeviceptr>(remote), e, 0));
        };
        auto wait = [&](std::uint64_t e) {
          CU(drv.cuStreamWaitValue64(s, reinterpret_cast<CUdeviceptr>(mine), e, CU_STREAM_WAIT_VALUE_GEQ));
        };
        auto one = [&](int) {
          ++epoch;
          if (g_rank == 0) { send(epoch); wait(epoch); }
          else if (g_rank == 1) { wait(epoch); send(epoch); }
        };
        for (int w = 0; w < 100; ++w) one(w);
        CK(cudaStreamSynchronize(s));
        MK(MPI_Barrier(MPI_COMM_WORLD));
        const double us = (pair ? stream_time_us(s, iters, one) : 0) / 2;
        record("put_signal", "cuda-memcpy-peer", 2, static_cast<long long>(size), us, size / us / 1e3);
        MK(MPI_Barrier(MPI_COMM_WORLD));
      }
    }
    CK(cudaFree(src));
  }

  // ---- barrier(stream): 2 ranks and all ranks ----
  // Idle stream (the issue's pattern): single = { barrier; sync }, burst = 200 back to back.
  // Busy stream: the same behind a 20 us kernel, so the barrier must be met on the GPU;
  // "busy-work-only" is that kernel alone, the floor of the busy rows.
  for (int group : {2, nranks}) {
    if (!wants("barrier")) break;
    MPI_Comm gc;
    MK(MPI_Comm_split(MPI_COMM_WORLD, g_rank < group ? 0 : 1, g_rank, &gc));
    const bool in = g_rank < group;
    if (in) {
      const BarrierTimes t = time_barrier(gc, s, [&] {});
      record_barrier("busy-work-only", group, t, true);
    } else {
      record_barrier("busy-work-only", group, BarrierTimes{}, true);
    }
    struct B {
      const char* name;
      const char* kind;  // MESHMEM_BARRIER
    } kinds[] = {{"meshmem", "auto"}, {"meshmem-meeting", "meeting"}, {"meshmem-flag", "flag"}, {"meshmem-event", "event"}};
    for (const B& b : kinds) {
      auto o = meshmem::Options::from_environment();
      o.set("MESHMEM_BARRIER", b.kind);
      meshmem::Comm comm(gc, o);  // ranks outside the group build their own Comm: harmless
      BarrierTimes t;
      if (in) t = time_barrier(gc, s, [&] { comm.barrier(s); });
      if (g_rank == 0) std::printf("# barrier %s, %d ranks: %s\n", b.name, group, comm.device_info().c_str());
      record_barrier(b.name, group, t, false);
      MK(MPI_Barrier(MPI_COMM_WORLD));
    }
#ifdef MESHMEM_BENCH_HAVE_NCCL
    {
      ncclUniqueId id;
      if (g_rank == 0) NK(ncclGetUniqueId(&id));
      MK(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD));
      ncclComm_t nc = nullptr;
      if (in) NK(ncclCommInitRank(&nc, group, id, g_rank));
      int* buf = nullptr;
      CK(cudaMalloc(&buf, sizeof(int)));
      BarrierTimes t;
      if (in) {
        t = time_barrier(gc, s, [&] { NK(ncclAllReduce(buf, buf, 1, ncclInt, ncclSum, nc, s)); });
        NK(ncclCommDestroy(nc));
      }
      record_barrier("nccl", group, t, false);
      CK(cudaFree(buf));
      MK(MPI_Barrier(MPI_COMM_WORLD));
    }
#endif
    MK(MPI_Comm_free(&gc));
    if (nranks == 2) break;
  }

  // ---- alloc + map of 1 GiB, every rank ----
  if (wants("alloc")) {
    meshmem::Comm comm(MPI_COMM_WORLD);
    std::vector<double> times;
    for (int rep = 0; rep < (quick ? 2 : 5); ++rep) {
      MK(MPI_Barrier(MPI_COMM_WORLD));
      const double t0 = MPI_Wtime();
      meshmem::Window w = comm.alloc(std::size_t{1} << 30);
      double mine = (MPI_Wtime() - t0) * 1e6, worst = 0;
      MK(MPI_Reduce(&mine, &worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD));
      times.push_back(worst);
    }
    if (g_rank == 0) {
      std::printf("# alloc+map 1 GiB, each repeat (ms):");
      for (double t : times) std::printf(" %.1f", t / 1e3);
      std::printf("\n");
    }
    std::sort(times.begin(), times.end());
    record("alloc", "meshmem", nranks, 1ll << 30, times[times.size() / 2], -1);
  }

  if (g_rank == 0) {
    print_tables();
    std::printf("\n# summary (ratios within this run)\n");
    const double gib = static_cast<double>(1ll << 30);
    const long long top = quick ? (64ll << 20) : (1ll << 30);
    auto ratio = [](double a, double b) { return (a > 0 && b > 0) ? a / b : -1.0; };
    std::printf("put %lld B bandwidth: meshmem %.1f GB/s, meshmem-sm %.1f, cuda-memcpy-peer %.1f, nccl %.1f; meshmem/memcpy-peer %.3f\n", top,
                find("put", "meshmem", top, -1, true), find("put", "meshmem-sm", top, -1, true),
                find("put", "cuda-memcpy-peer", top, -1, true), find("put", "nccl", top, -1, true),
                ratio(find("put", "meshmem", top, -1, true), find("put", "cuda-memcpy-peer", top, -1, true)));
    std::printf("put 8 B stream time: meshmem %.2f us, meshmem-ce %.2f, cuda-memcpy-peer %.2f\n", find("put", "meshmem", 8, -1, false),
                find("put", "meshmem-ce", 8, -1, false), find("put", "cuda-memcpy-peer", 8, -1, false));
    std::printf("put_signal 8 B one-way: meshmem %.2f us, meshmem-memop-wait %.2f, memcpy+writevalue %.2f, nccl %.2f\n",
                find("put_signal", "meshmem", 8, -1, false), find("put_signal", "meshmem-memop-wait", 8, -1, false),
                find("put_signal", "cuda-memcpy-peer", 8, -1, false), find("put_signal", "nccl", 8, -1, false));
    for (int g : {2, nranks}) {
      for (const char* v : {"meshmem", "meshmem-meeting", "meshmem-flag", "meshmem-event", "nccl"})
        std::printf("barrier %d ranks, %-15s idle stream: +sync %6.2f us, 200 back to back %5.2f us; behind a 20 us kernel: "
                    "+sync %6.2f us, back to back %6.2f us (kernel alone %.2f / %.2f)\n",
                    g, v, find("barrier", v, -1, g, false), find("barrier200", v, -1, g, false),
                    find("barrier_busy", v, -1, g, false), find("barrier200_busy", v, -1, g, false),
                    find("barrier_busy", "busy-work-only", -1, g, false), find("barrier200_busy", "busy-work-only", -1, g, false));
      if (nranks == 2) break;
    }
    std::printf("alloc+map 1 GiB, %d ranks: %.1f ms\n", nranks, find("alloc", "meshmem", 1ll << 30, -1, false) / 1e3);
    (void)gib;
    if (!csv.empty()) {
      std::vector<bench::ResultRow> out;
      for (const Row& r : g_rows) out.push_back({r.benchmark, r.variant, r.ranks, r.size, r.latency_us, r.bandwidth_gbps});
      bench::write_results_csv(csv, bench::CsvMode::Append, date, commit, machine, out, "device_bench");
    }
  }
  CK(cudaStreamDestroy(s));
  MPI_Comm_free(&pair_comm);
  MPI_Comm_free(&node);
  MPI_Finalize();
  return 0;
}
