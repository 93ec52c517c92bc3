// The fixture and helpers of the RealUse suites (tests/gpu/real_use_*.cu, process_death.cu):
// device windows used the way applications use them. Fresh random data every round,
// destinations poisoned first, every byte checked. Skipped without a GPU.
#pragma once

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <functional>
#include <initializer_list>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <meshmem/device/device.cuh>
#include <meshmem/meshmem.hpp>

#include "gpu_test.hpp"
#include "mpi_test.hpp"

namespace real_use {

using namespace meshmem;
using meshmem::test::DeviceBuffer;
using meshmem::test::fill_now;
using meshmem::test::first_difference;
using meshmem::test::to_host;
using meshmem::test::upload;
using meshmem::test::kPoison;
using meshmem::test::pattern;

// Sets an environment variable for the life of the object (the Comm reads MESHMEM_* when
// it is made).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_.c_str(), old_.c_str(), 1);
    else unsetenv(name_.c_str());
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

// Kernels and device helpers: internal to each test source that includes this header.
namespace {

__device__ std::uint64_t now_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins for *ns (device memory: a graph replay reads the value of that replay) or `fixed`.
__global__ void spin_kernel(const std::uint64_t* ns, std::uint64_t fixed) {
  const std::uint64_t wait = ns != nullptr ? *reinterpret_cast<const volatile std::uint64_t*>(ns) : fixed;
  const std::uint64_t start = now_ns();
  while (now_ns() - start < wait) {
  }
}

// Runs until the host sets *flag (mapped pinned memory).
__global__ void wait_for_host_flag(const std::uint64_t* flag) {
  while (*reinterpret_cast<const volatile std::uint64_t*>(flag) == 0) {
  }
}

// Writes `value` into word `index` of `target`'s part of a window through the device API.
__global__ void store_into_peer(device::WindowView view, int target, std::size_t offset, std::uint64_t value) {
  *device::peer_ptr<std::uint64_t>(view, target, offset) = value;
}

}  // namespace

inline std::uint64_t key(int round, int from, int to) {
  return (static_cast<std::uint64_t>(round) << 24) ^ (static_cast<std::uint64_t>(from) << 12) ^ static_cast<std::uint64_t>(to);
}

// Waits for `stream` without hanging the test: false after `seconds`.
inline bool finishes(cudaStream_t stream, int seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  while (cudaStreamQuery(stream) == cudaErrorNotReady) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return cudaStreamSynchronize(stream) == cudaSuccess;
}

// Whether environment variable `name` is `value` (the entries that run a test set it).
inline bool env_is(const char* name, const std::string& value) {
  const char* v = std::getenv(name);
  return v != nullptr && value == v;
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Bytes free on this GPU (cudaMemGetInfo): what a freed window's release gives back shows here.
inline std::size_t free_gpu_bytes() {
  std::size_t free_bytes = 0, total = 0;
  const cudaError_t rc = cudaMemGetInfo(&free_bytes, &total);
  EXPECT_EQ(rc, cudaSuccess) << "cudaMemGetInfo: " << cudaGetErrorString(rc);
  return free_bytes;
}

// Whether 90% of `bytes` more than `baseline` are free on this GPU within `seconds` (a freed
// window's memory coming back); `*now` is the last figure seen.
inline bool memory_comes_back(std::size_t baseline, std::size_t bytes, double seconds, std::size_t* now) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  do {
    *now = free_gpu_bytes();
    if (*now >= baseline + bytes * 9 / 10) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  } while (std::chrono::steady_clock::now() < end);
  return false;
}

// How many ranks use this rank's GPU (collective): frees on them all give memory back to
// what cudaMemGetInfo shows here.
inline int ranks_on_this_gpu() {
  int device = -1, n = 0;
  cudaDeviceProp prop{};
  EXPECT_EQ(cudaGetDevice(&device), cudaSuccess);
  EXPECT_EQ(cudaGetDeviceProperties(&prop, device), cudaSuccess);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  std::vector<char> uuids(static_cast<std::size_t>(n) * 16);
  MPI_Allgather(prop.uuid.bytes, 16, MPI_BYTE, uuids.data(), 16, MPI_BYTE, MPI_COMM_WORLD);
  int sharing = 0;
  for (int r = 0; r < n; ++r) sharing += std::memcmp(uuids.data() + 16 * r, prop.uuid.bytes, 16) == 0;
  return sharing;
}

// After transfers with a rank that was killed: the next quiet must raise, naming the end of
// that rank's process.
inline void expect_process_end_reported(Comm& comm, cudaStream_t stream, int dead, const char* what) {
  try {
    comm.quiet(stream);
    ADD_FAILURE() << what << " was not reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(dead) + "'s process"), std::string::npos)
        << what << ": " << e.what();
  }
}

class RealUse : public meshmem::test::MpiTest {
 protected:
  void SetUp() override {
    const std::string why = meshmem::test::select_gpu_on_every_rank();
    if (!why.empty()) GTEST_SKIP() << why;
    cudaGetDevice(&device);
    seed = meshmem::test::shared_seed();
    ASSERT_EQ(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking), cudaSuccess);
  }
  // Why a case that forces the staged transport between node peers cannot run in this entry
  // ("" where it can): entries that split the ranks into simulated nodes leave them no node
  // peers, and their barrier across nodes (nccl) then refuses the Comm.
  static std::string staged_cannot_be_forced() {
    const char* nodes = std::getenv("MESHMEM_SIMULATE_NODES");
    if (nodes != nullptr && std::string(nodes) != "1")
      return "forces the staged transport between node peers: this entry splits the ranks into simulated nodes";
    return "";
  }
  // Whether rank 0 reaches every one of `targets` through the staged transport, agreed by every rank.
  bool rank0_reaches_through_staged(std::initializer_list<int> targets) {
    int staged = 1;
    if (me == 0)
      for (int t : targets) staged &= t < n && comm->transport(t, Memory::Device) == TransportKind::Staged ? 1 : 0;
    MPI_Bcast(&staged, 1, MPI_INT, 0, MPI_COMM_WORLD);
    return staged != 0;
  }
  void make_comm() {
    comm = std::make_unique<Comm>(MPI_COMM_WORLD);
    me = comm->rank();
    n = comm->size();
    right = (me + 1) % n;
    left = (me + n - 1) % n;
  }
  void TearDown() override {
    // A failed case may leave its capture open: end it, so that the next case starts clean.
    for (cudaStream_t s : {s0, s1}) test::end_open_capture(s);
    comm.reset();
    if (s0) cudaStreamDestroy(s0);
    if (s1) cudaStreamDestroy(s1);
    MpiTest::TearDown();
  }

  // A 64-byte put to rank 1 at `at` (or get from there) on s0, ended: through the staged channels
  // that earlier transfers with rank 1 took, after them, so once it ended those were carried out
  // or dropped. A call may first raise the timeout of an earlier transfer (`after` names them).
  void fence(Window& win, std::size_t at, bool get, const char* after) {
    DeviceBuffer tail(64);
    bool ended = false;
    std::string last;
    for (int tries = 0; tries < 3 && !ended; ++tries) {
      try {
        if (get)
          comm->get(tail.p, win, 1, at, tail.bytes, s0);
        else
          comm->put(win, 1, at, tail.p, tail.bytes, s0);
        comm->quiet(s0);
        CUDA_OK(cudaStreamSynchronize(s0));
        ended = true;
      } catch (const Error& e) {
        last = e.what();
      }
    }
    EXPECT_TRUE(ended) << "the fence transfer after " << after << " failed: " << last;
  }

  std::unique_ptr<Comm> comm;
  int device = -1, me = 0, n = 1, right = 0, left = 0;
  std::uint64_t seed = 0;
  cudaStream_t s0 = nullptr, s1 = nullptr;
};

// ---- CUDA graphs ----

// Replays of the graph cases, and rounds of the early-launch cases: cut in the fast tier
// (tests/gpu/TIERS.md), the full count in gpu-long and by hand.
inline const int kReplays = meshmem::test::rounds(200, 50);
inline constexpr std::uint64_t kLateNs = 300000;

// Graph replays: before each, every rank poisons what it checks and loads fresh data, and
// the ranks meet on the host; then rank (replay % n) is late by kLateNs inside the graph.
class GraphReplay : public RealUse {
 protected:
  // One replay: this replay's late rank set, the ranks meet on the host, the graph runs to its end.
  ::testing::AssertionResult replay(cudaGraphExec_t exec, DeviceBuffer& delay, int rep) {
    const std::uint64_t ns = rep % n == me ? kLateNs : 0;
    if (cudaMemcpy(delay.p, &ns, sizeof(ns), cudaMemcpyHostToDevice) != cudaSuccess)
      return ::testing::AssertionFailure() << "replay " << rep << ": setting the delay failed";
    MPI_Barrier(MPI_COMM_WORLD);
    const cudaError_t rc = cudaGraphLaunch(exec, s0);
    if (rc != cudaSuccess) return ::testing::AssertionFailure() << "replay " << rep << ": cudaGraphLaunch: " << cudaGetErrorString(rc);
    if (!finishes(s0, 60)) return ::testing::AssertionFailure() << "replay " << rep << " did not finish within 60 s";
    return ::testing::AssertionSuccess();
  }
  cudaGraphExec_t instantiate(cudaGraph_t graph) {
    cudaGraphExec_t exec = nullptr;
    EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    cudaGraphDestroy(graph);
    return exec;
  }
  // ManyChainedPuts*: see there.
  void many_chained_puts(std::size_t barrier_every);
  // HaloExchangeReplaysWaitForTheLateRank and the per-thread stream's: see there.
  void halo_replays_wait_for_the_late_rank(cudaStream_t s);
  // Whether the Comm's barrier(stream) is the hierarchical one across nodes (NCCL's all-reduce).
  bool comm_barrier_is_hierarchical() const {
    return comm->device_info().find("barrier(stream) hierarchical") != std::string::npos;
  }
};

}  // namespace real_use
