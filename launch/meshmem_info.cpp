// meshmem-info: run under mpirun to see what meshmem would do in this job: the settings,
// the placement of the ranks, how descriptors are passed, and the transport of every pair.
#include <mpi.h>

#include <cstdio>
#include <meshmem/meshmem.hpp>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rc = 0;
  try {
    meshmem::select_local_device(MPI_COMM_WORLD);  // one GPU per rank, as applications do
    meshmem::Comm comm(MPI_COMM_WORLD);
    const int me = comm.rank();
    const int n = comm.size();
    // Each rank's row of the transport table, gathered to rank 0.
    std::string row, drow;
    for (int r = 0; r < n; ++r) {
      row += std::string(r ? " " : "") + meshmem::to_string(comm.transport(r, meshmem::Memory::Host));
      drow += std::string(r ? " " : "") + meshmem::to_string(comm.transport(r, meshmem::Memory::Device));
    }
    std::vector<char> mine(1024, '\0');
    std::snprintf(mine.data(), mine.size(), "rank %d (node %d): host windows -> %s; device windows -> %s; %s", me,
                  comm.node(), row.c_str(), drow.c_str(), comm.device_info().c_str());
    std::vector<char> all(me == 0 ? mine.size() * static_cast<std::size_t>(n) : 1);
    MPI_Gather(mine.data(), static_cast<int>(mine.size()), MPI_CHAR, all.data(), static_cast<int>(mine.size()),
               MPI_CHAR, 0, MPI_COMM_WORLD);
    if (me == 0) {
      std::printf("meshmem %s\n", "0.1.0");
      std::printf("settings:\n");
      for (const auto& line : comm.options().describe()) std::printf("  %s\n", line.c_str());
      std::printf("ranks: %d on %d node(s)%s\n", n, comm.node_count(),
                  comm.options().simulate_nodes > 1 ? " (simulated split)" : "");
      std::printf("MPI thread level: %s\n", provided >= MPI_THREAD_MULTIPLE ? "MPI_THREAD_MULTIPLE" : "below MPI_THREAD_MULTIPLE");
      std::printf("fd passing: %s\n", meshmem::to_string(comm.fd_passing()));
      std::printf("default window memory: %s\n", meshmem::to_string(meshmem::default_memory()));
      std::printf("transports (row: from rank, column: to rank):\n");
      for (int r = 0; r < n; ++r) std::printf("  %s\n", all.data() + static_cast<std::size_t>(r) * mine.size());
    }
  } catch (const meshmem::Error& e) {
    std::fprintf(stderr, "meshmem-info: %s\n", e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}
