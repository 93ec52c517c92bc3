#include "meshmem/config.hpp"

#include <unistd.h>  // environ

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "gpu_part.hpp"

#include "knobs.hpp"
#include "meshmem/error.hpp"
#include "transport_registry.hpp"

namespace meshmem {

const char* to_string(FdPassing mode) noexcept {
  switch (mode) {
    case FdPassing::Auto: return "auto";
    case FdPassing::Pidfd: return "pidfd";
    case FdPassing::Socket: return "socket";
  }
  return "?";
}

const char* to_string(LogLevel level) noexcept {
  switch (level) {
    case LogLevel::Error: return "error";
    case LogLevel::Warn: return "warn";
    case LogLevel::Info: return "info";
    case LogLevel::Debug: return "debug";
  }
  return "?";
}

namespace detail {
namespace {

// "30", "30s", "2.5s", "500ms", "5min", "0" / "inf" (forever).
std::chrono::milliseconds parse_duration(const char* var, const std::string& raw) {
  const std::string v = lower_trimmed(raw);
  const char* expected = "seconds such as 30, 2.5s, 500ms or 5min; 0 or inf to wait forever";
  if (v == "inf" || v == "infinite" || v == "forever") return std::chrono::milliseconds(0);
  // Plain decimals only (digits, optionally a point and digits): strtod alone also reads signs,
  // exponents and hexadecimal, so `-0` and `1e-400` were forever and `0x10` 16 s.
  std::size_t digits = 0;
  while (digits < v.size() && std::isdigit(static_cast<unsigned char>(v[digits]))) ++digits;
  if (digits == 0) bad_knob_value(var, raw, expected);
  if (digits < v.size() && v[digits] == '.') {
    std::size_t fraction = digits + 1;
    while (fraction < v.size() && std::isdigit(static_cast<unsigned char>(v[fraction]))) ++fraction;
    if (fraction == digits + 1) bad_knob_value(var, raw, expected);
    digits = fraction;
  }
  const double number = std::strtod(v.substr(0, digits).c_str(), nullptr);
  if (!std::isfinite(number)) bad_knob_value(var, raw, expected);
  const std::string unit = lower_trimmed(v.substr(digits));
  double ms = 0;
  if (unit.empty() || unit == "s") ms = number * 1e3;
  else if (unit == "ms") ms = number;
  else if (unit == "min" || unit == "m") ms = number * 60e3;
  else bad_knob_value(var, raw, expected);
  if (ms > 1e12) bad_knob_value(var, raw, expected);
  // A positive value under 1 ms still means "time out", not "forever".
  return std::chrono::milliseconds(ms > 0 && ms < 1 ? 1 : static_cast<long long>(ms));
}
std::string print_duration(const std::chrono::milliseconds& t) {
  return t.count() == 0 ? "inf" : std::to_string(t.count()) + "ms";
}

int parse_node_split(const char* var, const std::string& raw) {
  const std::string v = lower_trimmed(raw);
  char* end = nullptr;
  const long n = std::strtol(v.c_str(), &end, 10);
  constexpr long kMax = 1 << 20;
  if (v.empty() || *end != '\0' || n < 1 || n > kMax) bad_knob_value(var, raw, "an integer from 1 to " + std::to_string(kMax));
  return static_cast<int>(n);
}
std::string print_int(const int& n) { return std::to_string(n); }

constexpr std::pair<const char*, FdPassing> kFdPassing[] = {
    {"auto", FdPassing::Auto}, {"pidfd", FdPassing::Pidfd}, {"socket", FdPassing::Socket}};

constexpr std::pair<const char*, LogLevel> kLogLevels[] = {{"error", LogLevel::Error}, {"warn", LogLevel::Warn},
                                                          {"warning", LogLevel::Warn}, {"info", LogLevel::Info},
                                                          {"debug", LogLevel::Debug}};

std::vector<TransportKind> parse_transports(const char* var, const std::string& raw) {
  std::vector<TransportKind> kinds;
  std::stringstream ss(raw);
  std::string item;
  std::string names;
  for (const TransportEntry& e : transport_table()) names += (names.empty() ? "" : ", ") + std::string(e.name);
  const std::string expected = "a comma-separated list of transports, each named once, from: " + names;
  while (std::getline(ss, item, ',')) {
    const std::string name = lower_trimmed(item);
    const TransportEntry* found = nullptr;
    for (const TransportEntry& e : transport_table())
      if (name == e.name) found = &e;
    if (found == nullptr) bad_knob_value(var, raw, expected);
    for (TransportKind seen : kinds)
      if (seen == found->kind) bad_knob_value(var, raw, expected);
    kinds.push_back(found->kind);
  }
  if (kinds.empty()) bad_knob_value(var, raw, expected);
  return kinds;
}

std::string print_transports(const std::vector<TransportKind>& kinds) {
  std::string s;
  for (TransportKind k : kinds) s += (s.empty() ? "" : ",") + std::string(to_string(k));
  return s;
}

// The core's knobs.
const OptionKnob<std::chrono::milliseconds> kTimeout{
    Tier::User, "MESHMEM_TIMEOUT", &Options::timeout, parse_duration, print_duration,
    "longest wait for a peer (host waits, Comm construction, collectives): `30`, `2.5s`, `500ms`, `5min`; "
    "`0` or `inf` = forever",
    nullptr};
const OptionKnob<int> kSimulateNodes{
    Tier::Testing, "MESHMEM_SIMULATE_NODES", &Options::simulate_nodes, parse_node_split, print_int,
    "split each real node into N simulated nodes (blocks of ranks), treated like real nodes: cross-node routes on "
    "one machine",
    "Contiguous blocks of ranks form each simulated node; ranks of different simulated nodes are treated exactly "
    "like ranks of different real nodes (routes, descriptor passing, barriers), so that the tests of every "
    "placement run on one machine"};
const OptionKnob<FdPassing> kFdPassingKnob{
    Tier::User, "MESHMEM_FD_PASSING", &Options::fd_passing, parse_named<kFdPassing>, print_named<kFdPassing>,
    "how node peers pass memory descriptors: `pidfd` (pidfd_getfd), `socket` (SCM_RIGHTS), or `auto` (pidfd where "
    "every node peer permits it)",
    "`pidfd` (pidfd_getfd; needs ptrace permission), `socket` (SCM_RIGHTS over a Unix socket in a directory "
    "only the job's user may enter, mode 0700, under TMPDIR, else /tmp, which the node's ranks must see alike: "
    "checked when the Comm is made; the sender's pid and uid are checked with SO_PEERCRED), or `auto` (pidfd "
    "where every node peer permits it; no socket is made then)"};
const OptionKnob<std::vector<TransportKind>> kTransports{
    Tier::User, "MESHMEM_TRANSPORTS", &Options::transports, parse_transports, print_transports,
    "the transports allowed, in the order tried for each peer and memory kind: `ipc`, `staged`, `nccl`, "
    "`mpi-device`, `shm`, `mpi`",
    "`ipc` (device windows, same node, VMM mappings), `staged` (device windows, same node, GPUs without peer "
    "access: through the node's pinned staging pool; `staged,shm,mpi` forces it where peer access works), `nccl` "
    "(device windows, other nodes: NCCL send/receive driven by each rank's proxy thread; libnccl loaded at run "
    "time), `mpi-device` (device windows, other nodes, where NCCL is absent or left out: the same proxy threads, "
    "MPI messages through pinned host memory), `shm` (host windows, same node, mapped memfd), `mpi` (host windows, "
    "any node, progress thread). `mpi` alone sends even same-node host traffic through MPI; without `ipc` and "
    "`staged` device windows reach no node peer, without `nccl` and `mpi-device` no rank of another node"};

const OptionKnob<LogLevel> kLogLevel{
    Tier::User, "MESHMEM_LOG_LEVEL", &Options::log_level, parse_named<kLogLevels>, print_named<kLogLevels>,
    "`error`, `warn`, `info`, `debug` (stderr, prefixed with the rank); may differ between ranks", nullptr,
    /*must_agree=*/false};

// A GPU part's knob set in a program without the GPU part: accepted (its value checked), unused.
std::string unused_notice(const Knob& k, const Options& o) {
  return std::string(k.name()) + "=" + k.text(o) + " has no effect: " + kNoGpuPart;
}

}  // namespace
}  // namespace detail

void Options::set(const std::string& variable, const std::string& value) {
  bool old = false;
  const detail::Knob* knob = detail::find_knob(variable, &old);
  if (knob == nullptr) {
    const detail::Knob* near = detail::closest_knob(variable);
    throw Error(ErrorCode::InvalidArgument,
                "Options::set: " + variable + " is not a meshmem setting" +
                    (near != nullptr ? " (did you mean " + std::string(near->name()) + "?)" : "") +
                    "; `meshmem-info --all` lists them");
  }
  knob->set(*this, value);
  sources_[knob->name()] = old ? std::string("set (old name ") + variable + ")" : "set";
  if (old) notices_.push_back(detail::old_name_notice(*knob));
  if (knob->in_gpu_part() && !detail::gpu_part_linked()) notices_.push_back(detail::unused_notice(*knob, *this));
}

Options Options::parse(const std::function<const char*(const char*)>& lookup) {
  Options o;
  for (const detail::Knob* k : detail::knob_table()) {
    const char* v = lookup(k->name());
    const bool set = v != nullptr && v[0] != '\0';  // empty = unset
    const char* old = k->old_name() != nullptr ? lookup(k->old_name()) : nullptr;
    const bool old_set = old != nullptr && old[0] != '\0';
    if (set) {
      k->set(o, v);
      o.sources_[k->name()] = "env";
      if (old_set)
        o.notices_.push_back(std::string(k->old_name()) + " is ignored: " + k->name() + " is set too (" +
                             k->old_name() + " is its old name)");
    } else if (old_set) {
      k->set(o, old);
      o.sources_[k->name()] = std::string("env (old name ") + k->old_name() + ")";
      o.notices_.push_back(detail::old_name_notice(*k));
    }
    if ((set || old_set) && k->in_gpu_part() && !detail::gpu_part_linked())
      o.notices_.push_back(detail::unused_notice(*k, o));
  }
  return o;
}

Options Options::from_environment() {
  Options o = parse([](const char* var) { return std::getenv(var); });
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string entry = *e;
    const std::string notice = detail::unknown_variable_notice(entry.substr(0, entry.find('=')));
    if (!notice.empty()) o.notices_.push_back(notice);
  }
  return o;
}

std::vector<std::string> Options::describe() const {
  std::vector<std::string> lines;
  for (const detail::Knob* k : detail::knob_table())
    lines.push_back(std::string(k->name()) + "=" + k->text(*this) + " (" + k->doc() + ")");
  return lines;
}

std::vector<Options::Setting> Options::settings() const {
  std::vector<Setting> all;
  for (const detail::Knob* k : detail::knob_table()) {
    Setting s;
    s.name = k->name();
    s.old_name = k->old_name() != nullptr ? k->old_name() : "";
    s.value = k->text(*this);
    s.default_value = k->default_text();
    s.tier = detail::to_string(k->tier());
    const auto it = sources_.find(k->name());
    // A field assigned by the program itself (o.timeout = ...) has no recorded source.
    s.source = it != sources_.end() ? it->second : s.value == s.default_value ? "default" : "program";
    s.doc = k->doc();
    s.details = k->details();
    s.used = !k->in_gpu_part() || detail::gpu_part_linked();
    s.must_agree = k->must_agree();
    all.push_back(std::move(s));
  }
  return all;
}

std::string Options::fingerprint() const {
  std::string s;
  for (const detail::Knob* k : detail::knob_table())
    if (k->must_agree()) s += std::string(s.empty() ? "" : ";") + k->name() + "=" + k->text(*this);
  return s;
}

}  // namespace meshmem
