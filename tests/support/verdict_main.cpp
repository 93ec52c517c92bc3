// main() of the process-death cases: MPI with MPI_THREAD_MULTIPLE, exactly one case per job
// (each kills a rank or spoils a process), gtest output from rank 0 and other ranks' failures
// prefixed with their rank. A case that got past its setup ends in end_with_verdict; main
// returns only where it did not (skipped on every rank: 77, CTest's skipped).
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <cstdlib>

#include "mpi_test.hpp"
#include "verdict.hpp"

namespace meshmem::test {

void end_with_verdict(bool failed) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::printf("[ verdict ] rank %d %s: %s.%s\n", world_rank(), failed ? "FAILED" : "PASSED",
              info ? info->test_suite_name() : "?", info ? info->name() : "?");
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(failed ? 1 : 0);
}

}  // namespace meshmem::test

namespace {

// Refuses a job that would run other than one case: the first case's dead rank would hold
// every later one.
class OneCasePerJob : public ::testing::EmptyTestEventListener {
  void OnTestIterationStart(const ::testing::UnitTest& unit, int) override {
    if (unit.test_to_run_count() == 1) return;
    std::fprintf(stderr, "[ verdict ] rank %d FAILED: the filter selects %d cases; a process-death job runs one\n",
                 meshmem::test::world_rank(), unit.test_to_run_count());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
};

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  if (provided < MPI_THREAD_MULTIPLE) {
    std::fprintf(stderr, "MPI does not provide MPI_THREAD_MULTIPLE (got %d)\n", provided);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  const int rank = meshmem::test::world_rank();
  ::testing::InitGoogleTest(&argc, argv);
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new meshmem::test::RankFailurePrinter(rank));
  }
  listeners.Append(new OneCasePerJob);
  const int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  const auto* unit = ::testing::UnitTest::GetInstance();
  int skipped = unit->test_to_run_count() > 0 && unit->skipped_test_count() == unit->test_to_run_count() ? 1 : 0;
  int everywhere = 0;
  MPI_Allreduce(&skipped, &everywhere, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  MPI_Finalize();
  if (failed) return 1;
  return everywhere ? 77 : 1;  // a case that neither skipped nor gave a verdict failed
}
