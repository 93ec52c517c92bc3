// meshmem's load-time choice of CUDA_DEVICE_MAX_CONNECTIONS (comm/src/cuda/gpu_queues.hpp):
// each case runs in a process of its own, started with the environment its name says
// (tests/unit/CMakeLists.txt), and checks what the process sees once main runs. No GPU.
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
}  // namespace

// Started with neither variable set: meshmem asked CUDA for 32 queues before main.
TEST(GpuQueues, SetTo32AtLoadWhereUnset) {
  EXPECT_EQ(env("CUDA_DEVICE_MAX_CONNECTIONS"), "32");
  EXPECT_EQ(gpu_queues().count, 32);
  EXPECT_EQ(describe_gpu_queues(), "GPU queues 32 (CUDA_DEVICE_MAX_CONNECTIONS, set by meshmem at load)");
}

// Started with CUDA_DEVICE_MAX_CONNECTIONS=4: the user's value stays.
TEST(GpuQueues, UsersValueIsKept) {
  EXPECT_EQ(env("CUDA_DEVICE_MAX_CONNECTIONS"), "4");
  EXPECT_EQ(gpu_queues().count, 4);
  EXPECT_EQ(gpu_queues().how, "the user's");
}

// Started with MESHMEM_GPU_QUEUES=keep and the variable unset: left unset, CUDA's 8.
TEST(GpuQueues, KeepLeavesTheVariableAlone) {
  EXPECT_EQ(env("CUDA_DEVICE_MAX_CONNECTIONS"), "(unset)");
  EXPECT_EQ(gpu_queues().count, 8);
  EXPECT_EQ(gpu_queues().how, "CUDA's default, MESHMEM_GPU_QUEUES=keep");
}
