// HelperCpus: the CPUs that meshmem's busy threads run on (the staging agent, the nccl and
// mpi-device transfer proxies, the proxy stream barrier's thread, the host MPI transport's
// progress thread, and NCCL's own threads, which start inside meshmem's NCCL set-up).
//
// A thread starts with its creator's CPU mask. Open MPI binds each rank to one core by default
// for two ranks (--bind-to core), and then these threads share that core with the caller's
// thread, which spins in cudaStreamSynchronize or MPI calls: every staged step waited for the
// scheduler to take the core from it (2 ranks on 1 x H100: Jacobi 4096^2 with the staged halo
// 1,252 us per iteration against 362 us unbound; a staged put of 64 MiB 6.6 GB/s against 42.8
// unbound; ipc and MPI unaffected).
//
// So, with MESHMEM_HELPER_CPUS=auto, where a Comm is made on a thread bound to one core (one
// CPU, or the hardware threads of one core), the helper threads it starts run on the other
// CPUs of that core's NUMA node (every online CPU where the machine reports no node), less the
// CPUs that other ranks of the node are bound to one core each; where none is left they stay.
// The kernel keeps only what the process's cpuset allows; the creator reads back what it got
// and warns where a helper still shares the caller's core. The decision is the Comm's own
// (HelperCpusScope, in force on the constructing thread while the Comm is made): threads are
// placed by their creator right after they start. `inherit` leaves them on the creator's mask.
//
// CUDA-free and MPI-free.
#pragma once

#include <pthread.h>

#include <string>
#include <thread>
#include <vector>

#include "meshmem/config.hpp"

namespace meshmem::detail {

// Where a Comm's helper threads go: `cpus` empty keeps the creator's mask; `text` says why
// (device_info and the Comm's Info line), "" where there is nothing to say.
struct HelperPlacement {
  std::vector<int> cpus;
  std::string text;
};

// The calling thread's CPUs (sorted).
std::vector<int> cpus_of_this_thread();

// The decision, from plain facts (a test seam): `inherit` (the knob), `mine` (the creator's
// CPUs), `siblings` (the hardware threads of mine's first CPU's core), `node` (the CPUs of
// that core's NUMA node, or every online CPU; `node_id` -1 for the latter) and `taken` (the
// CPUs of the node's ranks that are bound to one core each, this one included).
HelperPlacement plan_helper_cpus(bool inherit, const std::vector<int>& mine, const std::vector<int>& siblings,
                                 const std::vector<int>& node, int node_id, const std::vector<int>& taken);

// Whether `mine` is one core: one CPU, or hardware threads of one core (sysfs).
bool bound_to_one_core(const std::vector<int>& mine);

// plan_helper_cpus from this thread's mask, sysfs and `taken` (the Comm gathers it).
HelperPlacement settle_helper_cpus(const Options& options, const std::vector<int>& taken);

// While alive, threads that meshmem creates on this thread are placed by `placement`.
class HelperCpusScope {
 public:
  explicit HelperCpusScope(const HelperPlacement& placement);
  ~HelperCpusScope();
  HelperCpusScope(const HelperCpusScope&) = delete;
  HelperCpusScope& operator=(const HelperCpusScope&) = delete;

 private:
  const HelperPlacement* previous_;
};

// Called by a helper's creator right after starting it: moves `thread` (what: "staging
// agent") to the placement in force on this thread, if any, and warns once per process where
// the cpuset left it on the creator's core.
void place_helper_thread(pthread_t thread, const char* what);
inline void place_helper_thread(std::thread& thread, const char* what) {
  place_helper_thread(thread.native_handle(), what);
}

// While alive, the calling thread itself runs on the placement in force (for a library that
// starts threads of its own inside a call: NCCL's initialisation); its mask is restored after.
class CallerOnHelperCpus {
 public:
  CallerOnHelperCpus();
  ~CallerOnHelperCpus();
  CallerOnHelperCpus(const CallerOnHelperCpus&) = delete;
  CallerOnHelperCpus& operator=(const CallerOnHelperCpus&) = delete;

 private:
  std::vector<int> restore_;  // empty: nothing was changed
};

// Test seams: the CPUs of a list such as "0-3,8,10-11" (sysfs's format; "" where it is not
// one); a set as such a list.
std::vector<int> parse_cpu_list(const std::string& list);
std::string print_cpu_list(const std::vector<int>& cpus);

}  // namespace meshmem::detail
