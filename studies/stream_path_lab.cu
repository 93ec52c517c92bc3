// stream_path_lab: the mechanism issue 54 proposes for small staged transfers, without meshmem.
// The calling thread enqueues stream work only: a device-to-host copy from the source into a
// pinned slot on the caller's stream, an event, the host-to-device copy from the slot into the
// target buffer on a stream of the target's GPU in this process (the signal write after it),
// and the caller's stream joining back (an event); no host thread between the copies, the
// slot's reuse ordered on the GPU. Two ranks of one node: the target buffer is the other
// rank's cuMemCreate allocation imported here (POSIX descriptor: pidfd_getfd, or SCM_RIGHTS);
// the slots are node-shared host memory (shm_open, mmap, cudaHostRegister) as the node pool.
// Rank 0 is the initiator except in the ping-pong. Each rank uses GPU (node rank % visible
// GPUs), so ranks share a GPU on a one-GPU machine and have one each on a larger one;
// --same-gpu puts both on GPU 0.
//
// Rows, per size (us per operation: the mean over the timed operations, which come after
// --warmup untimed ones and are as many as fit --budget-ms, between --min-iters and --iters):
//   ref d2h              cudaMemcpyAsync source -> slot, back to back on the caller's stream
//   ref h2d              slot -> peer memory, back to back on this process's stream of the target GPU
//   ref d2h>h2d local    the put's chain (d2h, event, h2d, event back) into this rank's own memory
//   ref driver d2d       cudaMemcpyAsync (cudaMemcpyPeerAsync across GPUs) source -> peer memory
//   stream-path put      N puts back to back, each joined back (complete at the target when the
//                        caller's stream passed it), one synchronize: total / N
//   ... joined at end    the same, the caller's stream waiting only for a slot's previous
//                        copy out (the source put of OpenSHMEM), one join at the end
//   ... sync each        each put followed by cudaStreamSynchronize (dependent latency)
//   put_signal ping-pong rank 0 puts + signals (cuStreamWriteValue64, or --signal kernel) into
//                        rank 1's memory; rank 1's stream waits (cuStreamWaitValue64 on its own
//                        memory), then puts + signals back; one way = round trip / 2
//   graph put[_signal]   one put (fork and join across the two streams) captured into a graph,
//                        replayed --iters times: per replay
//   "| target busy (B)"  h2d, driver d2d, put, put sync each and the ping-pong again while rank 1
//                        runs --busy-us kernels back to back on a stream of its own (B: one block
//                        of 32 threads, or "full": 8 blocks of 256 per SM), so that rank 0's work
//                        on that GPU waits for the driver's time slice (studies/timeslice_lab)
// host us: the initiator's enqueue time per operation. Every destination byte a row wrote is
// checked after it (fresh random data per size; destinations poisoned before the timed part;
// with 4 slots and 5 destination regions, a slot reused before its copy out shows).
//   mpirun -np 2 stream_path_lab [--sizes 8,16,64,...,4M] [--iters 1000] [--warmup 20]
//     [--min-iters 50] [--budget-ms 40] [--busy 1,full|none] [--busy-us 1000]
//     [--signal memop|kernel|copy] [--same-gpu] [--pad-d2h BYTES] [--pad-h2d BYTES] [--limit-s 300]
//     [--csv F --commit C --machine M --date D]
// --pad-d2h / --pad-h2d: each put's copy into / out of its slot copies at least that many bytes
// (the ping-pong step between 1 and 2 KiB: which copy is handled otherwise below it).
#include <cuda.h>
#include <cuda_runtime.h>
#include <mpi.h>
#include <csignal>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench_check.hpp"
#include "results_csv.hpp"
#include "stream_path_lab.hpp"

namespace {

using spl::Event;
using spl::now_us;
using spl::OnDevice;

constexpr int kSlots = 4;                   // pinned slots per initiator
constexpr int kRegions = 5;                 // destination regions (not a multiple of kSlots)
constexpr std::uint8_t kPoison = 0xA5;
constexpr std::size_t kSignalBytes = 4096;  // after the regions: ping-pong word at 0, graph word at 128
constexpr std::uint64_t kGraphValue = 0x5eed5eed5eedull;

__global__ void signal_kernel(std::uint64_t* word, std::uint64_t value) {
  *reinterpret_cast<volatile std::uint64_t*>(word) = value;
}

struct Opts {
  std::vector<std::size_t> sizes;
  long iters = 1000, warmup = 20, min_iters = 50;
  double budget_ms = 40;
  std::vector<std::string> busy = {"1", "full"};
  std::uint64_t busy_us = 1000;
  bool signal_kernel = false, signal_copy = false, same_gpu = false;
  std::size_t pad_d2h = 0, pad_h2d = 0;  // each put's copy into / out of its slot at least this long
  unsigned limit_s = 300;
  bench::RunInfo run;
};

enum class Kind { D2H, H2D, Chain, D2D, Put, PutSource, PutDependent, PingPong, GraphPut, GraphPutSignal };
enum class Dst { Slots, Own, Peer };  // where a row's bytes land: the initiator's slots, its memory, the peer's

// Where a put lands: the peer's memory on its GPU, or this rank's own (the local chain).
struct Route {
  int device = 0;                // the memory's GPU, as this process numbers it
  cudaStream_t stream = nullptr;  // this process's stream of that GPU
  std::uint8_t* dst = nullptr;    // kRegions regions, a stride apart
  std::uint64_t* word = nullptr;  // the ping-pong signal
  std::uint64_t* graph_word = nullptr;
  std::vector<Event> landed;      // per slot, of `device`: the copy out of the slot done
};

struct Lab {
  int rank = 0, peer = 1, dev = 0;
  bool signal_kernel = false;
  bool signal_copy = false;               // --signal copy: an 8-byte copy from one of `values`
  std::uint64_t* values = nullptr;        // pinned: kValues rotating words, then the graph's value
  unsigned long long next_value = 0;
  std::size_t pad_d2h = 0, pad_h2d = 0;  // --pad-d2h / --pad-h2d
  std::size_t stride = 0;          // a region's or a slot's bytes
  cudaStream_t cs = nullptr;       // the caller's stream
  std::uint8_t* src = nullptr;     // kRegions regions of device memory
  std::uint8_t* mine = nullptr;    // this rank's exported memory: kRegions regions, then the words
  std::uint8_t* slots = nullptr;   // this rank's kSlots slots in the shared pool
  std::uint64_t* my_word = nullptr;
  std::uint64_t* my_graph_word = nullptr;
  std::vector<Event> read;         // per slot, of `dev`: the copy into the slot done
  Event fork, join;                // the captured put's (dev, target GPU)
  Route remote, local;
  std::uint64_t seq = 0;           // ping-pong values, the same sequence on both ranks
  bool capturing = false;
  std::string capture_error;       // the first failed call of a capture
};

// Outside a capture a failed call ends the job; inside one the first failure is kept (a graph
// row then says it could not be captured).
void step(Lab& L, cudaError_t rc, const char* call, int line) {
  if (rc == cudaSuccess) return;
  if (!L.capturing) bench::fail(call, cudaGetErrorString(rc), __FILE__, line);
  if (L.capture_error.empty()) L.capture_error = std::string(call) + ": " + cudaGetErrorName(rc);
}
void step(Lab& L, CUresult rc, const char* call, int line) {
  if (rc == CUDA_SUCCESS) return;
  const char* name = nullptr;
  if (cuGetErrorName(rc, &name) != CUDA_SUCCESS) name = "?";
  if (!L.capturing) bench::fail(call, std::string("CUresult ") + name, __FILE__, line);
  if (L.capture_error.empty()) L.capture_error = std::string(call) + ": " + name;
}
#define PK(call) step(L, (call), #call, __LINE__)

constexpr std::size_t kValues = 64;  // more than a row keeps in flight: every signalled row joins each op

void write_signal(Lab& L, cudaStream_t s, std::uint64_t* word, std::uint64_t value) {
  if (L.signal_copy) {
    // A copy engine's write, in stream order after the data: no work for the GPU's front end or
    // SMs, which the target's process may hold for its time slice.
    std::uint64_t* from = L.values + kValues;  // the captured put's: kGraphValue, never rewritten
    if (!L.capturing) {
      from = L.values + L.next_value++ % kValues;
      *from = value;
    }
    PK(cudaMemcpyAsync(word, from, sizeof(std::uint64_t), cudaMemcpyHostToDevice, s));
  } else if (L.signal_kernel) {
    signal_kernel<<<1, 1, 0, s>>>(word, value);
    PK(cudaGetLastError());
  } else {
    PK(cuStreamWriteValue64(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(word), value,
                            CU_STREAM_WRITE_VALUE_DEFAULT));
  }
}

void wait_signal(Lab& L, std::uint64_t value) {
  PK(cuStreamWaitValue64(reinterpret_cast<CUstream>(L.cs), reinterpret_cast<CUdeviceptr>(L.my_word), value,
                         CU_STREAM_WAIT_VALUE_GEQ));
}

// The i-th put of a row: source region i % kRegions -> slot i % kSlots on the caller's stream;
// `to`'s stream waits for it (`read`), copies the slot into destination region i % kRegions,
// writes *word = value where a word is given and records `landed`. With `join` the caller's
// stream waits for `landed` (the put complete at its target once the stream passed it); without,
// it waits only before it fills that slot again.
void put(Lab& L, Route& to, std::size_t bytes, long i, bool join, std::uint64_t* word, std::uint64_t value,
         cudaEvent_t read, cudaEvent_t landed) {
  std::uint8_t* slot = L.slots + static_cast<std::size_t>(i % kSlots) * L.stride;
  const std::size_t region = static_cast<std::size_t>(i % kRegions) * L.stride;
  if (!join) PK(cudaStreamWaitEvent(L.cs, landed, 0));
  PK(cudaMemcpyAsync(slot, L.src + region, std::max(bytes, L.pad_d2h), cudaMemcpyDeviceToHost, L.cs));
  PK(cudaEventRecord(read, L.cs));
  if (to.device != L.dev) PK(cudaSetDevice(to.device));
  PK(cudaStreamWaitEvent(to.stream, read, 0));
  PK(cudaMemcpyAsync(to.dst + region, slot, std::max(bytes, L.pad_h2d), cudaMemcpyHostToDevice, to.stream));
  if (word != nullptr) write_signal(L, to.stream, word, value);
  PK(cudaEventRecord(landed, to.stream));
  if (to.device != L.dev) PK(cudaSetDevice(L.dev));
  if (join) PK(cudaStreamWaitEvent(L.cs, landed, 0));
}
void put_i(Lab& L, Route& to, std::size_t bytes, long i, bool join, std::uint64_t* word = nullptr, std::uint64_t value = 0) {
  put(L, to, bytes, i, join, word, value, L.read[i % kSlots], to.landed[i % kSlots]);
}

// One put (with its signal) captured from the caller's stream: the fork and join events are
// recorded inside the capture only, so no uncaptured work ever waits on them. Null (and
// L.capture_error says why) where the capture, instantiation or upload failed.
cudaGraphExec_t capture_put(Lab& L, std::size_t bytes, bool signal) {
  L.capture_error.clear();
  L.capturing = true;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  PK(cudaStreamBeginCapture(L.cs, cudaStreamCaptureModeThreadLocal));
  if (L.capture_error.empty()) {
    put(L, L.remote, bytes, 0, true, signal ? L.remote.graph_word : nullptr, kGraphValue, L.fork, L.join);
    PK(cudaStreamEndCapture(L.cs, &graph));
  }
  if (L.capture_error.empty()) PK(cudaGraphInstantiate(&exec, graph, 0));
  if (L.capture_error.empty()) PK(cudaGraphUpload(exec, L.cs));
  L.capturing = false;
  if (graph != nullptr) spl::warn_rt(cudaGraphDestroy(graph), "cudaGraphDestroy");
  if (!L.capture_error.empty()) {
    if (exec != nullptr) spl::warn_rt(cudaGraphExecDestroy(exec), "cudaGraphExecDestroy");
    exec = nullptr;
    (void)cudaGetLastError();
    CK(cudaSetDevice(L.dev));
  }
  CK(cudaStreamSynchronize(L.cs));
  return exec;
}

struct Timing {
  double total_us = 0, host_us = 0;
};

// n operations of `kind`, then a synchronize: rank 0's times (rank 1 takes part in the ping-pong only).
Timing run(Lab& L, Kind kind, std::size_t bytes, long n, cudaGraphExec_t graph) {
  Timing t;
  if (kind != Kind::PingPong && L.rank != 0) return t;
  auto slot = [&](long i) { return L.slots + static_cast<std::size_t>(i % kSlots) * L.stride; };
  auto region = [&](std::uint8_t* base, long i) { return base + static_cast<std::size_t>(i % kRegions) * L.stride; };
  cudaStream_t last = L.cs;
  double enqueue_us = 0;
  const double t0 = now_us();
  switch (kind) {
    case Kind::D2H:
      for (long i = 0; i < n; ++i) CK(cudaMemcpyAsync(slot(i), region(L.src, i), bytes, cudaMemcpyDeviceToHost, L.cs));
      break;
    case Kind::H2D: {
      OnDevice on(L.remote.device);
      for (long i = 0; i < n; ++i)
        CK(cudaMemcpyAsync(region(L.remote.dst, i), slot(i), bytes, cudaMemcpyHostToDevice, L.remote.stream));
      last = L.remote.stream;
      break;
    }
    case Kind::D2D:
      for (long i = 0; i < n; ++i) {
        if (L.remote.device == L.dev)
          CK(cudaMemcpyAsync(region(L.remote.dst, i), region(L.src, i), bytes, cudaMemcpyDeviceToDevice, L.cs));
        else
          CK(cudaMemcpyPeerAsync(region(L.remote.dst, i), L.remote.device, region(L.src, i), L.dev, bytes, L.cs));
      }
      break;
    case Kind::Chain:
      for (long i = 0; i < n; ++i) put_i(L, L.local, bytes, i, true);
      break;
    case Kind::Put:
    case Kind::PutSource:
      for (long i = 0; i < n; ++i) put_i(L, L.remote, bytes, i, kind == Kind::Put);
      if (kind == Kind::PutSource) CK(cudaStreamWaitEvent(L.cs, L.remote.landed[(n - 1) % kSlots], 0));
      break;
    case Kind::PutDependent:
      for (long i = 0; i < n; ++i) {
        const double a = now_us();
        put_i(L, L.remote, bytes, i, true);
        enqueue_us += now_us() - a;
        CK(cudaStreamSynchronize(L.cs));
      }
      break;
    case Kind::PingPong:
      for (long i = 0; i < n; ++i) {
        const std::uint64_t v = ++L.seq;
        if (L.rank == 0) {
          put_i(L, L.remote, bytes, i, true, L.remote.word, v);
          wait_signal(L, v);
        } else {
          wait_signal(L, v);
          put_i(L, L.remote, bytes, i, true, L.remote.word, v);
        }
      }
      break;
    case Kind::GraphPut:
    case Kind::GraphPutSignal:
      for (long i = 0; i < n; ++i) CK(cudaGraphLaunch(graph, L.cs));
      break;
  }
  if (kind != Kind::PutDependent) enqueue_us = now_us() - t0;
  CK(cudaStreamSynchronize(last));
  t.total_us = now_us() - t0;
  t.host_us = enqueue_us;
  return t;
}

struct RowDef {
  std::string name;
  Kind kind;
  Dst dst;
  int writers;  // bit r: rank r writes
  int count;    // destinations the row cycles through
  int src_mod;  // destination d holds source region (last i with i % count == d) % src_mod
  int busy;     // 1 + index into --busy; 0: none
  bool half;    // one way of a round trip
};

struct Result {
  std::size_t bytes = 0;
  double us = -1, gbps = -1, host_us = -1;
  long n = 0;
  unsigned long long bad = 0;
  std::string note;
};

bool checks_here(const Lab& L, const RowDef& row) {
  return row.dst == Dst::Peer ? (row.writers >> L.peer & 1) != 0 : (row.writers >> L.rank & 1) != 0;
}

std::uint8_t* dst_base(const Lab& L, const RowDef& row) { return row.dst == Dst::Slots ? L.slots : L.mine; }

// The destinations' bytes and the byte after each, poisoned; the graph word cleared.
void poison(Lab& L, const RowDef& row, std::size_t bytes) {
  const std::size_t span = std::min(bytes + 1, L.stride);
  for (int d = 0; d < row.count; ++d) {
    std::uint8_t* p = dst_base(L, row) + static_cast<std::size_t>(d) * L.stride;
    if (row.dst == Dst::Slots) std::memset(p, kPoison, span);
    else CK(cudaMemsetAsync(p, kPoison, span, L.cs));
  }
  if (row.kind == Kind::GraphPutSignal) CK(cudaMemsetAsync(L.my_graph_word, 0, sizeof(std::uint64_t), L.cs));
  CK(cudaStreamSynchronize(L.cs));
}

// Bytes that differ from what the last of n operations wrote into each destination (the
// writer's source `data`, kRegions regions of `bytes`), the byte after each still the poison.
unsigned long long check(Lab& L, const RowDef& row, std::size_t bytes, long n, const std::vector<std::uint8_t>& data) {
  const std::size_t span = std::min(bytes + 1, L.stride);
  std::vector<std::uint8_t> got(span);
  unsigned long long bad = 0;
  for (int d = 0; d < row.count; ++d) {
    const std::uint8_t* p = dst_base(L, row) + static_cast<std::size_t>(d) * L.stride;
    if (row.dst == Dst::Slots) {
      std::memcpy(got.data(), p, span);
    } else {
      CK(cudaMemcpyAsync(got.data(), p, span, cudaMemcpyDeviceToHost, L.cs));
      CK(cudaStreamSynchronize(L.cs));
    }
    const long last = d + row.count * ((n - 1 - d) / row.count);
    const std::uint8_t* want = data.data() + static_cast<std::size_t>(last % row.src_mod) * bytes;
    std::size_t first = bytes, here = 0;
    for (std::size_t b = 0; b < bytes; ++b)
      if (got[b] != want[b]) {
        if (here++ == 0) first = b;
      }
    if (span > bytes && bytes >= L.pad_h2d && got[bytes] != kPoison) ++here;  // a padded copy writes past it
    if (here != 0)
      std::fprintf(stderr, "rank %d: %s, %zu bytes: destination %d has %zu bad bytes (first at %zu%s)\n", L.rank,
                   row.name.c_str(), bytes, d, here, first, first == bytes ? ": the byte after it" : "");
    bad += here;
  }
  if (row.kind == Kind::GraphPutSignal) {
    std::uint64_t w = 0;
    CK(cudaMemcpyAsync(&w, L.my_graph_word, sizeof(w), cudaMemcpyDeviceToHost, L.cs));
    CK(cudaStreamSynchronize(L.cs));
    if (w != kGraphValue) {
      std::fprintf(stderr, "rank %d: %s: graph signal word %llu\n", L.rank, row.name.c_str(), static_cast<unsigned long long>(w));
      ++bad;
    }
  }
  return bad;
}

// One row at one size, on both ranks: warm-up, the count of timed operations (rank 0's choice),
// poison, the timed part, the check. `busy` is rank 1's load for busy rows (null otherwise).
Result measure(Lab& L, const RowDef& row, std::size_t bytes, const Opts& o, spl::BusyLoad* busy,
               const std::vector<std::uint8_t>& my_data, const std::vector<std::uint8_t>& peer_data) {
  Result res;
  res.bytes = bytes;
  const bool graph = row.kind == Kind::GraphPut || row.kind == Kind::GraphPutSignal;
  cudaGraphExec_t exec = nullptr;
  if (graph) {
    int ok = 1;
    if (L.rank == 0) {
      exec = capture_put(L, bytes, row.kind == Kind::GraphPutSignal);
      ok = exec != nullptr;
    }
    MK(MPI_Bcast(&ok, 1, MPI_INT, 0, MPI_COMM_WORLD));
    if (!ok) {
      res.note = "not captured: " + L.capture_error;
      return res;
    }
  }
  if (row.kind == Kind::H2D && L.rank == 0) {  // slot k holds source region k
    for (int k = 0; k < kSlots; ++k)
      CK(cudaMemcpyAsync(L.slots + k * L.stride, L.src + k * L.stride, bytes, cudaMemcpyDeviceToHost, L.cs));
    CK(cudaStreamSynchronize(L.cs));
  }
  if (busy != nullptr) busy->start();
  MK(MPI_Barrier(MPI_COMM_WORLD));
  const Timing warm = run(L, row.kind, bytes, o.warmup, exec);
  long n = o.iters;
  if (L.rank == 0 && !graph) {
    const double per = std::max(warm.total_us / static_cast<double>(o.warmup), 1e-3);
    n = std::clamp(static_cast<long>(o.budget_ms * 1e3 / per), std::max<long>(o.min_iters, kRegions), o.iters);
  }
  MK(MPI_Bcast(&n, 1, MPI_LONG, 0, MPI_COMM_WORLD));
  const bool checker = checks_here(L, row);
  if (checker) poison(L, row, bytes);
  MK(MPI_Barrier(MPI_COMM_WORLD));
  const Timing t = run(L, row.kind, bytes, n, exec);
  MK(MPI_Barrier(MPI_COMM_WORLD));
  if (busy != nullptr) busy->stop();
  if (exec != nullptr) CK(cudaGraphExecDestroy(exec));
  unsigned long long bad = checker ? check(L, row, bytes, n, row.dst == Dst::Peer ? peer_data : my_data) : 0;
  MK(MPI_Allreduce(&bad, &res.bad, 1, MPI_UNSIGNED_LONG_LONG, MPI_SUM, MPI_COMM_WORLD));
  res.n = n;
  res.us = t.total_us / (static_cast<double>(n) * (row.half ? 2 : 1));
  res.host_us = t.host_us / static_cast<double>(n);
  res.gbps = static_cast<double>(bytes) / res.us * 1e-3;
  return res;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

[[noreturn]] void usage(int rank, const std::string& why) {
  if (rank == 0)
    std::fprintf(stderr,
                 "stream_path_lab: %s\nusage: mpirun -np 2 stream_path_lab [--sizes LIST] [--iters N] [--warmup N] "
                 "[--min-iters N] [--budget-ms MS] [--busy 1,full|none] [--busy-us US] [--signal memop|kernel|copy] "
                 "[--same-gpu] [--pad-d2h BYTES] [--pad-h2d BYTES] [--limit-s S] [--csv F --commit C --machine M --date D]\n",
                 why.c_str());
  MPI_Abort(MPI_COMM_WORLD, 2);
  std::exit(2);
}

Opts parse(int argc, char** argv, int rank) {
  Opts o;
  std::vector<std::string> sizes = {"8", "16", "64", "256", "1K", "4K", "16K", "64K", "256K", "1M", "4M"};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has = i + 1 < argc;
    auto count = [&](long lo) {
      const long v = std::atol(argv[++i]);
      if (v < lo) usage(rank, a + " must be at least " + std::to_string(lo));
      return v;
    };
    if (o.run.parse(argc, argv, i)) continue;
    if (a == "--sizes" && has) sizes = split(argv[++i]);
    else if (a == "--iters" && has) o.iters = count(1);
    else if (a == "--warmup" && has) o.warmup = count(1);
    else if (a == "--min-iters" && has) o.min_iters = count(1);
    else if (a == "--budget-ms" && has) o.budget_ms = static_cast<double>(count(1));
    else if (a == "--busy" && has) o.busy = std::string(argv[++i]) == "none" ? std::vector<std::string>{} : split(argv[i]);
    else if (a == "--busy-us" && has) o.busy_us = static_cast<std::uint64_t>(count(1));
    else if (a == "--limit-s" && has) o.limit_s = static_cast<unsigned>(count(1));
    else if (a == "--signal" && has) {
      const std::string s = argv[++i];
      if (s != "memop" && s != "kernel" && s != "copy") usage(rank, "--signal memop, kernel or copy");
      o.signal_kernel = s == "kernel";
      o.signal_copy = s == "copy";
    } else if (a == "--same-gpu") o.same_gpu = true;
    else if ((a == "--pad-d2h" || a == "--pad-h2d") && has) {
      std::size_t b = 0;
      if (!bench::parse_bytes(argv[++i], &b) || b > (std::size_t(64) << 20)) usage(rank, a + ": 0 to 64M bytes");
      (a == "--pad-d2h" ? o.pad_d2h : o.pad_h2d) = b;
    }
    else usage(rank, "unknown argument " + a);
  }
  for (const auto& b : o.busy)
    if (b != "1" && b != "full") usage(rank, "--busy takes 1, full or none");
  for (const auto& s : sizes) {
    std::size_t b = 0;
    if (!bench::parse_bytes(s, &b) || b > (std::size_t(64) << 20)) usage(rank, "bad size " + s + " (1 byte to 64M)");
    o.sizes.push_back(b);
  }
  if (o.iters < std::max<long>(o.min_iters, kRegions)) usage(rank, "--iters below --min-iters (or below 5)");
  return o;
}

int g_rank = 0;
void on_alarm(int) {
  char msg[128];
  const int len = std::snprintf(msg, sizeof(msg), "rank %d: stream_path_lab ran past --limit-s; stopped (a wait that never passed?)\n", g_rank);
  if (len > 0) (void)!::write(2, msg, static_cast<std::size_t>(len));
  ::_exit(3);
}

std::string bus_id(int device) {
  char bus[32] = {};
  CK(cudaDeviceGetPCIBusId(bus, sizeof(bus), device));
  return bus;
}

}  // namespace

int main(int argc, char** argv) {
  // Every kernel loaded before anything waits; more hardware queues than streams, so that a
  // stream waiting on a word holds back no other stream (studies/queue_lab).
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  int provided = 0;
  MK(MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided));
  int rank = 0, size = 0;
  MK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  MK(MPI_Comm_size(MPI_COMM_WORLD, &size));
  bench::check_rank() = g_rank = rank;
  const Opts o = parse(argc, argv, rank);
  if (size != 2) usage(rank, "needs 2 ranks");
  MPI_Comm node = MPI_COMM_NULL;
  MK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int node_size = 0, node_rank = 0;
  MK(MPI_Comm_size(node, &node_size));
  MK(MPI_Comm_rank(node, &node_rank));
  if (node_size != 2) usage(rank, "both ranks must be on one node");
  std::signal(SIGALRM, on_alarm);
  alarm(o.limit_s);
  int ngpu = 0;
  if (cudaGetDeviceCount(&ngpu) != cudaSuccess || ngpu < 1) {
    if (rank == 0) std::printf("# stream_path_lab: no GPU; nothing measured\n");
    MK(MPI_Comm_free(&node));
    MK(MPI_Finalize());
    return 0;
  }
  const double start = now_us();
  const int dev = o.same_gpu ? 0 : node_rank % ngpu;
  CK(cudaSetDevice(dev));
  CK(cudaFree(nullptr));  // the primary context, current for the driver calls
  {
    CUdevice cu_dev = 0;
    int memops = 0;
    CU(cuDeviceGet(&cu_dev, dev));
    CU(cuDeviceGetAttribute(&memops, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, cu_dev));
    if (!memops) bench::fail("cuDeviceGetAttribute", "no 64-bit stream memory operations on this GPU", __FILE__, __LINE__);
  }
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, dev));
  std::size_t stride = std::max({*std::max_element(o.sizes.begin(), o.sizes.end()), o.pad_d2h, o.pad_h2d});
  stride = (stride + 1 + 65535) / 65536 * 65536;  // room for the poisoned byte after a region
  int failed_rows = 0;
  std::vector<bench::ResultRow> csv;
  {
    // This rank's memory, exported; the peer's, imported for its GPU as this process numbers it.
    std::size_t vbytes = kRegions * stride + kSignalBytes;
    const CUmemGenericAllocationHandle made = spl::vmm_create(&vbytes, dev);  // rounds vbytes up first
    spl::VmmMapping mine(made, vbytes, dev);
    CK(cudaMemset(mine.get() + kRegions * stride, 0, kSignalBytes));
    CK(cudaDeviceSynchronize());
    spl::Fd exported = spl::vmm_export(mine.handle());
    struct Hello {
      pid_t pid;
      int fd;
      std::size_t bytes;
      cudaUUID_t uuid;
      char bus[32];
    } me{getpid(), exported.get(), vbytes, prop.uuid, {}}, them{};
    std::snprintf(me.bus, sizeof(me.bus), "%s", bus_id(dev).c_str());
    const int peer = 1 - rank;
    MK(MPI_Sendrecv(&me, sizeof(me), MPI_BYTE, peer, 0, &them, sizeof(them), MPI_BYTE, peer, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
    int tdev = -1;
    for (int d = 0; d < ngpu && tdev < 0; ++d) {
      cudaDeviceProp p{};
      CK(cudaGetDeviceProperties(&p, d));
      if (std::memcmp(&p.uuid, &them.uuid, sizeof(p.uuid)) == 0) tdev = d;
    }
    if (tdev < 0)
      bench::fail("finding the peer's GPU", std::string("GPU ") + them.bus + " is not visible here (a hidden target: the stream path needs it)", __FILE__, __LINE__);
    spl::Fd received = spl::exchange_fd(rank, exported, them.pid, them.fd);
    spl::VmmMapping theirs(spl::vmm_import(received), them.bytes, tdev);
    received.reset();
    MK(MPI_Barrier(MPI_COMM_WORLD));  // both imported
    exported.reset();

    // The node pool: kSlots slots per rank in node-shared pinned memory.
    std::uint64_t pool_id = static_cast<std::uint64_t>(getpid());
    MK(MPI_Bcast(&pool_id, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD));
    const std::string pool_name = "/meshmem-stream-path-lab-" + std::to_string(pool_id);
    const std::size_t pool_bytes = 2 * kSlots * stride;
    std::unique_ptr<spl::SharedPinned> pool;
    if (rank == 0) pool = std::make_unique<spl::SharedPinned>(pool_name, pool_bytes, true);
    MK(MPI_Barrier(MPI_COMM_WORLD));
    if (rank == 1) pool = std::make_unique<spl::SharedPinned>(pool_name, pool_bytes, false);
    MK(MPI_Barrier(MPI_COMM_WORLD));
    if (rank == 0) pool->unlink_name();

    spl::Stream cs(dev), ls(dev), ts(tdev);
    spl::DeviceBuffer src(dev, kRegions * stride);
    Lab L;
    L.rank = rank;
    L.peer = peer;
    L.dev = dev;
    L.signal_kernel = o.signal_kernel;
    L.signal_copy = o.signal_copy;
    std::uint64_t* values = nullptr;
    CK(cudaHostAlloc(reinterpret_cast<void**>(&values), (kValues + 1) * sizeof(std::uint64_t), cudaHostAllocPortable));
    const std::unique_ptr<std::uint64_t, void (*)(std::uint64_t*)> values_owner(
        values, [](std::uint64_t* p) { (void)cudaFreeHost(p); });
    values[kValues] = kGraphValue;
    L.values = values;
    L.pad_d2h = o.pad_d2h;
    L.pad_h2d = o.pad_h2d;
    L.stride = stride;
    L.cs = cs;
    L.src = src.get();
    L.mine = mine.get();
    L.slots = pool->get() + static_cast<std::size_t>(rank) * kSlots * stride;
    L.my_word = reinterpret_cast<std::uint64_t*>(mine.get() + kRegions * stride);
    L.my_graph_word = L.my_word + 16;
    L.fork = Event(dev);
    L.join = Event(tdev);
    L.remote.device = tdev;
    L.remote.stream = ts;
    L.remote.dst = theirs.get();
    L.remote.word = reinterpret_cast<std::uint64_t*>(theirs.get() + kRegions * stride);
    L.remote.graph_word = L.remote.word + 16;
    L.local.device = dev;
    L.local.stream = ls;
    L.local.dst = mine.get();
    for (int k = 0; k < kSlots; ++k) {
      L.read.emplace_back(dev);
      L.remote.landed.emplace_back(tdev);
      L.local.landed.emplace_back(dev);
    }
    CK(cudaSetDevice(dev));
    std::vector<std::unique_ptr<spl::BusyLoad>> loads;
    for (const auto& b : o.busy) {
      const int blocks = b == "full" ? 8 * prop.multiProcessorCount : 1;
      loads.push_back(rank == 1 ? std::make_unique<spl::BusyLoad>(dev, blocks, b == "full" ? 256 : 32, o.busy_us * 1000) : nullptr);
    }

    std::vector<RowDef> rows = {
        {"ref d2h (source -> pinned slot)", Kind::D2H, Dst::Slots, 1, kSlots, kRegions, 0, false},
        {"ref h2d (pinned slot -> peer memory)", Kind::H2D, Dst::Peer, 1, kRegions, kSlots, 0, false},
        {"ref d2h>event>h2d into own memory", Kind::Chain, Dst::Own, 1, kRegions, kRegions, 0, false},
        {"ref driver d2d into peer memory", Kind::D2D, Dst::Peer, 1, kRegions, kRegions, 0, false},
        {"stream-path put", Kind::Put, Dst::Peer, 1, kRegions, kRegions, 0, false},
        {"stream-path put, joined at end", Kind::PutSource, Dst::Peer, 1, kRegions, kRegions, 0, false},
        {"stream-path put, sync each", Kind::PutDependent, Dst::Peer, 1, kRegions, kRegions, 0, false},
        {"stream-path put_signal ping-pong / 2", Kind::PingPong, Dst::Peer, 3, kRegions, kRegions, 0, true},
        {"graph stream-path put, per replay", Kind::GraphPut, Dst::Peer, 1, 1, 1, 0, false},
        {"graph stream-path put_signal, per replay", Kind::GraphPutSignal, Dst::Peer, 1, 1, 1, 0, false},
    };
    for (std::size_t b = 0; b < o.busy.size(); ++b) {
      const std::string tag = " | target busy (" + std::string(o.busy[b] == "1" ? "1 block" : "full") + ")";
      const int busy = static_cast<int>(b) + 1;
      rows.push_back({"ref h2d" + tag, Kind::H2D, Dst::Peer, 1, kRegions, kSlots, busy, false});
      rows.push_back({"ref driver d2d" + tag, Kind::D2D, Dst::Peer, 1, kRegions, kRegions, busy, false});
      rows.push_back({"stream-path put" + tag, Kind::Put, Dst::Peer, 1, kRegions, kRegions, busy, false});
      rows.push_back({"stream-path put, sync each" + tag, Kind::PutDependent, Dst::Peer, 1, kRegions, kRegions, busy, false});
      rows.push_back({"stream-path put_signal ping-pong / 2" + tag, Kind::PingPong, Dst::Peer, 3, kRegions, kRegions, busy, true});
    }

    std::uint64_t nonce = static_cast<std::uint64_t>(now_us());
    MK(MPI_Bcast(&nonce, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD));
    auto make_data = [&](int writer, std::size_t bytes) {
      std::vector<std::uint8_t> d(kRegions * bytes);
      for (int r = 0; r < kRegions; ++r)
        spl::fill_random(d.data() + r * bytes, bytes, spl::mix(nonce ^ spl::mix(bytes * 131 + writer * 17 + r)));
      return d;
    };
    std::vector<std::vector<Result>> results(rows.size());
    for (std::size_t bytes : o.sizes) {
      const double size_start = now_us();
      const std::vector<std::uint8_t> my_data = make_data(rank, bytes), peer_data = make_data(peer, bytes);
      for (int r = 0; r < kRegions; ++r)
        CK(cudaMemcpy(L.src + r * stride, my_data.data() + r * bytes, bytes, cudaMemcpyHostToDevice));
      for (std::size_t i = 0; i < rows.size(); ++i) {
        spl::BusyLoad* busy = rows[i].busy > 0 ? loads[rows[i].busy - 1].get() : nullptr;
        results[i].push_back(measure(L, rows[i], bytes, o, busy, my_data, peer_data));
      }
      if (rank == 0) std::fprintf(stderr, "# stream_path_lab: %zu bytes done in %.2f s\n", bytes, (now_us() - size_start) * 1e-6);
    }

    if (rank == 0) {
      std::printf("# stream_path_lab: 2 ranks; rank 0 on GPU %d (%s, %s), rank 1 on GPU %s; %s\n", dev, prop.name, me.bus,
                  them.bus, dev == tdev ? "one GPU shared" : "a GPU each");
      int peer_access = 0;
      if (dev != tdev) CK(cudaDeviceCanAccessPeer(&peer_access, dev, tdev));
      std::printf("# target: the peer's cuMemCreate memory imported here; slots: shm_open + cudaHostRegister; signal: %s;"
                  " peer access %s (never enabled); puts' copies padded to at least %zu (d2h) / %zu (h2d) bytes%s\n",
                  o.signal_copy ? "an 8-byte copy" : o.signal_kernel ? "kernel" : "cuStreamWriteValue64", dev == tdev ? "n/a" : peer_access ? "possible" : "none",
                  o.pad_d2h, o.pad_h2d, o.pad_h2d > 0 ? " (the byte after a destination is not checked below that)" : "");
      std::printf("# us: mean over the timed ops (after %ld warm-up; up to %.0f ms, %ld-%ld ops); GB/s = 1e9 B/s; host us: "
                  "rank 0's enqueue time per op; busy: %llu us kernels of rank 1\n",
                  o.warmup, o.budget_ms, std::max<long>(o.min_iters, kRegions), o.iters,
                  static_cast<unsigned long long>(o.busy_us));
      for (std::size_t i = 0; i < rows.size(); ++i) {
        std::printf("\n# %s\n# %-10s %12s %10s %12s %7s  %s\n", rows[i].name.c_str(), "Size", "us", "GB/s", "host us", "ops", "check");
        for (const Result& r : results[i]) {
          if (!r.note.empty()) {
            std::printf("%-12zu %s\n", r.bytes, r.note.c_str());
            continue;
          }
          std::printf("%-12zu %12.2f %10.3f %12.2f %7ld  %s\n", r.bytes, r.us, r.gbps, r.host_us, r.n,
                      r.bad == 0 ? "ok" : ("FAILED " + std::to_string(r.bad) + " bytes").c_str());
          failed_rows += r.bad != 0;
          csv.push_back({"stream_path_lab", rows[i].name, 2, static_cast<long long>(r.bytes), r.us, r.gbps});
        }
      }
      std::printf("\n# at 4096 bytes (issue 54's targets: put <= 10 us, put_signal one way <= 12 us)\n");
      for (std::size_t i = 0; i < rows.size(); ++i)
        for (const Result& r : results[i])
          if (r.bytes == 4096 && r.note.empty()) std::printf("#   %-62s %8.2f us\n", rows[i].name.c_str(), r.us);
      std::printf("\n# %zu rows x %zu sizes in %.1f s; %s\n", rows.size(), o.sizes.size(), (now_us() - start) * 1e-6,
                  failed_rows == 0 ? "every check passed" : (std::to_string(failed_rows) + " checks FAILED").c_str());
      std::fflush(stdout);
    }
    CK(cudaDeviceSynchronize());
    MK(MPI_Barrier(MPI_COMM_WORLD));  // no copy into the peer's memory in flight once it unmaps
  }
  if (rank == 0 && !o.run.csv.empty())
    bench::write_results_csv(o.run.csv, bench::CsvMode::Append, o.run.date, o.run.commit, o.run.machine, csv, "stream_path_lab");
  MK(MPI_Bcast(&failed_rows, 1, MPI_INT, 0, MPI_COMM_WORLD));
  MK(MPI_Comm_free(&node));
  MK(MPI_Finalize());
  return failed_rows == 0 ? 0 : 1;
}
