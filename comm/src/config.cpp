#include "meshmem/config.hpp"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <utility>
#include <sstream>

#include "meshmem/error.hpp"

namespace meshmem {

const char* to_string(TransportKind kind) noexcept {
  switch (kind) {
    case TransportKind::None: return "none";
    case TransportKind::Ipc: return "ipc";
    case TransportKind::Shm: return "shm";
    case TransportKind::Mpi: return "mpi";
  }
  return "?";
}

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

namespace {

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return {};
  const auto e = s.find_last_not_of(" \t");
  return s.substr(b, e - b + 1);
}

[[noreturn]] void bad_value(const char* var, const std::string& value, const std::string& expected) {
  throw Error(ErrorCode::InvalidArgument,
              std::string(var) + "='" + value + "' is not valid: expected " + expected);
}

// "30", "30s", "2.5s", "500ms", "5min", "0" / "inf" (forever).
std::chrono::milliseconds parse_duration(const char* var, const std::string& raw) {
  const std::string v = lower(trim(raw));
  const char* expected = "seconds such as 30, 2.5s, 500ms or 5min; 0 or inf to wait forever";
  if (v == "inf" || v == "infinite" || v == "forever") return std::chrono::milliseconds(0);
  char* end = nullptr;
  const double number = std::strtod(v.c_str(), &end);
  if (end == v.c_str() || !std::isfinite(number) || number < 0) bad_value(var, raw, expected);
  const std::string unit = trim(end);
  double ms = 0;
  if (unit.empty() || unit == "s") ms = number * 1e3;
  else if (unit == "ms") ms = number;
  else if (unit == "min" || unit == "m") ms = number * 60e3;
  else bad_value(var, raw, expected);
  if (ms > 1e12) bad_value(var, raw, expected);
  // A positive value under 1 ms still means "time out", not "forever".
  return std::chrono::milliseconds(ms > 0 && ms < 1 ? 1 : static_cast<long long>(ms));
}

int parse_positive_int(const char* var, const std::string& raw, int max) {
  const std::string v = trim(raw);
  char* end = nullptr;
  const long n = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || n < 1 || n > max)
    bad_value(var, raw, "an integer from 1 to " + std::to_string(max));
  return static_cast<int>(n);
}

std::size_t parse_bytes(const char* var, const std::string& raw) {
  const std::string t = trim(raw);
  char* end = nullptr;
  const unsigned long long n = std::strtoull(t.c_str(), &end, 10);
  if (t.empty() || t[0] == '-' || *end != '\0' || n > (1ull << 40)) bad_value(var, raw, "a byte count");
  return static_cast<std::size_t>(n);
}

// `raw` (case-insensitive, trimmed) must be one of `choices`' names.
template <class T>
T parse_choice(const char* var, const std::string& raw, std::initializer_list<std::pair<const char*, T>> choices) {
  const std::string m = lower(trim(raw));
  std::string names;
  for (const auto& [name, value] : choices) {
    if (m == name) return value;
    names += (names.empty() ? "" : ", ") + std::string(name);
  }
  bad_value(var, raw, "one of " + names);
}

TransportKind parse_transport(const char* var, const std::string& raw, const std::string& name) {
  const std::string n = lower(trim(name));
  if (n == "ipc") return TransportKind::Ipc;
  if (n == "shm") return TransportKind::Shm;
  if (n == "mpi") return TransportKind::Mpi;
  bad_value(var, raw, "a comma-separated list of transports from: ipc, shm, mpi");
}

}  // namespace

Options Options::parse(const std::function<const char*(const char*)>& lookup) {
  Options o;
  auto get = [&](const char* var) -> const char* {
    const char* v = lookup(var);
    return (v != nullptr && v[0] != '\0') ? v : nullptr;
  };
  if (const char* v = get("MESHMEM_TIMEOUT")) o.timeout = parse_duration("MESHMEM_TIMEOUT", v);
  if (const char* v = get("MESHMEM_SIMULATE_NODES"))
    o.simulate_nodes = parse_positive_int("MESHMEM_SIMULATE_NODES", v, 1 << 20);
  if (const char* v = get("MESHMEM_FD_PASSING"))
    o.fd_passing = parse_choice<FdPassing>("MESHMEM_FD_PASSING", v,
                                           {{"auto", FdPassing::Auto}, {"pidfd", FdPassing::Pidfd}, {"socket", FdPassing::Socket}});
  if (const char* v = get("MESHMEM_TRANSPORTS")) {
    o.transports.clear();
    std::stringstream ss(v);
    std::string item;
    while (std::getline(ss, item, ',')) {
      const TransportKind kind = parse_transport("MESHMEM_TRANSPORTS", v, item);
      for (TransportKind seen : o.transports)
        if (seen == kind) bad_value("MESHMEM_TRANSPORTS", v, "each transport named once");
      o.transports.push_back(kind);
    }
    if (o.transports.empty()) bad_value("MESHMEM_TRANSPORTS", v, "at least one transport");
  }
  if (const char* v = get("MESHMEM_SM_COPY_MAX")) o.sm_copy_max = parse_bytes("MESHMEM_SM_COPY_MAX", v);
  if (const char* v = get("MESHMEM_FUSED_SIGNAL_MAX")) o.fused_signal_max = parse_bytes("MESHMEM_FUSED_SIGNAL_MAX", v);
  if (const char* v = get("MESHMEM_BARRIER"))
    o.barrier = parse_choice<Barrier>("MESHMEM_BARRIER", v,
                                      {{"auto", Barrier::Auto}, {"flag", Barrier::Flag}, {"kernel", Barrier::Kernel}, {"event", Barrier::Event}});
  if (const char* v = get("MESHMEM_STREAM_WAIT"))
    o.stream_wait = parse_choice<StreamWait>("MESHMEM_STREAM_WAIT", v,
                                             {{"auto", StreamWait::Auto}, {"memop", StreamWait::Memop}, {"kernel", StreamWait::Kernel}});
  if (const char* v = get("MESHMEM_LOG_LEVEL"))
    o.log_level = parse_choice<LogLevel>("MESHMEM_LOG_LEVEL", v,
                                         {{"error", LogLevel::Error}, {"warn", LogLevel::Warn}, {"warning", LogLevel::Warn},
                                          {"info", LogLevel::Info}, {"debug", LogLevel::Debug}});
  return o;
}

Options Options::from_environment() {
  return parse([](const char* var) { return std::getenv(var); });
}

namespace {
std::string transport_list(const std::vector<TransportKind>& kinds) {
  std::string s;
  for (TransportKind k : kinds) s += (s.empty() ? "" : ",") + std::string(to_string(k));
  return s;
}
const char* barrier_text(Options::Barrier b) {
  switch (b) {
    case Options::Barrier::Auto: return "auto";
    case Options::Barrier::Flag: return "flag";
    case Options::Barrier::Kernel: return "kernel";
    case Options::Barrier::Event: return "event";
  }
  return "?";
}
const char* wait_text(Options::StreamWait w) {
  return w == Options::StreamWait::Auto ? "auto" : w == Options::StreamWait::Memop ? "memop" : "kernel";
}
std::string timeout_text(std::chrono::milliseconds t) {
  if (t.count() == 0) return "inf";
  return std::to_string(t.count()) + "ms";
}
}  // namespace

std::vector<std::string> Options::describe() const {
  return {
      "MESHMEM_TIMEOUT=" + timeout_text(timeout) + " (longest host-side wait; inf = forever)",
      "MESHMEM_SIMULATE_NODES=" + std::to_string(simulate_nodes) +
          " (each real node split into this many simulated nodes)",
      std::string("MESHMEM_FD_PASSING=") + to_string(fd_passing) +
          " (how descriptors move between ranks of a node: auto, pidfd, socket)",
      "MESHMEM_TRANSPORTS=" + transport_list(transports) + " (allowed transports, in the order tried)",
      "MESHMEM_SM_COPY_MAX=" + std::to_string(sm_copy_max) +
          " (device puts/gets up to this size run on the SMs, larger on the copy engine)",
      "MESHMEM_FUSED_SIGNAL_MAX=" + std::to_string(fused_signal_max) +
          " (device put_signal up to this size: one copy+signal kernel)",
      std::string("MESHMEM_BARRIER=") + barrier_text(barrier) +
          " (barrier(stream) on one node: flag = stream memory operations, kernel = one-block polling kernel, "
          "event = host meeting + IPC events of busy streams; auto = host meeting, then nothing if every stream is "
          "idle, else kernel (flag where ranks share a GPU))",
      std::string("MESHMEM_STREAM_WAIT=") + wait_text(stream_wait) +
          " (wait_until(stream): memop = stream wait operation, kernel = polling kernel; auto = kernel unless ranks share the GPU)",
      std::string("MESHMEM_LOG_LEVEL=") + to_string(log_level) + " (error, warn, info, debug)",
  };
}

std::string Options::fingerprint() const {
  // The log level may differ between ranks; everything else changes what ranks agree on.
  return "timeout=" + timeout_text(timeout) + ";nodes=" + std::to_string(simulate_nodes) +
         ";fd=" + to_string(fd_passing) + ";transports=" + transport_list(transports) +
         ";sm_copy_max=" + std::to_string(sm_copy_max) + ";fused=" + std::to_string(fused_signal_max) +
         ";barrier=" + barrier_text(barrier) + ";wait=" + wait_text(stream_wait);
}

}  // namespace meshmem
