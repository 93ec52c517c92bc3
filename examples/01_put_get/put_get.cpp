// 01_put_get: the smallest meshmem program. Every rank puts a greeting into its right
// neighbour's window with a signal, waits for its left neighbour's, gets a word back from
// the neighbour on the right, and checks both. Run: mpirun -np 2 ./01_put_get (-np 4 on fewer
// than 4 cores needs --oversubscribe; launch/meshrun -np 4 adds it)
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <meshmem/meshmem.hpp>

#if MESHMEM_EXAMPLE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace {
// Device windows hold GPU memory: the host reads it through copies.
void copy_to_host(void* dst, const void* src, std::size_t bytes, meshmem::Memory memory) {
#if MESHMEM_EXAMPLE_HAVE_CUDA
  if (memory == meshmem::Memory::Device) {
    cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);  // after the default stream's work
    return;
  }
#endif
  (void)memory;
  std::memcpy(dst, src, bytes);
}
void* device_scratch(meshmem::Memory memory, std::size_t bytes) {
#if MESHMEM_EXAMPLE_HAVE_CUDA
  static void* scratch = nullptr;
  if (memory == meshmem::Memory::Device && scratch == nullptr) cudaMalloc(&scratch, bytes);
  return memory == meshmem::Memory::Device ? scratch : nullptr;
#else
  (void)memory;
  (void)bytes;
  return nullptr;
#endif
}
void synchronize(meshmem::Memory memory) {
#if MESHMEM_EXAMPLE_HAVE_CUDA
  if (memory == meshmem::Memory::Device) cudaDeviceSynchronize();
#endif
  (void)memory;
}
}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  // MPI_THREAD_MULTIPLE: ranks on other nodes are served by a progress thread.
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rc = 0;
  try {
    meshmem::select_local_device(MPI_COMM_WORLD);  // GPU = node-local rank % GPUs, if any
    meshmem::Comm comm(MPI_COMM_WORLD);
    const int me = comm.rank();
    const int n = comm.size();
    const int right = (me + 1) % n;
    const int left = (me + n - 1) % n;
    const meshmem::Memory memory = meshmem::default_memory();  // GPU where available

    meshmem::Window win = comm.alloc(256, memory);
    meshmem::Signals ready = comm.alloc_signals(1, memory);

    // Host windows: the calls run on the host. Device windows: they are enqueued on the
    // default stream (null), and the host reads results after synchronising.
    char msg[64];
    std::snprintf(msg, sizeof(msg), "hello from rank %d", me);
    comm.put_signal(win, right, 0, msg, sizeof(msg), ready, 0, 1, meshmem::SignalOp::Set);
    comm.wait_until(ready, 0, meshmem::Cmp::EQ, 1);  // left neighbour's greeting has landed
    char received[64] = {};
    copy_to_host(received, win.local(), sizeof(received), memory);

    char expected[64];
    std::snprintf(expected, sizeof(expected), "hello from rank %d", left);
    const bool put_ok = std::strcmp(received, expected) == 0;

    comm.barrier(nullptr);  // every greeting is in place before anyone reads remotely
    char fetched[64] = {};
    char* staging = static_cast<char*>(device_scratch(memory, sizeof(fetched)));
    comm.get(staging ? staging : fetched, win, right, 0, sizeof(fetched));
    if (staging) copy_to_host(fetched, staging, sizeof(fetched), memory);
    std::snprintf(expected, sizeof(expected), "hello from rank %d", me);
    const bool get_ok = std::strcmp(fetched, expected) == 0;

    std::printf("rank %d/%d (node %d, %s memory, to rank %d via %s): received \"%s\" %s, got back \"%s\" %s\n",
                me, n, comm.node(), meshmem::to_string(memory), right,
                meshmem::to_string(comm.transport(right, memory)),
                received, put_ok ? "OK" : "WRONG", fetched,
                get_ok ? "OK" : "WRONG");
    rc = put_ok && get_ok ? 0 : 1;
    comm.barrier(nullptr);
    synchronize(memory);
  } catch (const meshmem::Error& e) {
    std::fprintf(stderr, "01_put_get: %s\n", e.what());
    rc = 1;
  }
  int any = 0;
  MPI_Allreduce(&rc, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}
