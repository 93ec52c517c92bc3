// Internal logging to stderr: "[meshmem rank R] level: message". Errors are logged once,
// where they are detected; raised errors are not logged again by the layers above.
#pragma once

#include <string>

#include "meshmem/config.hpp"

namespace meshmem::detail {

void set_log_level(LogLevel level);
void set_log_rank(int world_rank);
bool log_enabled(LogLevel level);
void log(LogLevel level, const std::string& message);

}  // namespace meshmem::detail
