// Taking a descriptor out of another process with pidfd_open + pidfd_getfd (Linux >= 5.6).
// The kernel allows it only where this process may ptrace the other (same user, and Yama
// permitting); otherwise the FdChannel socket path is used.
#pragma once

#include <sys/types.h>

#include "meshmem/ipc/unique_fd.hpp"

namespace meshmem::ipc {

// Duplicates descriptor `remote_fd` of process `pid` into this process.
// Raises Error(System) naming the pid, the fd and errno (EPERM where ptrace is refused).
UniqueFd fetch_fd(pid_t pid, int remote_fd);

// The same, without raising: returns an empty UniqueFd and sets `*err` to errno on failure.
UniqueFd try_fetch_fd(pid_t pid, int remote_fd, int* err) noexcept;

}  // namespace meshmem::ipc
