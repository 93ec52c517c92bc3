#include "cuda/runtime/gpu_queues.hpp"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <string>

#include "backoff.hpp"
#include "knobs.hpp"
#include "cuda/runtime/module_loading.hpp"
#include "cuda/runtime/startup_env.hpp"
#include "cuda/runtime/gpu_queues_knobs.hpp"

namespace meshmem::detail {
namespace {

// MESHMEM_GPU_QUEUES: gpu_queues_knobs.hpp.

int parse_count(const char* raw) {
  char* end = nullptr;
  const long v = std::strtol(raw, &end, 10);
  if (end == raw || *end != '\0' || v < 1) return 8;  // CUDA ignores what it cannot read
  return v > GpuQueues::kMost ? GpuQueues::kMost : static_cast<int>(v);
}

GpuQueues settle_at_load() {
  const StartupRequest request = request_at_load("CUDA_DEVICE_MAX_CONNECTIONS", "32", kGpuQueues.name());
  switch (request.outcome) {
    case StartupOutcome::Users: return GpuQueues{parse_count(request.users.c_str()), "the user's"};
    case StartupOutcome::Kept: return GpuQueues{8, "CUDA's default, MESHMEM_GPU_QUEUES=keep"};
    case StartupOutcome::OtherThreads: return GpuQueues{8, "CUDA's default: other threads ran when meshmem was loaded"};
    case StartupOutcome::SetenvFailed: return GpuQueues{8, "CUDA's default: setenv failed"};
    case StartupOutcome::Set: break;
  }
  return GpuQueues{GpuQueues::kMost, "requested by meshmem at load"};
}

// A namespace-scope object: runs when the program (or the shared object) is loaded.
const GpuQueues kAtLoad = settle_at_load();

// "(CUDA_DEVICE_MAX_CONNECTIONS, the user's)": where the count comes from.
std::string source() { return "(CUDA_DEVICE_MAX_CONNECTIONS, " + std::string(kAtLoad.how) + ")"; }

}  // namespace

const GpuQueues& gpu_queues() { return kAtLoad; }

std::string describe_gpu_queues() { return "GPU queues " + std::to_string(kAtLoad.count) + " " + source(); }

namespace {
std::atomic<int> most_transport_streams{0};  // the most any transport of this process ran
// Leaked: read by threads that may outlive static destruction.
std::mutex& held_m = *new std::mutex;
std::string& held_report = *new std::string;
std::chrono::steady_clock::time_point held_at;
}  // namespace

void note_held_stream(const std::string& report) {
  std::lock_guard<std::mutex> lock(held_m);
  held_report = report;
  held_at = std::chrono::steady_clock::now();
}

std::string note_transport_streams(int rank, const std::string& transport, int streams) {
  int seen = most_transport_streams.load();
  while (streams > seen && !most_transport_streams.compare_exchange_weak(seen, streams)) {
  }
  if (streams <= kAtLoad.count) return {};
  return "rank " + std::to_string(rank) + ": the " + transport + " transport runs " + std::to_string(streams) +
         " streams of its own (two per peer on another node) on " + std::to_string(kAtLoad.count) + " GPU queues " +
         source() + ": streams share queues, so a transfer's stream can wait behind another that waits for its peer, "
         "and a transfer can stall until MESHMEM_TIMEOUT (32 queues are CUDA's most; fewer peers on other nodes per "
         "Comm avoid it)";
}

namespace {
std::string queue_count_hint() {
  const int streams = most_transport_streams.load();
  if (kAtLoad.count >= GpuQueues::kMost && streams <= kAtLoad.count) return {};
  if (streams > kAtLoad.count)
    return "; a transport of this process runs " + std::to_string(streams) + " streams of its own on " +
           std::to_string(kAtLoad.count) + " GPU queues " + source() +
           ": a stream sharing this transfer's queue that waits may have held it back";
  return "; this process has " + std::to_string(kAtLoad.count) + " GPU queues " + source() +
         ": a stream of it that waits may have held this transfer's stream back (32 make that less likely)";
}
}  // namespace

std::string gpu_queue_hint() {
  std::string hint = queue_count_hint() + lazy_loading_hint();
  std::lock_guard<std::mutex> lock(held_m);
  if (held_report.empty()) return hint;
  // The latest report may be old (a stall that ended long before): its age says so.
  return hint + "; reported " + describe_seconds(std::chrono::steady_clock::now() - held_at) + " ago: " + held_report;
}

std::string few_gpu_queues_warning(int rank, const std::string& route) {
  if (kAtLoad.count >= GpuQueues::kMost) return {};
  return "rank " + std::to_string(rank) + " reaches " + route + ", whose transfers run on streams of this process, with " +
         std::to_string(kAtLoad.count) + " GPU queues " + source() +
         ": a stream that waits holds the queue it shares, so such a transfer can stall until MESHMEM_TIMEOUT; export "
         "CUDA_DEVICE_MAX_CONNECTIONS=32 before the program starts (see MESHMEM_GPU_QUEUES)";
}

}  // namespace meshmem::detail
