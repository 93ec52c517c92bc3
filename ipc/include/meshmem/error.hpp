// meshmem::Error: the one exception type of the host API.
#pragma once

#include <stdexcept>
#include <string>

namespace meshmem {

enum class ErrorCode {
  InvalidArgument,  // a bad argument; nothing was written
  Cuda,             // a CUDA runtime or driver call failed
  Mpi,              // an MPI call failed
  System,           // a system call failed (errno in the message)
  Timeout,          // a wait ran past MESHMEM_TIMEOUT; the message names the missing peers
  Unsupported,      // the operation is not possible on this machine or build
  Internal,         // a bug in meshmem
};

const char* to_string(ErrorCode code) noexcept;

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message);
  ErrorCode code() const noexcept { return code_; }
  // The message without the "meshmem: " that what() starts with, to nest it in another Error.
  const char* message() const noexcept;

 private:
  ErrorCode code_;
};

}  // namespace meshmem
