#include "knobs.hpp"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>

#include "gpu_part.hpp"
#include "meshmem/error.hpp"

// The GPU part's knobs, declared beside its code in CUDA-free headers: included here too, so
// that every build and every program (meshmem::core alone as well) has them in its table.
// Each is an inline variable: one object however many files include it.
#include "cuda/halo/device_halo_plan_knobs.hpp"
#include "cuda/runtime/gpu_device_knobs.hpp"
#include "cuda/runtime/gpu_queues_knobs.hpp"
#include "cuda/runtime/module_loading_knobs.hpp"
#include "cuda/barrier/stream_barrier_knobs.hpp"
#include "cuda/ipc/transport_ipc_knobs.hpp"
#include "cuda/proxy/transport_nccl_knobs.hpp"
#include "cuda/staged/transport_staged_knobs.hpp"

namespace meshmem::detail {

namespace {
// Filled by the knobs' constructors during static initialisation (a function-local
// static, so that it exists before the first knob of any translation unit registers).
std::vector<const Knob*>& registry() {
  static std::vector<const Knob*> knobs;
  return knobs;
}
}  // namespace

const char* to_string(Tier tier) noexcept {
  switch (tier) {
    case Tier::User: return "user";
    case Tier::Tuning: return "tuning";
    case Tier::Testing: return "testing";
  }
  return "?";
}

Knob::Knob(Tier tier, const char* group, KnobName name, const char* doc, const char* details, bool must_agree)
    : tier_(tier), group_(group), name_(name), doc_(doc), details_(details), must_agree_(must_agree) {
  registry().push_back(this);
}

bool Knob::in_gpu_part() const {
  // The groups of the knobs declared in comm/src/cuda/*_knobs.hpp.
  static const char* const kGpuGroups[] = {"device", "ipc", "staged", "nccl"};
  for (const char* g : kGpuGroups)
    if (std::strcmp(group_, g) == 0) return true;
  return false;
}

bool gpu_part_linked() { return gpu_available != nullptr; }

std::vector<const Knob*> knob_table() {
  std::vector<const Knob*> table = registry();
  std::stable_sort(table.begin(), table.end(), [](const Knob* a, const Knob* b) {
    const bool ca = std::strcmp(a->group(), "core") == 0, cb = std::strcmp(b->group(), "core") == 0;
    if (ca != cb) return ca;
    if (ca) return false;  // core knobs: one file, in declaration order
    const int g = std::strcmp(a->group(), b->group());
    return g != 0 ? g < 0 : std::strcmp(a->name(), b->name()) < 0;
  });
  return table;
}

const Knob* find_knob(const std::string& name, bool* old) {
  if (old != nullptr) *old = false;
  for (const Knob* k : registry())
    if (name == k->name()) return k;
  for (const Knob* k : registry())
    if (k->old_name() != nullptr && name == k->old_name()) {
      if (old != nullptr) *old = true;
      return k;
    }
  return nullptr;
}

bool exempt_variable(const std::string& name) {
  // Read by meshmem's tests (tests/support, tests/*/CMakeLists.txt), its launch tools
  // (launch/meshmem-hosts) and its build (CMake options, where someone exports them).
  static const char* const kPrefixes[] = {"MESHMEM_TEST_",  "MESHMEM_SOAK_",    "MESHMEM_HOSTS_",
                                          "MESHMEM_BUILD_", "MESHMEM_ENABLE_",  "MESHMEM_BENCH_",
                                          "MESHMEM_EXAMPLE_", "MESHMEM_NVSHMEM_", "MESHMEM_MPIEXEC_"};
  // Whole names: the GPU run script's commit label, the Python package's tool and interpreter,
  // and the CMake variable that names the NCCL of the examples and benchmarks.
  static const char* const kNames[] = {"MESHMEM_COMMIT", "MESHMEM_INFO", "MESHMEM_PYTHON", "MESHMEM_NCCL_LIBRARY_PATH"};
  for (const char* p : kPrefixes)
    if (name.rfind(p, 0) == 0) return true;
  for (const char* n : kNames)
    if (name == n) return true;
  return false;
}

namespace {
// Optimal string alignment distance: insertions, deletions, substitutions and swaps of two
// neighbouring letters each cost 1 (TIMOUT, TIEMOUT and TIMEOUTS are all 1 from TIMEOUT).
std::size_t edit_distance(const std::string& a, const std::string& b) {
  const std::size_t n = a.size(), m = b.size();
  std::vector<std::vector<std::size_t>> d(n + 1, std::vector<std::size_t>(m + 1));
  for (std::size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= n; ++i)
    for (std::size_t j = 1; j <= m; ++j) {
      const std::size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[n][m];
}
}  // namespace

const Knob* closest_knob(const std::string& name) {
  constexpr std::size_t kPrefix = sizeof("MESHMEM_") - 1;
  const std::string mine = name.rfind("MESHMEM_", 0) == 0 ? name.substr(kPrefix) : name;
  const Knob* best = nullptr;
  std::size_t best_distance = 0;
  for (const Knob* k : knob_table())
    for (const char* n : {k->name(), k->old_name()}) {
      if (n == nullptr) continue;
      const std::size_t dist = edit_distance(mine, std::string(n).substr(kPrefix));
      if (best == nullptr || dist < best_distance) best = k, best_distance = dist;
    }
  // A misspelling: a third of the name's letters at most (two for short names).
  const std::size_t limit = std::max<std::size_t>(2, mine.size() / 3);
  return best != nullptr && best_distance <= limit ? best : nullptr;
}

std::string old_name_notice(const Knob& k) {
  return std::string(k.old_name()) + " is the old name of " + k.name() + ", read until the next release: set " +
         k.name() + " instead";
}

std::string unknown_variable_notice(const std::string& name) {
  if (name.rfind("MESHMEM_", 0) != 0 || find_knob(name) != nullptr || exempt_variable(name)) return {};
  const Knob* near = closest_knob(name);
  return name + " is not a meshmem setting and is ignored" +
         (near != nullptr ? " (did you mean " + std::string(near->name()) + "?)"
                          : " (`meshmem-info --all` lists every setting)");
}

void bad_knob_value(const char* name, const std::string& raw, const std::string& expected) {
  throw Error(ErrorCode::InvalidArgument, std::string(name) + "='" + raw + "' is not valid: expected " + expected);
}

std::string lower_trimmed(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return {};
  const auto e = s.find_last_not_of(" \t");
  std::string t = s.substr(b, e - b + 1);
  for (char& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return t;
}

std::size_t parse_bytes(const char* name, const std::string& raw) {
  const std::string t = lower_trimmed(raw);
  char* end = nullptr;
  const unsigned long long n = std::strtoull(t.c_str(), &end, 10);
  if (t.empty() || t[0] == '-' || *end != '\0' || n > (1ull << 40)) bad_knob_value(name, raw, "a byte count");
  return static_cast<std::size_t>(n);
}

std::string print_number(const std::size_t& n) { return std::to_string(n); }

std::chrono::microseconds parse_micros(const char* name, const std::string& raw, std::chrono::microseconds max) {
  const std::string t = lower_trimmed(raw);
  const std::string expected = "a time with its unit, such as 250us or 2ms (at most " + print_micros(max) + "), or 0";
  std::size_t digits = 0;
  while (digits < t.size() && std::isdigit(static_cast<unsigned char>(t[digits]))) ++digits;
  if (digits == 0 || digits > 9) bad_knob_value(name, raw, expected);
  const long long n = std::stoll(t.substr(0, digits));
  const std::string unit = t.substr(digits);
  long long us = 0;
  if (unit == "us") us = n;
  else if (unit == "ms") us = n * 1000;
  else if (unit.empty() && n == 0) us = 0;
  else bad_knob_value(name, raw, expected);
  if (us > max.count()) bad_knob_value(name, raw, expected);
  return std::chrono::microseconds(us);
}

std::string print_micros(const std::chrono::microseconds& t) {
  const long long us = t.count();
  if (us == 0) return "0";
  return us % 1000 == 0 ? std::to_string(us / 1000) + "ms" : std::to_string(us) + "us";
}

}  // namespace meshmem::detail
