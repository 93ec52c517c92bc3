// Calls on a live Comm after MPI_Finalize: each raises meshmem::Error naming the call (before,
// the first one reached MPI and Open MPI aborted the job: "MPI_Irecv() called after
// MPI_FINALIZE"). A plain program: after MPI_Finalize there is no MPI to agree a gtest verdict
// on; each rank prints its verdict and exits with it.
#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <meshmem/meshmem.hpp>

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  meshmem::Comm comm(MPI_COMM_WORLD);
  meshmem::Window win = comm.alloc(4096, meshmem::Memory::Host);
  meshmem::Signals sig = comm.alloc_signals(2, meshmem::Memory::Host);
  const int right = (rank + 1) % size;
  std::vector<meshmem::HaloRegion> sends;
  if (size > 1) sends.push_back(meshmem::HaloRegion{right, 0, 2048, 512, 1, 0, 0});
  meshmem::HaloExchange halo = comm.make_halo(win, sends);
  std::uint64_t word = 7;
  comm.barrier();
  MPI_Finalize();
  struct Case {
    const char* call;
    std::function<void()> run;
  };
  const std::vector<Case> cases = {
      {"comm.alloc", [&] { (void)comm.alloc(64, meshmem::Memory::Host); }},
      {"comm.alloc_signals", [&] { (void)comm.alloc_signals(1, meshmem::Memory::Host); }},
      {"comm.put", [&] { comm.put(win, right, 0, &word, sizeof word); }},
      {"comm.get", [&] { comm.get(&word, win, right, 0, sizeof word); }},
      {"comm.put_signal", [&] { comm.put_signal(win, right, 0, &word, sizeof word, sig, 0, 1, meshmem::SignalOp::Set); }},
      {"comm.signal", [&] { comm.signal(sig, right, 1, 1, meshmem::SignalOp::Set); }},
      {"comm.wait_until", [&] { comm.wait_until(sig, 0, meshmem::Cmp::GE, 0); }},
      {"comm.wait_until_all", [&] { comm.wait_until_all(sig, 0, 2, meshmem::Cmp::GE, 0); }},
      {"comm.quiet", [&] { comm.quiet(); }},
      {"comm.barrier", [&] { comm.barrier(); }},
      {"comm.make_halo", [&] { (void)comm.make_halo(win, sends); }},
      {"HaloExchange::exchange", [&] { halo.exchange(); }},
  };
  int wrong = 0;
  for (const Case& c : cases) {
    try {
      c.run();
      std::printf("[rank %d] %s after MPI_Finalize returned instead of raising\n", rank, c.call);
      ++wrong;
    } catch (const meshmem::Error& e) {
      const std::string what = e.what();
      if (what.find(c.call) == std::string::npos || what.find("after MPI_Finalize") == std::string::npos) {
        std::printf("[rank %d] %s after MPI_Finalize raised an error that names neither it nor MPI_Finalize: %s\n",
                    rank, c.call, what.c_str());
        ++wrong;
      } else if (rank == 0 && c.call == cases.front().call) {
        std::printf("[rank 0] for example: %s\n", what.c_str());
      }
    }
  }
  std::printf("[rank %d] %s: %zu of %zu calls after MPI_Finalize raised meshmem::Error naming the call\n", rank,
              wrong == 0 ? "PASSED" : "FAILED", cases.size() - static_cast<std::size_t>(wrong), cases.size());
  return wrong == 0 ? 0 : 1;
}
