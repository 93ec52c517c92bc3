// The README's API tour, compiled and run in CI (tests/docs/check_snippets.py checks that the
// README's blocks are these lines). Host windows: runs on any machine, any number of ranks.
//   mpirun -np 2 build/examples/00_tour   (more ranks than cores: add --oversubscribe)
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <meshmem/meshmem.hpp>
#include <vector>

namespace {

int tour(MPI_Comm world) {
  // [tour-host]
  meshmem::Comm comm(world);                               // collective; duplicates `world`
  const int me = comm.rank(), n = comm.size();
  const int right = (me + 1) % n, left = (me + n - 1) % n;
  const std::size_t bytes = 1 << 20;
  meshmem::Window win = comm.alloc(bytes, meshmem::Memory::Host);   // collective, symmetric
  meshmem::Signals sig = comm.alloc_signals(1, meshmem::Memory::Host);
  std::vector<int> src(bytes / sizeof(int), me), dst(bytes / sizeof(int), -1);
  comm.barrier();  // every window is initialised before any rank writes into a peer's

  comm.put_signal(win, right, 0, src.data(), bytes, sig, 0, 1, meshmem::SignalOp::Set);
  comm.wait_until(sig, 0, meshmem::Cmp::GE, 1);            // left's bytes have landed here
  const int* mine = static_cast<const int*>(win.local());  // = left, in every int
  comm.get(dst.data(), win, right, 0, bytes);              // right's part; complete on return
  comm.quiet();                                            // my puts are complete at targets
  comm.barrier();                                          // quiet + every rank has arrived
  // [end tour-host]
  int bad = 0;
  for (std::size_t i = 0; i < src.size(); ++i) bad += (mine[i] != left) + (dst[i] != me);
  return bad;
}

}  // namespace

// [tour-errors]
int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, bad = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  try {
    bad = tour(MPI_COMM_WORLD);
  } catch (const meshmem::Error& e) {   // every meshmem failure: code(), and what() names
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());  // the call, the rank, the values
    MPI_Abort(MPI_COMM_WORLD, 1);       // the MPI way: end the whole job now
  }
  // [end tour-errors]
  int all_bad = 0;
  MPI_Allreduce(&bad, &all_bad, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) std::printf("tour: %s\n", all_bad == 0 ? "every byte as expected" : "WRONG DATA");
  MPI_Finalize();
  return all_bad == 0 ? 0 : 1;
}
