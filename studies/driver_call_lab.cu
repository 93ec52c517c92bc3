// driver_call_lab: the host cost of the CUDA calls the staging agent makes per small transfer,
// and whether two or more threads making them at once, each on a stream of its own on one GPU,
// get through them faster than one thread. The question behind the next step for issue 10's
// Jacobi 4096^2 on 4 GPUs: a trace of the agents (bench/results/2026-11-28-nvidia-h200-x4-staged-
// aa3e264.txt) found a middle rank making about 23 us of such calls per iteration on its one
// thread; fewer calls, cheaper calls, or a second thread (outgoing and incoming apart) are the
// candidates, and this lab prices each.
//
// One process, GPU 0, pinned host memory (cudaMallocHost). Each case makes --calls calls in
// batches of 64 with a cudaStreamSynchronize between batches (not timed: only the enqueueing is);
// the row is the mean host time per call (or per pair / per group for the combined cases).
//   memcpy-d2h-default   cudaMemcpyAsync device -> pinned, cudaMemcpyDefault (the agent's copy)
//   memcpy-d2h-kind      the same with cudaMemcpyDeviceToHost
//   cu-memcpy-dtoh       cuMemcpyDtoHAsync
//   memcpy-h2d-default, memcpy-h2d-kind, cu-memcpy-htod: the other way
//   batch-1, batch-3     cuStreamBatchMemOp with 1 / 3 stream writes of pinned words
//   write-value          cuStreamWriteValue64 of one pinned word (batch-1 without the batch)
//   event-record         cudaEventRecord
//   event-query          cudaEventQuery of an event that is done
//   pointer-attributes   cudaPointerGetAttributes of a device pointer (the agent's host-source test)
//   set-device           cudaGetDevice + cudaSetDevice (the agent's CurrentDevice, same device)
//   writer               copy d2h + event record + batch-1 (a small transfer's writer side)
//   reader               copy h2d + batch-3 (its reader side: signal, done word, consumed count)
//   reader-kernel        the reader's side as one kernel launch (the block copies the chunk out of
//                        the slot, then writes the three words): one call instead of two
//   writer+reader/T thr  T threads at once, each making writer then reader on a stream of its own:
//                        the time per writer+reader of each thread while all run (no gain from
//                        more threads if it grows T-fold)
//   memcpy-d2h-pool, memcpy-h2d-pool, writer-pool, reader-pool   the same with the host side in
//                        memory like the staging pool's (meshmem::ipc::SharedHostMemory: VMM host-NUMA
//                        memory, 2 MiB pages, mapped for GPU 0) instead of cudaMallocHost's: whether
//                        the pool's memory makes the agent's copy calls dearer
//   reader-pair          two readers one after the other (a middle rank of Jacobi gets a halo from
//                        each neighbour at about the same time): 2 copies + 2 batches of 3
//   reader-pair-batched  the same two as one cudaMemcpyBatchAsync of 2 copies and one batch of 6
//                        stream writes: whether carrying out what came in together as one batch
//                        saves the agent's time
//   writer, reader / app ahead   the writer and reader rows again while another thread of the
//                        process runs ahead of its GPU as Jacobi's does (a spin kernel of 200 us,
//                        then 100 empty kernels, over and over on a stream of its own, so that it
//                        waits in the driver for room in the launch queue): whether the agent's
//                        calls cost more while the application's thread is blocked in the driver
//   driver_call_lab [--bytes 32K] [--calls 4000] [--threads 1,2,4]
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <meshmem/ipc/vmm.hpp>

#include "bench_check.hpp"
#include "lab_gpu.hpp"

namespace {

__global__ void spin_kernel(std::uint64_t ns) {
  std::uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}
__global__ void empty_kernel() {}

// The reader's side in one launch: the block copies the chunk out of the slot, then writes the
// three words (signal, done word, consumed count) after it, as the batch of stream writes does.
__global__ void reader_kernel(char* dst, const char* slot, std::size_t bytes, std::uint64_t* words, std::uint64_t value) {
  for (std::size_t i = threadIdx.x; i < bytes / 16; i += blockDim.x)
    reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(slot)[i];
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x < 3) reinterpret_cast<volatile std::uint64_t*>(words)[8 * threadIdx.x] = value;
}

using Clock = std::chrono::steady_clock;
constexpr int kBatch = 64;

// What one thread needs: its stream, a device buffer, a pinned buffer, pinned words, an event.
struct Lane {
  cudaStream_t stream = nullptr;
  char* device = nullptr;
  char* host = nullptr;
  std::uint64_t* words = nullptr;
  cudaEvent_t event = nullptr;
  explicit Lane(std::size_t bytes) {
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CK(cudaMalloc(&device, bytes));
    CK(cudaMallocHost(&host, bytes));
    CK(cudaMallocHost(&words, 4096));
    CK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  }
  ~Lane() {
    cudaStreamSynchronize(stream);
    cudaEventDestroy(event);
    cudaFreeHost(words);
    cudaFreeHost(host);
    cudaFree(device);
    cudaStreamDestroy(stream);
  }
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;
};

using bench::write_op;

// n (1 .. 6) stream writes of `value` into words[0], [8], [16], ...
void batch(cudaStream_t stream, std::uint64_t* words, int n, std::uint64_t value) {
  CUstreamBatchMemOpParams ops[6];
  for (int k = 0; k < n; ++k) ops[k] = write_op(words + 8 * k, value);
  CU(cuStreamBatchMemOp(reinterpret_cast<CUstream>(stream), static_cast<unsigned>(n), ops, 0));
}
void batch(Lane& l, int n, std::uint64_t value) { batch(l.stream, l.words, n, value); }

// A small transfer's writer side (copy into the slot `host`, event record, posted count in
// `words`) and reader side (copy out of it; signal, done word, consumed count), call i.
void writer_calls(Lane& l, char* host, std::uint64_t* words, std::size_t bytes, int i) {
  CK(cudaMemcpyAsync(host, l.device, bytes, cudaMemcpyDefault, l.stream));
  CK(cudaEventRecord(l.event, l.stream));
  batch(l.stream, words, 1, static_cast<std::uint64_t>(i) + 1);
}
void reader_calls(Lane& l, char* host, std::uint64_t* words, std::size_t bytes, int i) {
  CK(cudaMemcpyAsync(l.device, host, bytes, cudaMemcpyDefault, l.stream));
  batch(l.stream, words, 3, static_cast<std::uint64_t>(i) + 1);
}

// Two readers' sides, from the two halves of `host` into the two halves of the device buffer
// (each `bytes`): one after the other, or as one copy batch and one batch of stream writes.
void reader_pair_calls(Lane& l, std::size_t bytes, int i) {
  for (int k = 0; k < 2; ++k) {
    CK(cudaMemcpyAsync(l.device + k * bytes, l.host + k * bytes, bytes, cudaMemcpyDefault, l.stream));
    batch(l.stream, l.words + 24 * k, 3, static_cast<std::uint64_t>(i) + 1);
  }
}
void reader_pair_batched_calls(Lane& l, std::size_t bytes, int i) {
  void* dsts[2] = {l.device, l.device + bytes};
  const void* srcs[2] = {l.host, l.host + bytes};
  std::size_t sizes[2] = {bytes, bytes};
  cudaMemcpyAttributes attributes{};
  attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  std::size_t first = 0;
  CK(cudaMemcpyBatchAsync(dsts, srcs, sizes, 2, &attributes, &first, 1, l.stream));
  batch(l.stream, l.words, 6, static_cast<std::uint64_t>(i) + 1);
}

// Mean host microseconds per call of `call` (i = 0 .. calls-1), synchronising `lane`'s stream
// between batches of kBatch calls (not timed).
double per_call(Lane& lane, int calls, const std::function<void(int)>& call) {
  double us = 0;
  for (int done = 0; done < calls;) {
    const int n = std::min(kBatch, calls - done);
    const auto t0 = Clock::now();
    for (int i = 0; i < n; ++i) call(done + i);
    us += std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    CK(cudaStreamSynchronize(lane.stream));
    done += n;
  }
  return us / calls;
}

std::vector<int> parse_counts(const std::string& text) {
  std::vector<int> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    const int v = std::atoi(item.c_str());
    if (v < 1 || v > 64) {
      std::fprintf(stderr, "driver_call_lab: '%s' is not a thread count of 1 .. 64\n", item.c_str());
      std::exit(2);
    }
    out.push_back(v);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t bytes = 32 << 10;
  int calls = 4000;
  std::vector<int> threads = {1, 2, 4};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has = i + 1 < argc;
    if (a == "--bytes" && has && bench::parse_bytes(argv[i + 1], &bytes)) ++i;
    else if (a == "--calls" && has && (calls = std::atoi(argv[i + 1])) > 0) ++i;
    else if (a == "--threads" && has) threads = parse_counts(argv[++i]);
    else {
      std::fprintf(stderr, "usage: driver_call_lab [--bytes 32K] [--calls 4000] [--threads 1,2,4]\n");
      return 2;
    }
  }
  cudaDeviceProp prop{};
  if (!bench::use_gpu0("driver_call_lab", &prop)) return 0;
  std::printf("# driver_call_lab: GPU 0 (%s), copies of %zu bytes, %d calls per row in batches of %d, host time "
              "of the enqueueing only\n", prop.name, bytes, calls, kBatch);
  std::printf("%-32s %8s %14s\n", "# case", "threads", "us per call");
  auto row = [](const char* name, int t, double us) { std::printf("%-32s %8d %14.3f\n", name, t, us); };
  {
    Lane l(bytes);
    const auto dev = reinterpret_cast<CUdeviceptr>(l.device);
    const auto cs = reinterpret_cast<CUstream>(l.stream);
    row("memcpy-d2h-default", 1, per_call(l, calls, [&](int) {
          CK(cudaMemcpyAsync(l.host, l.device, bytes, cudaMemcpyDefault, l.stream));
        }));
    row("memcpy-d2h-kind", 1, per_call(l, calls, [&](int) {
          CK(cudaMemcpyAsync(l.host, l.device, bytes, cudaMemcpyDeviceToHost, l.stream));
        }));
    row("cu-memcpy-dtoh", 1, per_call(l, calls, [&](int) { CU(cuMemcpyDtoHAsync(l.host, dev, bytes, cs)); }));
    row("memcpy-h2d-default", 1, per_call(l, calls, [&](int) {
          CK(cudaMemcpyAsync(l.device, l.host, bytes, cudaMemcpyDefault, l.stream));
        }));
    row("memcpy-h2d-kind", 1, per_call(l, calls, [&](int) {
          CK(cudaMemcpyAsync(l.device, l.host, bytes, cudaMemcpyHostToDevice, l.stream));
        }));
    row("cu-memcpy-htod", 1, per_call(l, calls, [&](int) { CU(cuMemcpyHtoDAsync(dev, l.host, bytes, cs)); }));
    row("batch-1", 1, per_call(l, calls, [&](int i) { batch(l, 1, static_cast<std::uint64_t>(i) + 1); }));
    row("batch-3", 1, per_call(l, calls, [&](int i) { batch(l, 3, static_cast<std::uint64_t>(i) + 1); }));
    row("write-value", 1, per_call(l, calls, [&](int i) {
          CU(cuStreamWriteValue64(cs, reinterpret_cast<CUdeviceptr>(l.words), static_cast<std::uint64_t>(i) + 1,
                                  CU_STREAM_WRITE_VALUE_DEFAULT));
        }));
    row("event-record", 1, per_call(l, calls, [&](int) { CK(cudaEventRecord(l.event, l.stream)); }));
    CK(cudaStreamSynchronize(l.stream));
    row("event-query", 1, per_call(l, calls, [&](int) { CK(cudaEventQuery(l.event)); }));
    row("pointer-attributes", 1, per_call(l, calls, [&](int) {
          cudaPointerAttributes attributes{};
          CK(cudaPointerGetAttributes(&attributes, l.device));
        }));
    row("set-device", 1, per_call(l, calls, [&](int) {
          int d = -1;
          CK(cudaGetDevice(&d));
          CK(cudaSetDevice(d));
        }));
    row("writer", 1, per_call(l, calls, [&](int i) { writer_calls(l, l.host, l.words, bytes, i); }));
    row("reader", 1, per_call(l, calls, [&](int i) { reader_calls(l, l.host, l.words, bytes, i); }));
    row("reader-kernel", 1, per_call(l, calls, [&](int i) {
          reader_kernel<<<1, 1024, 0, l.stream>>>(l.device, l.host, bytes, l.words, static_cast<std::uint64_t>(i) + 1);
          CK(cudaGetLastError());
        }));
  }
  {
    Lane pair(2 * bytes);
    row("reader-pair", 1, per_call(pair, calls, [&](int i) { reader_pair_calls(pair, bytes, i); }));
    row("reader-pair-batched", 1, per_call(pair, calls, [&](int i) { reader_pair_batched_calls(pair, bytes, i); }));
  }
  {
    // The host side in the staging pool's kind of memory.
    const int numa = meshmem::ipc::host_numa_node_of(0);
    if (numa < 0) {
      std::printf("# GPU 0 cannot allocate VMM host-NUMA memory: no pool rows\n");
    } else {
      const std::size_t granule = meshmem::ipc::host_numa_granularity(numa);
      auto pool = meshmem::ipc::SharedHostMemory::create(meshmem::ipc::vmm_round(bytes + 4096, granule), numa, {0});
      Lane l(bytes);
      char* host = static_cast<char*>(pool.data());
      auto* words = reinterpret_cast<std::uint64_t*>(host + bytes);
      row("memcpy-d2h-pool", 1, per_call(l, calls, [&](int) {
            CK(cudaMemcpyAsync(host, l.device, bytes, cudaMemcpyDefault, l.stream));
          }));
      row("memcpy-h2d-pool", 1, per_call(l, calls, [&](int) {
            CK(cudaMemcpyAsync(l.device, host, bytes, cudaMemcpyDefault, l.stream));
          }));
      row("batch-3-pool", 1, per_call(l, calls, [&](int i) { batch(l.stream, words, 3, static_cast<std::uint64_t>(i) + 1); }));
      row("writer-pool", 1, per_call(l, calls, [&](int i) { writer_calls(l, host, words, bytes, i); }));
      row("reader-pool", 1, per_call(l, calls, [&](int i) { reader_calls(l, host, words, bytes, i); }));
    }
  }
  {
    // An application thread far ahead of its GPU, blocked in the driver on a full launch queue.
    std::atomic<bool> stop{false};
    std::atomic<long> launched{0};
    std::thread app([&] {
      CK(cudaSetDevice(0));
      cudaStream_t s = nullptr;
      CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      while (!stop.load()) {
        spin_kernel<<<1, 1, 0, s>>>(200'000);
        for (int k = 0; k < 100; ++k) empty_kernel<<<1, 1, 0, s>>>();
        CK(cudaGetLastError());
        launched.fetch_add(101);
      }
      CK(cudaStreamSynchronize(s));
      CK(cudaStreamDestroy(s));
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(500));  // its queue fills
    Lane l(bytes);
    Lane pair(2 * bytes);
    const long before = launched.load();
    row("writer / app ahead", 1, per_call(l, calls, [&](int i) { writer_calls(l, l.host, l.words, bytes, i); }));
    row("reader / app ahead", 1, per_call(l, calls, [&](int i) { reader_calls(l, l.host, l.words, bytes, i); }));
    row("reader-pair / app ahead", 1, per_call(pair, calls, [&](int i) { reader_pair_calls(pair, bytes, i); }));
    row("reader-pair-batched / app ahead", 1,
        per_call(pair, calls, [&](int i) { reader_pair_batched_calls(pair, bytes, i); }));
    const long during = launched.load() - before;
    stop.store(true);
    app.join();
    std::printf("# (the application thread launched %ld kernels meanwhile)\n", during);
  }
  for (int t : threads) {
    std::vector<std::unique_ptr<Lane>> lanes;
    for (int k = 0; k < t; ++k) lanes.push_back(std::make_unique<Lane>(bytes));
    std::vector<double> us(static_cast<std::size_t>(t), 0.0);
    std::atomic<int> arrived{0};
    std::vector<std::thread> pool;
    for (int k = 0; k < t; ++k) {
      pool.emplace_back([&, k] {
        CK(cudaSetDevice(0));
        Lane& l = *lanes[static_cast<std::size_t>(k)];
        arrived.fetch_add(1);
        while (arrived.load() < t) {
        }
        us[static_cast<std::size_t>(k)] = per_call(l, calls, [&](int i) {
          writer_calls(l, l.host, l.words, bytes, i);
          reader_calls(l, l.host, l.words, bytes, i);
        });
      });
    }
    for (std::thread& th : pool) th.join();
    row("writer+reader", t, *std::max_element(us.begin(), us.end()));
  }
  return 0;
}
