// Taking a descriptor out of another process with pidfd_open + pidfd_getfd (Linux >= 5.6).
// The kernel allows it only where this process may ptrace the other (same user, and Yama
// permitting); otherwise the FdChannel socket path is used. And ProcessWatch: whether a
// process of this machine has ended.
#pragma once

#include <sys/types.h>

#include "meshmem/ipc/unique_fd.hpp"

namespace meshmem::ipc {

// Duplicates descriptor `remote_fd` of process `pid` into this process.
// Raises Error(System) naming the pid, the fd and errno (EPERM where ptrace is refused).
UniqueFd fetch_fd(pid_t pid, int remote_fd);

// The same, without raising: returns an empty UniqueFd and sets `*err` to errno on failure.
UniqueFd try_fetch_fd(pid_t pid, int remote_fd, int* err) noexcept;

// Whether process `pid` has ended, through a pidfd (Linux >= 5.3) opened when the watch is
// made: the descriptor stands for that process, so a process id reused later is never taken
// for it. Made while the process lives; where pidfd_open fails (no such process, an older
// kernel, a seccomp filter) the watch knows nothing and ended() stays false. Move-only.
class ProcessWatch {
 public:
  ProcessWatch() = default;
  explicit ProcessWatch(pid_t pid) noexcept;
  bool watching() const noexcept { return static_cast<bool>(fd_); }
  // The process has exited (it is a zombie or gone): a poll of the pidfd, without waiting.
  bool ended() const noexcept;
  pid_t pid() const noexcept { return pid_; }

 private:
  UniqueFd fd_;
  pid_t pid_ = -1;
};

}  // namespace meshmem::ipc
