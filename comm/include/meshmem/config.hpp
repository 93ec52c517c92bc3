// Options read from the MESHMEM_* environment variables (docs/configuration.md lists them all;
// parsed through the knob table of comm/src/knobs.hpp). CUDA-free and MPI-free.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace meshmem {

enum class TransportKind {
  None,  // no transport reaches the peer
  Ipc,   // same node, device memory: the peer's VMM allocation is mapped here
  Staged,  // same node, device memory without peer access: staged through pinned host memory
  Shm,   // same node, host memory: the peer's memfd is mapped here
  Mpi,   // any node: requests served by the target's progress thread over MPI
  Nccl,  // other nodes, device memory: NCCL transfers driven by each rank's proxy thread
  MpiDevice,  // other nodes, device memory: MPI messages through pinned host memory, same proxy
};
const char* to_string(TransportKind kind) noexcept;

enum class FdPassing {
  Auto,    // pidfd_getfd where every node peer permits it, else Socket
  Pidfd,   // pidfd_open + pidfd_getfd (needs ptrace permission over the peer)
  Socket,  // SCM_RIGHTS over a Unix socket in a directory of mode 0700, SO_PEERCRED checked
};
const char* to_string(FdPassing mode) noexcept;

enum class LogLevel { Error, Warn, Info, Debug };
const char* to_string(LogLevel level) noexcept;

namespace detail {
template <class T>
class TuningKnob;
}

// What a program may set. Every field is also a MESHMEM_* variable (docs/configuration.md;
// `meshmem-info --all` prints them all). Transports have tuning knobs of their own (copy-kernel
// thresholds, barrier variants, ...): set them with set(), by their variable's name.
struct Options {
  // MESHMEM_TIMEOUT: how long a wait may take. "0" or "inf": forever.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // MESHMEM_SIMULATE_NODES: split each real node into this many simulated nodes.
  int simulate_nodes = 1;
  // MESHMEM_FD_PASSING
  FdPassing fd_passing = FdPassing::Auto;
  // MESHMEM_TRANSPORTS: the transports allowed, in the order tried.
  std::vector<TransportKind> transports{TransportKind::Ipc, TransportKind::Staged, TransportKind::Nccl,
                                       TransportKind::MpiDevice, TransportKind::Shm, TransportKind::Mpi};
  // MESHMEM_LOG_LEVEL
  LogLevel log_level = LogLevel::Warn;

  bool waits_forever() const { return timeout.count() == 0; }

  // Sets any MESHMEM_* variable as if it were in the environment (the fields above
  // included; an old name too, with a notice); raises Error(InvalidArgument) for an unknown
  // name or an invalid value.
  void set(const std::string& variable, const std::string& value);
  // The transports' knobs set so far (by set() or parse()), by name, canonical values.
  const std::map<std::string, std::string>& tuning() const { return tuning_; }

  // Parses every known MESHMEM_* variable (and the old names of renamed ones) from a
  // getenv-like lookup; an unparsable value raises Error(InvalidArgument) naming the variable
  // and the value. from_environment also notes MESHMEM_* variables that are no setting.
  static Options parse(const std::function<const char*(const char*)>& lookup);
  static Options from_environment();

  // What reading the settings found that the user should hear of: old names, MESHMEM_*
  // variables that are no setting (with the nearest one), settings this program does not use.
  // A Comm logs them once per process, on rank 0, with the ranks they came from.
  const std::vector<std::string>& notices() const { return notices_; }

  // One line per variable, "NAME=value (meaning)", for the diagnostics tool and logs.
  std::vector<std::string> describe() const;
  // Every setting with its value and where it came from, for meshmem-info and docs.
  struct Setting {
    std::string name;
    std::string old_name;       // the name before a rename, still read ("" if none)
    std::string value;          // canonical text
    std::string default_value;
    std::string tier;           // "user", "tuning" or "testing"
    std::string source;         // "default", "env", "env (old name X)", "set", "program"
    std::string doc;            // one line
    std::string details;        // the longer explanation ("" if none)
    bool used = true;           // false: read by the GPU part, which this program lacks
    bool must_agree = true;     // every rank must have the same value
  };
  std::vector<Setting> settings() const;
  // A canonical string of every setting the ranks must agree on, compared at Comm creation.
  std::string fingerprint() const;

 private:
  template <class T>
  friend class detail::TuningKnob;
  std::map<std::string, std::string> tuning_;
  std::map<std::string, std::string> sources_;  // by name, where not the default
  std::vector<std::string> notices_;
};

}  // namespace meshmem
