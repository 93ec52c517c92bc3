#include "step_trace.hpp"

#include <time.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace meshmem::detail {

StepTrace::StepTrace(std::string path, std::size_t capacity)
    : path_(std::move(path)), steps_(capacity == 0 ? nullptr : new Step[capacity]), capacity_(capacity) {}

std::int64_t StepTrace::now_ns() noexcept {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<std::int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

std::string StepTrace::write() const {
  if (!on()) return "the trace is off";
  std::FILE* out = std::fopen(path_.c_str(), "w");
  if (out == nullptr) return "cannot open " + path_ + ": " + std::strerror(errno);
  const std::size_t recorded = next_.load();
  const std::size_t kept = std::min(recorded, capacity_);
  std::fprintf(out, "# meshmem step trace: %zu steps kept, %zu dropped (capacity %zu); ns step peer id aux\n", kept,
               recorded - kept, capacity_);
  for (std::size_t i = 0; i < kept; ++i) {
    const Step& s = steps_[i];
    std::fprintf(out, "%lld %c %d %llu %lld\n", static_cast<long long>(s.ns), s.step, s.peer,
                 static_cast<unsigned long long>(s.id), static_cast<long long>(s.aux));
  }
  const bool failed = std::ferror(out) != 0;
  if (std::fclose(out) != 0 || failed) return "cannot write " + path_ + ": " + std::strerror(errno);
  return "";
}

}  // namespace meshmem::detail
