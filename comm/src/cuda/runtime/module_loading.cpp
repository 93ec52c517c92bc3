#include "cuda/runtime/module_loading.hpp"

#include <strings.h>

#include <atomic>
#include <cstdio>

#include "knobs.hpp"
#include "cuda/runtime/startup_env.hpp"
#include "cuda/runtime/module_loading_knobs.hpp"

namespace meshmem::detail {
namespace {

// MESHMEM_MODULE_LOADING: module_loading_knobs.hpp.

ModuleLoadingRequest settle_at_load() {
  const StartupRequest request = request_at_load("CUDA_MODULE_LOADING", "EAGER", kModuleLoading.name());
  ModuleLoadingRequest r{false, false, "", {}};
  switch (request.outcome) {
    case StartupOutcome::Users:
      // As CUDA reads it, as far as the documentation says: EAGER or LAZY, in any case.
      r.eager = strcasecmp(request.users.c_str(), "EAGER") == 0;
      r.how = "the user's";
      std::snprintf(r.users, sizeof r.users, "%s", request.users.c_str());
      return r;
    case StartupOutcome::Kept: r.how = "CUDA's default, MESHMEM_MODULE_LOADING=keep"; return r;
    case StartupOutcome::OtherThreads: r.how = "CUDA's default: other threads ran when meshmem was loaded"; return r;
    case StartupOutcome::SetenvFailed: r.how = "CUDA's default: setenv failed"; return r;
    case StartupOutcome::Set: break;
  }
  r.eager = r.set_by_meshmem = true;
  r.how = "requested by meshmem at load";
  return r;
}

// A namespace-scope object: runs when the program (or the shared object) is loaded. Trivially
// destructible: threads that outlive static destruction may describe it.
const ModuleLoadingRequest kAtLoad = settle_at_load();

enum Reported : int { kNotYet, kEager, kLazy, kUnknown };
std::atomic<int> reported{kNotYet};

// "(CUDA_MODULE_LOADING, the user's 'EAGER ')": where the mode comes from.
std::string source() {
  std::string how = kAtLoad.how;
  if (kAtLoad.users[0] != '\0') how += std::string(" '") + kAtLoad.users + "'";
  // EAGER set by meshmem, and yet CUDA loads lazily: it had started before meshmem was loaded.
  if (kAtLoad.set_by_meshmem && reported.load() == kLazy) how += ", too late: CUDA had started";
  return "(CUDA_MODULE_LOADING, " + how + ")";
}

}  // namespace

const ModuleLoadingRequest& module_loading_request() { return kAtLoad; }

void note_module_loading(LoadingMode mode) {
  reported.store(mode == LoadingMode::Eager ? kEager : mode == LoadingMode::Lazy ? kLazy : kUnknown);
}

std::string describe_module_loading() {
  const int r = reported.load();
  const char* mode = r == kNotYet ? (kAtLoad.eager ? "eager" : "lazy")
                     : r == kEager ? "eager"
                     : r == kLazy  ? "lazy"
                                   : "unknown (cuModuleGetLoadingMode failed)";
  return std::string("module loading ") + mode + " " + source();
}

std::string lazy_loading_warning(int rank, const std::string& route) {
  if (reported.load() != kLazy) return {};
  return "rank " + std::to_string(rank) + " reaches " + route + ", whose transfers are ended by threads of this " +
         "process, under lazy module loading " + source() + ": an application kernel launched for the first time " +
         "while such a transfer is in flight waits for the GPU to be idle and holds the transfer until "
         "MESHMEM_TIMEOUT; export CUDA_MODULE_LOADING=EAGER before the program starts, or launch each kernel once "
         "before the first transfer (see MESHMEM_MODULE_LOADING)";
}

std::string lazy_loading_hint() {
  if (reported.load() != kLazy) return {};
  return "; " + describe_module_loading() +
         ": an application kernel launched for the first time while this transfer ran may have held it";
}

}  // namespace meshmem::detail
