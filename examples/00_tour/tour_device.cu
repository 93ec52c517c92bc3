// The README's device-window tour, compiled in CI wherever the GPU part is built (and run
// on the GPU machines): stream-ordered calls, then a kernel using the device API.
//   mpirun -np 2 build/examples/00_tour_device
#include <mpi.h>

#include <cstdio>
#include <meshmem/device/device.cuh>
#include <meshmem/meshmem.hpp>
#include <string>

#define CHECK_CUDA(call)                                                                     \
  do {                                                                                       \
    cudaError_t rc_ = (call);                                                                \
    if (rc_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(rc_));                    \
      MPI_Abort(MPI_COMM_WORLD, 1);                                                          \
    }                                                                                        \
  } while (0)

// [tour-kernel]
// Views are small values that kernels take by value (windows and signals themselves are
// move-only host objects): win.view(), sig.view().
__global__ void push_right(meshmem::device::WindowView w, meshmem::device::SignalsView s, int right,
                           const char* src, std::size_t n) {
  meshmem::device::put_signal_block(w, right, 0, src, n, s, 1, 1, meshmem::SignalOp::Add);
}
// [end tour-kernel]

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rc = 0;
  try {
    std::string why;
    if (!meshmem::gpu_available(&why)) {  // 77: reported as skipped by CTest
      std::printf("tour_device: skipped: %s\n", why.c_str());
      MPI_Finalize();
      return 77;
    }
    // [tour-device]
    meshmem::select_local_device(MPI_COMM_WORLD);   // GPU = node-local rank % GPUs
    meshmem::Comm comm(MPI_COMM_WORLD);             // uses the device current now
    const int me = comm.rank(), right = (me + 1) % comm.size();
    const std::size_t n = 1 << 20;
    meshmem::Window win = comm.alloc(n);            // Memory::Device
    meshmem::Signals sig = comm.alloc_signals(2);
    char* d_src = nullptr;
    cudaStream_t stream = nullptr;
    CHECK_CUDA(cudaMalloc(&d_src, n));
    CHECK_CUDA(cudaMemset(d_src, me + 1, n));
    CHECK_CUDA(cudaStreamCreate(&stream));
    comm.barrier();                                 // windows initialised everywhere

    comm.put_signal(win, right, 0, d_src, n, sig, 0, 1, meshmem::SignalOp::Set, stream);
    comm.wait_until(sig, 0, meshmem::Cmp::GE, 1, stream);  // the stream waits; the host does not
    const int left = (me + comm.size() - 1) % comm.size();
    if (comm.transport(right, meshmem::Memory::Device) == meshmem::TransportKind::Ipc &&
        comm.transport(left, meshmem::Memory::Device) == meshmem::TransportKind::Ipc) {
      // The device API reaches directly mapped peers (ipc) only.
      push_right<<<1, 256, 0, stream>>>(win.view(), sig.view(), right, d_src, n);
      comm.wait_until(sig, 1, meshmem::Cmp::GE, 1, stream);
    }
    comm.barrier(stream);                           // stream-ordered barrier of all ranks
    CHECK_CUDA(cudaStreamSynchronize(stream));
    // [end tour-device]
    CHECK_CUDA(cudaStreamDestroy(stream));
    CHECK_CUDA(cudaFree(d_src));
  } catch (const meshmem::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return rc;
}
