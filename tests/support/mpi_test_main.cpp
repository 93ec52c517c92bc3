// main() of the multi-rank suites: MPI with MPI_THREAD_MULTIPLE, gtest output from rank 0
// only (other ranks print their own failures, prefixed with their rank), and an exit code
// that is non-zero on every rank if any rank failed.
#include <gtest/gtest.h>
#include <mpi.h>

#include <dirent.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#include "mpi_test.hpp"

namespace {

// A test that fails on one rank can leave the others in a different MPI collective (the
// failing rank has gone on to TearDown's Allgather); the job then hangs until the launcher's
// timeout, minutes later, with no word of where. The watchdog ends such a job early and names
// the test: MPI_Abort after MESHMEM_TEST_WATCHDOG_S seconds (default 240; the longest GPU test, 10,000 barriers on a shared GPU, has taken 135 s) in one test.
class TestWatchdog : public ::testing::EmptyTestEventListener {
 public:
  explicit TestWatchdog(int rank) : rank_(rank), limit_(limit_from_environment()) {
    if (limit_.count() > 0) thread_ = std::thread([this] { watch(); });
  }
  ~TestWatchdog() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  void OnTestStart(const ::testing::TestInfo& info) override {
    std::lock_guard<std::mutex> lock(mutex_);
    current_ = std::string(info.test_suite_name()) + "." + info.name();
    ++generation_;
    changed_.notify_all();
  }
  void OnTestEnd(const ::testing::TestInfo&) override {
    std::lock_guard<std::mutex> lock(mutex_);
    current_.clear();
    ++generation_;
    changed_.notify_all();
  }

 private:
  static std::chrono::seconds limit_from_environment() {
    const char* v = std::getenv("MESHMEM_TEST_WATCHDOG_S");
    return std::chrono::seconds(v != nullptr ? std::atoi(v) : 240);
  }
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
      const unsigned long seen = generation_;
      const bool running = !current_.empty();
      const bool moved = running ? changed_.wait_for(lock, limit_, [&] { return stopping_ || generation_ != seen; })
                                 : (changed_.wait(lock, [&] { return stopping_ || generation_ != seen; }), true);
      if (!moved) {
        std::fprintf(stderr, "[rank %d] test watchdog: %s still running after %lld s; aborting the job\n", rank_,
                     current_.c_str(), static_cast<long long>(limit_.count()));
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 3);
      }
    }
  }

  int rank_;
  std::chrono::seconds limit_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::string current_;
  unsigned long generation_ = 0;
  bool stopping_ = false;
  std::thread thread_;
};

// MESHMEM_TEST_ISOLATE=1: give each rank only its own GPU through CUDA_VISIBLE_DEVICES,
// as per-rank isolating launchers do. Done before any CUDA call; GPUs are counted from
// the driver's /proc entries so that no CUDA call is needed.
void isolate_gpu() {
  const char* isolate = std::getenv("MESHMEM_TEST_ISOLATE");
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  if (isolate == nullptr || std::string(isolate) != "1" || local == nullptr) return;
  int gpus = 0;
  if (DIR* d = opendir("/proc/driver/nvidia/gpus")) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') ++gpus;
    closedir(d);
  }
  if (gpus == 0) return;
  const std::string device = std::to_string(std::atoi(local) % gpus);
  setenv("CUDA_VISIBLE_DEVICES", device.c_str(), 1);
}

}  // namespace

int main(int argc, char** argv) {
  isolate_gpu();
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  if (provided < MPI_THREAD_MULTIPLE) {
    std::fprintf(stderr, "MPI does not provide MPI_THREAD_MULTIPLE (got %d)\n", provided);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  ::testing::InitGoogleTest(&argc, argv);
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new meshmem::test::RankFailurePrinter(rank));
  }
  listeners.Append(new TestWatchdog(rank));  // gtest owns and deletes it
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  // Exit code 77 when every test skipped itself (no GPU, say): CTest reports the test as
  // skipped (SKIP_RETURN_CODE), not as passed.
  const auto* unit = ::testing::UnitTest::GetInstance();
  int all_skipped = unit->test_to_run_count() > 0 && unit->skipped_test_count() == unit->test_to_run_count() ? 1 : 0;
  int everywhere = 0;
  MPI_Allreduce(&all_skipped, &everywhere, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  MPI_Finalize();
  if (any_failed) return 1;
  return everywhere ? 77 : 0;
}
