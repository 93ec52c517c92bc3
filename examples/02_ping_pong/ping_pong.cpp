// 02_ping_pong: rank 0 and rank 1 bounce a message with put_signal + wait_until and print the
// one-way latency (round trip / 2) per size, OSU style. Device windows where a GPU is
// present (everything enqueued on one stream, GPU-timed), host windows otherwise.
//   mpirun -np 2 ./02_ping_pong [iterations]
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <meshmem/meshmem.hpp>
#include <vector>

#if MESHMEM_EXAMPLE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace {

// Runs `iters` round trips of `bytes`; returns microseconds per one-way trip (rank 0's view).
double ping_pong(meshmem::Comm& comm, meshmem::Window& win, meshmem::Signals& sig, const void* src, std::size_t bytes,
                 int iters, std::uint64_t& epoch, meshmem::Stream stream, meshmem::Memory memory) {
  const int me = comm.rank();
  auto round = [&] {
    ++epoch;
    if (me == 0) {
      comm.put_signal(win, 1, 0, src, bytes, sig, 0, epoch, meshmem::SignalOp::Set, stream);
      comm.wait_until(sig, 0, meshmem::Cmp::GE, epoch, stream);
    } else if (me == 1) {
      comm.wait_until(sig, 0, meshmem::Cmp::GE, epoch, stream);
      comm.put_signal(win, 0, 0, src, bytes, sig, 0, epoch, meshmem::SignalOp::Set, stream);
    }
  };
  for (int i = 0; i < 10; ++i) round();  // warm-up
#if MESHMEM_EXAMPLE_HAVE_CUDA
  if (memory == meshmem::Memory::Device) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    cudaStreamSynchronize(stream);
    MPI_Barrier(MPI_COMM_WORLD);
    cudaEventRecord(a, stream);
    for (int i = 0; i < iters; ++i) round();
    cudaEventRecord(b, stream);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return ms * 1e3 / (2.0 * iters);
  }
#endif
  (void)memory;
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) round();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / (2.0 * iters);
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rc = 0;
  try {
    meshmem::select_local_device(MPI_COMM_WORLD);
    meshmem::Comm comm(MPI_COMM_WORLD);
    const int iters = argc > 1 ? std::atoi(argv[1]) : 1000;
    if (comm.size() < 2) throw meshmem::Error(meshmem::ErrorCode::InvalidArgument, "02_ping_pong needs 2 ranks");
    const meshmem::Memory memory = meshmem::default_memory();
    const std::size_t max = std::size_t{1} << 20;
    meshmem::Window win = comm.alloc(max, memory);
    meshmem::Signals sig = comm.alloc_signals(1, memory);
    std::vector<char> host(max, 'x');
    const void* src = host.data();
    meshmem::Stream stream = nullptr;
#if MESHMEM_EXAMPLE_HAVE_CUDA
    void* dev = nullptr;
    if (memory == meshmem::Memory::Device) {
      cudaMalloc(&dev, max);
      cudaMemcpy(dev, host.data(), max, cudaMemcpyHostToDevice);
      cudaDeviceSynchronize();
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      src = dev;
    }
#endif
    if (comm.rank() == 0)
      std::printf("# meshmem put_signal ping-pong, %s windows, rank 0 -> rank 1 via %s\n# %10s %14s\n",
                  meshmem::to_string(memory), meshmem::to_string(comm.transport(1, memory)), "size", "latency(us)");
    std::uint64_t epoch = 0;
    for (std::size_t bytes = 8; bytes <= max; bytes *= 8) {
      const double us = ping_pong(comm, win, sig, src, bytes, iters, epoch, stream, memory);
      if (comm.rank() == 0) std::printf("  %10zu %14.2f\n", bytes, us);
    }
    comm.barrier(stream);
#if MESHMEM_EXAMPLE_HAVE_CUDA
    if (memory == meshmem::Memory::Device) {
      cudaStreamSynchronize(stream);
      cudaStreamDestroy(stream);
      cudaFree(dev);
    }
#endif
  } catch (const meshmem::Error& e) {
    std::fprintf(stderr, "02_ping_pong: %s\n", e.what());
    rc = 1;
  }
  int any = 0;
  MPI_Allreduce(&rc, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}
