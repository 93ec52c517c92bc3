// meshmem's load-time request for CUDA_DEVICE_MAX_CONNECTIONS (comm/src/cuda/gpu_queues.hpp):
// each case runs in a process of its own, started with the environment it needs and with
// MESHMEM_TEST_GPU_QUEUES_CASE naming it (tests/unit/CMakeLists.txt), and checks what the
// process sees once main runs; without that marker a case skips. No GPU.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "cuda/gpu_queues.hpp"

using meshmem::detail::describe_gpu_queues;
using meshmem::detail::gpu_queues;

namespace {
std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "(unset)";
}
bool started_for_this_case() {
  return env("MESHMEM_TEST_GPU_QUEUES_CASE") == ::testing::UnitTest::GetInstance()->current_test_info()->name();
}
}  // namespace

#define SKIP_UNLESS_STARTED_FOR_IT()                                                                   \
  if (!started_for_this_case())                                                                        \
  GTEST_SKIP() << "needs its own process and environment: run it through ctest (unit.gpu_queues.*)"

// Neither variable set: meshmem asked CUDA for 32 queues before main.
TEST(GpuQueues, SetTo32AtLoadWhereUnset) {
  SKIP_UNLESS_STARTED_FOR_IT();
  EXPECT_EQ(env("CUDA_DEVICE_MAX_CONNECTIONS"), "32");
  EXPECT_EQ(gpu_queues().count, 32);
  EXPECT_EQ(describe_gpu_queues(), "GPU queues 32 (CUDA_DEVICE_MAX_CONNECTIONS, requested by meshmem at load)");
}

// CUDA_DEVICE_MAX_CONNECTIONS set but empty: counts as unset.
TEST(GpuQueues, EmptyCountsAsUnset) {
  SKIP_UNLESS_STARTED_FOR_IT();
  EXPECT_EQ(env("CUDA_DEVICE_MAX_CONNECTIONS"), "32");
  EXPECT_EQ(gpu_queues().count, 32);
}

// CUDA_DEVICE_MAX_CONNECTIONS=4: the user's value stays.
TEST(GpuQueues, UsersValueIsKept) {
  SKIP_UNLESS_STARTED_FOR_IT();
  EXPECT_EQ(env("CUDA_DEVICE_MAX_CONNECTIONS"), "4");
  EXPECT_EQ(gpu_queues().count, 4);
  EXPECT_STREQ(gpu_queues().how, "the user's");
}

// MESHMEM_GPU_QUEUES=keep and the variable unset: left unset, CUDA's 8.
TEST(GpuQueues, KeepLeavesTheVariableAlone) {
  SKIP_UNLESS_STARTED_FOR_IT();
  EXPECT_EQ(env("CUDA_DEVICE_MAX_CONNECTIONS"), "(unset)");
  EXPECT_EQ(gpu_queues().count, 8);
  EXPECT_STREQ(gpu_queues().how, "CUDA's default, MESHMEM_GPU_QUEUES=keep");
}

// A transport with more streams of its own than queues (the proxy's two per peer on another
// node, 17 such peers): warned once at its start, and named in a stalled transfer's message;
// as many streams as queues: neither.
TEST(GpuQueues, TransportStreamsBeyondTheQueues) {
  SKIP_UNLESS_STARTED_FOR_IT();
  using meshmem::detail::gpu_queue_hint;
  using meshmem::detail::note_transport_streams;
  ASSERT_EQ(gpu_queues().count, 32);
  EXPECT_EQ(note_transport_streams(3, "nccl", 32), "");
  EXPECT_EQ(gpu_queue_hint(), "");
  const std::string warning = note_transport_streams(3, "nccl", 34);
  EXPECT_NE(warning.find("rank 3: the nccl transport runs 34 streams of its own"), std::string::npos) << warning;
  EXPECT_NE(warning.find("on 32 GPU queues"), std::string::npos) << warning;
  EXPECT_NE(gpu_queue_hint().find("runs 34 streams of its own on 32 GPU queues"), std::string::npos) << gpu_queue_hint();
  EXPECT_EQ(note_transport_streams(3, "mpi-device", 4), "");  // the most seen stays
  EXPECT_NE(gpu_queue_hint().find("34 streams"), std::string::npos);
}
