// meshmem-info: run under mpirun to see what meshmem would do in this job: the settings,
// the placement of the ranks, how descriptors are passed, the transport of every pair and,
// where none reaches a pair, every transport's reason.
//   meshmem-info                   (under mpirun) the job as meshmem sees it
//   meshmem-info --knobs-markdown  the MESHMEM_* table of README.md, from the knob table
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <meshmem/meshmem.hpp>
#include <string>
#include <vector>

namespace {

// The README's table ("## Configuration"), generated from the knob table through
// Options::describe(), so that the docs cannot drift from the code (tests/docs check it).
void print_knob_markdown() {
  const meshmem::Options defaults;
  std::printf("| variable | default | meaning |\n| --- | --- | --- |\n");
  for (const std::string& line : defaults.describe()) {
    const auto eq = line.find('=');
    const auto open = line.find(" (", eq);
    const std::string name = line.substr(0, eq);
    const std::string value = line.substr(eq + 1, open - eq - 1);
    const std::string doc = line.substr(open + 2, line.size() - open - 3);
    std::printf("| `%s` | `%s` | %s |\n", name.c_str(), value.c_str(), doc.c_str());
  }
}

// "host: shm mpi mpi ..." for one rank's row, the reasons of unreachable pairs after it.
std::string row_of(const meshmem::Comm& comm, meshmem::Memory memory, std::string* reasons) {
  std::string row;
  for (int r = 0; r < comm.size(); ++r) {
    const meshmem::TransportKind k = comm.transport(r, memory);
    row += std::string(r ? " " : "") + meshmem::to_string(k);
    if (k == meshmem::TransportKind::None)
      *reasons += "    to rank " + std::to_string(r) + " (" + meshmem::to_string(memory) +
                  "): " + comm.unreachable_reason(r, memory) + "\n";
  }
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--knobs-markdown") == 0) {
      print_knob_markdown();
      return 0;
    }
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::printf("usage: mpirun -np N meshmem-info      the job as meshmem sees it\n"
                  "       meshmem-info --knobs-markdown  the MESHMEM_* settings as a Markdown table\n");
      return 0;
    }
    std::fprintf(stderr, "meshmem-info: unknown argument %s (try --help)\n", argv[i]);
    return 2;
  }
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rc = 0;
  try {
    meshmem::select_local_device(MPI_COMM_WORLD);  // one GPU per rank, as applications do
    meshmem::Comm comm(MPI_COMM_WORLD);
    const int me = comm.rank();
    const int n = comm.size();
    // Each rank's row of the transport table, gathered to rank 0.
    std::string reasons;
    const std::string row = row_of(comm, meshmem::Memory::Host, &reasons);
    // Without device windows, device_info() says why once; no reasons per pair.
    std::string no_device_reasons;
    const bool device = comm.device_info().rfind("none", 0) != 0;
    const std::string drow = row_of(comm, meshmem::Memory::Device, device ? &reasons : &no_device_reasons);
    std::string text = "rank " + std::to_string(me) + " (node " + std::to_string(comm.node()) +
                       "): host windows -> " + row + "; device windows -> " + drow + "; " + comm.device_info() + "\n" +
                       reasons;
    int len = static_cast<int>(text.size());
    std::vector<int> lens(static_cast<std::size_t>(n)), displs(static_cast<std::size_t>(n));
    MPI_Gather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
    int total = 0;
    for (int r = 0; r < n; ++r) {
      displs[r] = total;
      total += lens[r];
    }
    std::vector<char> all(static_cast<std::size_t>(me == 0 ? total + 1 : 1), '\0');
    MPI_Gatherv(text.data(), len, MPI_CHAR, all.data(), lens.data(), displs.data(), MPI_CHAR, 0, MPI_COMM_WORLD);
    if (me == 0) {
      std::printf("meshmem %s\n", "0.1.0");
      std::printf("settings:\n");
      for (const auto& line : comm.options().describe()) std::printf("  %s\n", line.c_str());
      std::printf("ranks: %d on %d node(s)%s\n", n, comm.node_count(),
                  comm.options().simulate_nodes > 1 ? " (simulated split)" : "");
      std::printf("MPI thread level: %s\n", provided >= MPI_THREAD_MULTIPLE ? "MPI_THREAD_MULTIPLE" : "below MPI_THREAD_MULTIPLE");
      std::printf("fd passing: %s\n", meshmem::to_string(comm.fd_passing()));
      std::printf("default window memory: %s\n", meshmem::to_string(meshmem::default_memory()));
      std::printf("transports (row: from rank, column: to rank; where none reaches, each transport's reason):\n");
      std::printf("%s", all.data());
    }
  } catch (const meshmem::Error& e) {
    std::fprintf(stderr, "meshmem-info: %s\n", e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}
