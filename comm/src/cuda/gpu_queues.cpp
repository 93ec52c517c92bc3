#include "gpu_queues.hpp"

#include <cstdlib>
#include <string>

#include "../knobs.hpp"

namespace meshmem::detail {
namespace {

enum class QueueSetting { Auto, Keep };
constexpr std::pair<const char*, QueueSetting> kQueueSettings[] = {{"auto", QueueSetting::Auto},
                                                                   {"keep", QueueSetting::Keep}};
QueueSetting parse_queue_setting(const char* n, const std::string& raw) { return parse_choice(n, raw, kQueueSettings); }
std::string print_queue_setting(const QueueSetting& q) { return choice_name(q, kQueueSettings); }

// Read at load, not through Options (which exist only once a Comm is made, too late for
// CUDA); declared here so that it is in the knob table and checked like every other.
const TuningKnob<QueueSetting> kGpuQueues{
    "device", "MESHMEM_GPU_QUEUES", QueueSetting::Auto, parse_queue_setting, print_queue_setting,
    "`auto`: when the program starts, meshmem sets CUDA_DEVICE_MAX_CONNECTIONS=32 (CUDA's most hardware queues per "
    "device; 8 by default) unless the variable is set: a stream that waits stalls the queue it shares with other "
    "streams of its process, and the staged, nccl and mpi-device transfers that such a wait waits for run on "
    "meshmem's own streams of the same process (with 8 queues a transfer was seen never to start). `keep`: leave "
    "the variable alone. Read from the environment at load, before any Comm; a Comm that routes a peer through "
    "those transports with fewer than 32 queues logs a warning",
    false};

int parse_count(const char* raw) {
  char* end = nullptr;
  const long v = std::strtol(raw, &end, 10);
  if (end == raw || *end != '\0' || v < 1) return 8;  // CUDA ignores what it cannot read
  return v > GpuQueues::kMost ? GpuQueues::kMost : static_cast<int>(v);
}

GpuQueues settle_at_load() {
  const char* mode = std::getenv("MESHMEM_GPU_QUEUES");
  const bool keep = mode != nullptr && lower_trimmed(mode) == "keep";
  const char* user = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  if (user != nullptr) return GpuQueues{parse_count(user), "the user's"};
  if (keep) return GpuQueues{8, "CUDA's default, MESHMEM_GPU_QUEUES=keep"};
  // Before main no other thread runs, so setenv is safe here.
  if (setenv("CUDA_DEVICE_MAX_CONNECTIONS", std::to_string(GpuQueues::kMost).c_str(), 0) != 0)
    return GpuQueues{8, "CUDA's default: setenv failed"};
  return GpuQueues{GpuQueues::kMost, "set by meshmem at load"};
}

// A namespace-scope object: runs when the program (or the shared object) is loaded.
const GpuQueues kAtLoad = settle_at_load();

}  // namespace

const GpuQueues& gpu_queues() { return kAtLoad; }

std::string describe_gpu_queues() {
  return "GPU queues " + std::to_string(kAtLoad.count) + " (CUDA_DEVICE_MAX_CONNECTIONS, " + kAtLoad.how + ")";
}

std::string gpu_queue_hint() {
  if (kAtLoad.count >= GpuQueues::kMost) return {};
  return "; this process has " + std::to_string(kAtLoad.count) +
         " GPU queues (CUDA_DEVICE_MAX_CONNECTIONS, " + kAtLoad.how +
         "): a stream of it that waits may have held this transfer's stream back (32 make that less likely)";
}

}  // namespace meshmem::detail
