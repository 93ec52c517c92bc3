// Puts each rank's number into its right neighbour's host window; exit 0 if every rank got
// its left neighbour's.
#include <cstdio>
#include <meshmem/meshmem.hpp>

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int bad = 0;
  {
    meshmem::Comm comm(MPI_COMM_WORLD);
    meshmem::Window win = comm.alloc(sizeof(int), meshmem::Memory::Host);
    const int me = comm.rank(), n = comm.size();
    comm.put(win, (me + 1) % n, 0, &me, sizeof(me));
    comm.barrier();
    bad = *static_cast<int*>(win.local()) != (me + n - 1) % n;
    if (bad) std::fprintf(stderr, "rank %d: wrong value\n", me);
  }
  int any = 0;
  MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}
