// The nccl transport's knobs (transport_nccl.cpp reads them). CUDA-free: knobs.cpp includes
// this file too, so that every build checks their values (knobs.hpp).
#pragma once

#include <string>

#include "knobs.hpp"

namespace meshmem::detail {

inline std::string parse_nccl_path(const char* name, const std::string& raw) {
  if (raw.empty()) bad_knob_value(name, raw, "a library name or path");
  return raw;
}
inline std::string print_nccl_path(const std::string& p) { return p; }

inline const TuningKnob<std::string> kNcclLibrary{
    Tier::User, "nccl", "MESHMEM_NCCL_LIBRARY", "libnccl.so.2", parse_nccl_path, print_nccl_path,
    "the NCCL library the nccl transport loads at run time (a name the dynamic linker finds, or a path)",
    "The nccl transport carries device windows between ranks of different nodes. meshmem never links NCCL: it "
    "loads this library when a Comm first needs it; where it is missing, that transport reports why and "
    "`mpi-device` takes over. Not to be confused with the CMake variable MESHMEM_NCCL_LIBRARY_PATH (the NCCL "
    "that the examples and benchmarks link)",
    false};

}  // namespace meshmem::detail
