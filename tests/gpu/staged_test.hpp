// The fixture of the staged transport's GPU tests (test_staged.cu, staged_streams.cu): a Comm
// with the staged route forced for every pair. Not in an anonymous namespace: GoogleTest wants
// one fixture type for the suite across both files.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

#include <meshmem/meshmem.hpp>

#include "gpu_test.hpp"
#include "mpi_test.hpp"

namespace meshmem::test::staged {

// The environment's options with the staged route forced for every pair (and `knob` set to
// `value` where one is given).
inline Options staged_options(const char* knob = nullptr, const char* value = nullptr) {
  Options o = Options::from_environment();
  o.set("MESHMEM_TRANSPORTS", "staged,shm,mpi");
  if (knob != nullptr) o.set(knob, value);
  return o;
}

class Staged : public meshmem::test::MpiTest {
 protected:
  void SetUp() override {
    const std::string why = meshmem::test::select_gpu_on_every_rank();
    if (!why.empty()) GTEST_SKIP() << why;
    comm = std::make_unique<Comm>(MPI_COMM_WORLD, staged_options());
    me = comm->rank();
    n = comm->size();
    right = (me + 1) % n;
    left = (me + n - 1) % n;
    seed = meshmem::test::shared_seed();
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    comm.reset();
    if (s) cudaStreamDestroy(s);
    MpiTest::TearDown();
  }
  std::unique_ptr<Comm> comm;
  int me = 0, n = 1, right = 0, left = 0;
  std::uint64_t seed = 0;
  cudaStream_t s = nullptr;
};

inline std::uint64_t key(std::size_t size, int from, int kind) { return (size << 8) ^ (static_cast<std::uint64_t>(from) << 2) ^ kind; }

}  // namespace meshmem::test::staged

using meshmem::test::staged::key;
using meshmem::test::staged::Staged;
using meshmem::test::staged::staged_options;
