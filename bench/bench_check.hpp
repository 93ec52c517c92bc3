// Return-code checks and the common command line of the device benchmarks and studies: a
// failed CUDA, driver or MPI call prints the call, the rank and the code, then aborts the job.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <mpi.h>

#include <cstdio>
#include <string>

namespace bench {

inline int& check_rank() {
  static int rank = 0;  // set once MPI is up
  return rank;
}

[[noreturn]] inline void fail(const char* call, const std::string& why, const char* file, int line) {
  std::fprintf(stderr, "rank %d: %s failed: %s (%s:%d)\n", check_rank(), call, why.c_str(), file, line);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

// --csv FILE --commit C --machine M --date D (the rest is left to the program).
struct RunInfo {
  std::string csv, commit = "unknown", machine = "unknown", date = "unknown";
  // True if argv[i] was one of these (and consumed its value).
  bool parse(int argc, char** argv, int& i) {
    const std::string a = argv[i];
    std::string* field = a == "--csv" ? &csv : a == "--commit" ? &commit : a == "--machine" ? &machine : a == "--date" ? &date : nullptr;
    if (field == nullptr || i + 1 >= argc) return false;
    *field = argv[++i];
    return true;
  }
};

}  // namespace bench

#define CK(call)                                                                                          \
  do {                                                                                                    \
    const cudaError_t rc_ = (call);                                                                       \
    if (rc_ != cudaSuccess) bench::fail(#call, cudaGetErrorString(rc_), __FILE__, __LINE__);               \
  } while (0)
#define CU(call)                                                                                          \
  do {                                                                                                    \
    const CUresult rc_ = (call);                                                                          \
    if (rc_ != CUDA_SUCCESS) bench::fail(#call, "CUresult " + std::to_string(static_cast<int>(rc_)), __FILE__, __LINE__); \
  } while (0)
#define MK(call)                                                                                          \
  do {                                                                                                    \
    const int rc_ = (call);                                                                               \
    if (rc_ != MPI_SUCCESS) bench::fail(#call, "MPI error " + std::to_string(rc_), __FILE__, __LINE__);    \
  } while (0)
