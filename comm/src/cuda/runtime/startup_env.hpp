// Variables that CUDA reads once, when it starts in this process, and that meshmem sets at
// static initialisation (before main, so before any CUDA context) where the user has not:
// CUDA_DEVICE_MAX_CONNECTIONS (gpu_queues.hpp) and CUDA_MODULE_LOADING (module_loading.hpp).
// Each has a knob `auto` (set it) / `keep` (leave it alone), read from the environment at load
// because Options exist only once a Comm is made, too late for CUDA.
//
// CUDA-free.
#pragma once

#include <string>
#include <utility>

namespace meshmem::detail {

enum class StartupSetting { Auto, Keep };
inline constexpr std::pair<const char*, StartupSetting> kStartupSettings[] = {{"auto", StartupSetting::Auto},
                                                                            {"keep", StartupSetting::Keep}};

// What became of a request to set a variable at load.
enum class StartupOutcome {
  Users,         // the user had set it (non-empty): left as it is
  Kept,          // unset, and the knob says keep
  OtherThreads,  // unset: other threads already ran (setenv beside another thread's getenv is
                 // undefined: a library loaded by dlopen into a running program)
  SetenvFailed,  // unset: setenv failed
  Set,           // set by meshmem now
};
struct StartupRequest {
  StartupOutcome outcome;
  std::string users;  // the user's value as read once (Users), else ""
};

// Sets `variable` to `value` unless one of the other outcomes applies; `knob` names the
// auto/keep knob (a value it refuses counts as auto here, since static initialisation cannot
// raise; a Comm raises it when it parses its Options).
StartupRequest request_at_load(const char* variable, const char* value, const char* knob);

}  // namespace meshmem::detail
