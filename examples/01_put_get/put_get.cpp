// 01_put_get: the smallest meshmem program. Every rank puts a greeting into its right
// neighbour's window with a signal, waits for its left neighbour's, gets a word back from
// the neighbour on the right, and checks both. Run: mpirun -np 4 ./01_put_get
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <meshmem/meshmem.hpp>

int main(int argc, char** argv) {
  int provided = 0;
  // MPI_THREAD_MULTIPLE: ranks on other nodes are served by a progress thread.
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rc = 0;
  try {
    meshmem::Comm comm(MPI_COMM_WORLD);
    const int me = comm.rank();
    const int n = comm.size();
    const int right = (me + 1) % n;
    const int left = (me + n - 1) % n;
    const meshmem::Memory memory = meshmem::default_memory();  // GPU where available

    meshmem::Window win = comm.alloc(256, memory);
    meshmem::Signals ready = comm.alloc_signals(1, memory);

    char msg[64];
    std::snprintf(msg, sizeof(msg), "hello from rank %d", me);
    comm.put_signal(win, right, 0, msg, sizeof(msg), ready, 0, 1, meshmem::SignalOp::Set);
    comm.wait_until(ready, 0, meshmem::Cmp::EQ, 1);  // left neighbour's greeting has landed

    char expected[64];
    std::snprintf(expected, sizeof(expected), "hello from rank %d", left);
    const bool put_ok = std::strcmp(static_cast<const char*>(win.local()), expected) == 0;

    comm.barrier();  // every greeting is in place before anyone reads remotely
    char fetched[64] = {};
    comm.get(fetched, win, right, 0, sizeof(fetched));
    std::snprintf(expected, sizeof(expected), "hello from rank %d", me);
    const bool get_ok = std::strcmp(fetched, expected) == 0;

    std::printf("rank %d/%d (node %d, %s memory, to rank %d via %s): received \"%s\" %s, got back \"%s\" %s\n",
                me, n, comm.node(), meshmem::to_string(memory), right,
                meshmem::to_string(comm.transport(right, memory)),
                static_cast<const char*>(win.local()), put_ok ? "OK" : "WRONG", fetched,
                get_ok ? "OK" : "WRONG");
    rc = put_ok && get_ok ? 0 : 1;
    comm.barrier();
  } catch (const meshmem::Error& e) {
    std::fprintf(stderr, "01_put_get: %s\n", e.what());
    rc = 1;
  }
  int any = 0;
  MPI_Allreduce(&rc, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}
