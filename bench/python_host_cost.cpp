// The per-call host cost of put_signal and wait_until from C++: the baseline of
// bench/python_host_cost.py, which times the same calls from Python. Each rank issues
// `calls` put_signal of 8 bytes to its right neighbour (host form: returns once the source
// may be reused), then `calls` wait_until on a word that is already satisfied; the table
// gives rank 0's mean time per call.
//   mpirun -np 2 python_host_cost_cpp [--memory host|device] [--calls N]
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "meshmem/meshmem.hpp"

#if MESHMEM_BENCH_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace {

double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  std::string memory = "host";
  long calls = 20000;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--memory") == 0 && i + 1 < argc) memory = argv[++i];
    else if (std::strcmp(argv[i], "--calls") == 0 && i + 1 < argc) calls = std::atol(argv[++i]);
  }
  int rc = 0;
  try {
    const meshmem::Memory mem = memory == "device" ? meshmem::Memory::Device : meshmem::Memory::Host;
    if (mem == meshmem::Memory::Device) meshmem::select_local_device(MPI_COMM_WORLD);
    meshmem::Comm comm(MPI_COMM_WORLD);
    meshmem::Window win = comm.alloc(4096, mem);
    meshmem::Signals sig = comm.alloc_signals(2, mem);
    std::vector<unsigned char> src(8, 1);
    const int right = (comm.rank() + 1) % comm.size();
    // Device windows: the stream forms (what is timed is the host's enqueue), on a stream of
    // this program's own; the null stream would be the host form.
    meshmem::Stream stream = nullptr;
#if MESHMEM_BENCH_HAVE_CUDA
    cudaStream_t made = nullptr;
    if (mem == meshmem::Memory::Device) {
      if (cudaStreamCreateWithFlags(&made, cudaStreamNonBlocking) != cudaSuccess)
        throw meshmem::Error(meshmem::ErrorCode::Cuda, "cudaStreamCreateWithFlags failed");
      stream = made;
    }
#else
    if (mem == meshmem::Memory::Device)
      throw meshmem::Error(meshmem::ErrorCode::Unsupported, "built without the GPU part");
#endif
    comm.barrier();
    const double t0 = seconds();
    for (long i = 0; i < calls; ++i)
      comm.put_signal(win, right, 0, src.data(), src.size(), sig, 0, 1, meshmem::SignalOp::Add, stream);
    const double t1 = seconds();
#if MESHMEM_BENCH_HAVE_CUDA
    if (made != nullptr) cudaStreamSynchronize(made);
#endif
    comm.barrier();
    const double t2 = seconds();
    for (long i = 0; i < calls; ++i) comm.wait_until(sig, 1, meshmem::Cmp::GE, 0, stream);
    const double t3 = seconds();
#if MESHMEM_BENCH_HAVE_CUDA
    if (made != nullptr) {
      cudaStreamSynchronize(made);
      comm.barrier();
    }
#endif
    comm.barrier();
    if (comm.rank() == 0) {
      std::printf("# language  call  memory  calls  per_call_us\n");
      std::printf("c++  put_signal  %s  %ld  %.3f\n", memory.c_str(), calls, (t1 - t0) / calls * 1e6);
      std::printf("c++  wait_until  %s  %ld  %.3f\n", memory.c_str(), calls, (t3 - t2) / calls * 1e6);
    }
  } catch (const meshmem::Error& e) {
    std::fprintf(stderr, "python_host_cost_cpp: %s\n", e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}
