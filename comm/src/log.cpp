#include "log.hpp"

#include <atomic>
#include <cstdio>

namespace meshmem::detail {

namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::Warn)};
std::atomic<int> g_rank{-1};
}  // namespace

void set_log_level(LogLevel level) { g_level = static_cast<int>(level); }
void set_log_rank(int world_rank) { g_rank = world_rank; }
bool log_enabled(LogLevel level) { return static_cast<int>(level) <= g_level.load(); }

void log(LogLevel level, const std::string& message) {
  if (!log_enabled(level)) return;
  // One fprintf per line so that lines of concurrent ranks do not interleave mid-line.
  std::fprintf(stderr, "[meshmem rank %d] %s: %s\n", g_rank.load(), to_string(level),
               message.c_str());
}

}  // namespace meshmem::detail
