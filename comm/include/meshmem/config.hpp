// Options read from the MESHMEM_* environment variables (documented in docs/configuration.md, parsed
// through the knob table of comm/src/knobs.hpp). CUDA-free and MPI-free.
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
  Socket,  // SCM_RIGHTS over an abstract Unix socket, SO_PEERCRED checked
};
const char* to_string(FdPassing mode) noexcept;

enum class LogLevel { Error, Warn, Info, Debug };
const char* to_string(LogLevel level) noexcept;

namespace detail {
template <class T>
class TuningKnob;
}

// What a program may set. Every field is also a MESHMEM_* variable (docs/configuration.md;
// `meshmem-info` prints them all). Transports have tuning knobs of their own (copy-kernel
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
  // included); raises Error(InvalidArgument) for an unknown name or an invalid value.
  void set(const std::string& variable, const std::string& value);
  // The transports' knobs set so far (by set() or parse()), by name, canonical values.
  const std::map<std::string, std::string>& tuning() const { return tuning_; }

  // Parses every known MESHMEM_* variable from a getenv-like lookup; an unparsable value
  // raises Error(InvalidArgument) naming the variable and the value.
  static Options parse(const std::function<const char*(const char*)>& lookup);
  static Options from_environment();

  // One line per variable, "NAME=value (meaning)", for the diagnostics tool and logs.
  std::vector<std::string> describe() const;
  // A canonical string of every setting the ranks must agree on, compared at Comm creation.
  std::string fingerprint() const;

 private:
  template <class T>
  friend class detail::TuningKnob;
  std::map<std::string, std::string> tuning_;
};

}  // namespace meshmem
