// GpuQueues: how many hardware work queues CUDA gives this process per device, and why
// meshmem asks for the most (32) when the process starts.
//
// Streams share CUDA_DEVICE_MAX_CONNECTIONS queues per device (8 by default), read when a
// context is created. A stream that stalls (a stream memory wait, or a polling kernel with
// work behind it) stalls its queue, and with it every other stream of the process on that
// queue, in any context made with the primary one (green contexts included): its kernels,
// stream memory operations, device-to-device and small host-to-device copies (copies into
// host memory, and large ones from it, go on). The staged, nccl and mpi-device transports
// run such work on streams of this process (the staging agent's word writes, the proxy
// thread's kernels) after the caller's stream already waits for it: if they share a queue
// with the waiting stream, the transfer cannot end and ends in MESHMEM_TIMEOUT (the staging
// agent reports a held stream of its own: note_held_stream).
// Measured on 1 x H100 (studies/queue_lab.cu, studies/results/*queue-lab*): waits on 8 streams
// hold back copies and kernels of another stream; with 32 queues and 8 waiting streams a copy
// of another stream ran, and the soak's graph round that timed out with 8 passed.
//
// So at static initialisation this asks for 32 (sets CUDA_DEVICE_MAX_CONNECTIONS) unless the
// variable is set (empty counts as unset), MESHMEM_GPU_QUEUES=keep, or other threads already
// run (setenv is not safe beside them: a library loaded by dlopen into a running program).
// For a program linked with meshmem that is before main, before any CUDA context; where CUDA
// started earlier (dlopen after CUDA use, a static constructor of another file) the request
// comes too late and the user must export the variable. It lowers the chance, it does not
// remove it: more streams than queues share them again.
//
// CUDA-free.
#pragma once

#include <string>

namespace meshmem::detail {

struct GpuQueues {
  int count;        // queues per device the variable asks for (CUDA's default 8 when unset)
  const char* how;  // "requested by meshmem at load", "the user's", ... (a literal: read by
                    // threads that may outlive static destruction)
  static constexpr int kMost = 32;  // CUDA's limit for CUDA_DEVICE_MAX_CONNECTIONS
};

// The variable as meshmem left it at load (what CUDA reads where no context existed before).
const GpuQueues& gpu_queues();

// "GPU queues 32 (CUDA_DEVICE_MAX_CONNECTIONS, requested by meshmem at load)".
std::string describe_gpu_queues();

// For the message of a transfer on meshmem's own streams that did not end: where the process
// has fewer than 32 queues, or a transport more streams than queues, "; ... a waiting stream
// may have held it back ...", where CUDA loads lazily "; module loading lazy ..."
// (module_loading.hpp), then "; " and the report of a held stream, if one was noted; else "".
std::string gpu_queue_hint();

// A stream of meshmem's own that was seen held back (its work did not move for seconds, and
// it waits for nothing outside the process): the report, which gpu_queue_hint adds from now
// on (the latest one, with its age).
void note_held_stream(const std::string& report);

// A transport of this process now runs `streams` streams of its own on its device (the proxy's
// two per peer on another node): remembered for gpu_queue_hint. Where they are more than the
// queues, they share queues whatever else runs: the warning to log; else "".
std::string note_transport_streams(int rank, const std::string& transport, int streams);

// Where `rank` reaches `route` ("rank 3 through nccl") through a transport whose transfers run
// on streams of this process and the process has fewer than 32 queues: the warning to log;
// else "".
std::string few_gpu_queues_warning(int rank, const std::string& route);

}  // namespace meshmem::detail
