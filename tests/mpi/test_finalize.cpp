// Objects still alive at MPI_Finalize (issue 13): the natural shape of main() declares the
// Comm, its windows, signals and halo exchange in main's scope and calls MPI_Finalize last,
// so their destructors run after it. They must release what they hold without MPI (which
// aborted every rank with exit 1 before the fix) and the program must exit 0. Host windows,
// under every placement the ctest entries give it. A plain program, not GoogleTest: the
// verdict is each rank's exit code and the line it prints.
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <meshmem/meshmem.hpp>
#include <vector>

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  meshmem::Comm comm(MPI_COMM_WORLD);
  meshmem::Window win = comm.alloc(4096, meshmem::Memory::Host);
  meshmem::Signals sig = comm.alloc_signals(2, meshmem::Memory::Host);
  meshmem::Window default_win = comm.alloc(4096, meshmem::default_memory());  // device memory where a GPU is usable
  const int right = (rank + 1) % size, left = (rank + size - 1) % size;
  std::vector<meshmem::HaloRegion> sends;
  if (size > 1) {  // neighbours name each other: a region to each side
    sends.push_back(meshmem::HaloRegion{right, 0, 2048, 512, 1, 0, 0});
    sends.push_back(meshmem::HaloRegion{left, 0, 2560, 512, 1, 0, 0});
  }
  meshmem::HaloExchange halo = comm.make_halo(win, sends);
  std::memset(win.local(), rank + 1, 2048);
  comm.barrier();
  halo.exchange();
  comm.put_signal(win, right, 3072, win.local(), 8, sig, 0, 1, meshmem::SignalOp::Add);
  comm.wait_until(sig, 0, meshmem::Cmp::GE, 1);
  const auto* bytes = static_cast<const unsigned char*>(win.local());
  const bool ok = size == 1 || (bytes[2048] == left + 1 && bytes[2559] == left + 1 && bytes[2560] == right + 1 &&
                                 bytes[3071] == right + 1 && bytes[3072] == left + 1);
  comm.barrier();
  MPI_Finalize();  // the Comm, window, signals and halo exchange are still alive
  std::printf("[rank %d] %s; MPI finalized with meshmem objects alive\n", rank, ok ? "data ok" : "DATA WRONG");
  return ok ? 0 : 1;
}
