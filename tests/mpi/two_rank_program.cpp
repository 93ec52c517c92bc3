// A program written for two ranks (each puts to its partner, 1 - rank, and waits for the
// partner's signal), which host.wrong_rank_count runs with three: rank 2's partner is -1, and
// its put_signal raises. The user must see that cause first; the destructors that then unwind
// the Comm on every rank (out of step with each other) add at most one line each
// (first_message.sh checks both).
#include <mpi.h>

#include <cstdio>
#include <cstring>

#include <meshmem/meshmem.hpp>

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int rc = 0;
  try {
    meshmem::Comm comm(MPI_COMM_WORLD);
    meshmem::Window win = comm.alloc(4096, meshmem::Memory::Host);
    meshmem::Signals sig = comm.alloc_signals(1, meshmem::Memory::Host);
    char src[64];
    std::memset(src, rank + 1, sizeof src);
    const int partner = 1 - comm.rank();
    comm.put_signal(win, partner, 0, src, sizeof src, sig, 0, 1, meshmem::SignalOp::Set);
    comm.wait_until(sig, 0, meshmem::Cmp::GE, 1);
    comm.barrier();
  } catch (const meshmem::Error& e) {
    std::fprintf(stderr, "two_rank_program on rank %d: %s\n", rank, e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}
