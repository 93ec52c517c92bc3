// Options read from the MESHMEM_* environment variables (documented in README.md).
// CUDA-free and MPI-free so that parsing is unit-testable anywhere.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

namespace meshmem {

enum class TransportKind {
  None,  // no transport reaches the peer
  Ipc,   // same node, device memory: the peer's VMM allocation is mapped here
  Shm,   // same node, host memory: the peer's memfd is mapped here
  Mpi,   // any node: requests served by the target's progress thread over MPI
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

struct Options {
  // MESHMEM_TIMEOUT: how long a host-side wait may take. "0" or "inf": forever.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // MESHMEM_SIMULATE_NODES: split each real node into this many simulated nodes.
  int simulate_nodes = 1;
  // MESHMEM_FD_PASSING
  FdPassing fd_passing = FdPassing::Auto;
  // MESHMEM_TRANSPORTS: the transports allowed, in the order they are tried.
  std::vector<TransportKind> transports{TransportKind::Ipc, TransportKind::Shm, TransportKind::Mpi};
  // MESHMEM_SM_COPY_MAX: device puts/gets up to this many bytes run as a copy kernel on the
  // SMs, larger ones on the copy engine. 0 (measured fastest on H200, bench/results): always
  // the copy engine.
  std::size_t sm_copy_max = 0;
  // MESHMEM_FUSED_SIGNAL_MAX: a device put_signal up to this many bytes is one kernel that
  // copies and then signals; larger ones are a copy-engine copy followed by a stream write.
  std::size_t fused_signal_max = 8192;
  // MESHMEM_BARRIER: how barrier(stream) synchronises the ranks of a node: flag words
  // through stream memory operations, a one-block kernel polling the same flags (neither
  // involves the host), or IPC events after a host meeting. Auto: a host meeting through
  // shared memory, where ranks whose stream is idle need nothing more; if any stream has
  // work, the kernel barrier, or flag where two ranks of a node share a GPU (a polling
  // kernel would hold a time-sliced GPU from the ranks it waits for).
  enum class Barrier { Auto, Flag, Kernel, Event } barrier = Barrier::Auto;
  // MESHMEM_STREAM_WAIT: how wait_until(stream) waits: stream memory operations (the GPU's
  // front end polls, no SM is held) or a one-thread polling kernel (lower latency). Auto:
  // kernel where this rank's GPU is its own, memop otherwise.
  enum class StreamWait { Auto, Memop, Kernel } stream_wait = StreamWait::Auto;
  // MESHMEM_LOG_LEVEL
  LogLevel log_level = LogLevel::Warn;

  bool waits_forever() const { return timeout.count() == 0; }

  // Parses from a getenv-like lookup; an unparsable value raises Error(InvalidArgument)
  // naming the variable and the value.
  static Options parse(const std::function<const char*(const char*)>& lookup);
  static Options from_environment();

  // One line per variable, "NAME=value (meaning)", for the diagnostics tool and logs.
  std::vector<std::string> describe() const;
  // A canonical string of every setting, compared across ranks at Comm creation.
  std::string fingerprint() const;
};

}  // namespace meshmem
