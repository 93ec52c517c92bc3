#include "cuda/runtime/startup_env.hpp"

#include <dirent.h>

#include <cstdlib>

#include "knobs.hpp"

namespace meshmem::detail {
namespace {

// Threads of this process now (1 where only the loading thread runs; 0 if unknown).
int threads_running() {
  DIR* d = opendir("/proc/self/task");
  if (d == nullptr) return 0;
  int n = 0;
  while (const dirent* e = readdir(d))
    if (e->d_name[0] != '.') ++n;
  closedir(d);
  return n;
}

bool keep_requested(const char* knob) {
  const char* mode = std::getenv(knob);
  if (mode == nullptr) return false;
  try {
    return parse_named<kStartupSettings>(knob, mode) == StartupSetting::Keep;
  } catch (...) {
    return false;
  }
}

}  // namespace

StartupRequest request_at_load(const char* variable, const char* value, const char* knob) {
  const char* user = std::getenv(variable);
  if (user != nullptr && *user != '\0') return {StartupOutcome::Users, user};
  if (keep_requested(knob)) return {StartupOutcome::Kept, {}};
  if (threads_running() != 1) return {StartupOutcome::OtherThreads, {}};
  if (setenv(variable, value, 1) != 0) return {StartupOutcome::SetenvFailed, {}};
  return {StartupOutcome::Set, {}};
}

}  // namespace meshmem::detail
