// timeslice_lab: two processes share one GPU. Process 0's stream waits (a stream memory wait
// or a polling kernel) for a pinned word that process 1's stream writes after some work (a
// copy of N bytes, or nothing). How long from process 1 enqueueing its work until process 0's
// stream passed the wait, and until process 1's own stream was done? The study behind the
// staged transport's small puts between ranks sharing a GPU (2.39 ms at 16 KiB and less,
// bench/results/2026-11-29-nvidia-h200-staged-shared-gpu-f1f65df.txt).
//   mpirun -np 2 timeslice_lab [--reps N] [--sizes 4K,16K,...] [--waiters none,memop,kernel]
//                              [--ops write,h2d,...]
// ops (each followed by a stream write of the word on process 1's stream, except host-write):
//   write        nothing before the write
//   h2d          cudaMemcpyAsync pinned -> device, cudaMemcpyHostToDevice
//   h2d-default  the same with cudaMemcpyDefault (what the staging agent passes)
//   h2d-as-d2d   the same with cudaMemcpyDeviceToDevice (the pinned pointer is a device pointer too)
//   h2d-batch    cudaMemcpyBatchAsync of one copy, cudaMemcpyFlagPreferOverlapWithCompute
//   h2d-2d       cudaMemcpy2DAsync of one row (cudaMemcpyDefault)
//   h2d-kernel   a copy kernel reading the pinned memory
//   d2h          cudaMemcpyAsync device -> pinned
//   host-write   h2d, an event, and process 1's host writes the word once the event passed
// Times: host clock (CLOCK_MONOTONIC, one machine), median and max of --reps.
#include <cuda.h>
#include <cuda_runtime.h>
#include <mpi.h>
#include <time.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "bench_check.hpp"

namespace {

double now_us() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

// Polls `word` until it reaches `value` or about 2 s of GPU clock passed (then gives up: the
// host reports it as held back).
__global__ void poll_word(const volatile std::uint64_t* word, std::uint64_t value) {
  const long long start = clock64();
  while (*word < value) {
    if (clock64() - start > 4'000'000'000LL) return;
  }
}

__global__ void copy_bytes(std::uint8_t* dst, const std::uint8_t* src, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

void write_word(cudaStream_t s, std::uint64_t* word, std::uint64_t v) {
  CU(cuStreamWriteValue64(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(word), v,
                          CU_STREAM_WRITE_VALUE_DEFAULT));
}

}  // namespace

int main(int argc, char** argv) {
  MK(MPI_Init(&argc, &argv));
  int rank = 0, size = 0;
  MK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  MK(MPI_Comm_size(MPI_COMM_WORLD, &size));
  bench::check_rank() = rank;
  int reps = 20;
  std::vector<std::string> size_list = {"4K", "8K", "16K", "32K", "48K", "64K", "256K"};
  std::vector<std::string> waiters = {"none", "memop", "kernel"};
  std::vector<std::string> ops = {"write", "h2d", "h2d-default", "h2d-as-d2d", "h2d-batch", "h2d-2d",
                                  "h2d-kernel", "d2h", "host-write"};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (a == "--sizes" && i + 1 < argc) size_list = split(argv[++i]);
    else if (a == "--waiters" && i + 1 < argc) waiters = split(argv[++i]);
    else if (a == "--ops" && i + 1 < argc) ops = split(argv[++i]);
    else {
      if (rank == 0) std::fprintf(stderr, "timeslice_lab: unknown argument %s\n", argv[i]);
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
  }
  std::vector<std::size_t> sizes;
  for (const auto& s : size_list) {
    std::size_t b = 0;
    if (!bench::parse_bytes(s, &b) || b > (1u << 20)) {
      if (rank == 0) std::fprintf(stderr, "timeslice_lab: bad size %s (at most 1M)\n", s.c_str());
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
    sizes.push_back(b);
  }
  if (size != 2) {
    if (rank == 0) std::fprintf(stderr, "timeslice_lab: needs 2 ranks\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  int ngpu = 0;
  if (cudaGetDeviceCount(&ngpu) != cudaSuccess || ngpu < 1) {
    if (rank == 0) std::printf("# timeslice_lab: no GPU; nothing measured\n");
    MPI_Finalize();
    return 0;
  }
  CK(cudaSetDevice(0));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));

  // Node-shared host memory (MPI's), pinned and mapped in both processes: the word at 0, a
  // 1 MiB source / destination from 4 KiB on.
  const std::size_t shared_bytes = (2u << 20);
  MPI_Comm node = MPI_COMM_NULL;
  MK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  MPI_Win win = MPI_WIN_NULL;
  void* base = nullptr;
  MK(MPI_Win_allocate_shared(rank == 0 ? static_cast<MPI_Aint>(shared_bytes) : 0, 1, MPI_INFO_NULL, node, &base,
                             &win));
  MPI_Aint got = 0;
  int unit = 0;
  MK(MPI_Win_shared_query(win, 0, &got, &unit, &base));
  std::memset(base, 0, rank == 0 ? shared_bytes : 0);
  MK(MPI_Barrier(MPI_COMM_WORLD));
  CK(cudaHostRegister(base, shared_bytes, cudaHostRegisterMapped | cudaHostRegisterPortable));
  auto* word = static_cast<std::uint64_t*>(base);
  auto* host_buf = static_cast<std::uint8_t*>(base) + 4096 + (static_cast<std::size_t>(rank) << 19);
  std::uint8_t* dev = nullptr;
  CK(cudaMalloc(&dev, 1u << 20));
  cudaStream_t stream = nullptr;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t event = nullptr;
  CK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  // Load both kernels before anything waits (lazy loading would stall a first launch).
  poll_word<<<1, 1, 0, stream>>>(word, 0);
  copy_bytes<<<1, 32, 0, stream>>>(dev, dev, 0);
  CK(cudaStreamSynchronize(stream));

  if (rank == 0)
    std::printf("# timeslice_lab: 2 ranks sharing GPU 0 (%s); process 0 waits on its stream for a pinned word, process 1\n"
                "# enqueues OP then a stream write of the word. pass = process 1's enqueue -> process 0's stream past the\n"
                "# wait; own = process 1's enqueue -> its own stream done. Median / max of %d, microseconds.\n"
                "# %-7s %-12s %8s %10s %10s %10s %10s %s\n",
                prop.name, reps, "waiter", "op", "bytes", "pass-med", "pass-max", "own-med", "own-max", "held");
  std::uint64_t value = 0;
  for (const auto& waiter : waiters) {
    for (const auto& op : ops) {
      for (std::size_t bytes : sizes) {
        if (op == "write" && bytes != sizes.front()) continue;  // no bytes moved
        std::vector<double> pass, own;
        int held = 0;
        for (int r = 0; r < reps; ++r) {
          ++value;
          if (rank == 0) {
            if (waiter == "memop")
              CU(cuStreamWaitValue64(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(word), value,
                                     CU_STREAM_WAIT_VALUE_GEQ));
            else if (waiter == "kernel")
              poll_word<<<1, 1, 0, stream>>>(word, value);
            CK(cudaGetLastError());
          }
          MK(MPI_Barrier(MPI_COMM_WORLD));
          double t0 = 0, t_own = 0;
          if (rank == 1) {
            const double settle = now_us() + 200;  // process 0's wait is running on the GPU by then
            while (now_us() < settle) {
            }
            t0 = now_us();
            if (op == "h2d") CK(cudaMemcpyAsync(dev, host_buf, bytes, cudaMemcpyHostToDevice, stream));
            else if (op == "h2d-default" || op == "host-write")
              CK(cudaMemcpyAsync(dev, host_buf, bytes, cudaMemcpyDefault, stream));
            else if (op == "h2d-as-d2d") CK(cudaMemcpyAsync(dev, host_buf, bytes, cudaMemcpyDeviceToDevice, stream));
            else if (op == "h2d-2d") CK(cudaMemcpy2DAsync(dev, bytes, host_buf, bytes, bytes, 1, cudaMemcpyDefault, stream));
            else if (op == "d2h") CK(cudaMemcpyAsync(host_buf, dev, bytes, cudaMemcpyDeviceToHost, stream));
            else if (op == "h2d-kernel") copy_bytes<<<8, 256, 0, stream>>>(dev, host_buf, bytes);
            else if (op == "h2d-batch") {
#if CUDART_VERSION >= 13000
              void* dsts[1] = {dev};
              const void* srcs[1] = {host_buf};
              std::size_t lens[1] = {bytes};
              cudaMemcpyAttributes attributes{};
              attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
              attributes.flags = cudaMemcpyFlagPreferOverlapWithCompute;
              std::size_t first = 0;
              CK(cudaMemcpyBatchAsync(dsts, srcs, lens, 1,
                                      &attributes, &first, 1, stream));
#else
              CK(cudaMemcpyAsync(dev, host_buf, bytes, cudaMemcpyDefault, stream));
#endif
            } else if (op != "write") {
              std::fprintf(stderr, "timeslice_lab: unknown op %s\n", op.c_str());
              MPI_Abort(MPI_COMM_WORLD, 2);
            }
            CK(cudaGetLastError());
            if (op == "host-write") {
              CK(cudaEventRecord(event, stream));
              CK(cudaEventSynchronize(event));
              __atomic_store_n(word, value, __ATOMIC_RELEASE);
            } else {
              write_word(stream, word, value);
            }
            CK(cudaStreamSynchronize(stream));
            t_own = now_us();
            MK(MPI_Send(&t0, 1, MPI_DOUBLE, 0, 0, MPI_COMM_WORLD));
            MK(MPI_Send(&t_own, 1, MPI_DOUBLE, 0, 1, MPI_COMM_WORLD));
          } else {
            MK(MPI_Recv(&t0, 1, MPI_DOUBLE, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
            double t_pass = 0;
            const double give_up = now_us() + 2e6;
            for (;;) {
              const cudaError_t q = cudaStreamQuery(stream);
              if (q == cudaSuccess) {
                t_pass = now_us();
                break;
              }
              if (q != cudaErrorNotReady) CK(q);
              if (now_us() > give_up) {  // release it from here
                __atomic_store_n(word, value, __ATOMIC_RELEASE);
                CK(cudaStreamSynchronize(stream));
                ++held;
                t_pass = now_us();
                break;
              }
            }
            MK(MPI_Recv(&t_own, 1, MPI_DOUBLE, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
            pass.push_back(t_pass - t0);
            own.push_back(t_own - t0);
          }
          MK(MPI_Barrier(MPI_COMM_WORLD));
        }
        if (rank == 0) {
          std::sort(pass.begin(), pass.end());
          std::sort(own.begin(), own.end());
          std::printf("  %-7s %-12s %8zu %10.1f %10.1f %10.1f %10.1f %d\n", waiter.c_str(), op.c_str(),
                      op == "write" ? std::size_t{0} : bytes, pass[pass.size() / 2], pass.back(),
                      own[own.size() / 2], own.back(), held);
          std::fflush(stdout);
        }
      }
    }
  }
  CK(cudaStreamSynchronize(stream));
  CK(cudaHostUnregister(base));
  CK(cudaFree(dev));
  CK(cudaEventDestroy(event));
  CK(cudaStreamDestroy(stream));
  MK(MPI_Win_free(&win));
  MK(MPI_Comm_free(&node));
  MK(MPI_Finalize());
  return 0;
}
