// Return-code checks and the common command line of the device benchmarks and studies: a
// failed CUDA, driver or MPI call prints the call, the rank and the code, then aborts the job
// (or, in a lab without MPI, ends the process).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <mpi.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace bench {

inline int& check_rank() {
  static int rank = 0;  // set once MPI is up
  return rank;
}

// Ends the job (MPI_Abort), or the process where MPI is not up (the single-process labs).
[[noreturn]] inline void fail(const char* call, const std::string& why, const char* file, int line) {
  std::fprintf(stderr, "rank %d: %s failed: %s (%s:%d)\n", check_rank(), call, why.c_str(), file, line);
  int up = 0, down = 0;
  MPI_Initialized(&up);
  MPI_Finalized(&down);
  if (up && !down) MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);
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

// A byte count on the command line: "4096", "64K", "16M", "1G" (binary units; KiB, MiB, GiB
// too). False for anything else, zero or an overflow: strtoull alone reads "4G" as 4.
inline bool parse_bytes(const std::string& text, std::size_t* out) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (errno != 0 || end == text.c_str() || v == 0 || text[0] == '-') return false;
  const std::string suffix = end;
  unsigned shift = 0;
  if (suffix == "K" || suffix == "k" || suffix == "KiB") shift = 10;
  else if (suffix == "M" || suffix == "m" || suffix == "MiB") shift = 20;
  else if (suffix == "G" || suffix == "g" || suffix == "GiB") shift = 30;
  else if (!suffix.empty()) return false;
  if (v > (~0ull >> shift)) return false;
  *out = static_cast<std::size_t>(v << shift);
  return true;
}

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
