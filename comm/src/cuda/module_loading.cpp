#include "module_loading.hpp"

#include <strings.h>

#include <atomic>
#include <cstdlib>

#include "../knobs.hpp"
#include "startup_env.hpp"

namespace meshmem::detail {
namespace {

// Read at load, not through Options (which exist only once a Comm is made, too late for
// CUDA); declared here so that it is in the knob table and checked like every other.
const TuningKnob<StartupSetting> kModuleLoading{
    "device", "MESHMEM_MODULE_LOADING", StartupSetting::Auto, parse_named<kStartupSettings>,
    print_named<kStartupSettings>,
    "`auto`: when the program starts, meshmem sets CUDA_MODULE_LOADING=EAGER unless the variable is set: under "
    "CUDA's lazy loading (its default) an application kernel launched for the first time waits for the GPU to be "
    "idle, and a stream that waits for a staged, nccl or mpi-device transfer is not, since threads of the same "
    "process end those transfers: the launch and the transfer stalled until MESHMEM_TIMEOUT (1 x H100). Eager "
    "loading costs the GPU memory and start-up time of every kernel in the process. `keep`: leave the variable "
    "alone (a Comm with such routes under lazy loading logs a warning). Read from the environment when meshmem is "
    "loaded, with the rules of MESHMEM_GPU_QUEUES",
    false};

ModuleLoadingRequest settle_at_load() {
  switch (request_at_load("CUDA_MODULE_LOADING", "EAGER", kModuleLoading.name())) {
    case StartupRequest::Users: {
      const char* user = std::getenv("CUDA_MODULE_LOADING");
      return ModuleLoadingRequest{strcasecmp(user, "EAGER") == 0, "the user's"};
    }
    case StartupRequest::Kept: return ModuleLoadingRequest{false, "CUDA's default, MESHMEM_MODULE_LOADING=keep"};
    case StartupRequest::OtherThreads:
      return ModuleLoadingRequest{false, "CUDA's default: other threads ran when meshmem was loaded"};
    case StartupRequest::SetenvFailed: return ModuleLoadingRequest{false, "CUDA's default: setenv failed"};
    case StartupRequest::Set: break;
  }
  return ModuleLoadingRequest{true, "requested by meshmem at load"};
}

// A namespace-scope object: runs when the program (or the shared object) is loaded.
const ModuleLoadingRequest kAtLoad = settle_at_load();

// 0: not known yet (no device runtime started), 1: eager, 2: lazy.
std::atomic<int> reported{0};

bool lazy_now() { return reported.load() == 2; }

}  // namespace

const ModuleLoadingRequest& module_loading_request() { return kAtLoad; }

void note_module_loading(bool lazy) { reported.store(lazy ? 2 : 1); }

std::string describe_module_loading() {
  const int r = reported.load();
  const char* mode = r == 0 ? (kAtLoad.eager ? "eager" : "lazy") : (r == 2 ? "lazy" : "eager");
  return std::string("module loading ") + mode + " (CUDA_MODULE_LOADING, " + kAtLoad.how + ")";
}

std::string lazy_loading_warning(int rank, const std::string& route) {
  if (!lazy_now()) return {};
  return "rank " + std::to_string(rank) + " reaches " + route + ", whose transfers are ended by threads of this " +
         "process, with lazy module loading (" + describe_module_loading() + "): an application kernel launched for " +
         "the first time while such a transfer is in flight waits for the GPU to be idle and holds the transfer " +
         "until MESHMEM_TIMEOUT; export CUDA_MODULE_LOADING=EAGER before the program starts, or launch each kernel "
         "once before the first transfer (see MESHMEM_MODULE_LOADING)";
}

std::string lazy_loading_hint() {
  if (!lazy_now()) return {};
  return "; " + describe_module_loading() +
         ": an application kernel launched for the first time while this transfer ran may have held it";
}

}  // namespace meshmem::detail
