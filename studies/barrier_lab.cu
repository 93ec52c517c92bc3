// barrier_lab: the study behind meshmem's barrier(stream) defaults. Times candidate ways of
// building a stream-ordered barrier between the GPUs of one node, each in the two patterns
// of the issue's benchmark: { barrier; cudaStreamSynchronize } (single) and 200 barriers
// back to back, then one synchronize (burst). Floors (a bare synchronize, an empty kernel,
// one local stream write) show what launch and completion cost alone. Some variants are
// measurement-only (no fences): they are marked "unsafe" and never used by meshmem.
//   mpirun -np 2|4 barrier_lab [--csv FILE --commit C --machine M --date D]
#include <cuda.h>
#include <cuda/atomic>
#include <cuda_runtime.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <meshmem/ipc/cuda_driver.hpp>
#include <meshmem/meshmem.hpp>
#include <string>
#include <vector>

#include "bench_check.hpp"
#include "results_csv.hpp"

namespace {


using Word = cuda::atomic_ref<std::uint64_t, cuda::thread_scope_system>;

__global__ void empty_kernel() {}

// meshmem's kernel barrier as it stands: a system fence, a release store, acquire polls.
__device__ void fence_store_poll(std::uint64_t* const* peer, std::uint64_t* mine, int rank, int size, std::uint64_t e) {
  const int r = threadIdx.x;
  if (r >= size || r == rank) return;
  __threadfence_system();
  Word(peer[r][rank]).store(e, cuda::memory_order_release);
  Word w(mine[r]);
  while (w.load(cuda::memory_order_acquire) < e) {
  }
}
__global__ void barrier_fence(std::uint64_t* const* peer, std::uint64_t* mine, int rank, int size, std::uint64_t e) {
  fence_store_poll(peer, mine, rank, size, e);
}

// The release store alone orders this thread's view (no separate fence).
__global__ void barrier_release(std::uint64_t* const* peer, std::uint64_t* mine, int rank, int size, std::uint64_t e) {
  const int r = threadIdx.x;
  if (r >= size || r == rank) return;
  Word(peer[r][rank]).store(e, cuda::memory_order_release);
  Word w(mine[r]);
  while (w.load(cuda::memory_order_relaxed) < e) {
  }
  cuda::atomic_thread_fence(cuda::memory_order_acquire, cuda::thread_scope_system);
}

// Unsafe (no ordering at all): what the flag round trip costs by itself.
__global__ void barrier_relaxed(std::uint64_t* const* peer, std::uint64_t* mine, int rank, int size, std::uint64_t e) {
  const int r = threadIdx.x;
  if (r >= size || r == rank) return;
  *reinterpret_cast<volatile std::uint64_t*>(&peer[r][rank]) = e;
  while (*reinterpret_cast<volatile std::uint64_t*>(&mine[r]) < e) {
  }
}

// Programmatic dependent launch: the next barrier kernel may be resident before this one
// ends; it waits (griddepcontrol.wait) for this grid's completion and memory flush.
__global__ void barrier_pdl(std::uint64_t* const* peer, std::uint64_t* mine, int rank, int size, std::uint64_t e) {
#if __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();
  cudaTriggerProgrammaticLaunchCompletion();
#endif
  fence_store_poll(peer, mine, rank, size, e);
}

// kernel-fence with the barrier number kept in device memory and advanced by the kernel (a
// graph replay takes the next one), as meshmem's kernel barrier does.
__global__ void barrier_counter(std::uint64_t* const* peer, std::uint64_t* mine, int rank, int size, std::uint64_t* counter) {
  __shared__ std::uint64_t e;
  if (threadIdx.x == 0) {
    e = *counter + 1;
    *counter = e;
  }
  __syncthreads();
  fence_store_poll(peer, mine, rank, size, e);
}

struct Lab {
  int rank = 0, size = 0;
  cudaStream_t s = nullptr;
  std::uint64_t epoch = 0;
  std::uint64_t* mine = nullptr;          // this rank's flags (word r: rank r's last epoch)
  std::vector<std::uint64_t*> peer;       // peers' flags, mapped
  std::uint64_t* const* peer_table = nullptr;
  unsigned wait_flush = 0;
  std::vector<cudaEvent_t> ring;                      // this rank's IPC events
  std::vector<std::vector<cudaEvent_t>> peer_ring;    // [slot][rank]
  volatile std::uint64_t* host_slots = nullptr;       // shm host meeting, a cache line per rank
  static constexpr int kRing = 4;
  std::uint64_t* counter = nullptr;  // kernel-counter's barrier number (device memory)
  bool counter_set = false;
  cudaEvent_t sequence = nullptr;    // kernel+event: meshmem's StreamSequence record

  void host_meet() {
    auto* slot = const_cast<std::uint64_t*>(host_slots);
    __atomic_store_n(&slot[rank * 8], epoch, __ATOMIC_RELEASE);
    for (int r = 0; r < size; ++r)
      while (__atomic_load_n(&slot[r * 8], __ATOMIC_ACQUIRE) < epoch) __builtin_ia32_pause();
  }
  void kernel(void (*k)(std::uint64_t* const*, std::uint64_t*, int, int, std::uint64_t)) {
    k<<<1, (size + 31) / 32 * 32, 0, s>>>(peer_table, mine, rank, size, epoch);
    CK(cudaGetLastError());
  }
  void kernel_counter() {
    if (!counter_set) {  // the flags hold earlier variants' numbers: continue from there
      const std::uint64_t start = epoch - 1;
      CK(cudaMemcpyAsync(counter, &start, sizeof(start), cudaMemcpyHostToDevice, s));
      CK(cudaStreamSynchronize(s));
      counter_set = true;
    }
    barrier_counter<<<1, (size + 31) / 32 * 32, 0, s>>>(peer_table, mine, rank, size, counter);
    CK(cudaGetLastError());
  }
  void kernel_pdl() {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = 1;
    cfg.blockDim = (size + 31) / 32 * 32;
    cfg.stream = s;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, barrier_pdl, peer_table, mine, rank, size, epoch));
  }
  void memop_batch(unsigned wait_flags) {
    std::vector<CUstreamBatchMemOpParams> ops;
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      CUstreamBatchMemOpParams op{};
      op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
      op.writeValue.address = reinterpret_cast<CUdeviceptr>(peer[r] + rank);
      op.writeValue.value64 = epoch;
      ops.push_back(op);
    }
    for (int r = 0; r < size; ++r) {
      if (r == rank) continue;
      CUstreamBatchMemOpParams op{};
      op.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
      op.waitValue.address = reinterpret_cast<CUdeviceptr>(mine + r);
      op.waitValue.value64 = epoch;
      op.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ | wait_flags;
      ops.push_back(op);
    }
    CU(meshmem::ipc::cuda_driver().cuStreamBatchMemOp(s, static_cast<unsigned>(ops.size()), ops.data(), 0));
  }
  // (CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER on all but the first write is refused with
  // CUDA_ERROR_INVALID_VALUE on H200, driver 580: every write keeps its memory barrier.)
  void memop_calls() {
    for (int r = 0; r < size; ++r)
      if (r != rank)
        CU(meshmem::ipc::cuda_driver().cuStreamWriteValue64(s, reinterpret_cast<CUdeviceptr>(peer[r] + rank), epoch, 0));
    for (int r = 0; r < size; ++r)
      if (r != rank)
        CU(meshmem::ipc::cuda_driver().cuStreamWaitValue64(s, reinterpret_cast<CUdeviceptr>(mine + r), epoch,
                                                          CU_STREAM_WAIT_VALUE_GEQ));
  }
  void event(bool shm) {
    const int slot = static_cast<int>(epoch % kRing);
    CK(cudaEventRecord(ring[slot], s));
    if (shm) host_meet();
    else MK(MPI_Barrier(MPI_COMM_WORLD));
    for (int r = 0; r < size; ++r)
      if (r != rank) CK(cudaStreamWaitEvent(s, peer_ring[slot][r], 0));
  }
};

struct Variant {
  const char* name;
  const char* what;
  std::function<void(Lab&)> run;
};

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  bench::RunInfo run;
  for (int i = 1; i < argc; ++i) run.parse(argc, argv, i);
  {
    Lab lab;
    MK(MPI_Comm_rank(MPI_COMM_WORLD, &lab.rank));
    MK(MPI_Comm_size(MPI_COMM_WORLD, &lab.size));
    bench::check_rank() = lab.rank;
    meshmem::select_local_device(MPI_COMM_WORLD);
    meshmem::Comm comm(MPI_COMM_WORLD);
    meshmem::Options kernel_options;
    kernel_options.set("MESHMEM_BARRIER", "kernel");
    meshmem::Comm kernel_comm(MPI_COMM_WORLD, kernel_options);
    kernel_options.set("MESHMEM_EARLY_LAUNCH", "off");
    meshmem::Comm plain_comm(MPI_COMM_WORLD, kernel_options);
    meshmem::Window flags = comm.alloc(sizeof(std::uint64_t) * lab.size, meshmem::Memory::Device);
    lab.mine = static_cast<std::uint64_t*>(flags.local());
    lab.peer.resize(lab.size);
    for (int r = 0; r < lab.size; ++r) lab.peer[r] = static_cast<std::uint64_t*>(flags.peer(r));
    void* table = nullptr;
    CK(cudaMalloc(&table, sizeof(void*) * lab.size));
    CK(cudaMemcpy(table, lab.peer.data(), sizeof(void*) * lab.size, cudaMemcpyHostToDevice));
    lab.peer_table = static_cast<std::uint64_t* const*>(table);
    CK(cudaStreamCreateWithFlags(&lab.s, cudaStreamNonBlocking));
    CK(cudaMalloc(&lab.counter, sizeof(std::uint64_t)));
    CK(cudaEventCreateWithFlags(&lab.sequence, cudaEventDisableTiming));
    int dev = 0, flush = 0;
    CK(cudaGetDevice(&dev));
    CU(meshmem::ipc::cuda_driver().cuDeviceGetAttribute(&flush, CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES, dev));
    lab.wait_flush = flush ? CU_STREAM_WAIT_VALUE_FLUSH : 0;
    // IPC event ring.
    lab.ring.resize(Lab::kRing);
    std::vector<cudaIpcEventHandle_t> mine(Lab::kRing), all(static_cast<std::size_t>(Lab::kRing) * lab.size);
    for (int k = 0; k < Lab::kRing; ++k) {
      CK(cudaEventCreateWithFlags(&lab.ring[k], cudaEventDisableTiming | cudaEventInterprocess));
      CK(cudaIpcGetEventHandle(&mine[k], lab.ring[k]));
    }
    MK(MPI_Allgather(mine.data(), sizeof(cudaIpcEventHandle_t) * Lab::kRing, MPI_BYTE, all.data(),
                     sizeof(cudaIpcEventHandle_t) * Lab::kRing, MPI_BYTE, MPI_COMM_WORLD));
    lab.peer_ring.assign(Lab::kRing, std::vector<cudaEvent_t>(lab.size, nullptr));
    for (int k = 0; k < Lab::kRing; ++k)
      for (int r = 0; r < lab.size; ++r)
        if (r != lab.rank) CK(cudaIpcOpenEventHandle(&lab.peer_ring[k][r], all[static_cast<std::size_t>(r) * Lab::kRing + k]));
    // Shared host page for the host meeting (all ranks on this node).
    MPI_Win shm_win;
    std::uint64_t* base = nullptr;
    MK(MPI_Win_allocate_shared(lab.rank == 0 ? 64 * lab.size : 0, 64, MPI_INFO_NULL, MPI_COMM_WORLD, &base, &shm_win));
    MPI_Aint seg = 0;
    int unit = 0;
    MK(MPI_Win_shared_query(shm_win, 0, &seg, &unit, &base));
    if (lab.rank == 0) std::memset(base, 0, 64 * lab.size);
    lab.host_slots = base;
    MK(MPI_Barrier(MPI_COMM_WORLD));

    const std::vector<Variant> variants = {
        {"sync-only", "floor: cudaStreamSynchronize on an idle stream", [](Lab&) {}},
        {"empty-kernel", "floor: an empty kernel", [](Lab& l) { empty_kernel<<<1, 32, 0, l.s>>>(); }},
        {"local-write", "floor: one cuStreamWriteValue64 to local memory",
         [](Lab& l) { CU(meshmem::ipc::cuda_driver().cuStreamWriteValue64(l.s, reinterpret_cast<CUdeviceptr>(l.mine + l.rank), l.epoch, 0)); }},
        {"kernel-fence", "meshmem kernel barrier: fence.sys + release store + acquire polls", [](Lab& l) { l.kernel(barrier_fence); }},
        {"kernel-release", "release store, relaxed polls, one acquire fence", [](Lab& l) { l.kernel(barrier_release); }},
        {"kernel-relaxed", "unsafe: volatile store and polls, no fences", [](Lab& l) { l.kernel(barrier_relaxed); }},
        {"kernel-pdl", "kernel-fence with programmatic dependent launch", [](Lab& l) { l.kernel_pdl(); }},
        {"kernel-counter", "kernel-fence, barrier number from a device counter the kernel advances",
         [](Lab& l) { l.kernel_counter(); }},
        {"kernel-fence+event", "kernel-fence, then cudaEventRecord (meshmem's cross-stream order)", [](Lab& l) {
           l.kernel(barrier_fence);
           CK(cudaEventRecord(l.sequence, l.s));
         }},
        {"meshmem-kernel", "comm.barrier(stream), MESHMEM_BARRIER=kernel", [&](Lab& l) { kernel_comm.barrier(l.s); }},
        {"meshmem-kernel-plain", "the same, MESHMEM_EARLY_LAUNCH=off (ordinary launches)",
         [&](Lab& l) { plain_comm.barrier(l.s); }},
        {"memop-batch", "meshmem flag barrier: one cuStreamBatchMemOp, waits with FLUSH where supported",
         [](Lab& l) { l.memop_batch(l.wait_flush); }},
        {"memop-batch-noflush", "the same without the FLUSH flag", [](Lab& l) { l.memop_batch(0); }},
        {"memop-calls", "one cuStreamWriteValue64 / cuStreamWaitValue64 call per peer",
         [](Lab& l) { l.memop_calls(); }},
        {"event-mpi", "IPC events, MPI_Barrier host meeting", [](Lab& l) { l.event(false); }},
        {"event-shm", "IPC events, shared-memory host meeting", [](Lab& l) { l.event(true); }},
    };
    std::vector<bench::ResultRow> rows;
    if (lab.rank == 0) {
      std::printf("# barrier_lab, %d ranks, %s, wait FLUSH %s\n", lab.size, comm.device_info().c_str(), flush ? "supported" : "unsupported");
      std::printf("# single = per { barrier; cudaStreamSynchronize }, 500 iterations; burst = per barrier, 200 back to back, best of 5; "
                  "enqueue = the host's time per call in the burst (before its synchronize); max over ranks\n");
      std::printf("%-22s %12s %12s %12s  %s\n", "# variant", "single (us)", "burst (us)", "enqueue (us)", "what");
    }
    for (const Variant& v : variants) {
      auto one = [&] {
        ++lab.epoch;
        v.run(lab);
      };
      for (int w = 0; w < 50; ++w) one();
      CK(cudaStreamSynchronize(lab.s));
      MK(MPI_Barrier(MPI_COMM_WORLD));
      const int iters = 500;
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) {
        one();
        CK(cudaStreamSynchronize(lab.s));
      }
      const double single = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
      double burst = 1e30, enqueue = 1e30;
      for (int rep = 0; rep < 5; ++rep) {
        MK(MPI_Barrier(MPI_COMM_WORLD));
        t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < 200; ++i) one();
        const auto t1 = std::chrono::steady_clock::now();
        CK(cudaStreamSynchronize(lab.s));
        burst = std::min(burst, std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / 200);
        enqueue = std::min(enqueue, std::chrono::duration<double, std::micro>(t1 - t0).count() / 200);
      }
      double mine2[3] = {single, burst, enqueue}, worst[3] = {0, 0, 0};
      MK(MPI_Reduce(mine2, worst, 3, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD));
      if (lab.rank == 0) {
        std::printf("%-22s %12.2f %12.2f %12.2f  %s\n", v.name, worst[0], worst[1], worst[2], v.what);
        std::fflush(stdout);
        rows.push_back({"barrier_lab", v.name, lab.size, -1, worst[0], -1});
        rows.push_back({"barrier_lab200", v.name, lab.size, -1, worst[1], -1});
      }
      MK(MPI_Barrier(MPI_COMM_WORLD));
    }
    if (lab.rank == 0 && !run.csv.empty())
      bench::write_results_csv(run.csv, bench::CsvMode::Append, run.date, run.commit, run.machine, rows, "barrier_lab");
    CK(cudaDeviceSynchronize());
    for (auto& ring : lab.peer_ring)
      for (cudaEvent_t e : ring)
        if (e) CK(cudaEventDestroy(e));
    for (cudaEvent_t e : lab.ring) CK(cudaEventDestroy(e));
    CK(cudaFree(table));
    CK(cudaFree(lab.counter));
    CK(cudaEventDestroy(lab.sequence));
    CK(cudaStreamDestroy(lab.s));
    MK(MPI_Win_free(&shm_win));
  }
  MPI_Finalize();
  return 0;
}
