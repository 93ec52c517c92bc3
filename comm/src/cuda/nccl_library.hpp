// NcclLibrary: libnccl loaded at run time (dlopen), as the CUDA driver's entry points are, so
// that a build or a machine without NCCL still runs and says why the nccl route is missing.
// Only what the nccl transport uses, declared here with NCCL's C ABI (nccl.h is not needed
// to build meshmem). NcclComm owns one communicator.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

namespace meshmem::detail {

struct NcclUniqueId {
  char internal[128];  // NCCL_UNIQUE_ID_BYTES
};
struct NcclCommOpaque;
using NcclCommHandle = NcclCommOpaque*;

class NcclLibrary {
 public:
  // The library of MESHMEM_NCCL_LIBRARY (default libnccl.so.2), loaded once per process;
  // null with *why when it cannot be loaded or lacks an entry point.
  static const NcclLibrary* get(const std::string& path, std::string* why);

  int version = 0;   // ncclGetVersion: 22809 for 2.28.9
  std::string path;  // as loaded
  std::string version_text() const;

  int (*get_unique_id)(NcclUniqueId*) = nullptr;
  int (*comm_init_rank)(NcclCommHandle*, int nranks, NcclUniqueId id, int rank) = nullptr;
  int (*comm_destroy)(NcclCommHandle) = nullptr;
  int (*comm_abort)(NcclCommHandle) = nullptr;
  int (*comm_get_async_error)(NcclCommHandle, int*) = nullptr;
  int (*send)(const void*, std::size_t count, int datatype, int peer, NcclCommHandle, cudaStream_t) = nullptr;
  int (*recv)(void*, std::size_t count, int datatype, int peer, NcclCommHandle, cudaStream_t) = nullptr;
  int (*group_start)() = nullptr;
  int (*group_end)() = nullptr;
  const char* (*error_string)(int) = nullptr;

  static constexpr int kInt8 = 0;  // ncclInt8
  // Raises Error(Cuda) naming the call, its result and `what` unless rc is ncclSuccess.
  void check(int rc, const char* call, const std::string& what) const;
};

// One communicator: destroyed with its owner (ncclCommDestroy), or aborted (ncclCommAbort:
// a peer may never come, so a destroy that waits for it would hang).
class NcclComm {
 public:
  NcclComm() = default;
  NcclComm(const NcclLibrary* lib, NcclCommHandle c) : lib_(lib), comm_(c) {}
  NcclComm(NcclComm&& o) noexcept : lib_(o.lib_), comm_(o.comm_) { o.comm_ = nullptr; }
  NcclComm& operator=(NcclComm&& o) noexcept;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  ~NcclComm() { reset(false); }
  NcclCommHandle get() const { return comm_; }
  void reset(bool abort) noexcept;

 private:
  const NcclLibrary* lib_ = nullptr;
  NcclCommHandle comm_ = nullptr;
};

}  // namespace meshmem::detail
