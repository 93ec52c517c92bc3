// HelperCpus: the CPUs that meshmem's own busy threads run on (the staging agent, the nccl and
// mpi-device transfer proxies, the host MPI transport's progress thread).
//
// A thread starts with its creator's CPU mask. Open MPI binds each rank to one core by default
// for two ranks (--bind-to core), and then these threads share that core with the caller's
// thread, which spins in cudaStreamSynchronize or MPI calls: a staged transfer's every step
// waited for the scheduler to take the core from it (2 ranks on 1 x H100: Jacobi 4096^2 with
// the staged halo 1,252 us per iteration against 362 us unbound; staged put of 64 MiB
// 6.6 GB/s against 54 for the copies themselves; ipc and MPI unaffected).
//
// So, with MESHMEM_HELPER_CPUS=auto, where a Comm is made on a thread bound to a single CPU,
// the helper threads started after it run on the CPUs of that CPU's NUMA node (every online
// CPU where the machine reports no NUMA node), as far as the process's cpuset allows; the
// caller's threads keep their binding. `inherit` leaves the helpers on the creator's mask.
//
// CUDA-free and MPI-free.
#pragma once

#include <string>
#include <vector>

#include "meshmem/config.hpp"

namespace meshmem::detail {

// Decides, from the calling thread's CPU mask and the Comm's options, where helper threads
// started from now on run (the latest Comm's decision holds for the process). Returns what
// it decided, for device_info and the log: "" where helpers keep the creator's mask.
std::string settle_helper_cpus(const Options& options);

// Called first thing by each helper thread: moves it to the settled CPUs, if any. `what`
// names the thread for a warning where the move is refused (logged once per process).
void place_helper_thread(const char* what);

// "helper threads on CPUs 0-7 (NUMA node 0 of CPU 3, the one this thread is bound to)", or "".
std::string describe_helper_cpus();

// Test seams: the CPUs of a list such as "0-3,8,10-11" (sysfs's format); a set as such a list.
std::vector<int> parse_cpu_list(const std::string& list);
std::string print_cpu_list(const std::vector<int>& cpus);

}  // namespace meshmem::detail
