// The variables meshmem sets for CUDA when a program starts (comm/src/cuda/startup_env.hpp):
// CUDA_DEVICE_MAX_CONNECTIONS (gpu_queues.hpp) and CUDA_MODULE_LOADING (module_loading.hpp).
// Each case runs in a process of its own, started with the environment it needs and with
// MESHMEM_TEST_STARTUP_CASE naming it (tests/unit/CMakeLists.txt), and checks what the
// process sees once main runs; without that marker a case skips. No GPU.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "cuda/runtime/gpu_queues.hpp"
#include "cuda/runtime/module_loading.hpp"

using meshmem::detail::describe_gpu_queues;
using meshmem::detail::gpu_queues;
using meshmem::detail::describe_module_loading;
using meshmem::detail::lazy_loading_hint;
using meshmem::detail::lazy_loading_warning;
using meshmem::detail::module_loading_request;
using meshmem::detail::note_module_loading;

namespace {
std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "(unset)";
}
bool started_for_this_case() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return env("MESHMEM_TEST_STARTUP_CASE") == std::string(info->test_suite_name()) + "." + info->name();
}
}  // namespace

#define SKIP_UNLESS_STARTED_FOR_IT()                                                                   \
  if (!started_for_this_case())                                                                        \
  GTEST_SKIP() << "needs its own process and environment: run it through ctest (unit.startup_env.*)"

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

// Neither variable set: meshmem asked CUDA for eager loading before main; until a device
// runtime reports what CUDA does, that is what is described, and nothing is warned.
TEST(ModuleLoading, EagerAtLoadWhereUnset) {
  SKIP_UNLESS_STARTED_FOR_IT();
  EXPECT_EQ(env("CUDA_MODULE_LOADING"), "EAGER");
  EXPECT_TRUE(module_loading_request().eager);
  EXPECT_EQ(describe_module_loading(), "module loading eager (CUDA_MODULE_LOADING, requested by meshmem at load)");
  EXPECT_EQ(lazy_loading_warning(1, "rank 0 through staged"), "");
  EXPECT_EQ(lazy_loading_hint(), "");
}

// The user's LAZY stays; once CUDA reports lazy loading a Comm with a staged route warns, and
// a stalled transfer's message names it (through the GPU queue hint, where transfers on
// meshmem's own streams report).
TEST(ModuleLoading, UsersLazyIsKeptAndWarned) {
  SKIP_UNLESS_STARTED_FOR_IT();
  EXPECT_EQ(env("CUDA_MODULE_LOADING"), "LAZY");
  EXPECT_FALSE(module_loading_request().eager);
  EXPECT_STREQ(module_loading_request().how, "the user's");
  note_module_loading(meshmem::detail::LoadingMode::Lazy);
  EXPECT_EQ(describe_module_loading(), "module loading lazy (CUDA_MODULE_LOADING, the user's 'LAZY')");
  const std::string warning = lazy_loading_warning(1, "rank 0 through staged");
  EXPECT_NE(warning.find("rank 1 reaches rank 0 through staged"), std::string::npos) << warning;
  EXPECT_NE(warning.find("under lazy module loading (CUDA_MODULE_LOADING, the user's 'LAZY')"), std::string::npos)
      << warning;
  EXPECT_NE(warning.find("export CUDA_MODULE_LOADING=EAGER"), std::string::npos) << warning;
  EXPECT_NE(lazy_loading_hint().find("module loading lazy"), std::string::npos) << lazy_loading_hint();
  EXPECT_NE(meshmem::detail::gpu_queue_hint().find("launched for the first time"), std::string::npos)
      << meshmem::detail::gpu_queue_hint();
  note_module_loading(meshmem::detail::LoadingMode::Eager);  // CUDA may load eagerly all the same: no warning
  EXPECT_EQ(lazy_loading_warning(1, "rank 0 through staged"), "");
  EXPECT_EQ(meshmem::detail::gpu_queue_hint(), "");
}

// The user's EAGER (in any case) counts as eager.
TEST(ModuleLoading, UsersEagerIsKept) {
  SKIP_UNLESS_STARTED_FOR_IT();
  EXPECT_EQ(env("CUDA_MODULE_LOADING"), "eager");
  EXPECT_TRUE(module_loading_request().eager);
  EXPECT_STREQ(module_loading_request().how, "the user's");
}

// MESHMEM_MODULE_LOADING=keep: the variable stays unset (CUDA's lazy default), and the
// other variable is still set (the knobs are independent).
TEST(ModuleLoading, KeepLeavesTheVariableAlone) {
  SKIP_UNLESS_STARTED_FOR_IT();
  EXPECT_EQ(env("CUDA_MODULE_LOADING"), "(unset)");
  EXPECT_FALSE(module_loading_request().eager);
  EXPECT_STREQ(module_loading_request().how, "CUDA's default, MESHMEM_MODULE_LOADING=keep");
  EXPECT_EQ(env("CUDA_DEVICE_MAX_CONNECTIONS"), "32");
}

// meshmem set EAGER, yet CUDA reports lazy loading (it had started before meshmem was loaded):
// said so, and warned; a mode that could not be asked is described as unknown, not warned.
TEST(ModuleLoading, EagerRequestedTooLate) {
  SKIP_UNLESS_STARTED_FOR_IT();
  ASSERT_TRUE(module_loading_request().set_by_meshmem);
  note_module_loading(meshmem::detail::LoadingMode::Lazy);
  EXPECT_EQ(describe_module_loading(),
            "module loading lazy (CUDA_MODULE_LOADING, requested by meshmem at load, too late: CUDA had started)");
  EXPECT_NE(lazy_loading_warning(0, "rank 1 through nccl"), "");
  note_module_loading(meshmem::detail::LoadingMode::Unknown);
  EXPECT_EQ(describe_module_loading(),
            "module loading unknown (cuModuleGetLoadingMode failed) (CUDA_MODULE_LOADING, requested by meshmem at load)");
  EXPECT_EQ(lazy_loading_warning(0, "rank 1 through nccl"), "");
}

// CUDA_MODULE_LOADING set but empty: counts as unset (meshmem sets EAGER).
TEST(ModuleLoading, EmptyCountsAsUnset) {
  SKIP_UNLESS_STARTED_FOR_IT();
  EXPECT_EQ(env("CUDA_MODULE_LOADING"), "EAGER");
  EXPECT_TRUE(module_loading_request().set_by_meshmem);
}
