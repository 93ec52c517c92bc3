// The whole job suspended (every rank stopped, as a scheduler's suspend or a debugger's
// all-stop does) for longer than MESHMEM_TIMEOUT while a wait spins on the GPU, then resumed:
// the GPU keeps running meanwhile, but the wait's timeout is measured on the process's
// AwakeClock, so it does not fire, and the signal sent after the resume ends the wait. Before,
// the wait timed out on the GPU's clock during the stop and the next call raised Timeout.
// Two ranks on one machine; rank 0 stops and continues both through a forked child.
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "gpu_test.hpp"
#include "job_suspend.hpp"
#include "mpi_test.hpp"

using namespace meshmem;

namespace {

constexpr std::chrono::milliseconds kTimeout{2000};
constexpr std::chrono::milliseconds kStopped{5000};

class Suspend : public meshmem::test::MpiTest {
 protected:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) GTEST_SKIP() << "no GPU";
    if (meshmem::test::world_size() != 2) GTEST_SKIP() << "two ranks on one machine";
    const auto hosts = meshmem::test::host_names();
    if (hosts[0] != hosts[1]) GTEST_SKIP() << "the ranks are on different hosts";
    me = meshmem::test::world_rank();
    const pid_t mine = getpid();
    MPI_Allgather(&mine, 1, MPI_INT, pids, 1, MPI_INT, MPI_COMM_WORLD);
  }
  pid_t pids[2] = {0, 0};
  int me = 0;
};

TEST_F(Suspend, AWaitUntilSpinningOnTheGpuDoesNotTimeOutWhileTheJobIsStopped) {
  Options o = Options::from_environment();
  o.timeout = kTimeout;
  o.set("MESHMEM_STREAM_WAIT", "kernel");  // the wait that can time out (memop waits cannot)
  Comm c(MPI_COMM_WORLD, o);
  Signals sig = c.alloc_signals(1);
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  c.barrier(stream);
  CUDA_OK(cudaStreamSynchronize(stream));
  const auto t0 = std::chrono::steady_clock::now();
  pid_t suspender = -1;
  if (me == 0) {
    c.wait_until(sig, 0, Cmp::GE, 7, stream);  // spins on the GPU from now on
    suspender = meshmem::test::suspend_job_after({pids[1], pids[0]}, std::chrono::milliseconds(200), kStopped);
    ASSERT_GT(suspender, 0) << "fork: " << std::strerror(errno);
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(800));  // still asleep at the stop
    c.signal(sig, 0, 0, 7, SignalOp::Set, stream);
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  const auto waited = std::chrono::steady_clock::now() - t0;
  if (me == 0) {
    int status = 0;
    ASSERT_EQ(waitpid(suspender, &status, 0), suspender);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    EXPECT_GE(waited, kStopped) << "the wait ended before the job was suspended: this proves nothing";
  }
  // The next stream call raises if the wait timed out on the GPU.
  EXPECT_NO_THROW(c.barrier(stream)) << "rank " << me << ": the wait timed out while the whole job was stopped";
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaStreamDestroy(stream));
}

}  // namespace
