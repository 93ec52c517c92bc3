// NcclLibrary: libnccl loaded at run time (dlopen), as the CUDA driver's entry points are, so
// that a build or a machine without NCCL still runs and says why the nccl route is missing.
// Only what the nccl transport uses, declared here with NCCL's C ABI (nccl.h is not needed
// to build meshmem); NCCL 2.18 or later (ncclCommSplit). NcclComm owns one communicator.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <string>

namespace meshmem::detail {

struct NcclUniqueId {
  char internal[128];  // NCCL_UNIQUE_ID_BYTES
};
struct NcclCommOpaque;
using NcclCommHandle = NcclCommOpaque*;

// ncclConfig_t's fields up to splitShare, as NCCL 2.18 laid them out. NCCL reads a config by
// its size and version, so later versions take it as it is (their newer fields keep their
// defaults).
struct NcclConfig {
  std::size_t size;
  unsigned magic;
  unsigned version;
  int blocking;
  int cga_cluster_size;
  int min_ctas;
  int max_ctas;
  const char* net_name;
  int split_share;
  // Every field NCCL's default except these two.
  static NcclConfig make(bool blocking, bool split_share);
};

class NcclLibrary {
 public:
  // The library of MESHMEM_NCCL_LIBRARY (default libnccl.so.2), loaded once per process;
  // null with *why when it cannot be loaded or lacks an entry point.
  static const NcclLibrary* get(const std::string& path, std::string* why);

  int version = 0;   // ncclGetVersion: 22809 for 2.28.9
  std::string path;  // as loaded
  std::string version_text() const;

  int (*get_unique_id)(NcclUniqueId*) = nullptr;
  int (*comm_init_rank_config)(NcclCommHandle*, int nranks, NcclUniqueId id, int rank, NcclConfig*) = nullptr;
  int (*comm_split)(NcclCommHandle, int color, int key, NcclCommHandle*, NcclConfig*) = nullptr;
  int (*comm_destroy)(NcclCommHandle) = nullptr;
  int (*comm_abort)(NcclCommHandle) = nullptr;
  int (*comm_get_async_error)(NcclCommHandle, int*) = nullptr;
  int (*send)(const void*, std::size_t count, int datatype, int peer, NcclCommHandle, cudaStream_t) = nullptr;
  int (*recv)(void*, std::size_t count, int datatype, int peer, NcclCommHandle, cudaStream_t) = nullptr;
  int (*all_reduce)(const void*, void*, std::size_t count, int datatype, int op, NcclCommHandle, cudaStream_t) = nullptr;
  int (*group_start)() = nullptr;
  int (*group_end)() = nullptr;
  const char* (*error_string)(int) = nullptr;

  static constexpr int kInt8 = 0;        // ncclInt8
  static constexpr int kUint64 = 5;      // ncclUint64
  static constexpr int kSum = 0;         // ncclSum
  static constexpr int kInProgress = 7;  // ncclInProgress: a nonblocking communicator's work goes on
  // Raises Error(Cuda) naming the call, its result and `what` unless rc is ncclSuccess.
  void check(int rc, const char* call, const std::string& what) const;
};

// One communicator: destroyed with its owner (ncclCommDestroy), or aborted (ncclCommAbort:
// a peer may never come, so a destroy that waits for it would hang).
// A destroy is carried out by a thread of meshmem's once the device's earlier work has ended
// (cudaDeviceSynchronize, which holds up no other thread): ncclCommDestroy frees NCCL's
// memory, and cudaFree and cudaFreeHost wait for every kernel of the device (a user's too)
// and hold up the other threads' CUDA calls while they wait (studies/queue_lab contention). An
// abort runs at once: it is what ends NCCL kernels that wait for a peer that never comes.
class NcclComm {
 public:
  NcclComm() = default;
  // `c` was made on the current device.
  NcclComm(const NcclLibrary* lib, NcclCommHandle c);
  NcclComm(NcclComm&& o) noexcept : lib_(o.lib_), comm_(o.comm_), device_(o.device_) { o.comm_ = nullptr; }
  NcclComm& operator=(NcclComm&& o) noexcept;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  ~NcclComm() { reset(false); }
  NcclCommHandle get() const { return comm_; }
  void reset(bool abort) noexcept;

 private:
  const NcclLibrary* lib_ = nullptr;
  NcclCommHandle comm_ = nullptr;
  int device_ = -1;
};

// Waits until every communicator handed to the destroying thread so far is destroyed, for at
// most `bound` (0: for ever). Where they are not, `who` logs a warning saying which case it is.
// A teardown waits one bound, not one per communicator: while communicators that an earlier
// call gave up on still wait for the device, this returns at once.
void await_nccl_destroys(std::chrono::milliseconds bound, const std::string& who);

// A Comm starting on a GPU first lets the destroys that earlier Comms left behind finish (a
// teardown that gave up waiting, e.g. for a graph that captured a communicator), for at most
// a quarter of `bound` (0: a minute; not at all while an earlier start's give-up is still
// pending), and warns where they do not: a destroy's frees hold up every CUDA
// call of the process while the GPU has work, and a Comm's transfers wait for its threads'
// CUDA calls (seen: a destroy that began during the next Comm's first transfers took 20 s,
// the transfers' time limit, and they lost their data).
void finish_earlier_nccl_destroys(std::chrono::milliseconds bound, const std::string& who);

// Held by a live Comm on its GPU: a destroy that runs while one is held (another Comm torn
// down beside it, or a destroy left behind later than `finish_earlier_nccl_destroys` waits)
// warns, naming the hazard above.
class LiveCommMark {
 public:
  explicit LiveCommMark(int device);
  ~LiveCommMark();
  LiveCommMark(const LiveCommMark&) = delete;
  LiveCommMark& operator=(const LiveCommMark&) = delete;

 private:
  int device_;
};

}  // namespace meshmem::detail
