#include "meshmem/error.hpp"

namespace meshmem {

const char* to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::InvalidArgument: return "invalid argument";
    case ErrorCode::Cuda: return "CUDA error";
    case ErrorCode::Mpi: return "MPI error";
    case ErrorCode::System: return "system error";
    case ErrorCode::Timeout: return "timeout";
    case ErrorCode::Unsupported: return "unsupported";
    case ErrorCode::Internal: return "internal error";
  }
  return "unknown error";
}

namespace {
constexpr char kPrefix[] = "meshmem: ";
}

Error::Error(ErrorCode code, const std::string& message)
    : std::runtime_error(kPrefix + message), code_(code) {}

const char* Error::message() const noexcept { return what() + sizeof(kPrefix) - 1; }

}  // namespace meshmem
