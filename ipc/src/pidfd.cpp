#include "meshmem/ipc/pidfd.hpp"

#include <errno.h>
#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "meshmem/error.hpp"

// Older libc headers lack the numbers; they are the same on every architecture.
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

namespace meshmem::ipc {
namespace {

enum class Step { None, Open, GetFd };

// Both calls return close-on-exec descriptors: pidfd_open always, pidfd_getfd by definition
// (the kernel sets O_CLOEXEC on the new descriptor; its flags argument must be zero).
UniqueFd fetch(pid_t pid, int remote_fd, Step* failed, int* err) noexcept {
  const long pidfd = ::syscall(SYS_pidfd_open, pid, 0);
  if (pidfd < 0) {
    *failed = Step::Open;
    *err = errno;
    return UniqueFd();
  }
  UniqueFd pidfd_owner(static_cast<int>(pidfd));
  const long fd = ::syscall(SYS_pidfd_getfd, pidfd_owner.get(), remote_fd, 0);
  if (fd < 0) {
    *failed = Step::GetFd;
    *err = errno;
    return UniqueFd();
  }
  *failed = Step::None;
  *err = 0;
  return UniqueFd(static_cast<int>(fd));
}

// What the user can do about the errors that mean "not possible here".
const char* hint(int err) {
  switch (err) {
    case EPERM: return " (ptrace permission refused; set MESHMEM_FD_PASSING=socket)";
    case ENOSYS: return " (the kernel lacks pidfd_getfd, Linux >= 5.6; set MESHMEM_FD_PASSING=socket)";
    default: return "";
  }
}

}  // namespace

UniqueFd fetch_fd(pid_t pid, int remote_fd) {
  Step failed = Step::None;
  int err = 0;
  UniqueFd fd = fetch(pid, remote_fd, &failed, &err);
  if (failed == Step::Open) {
    throw Error(ErrorCode::System, "pidfd_open(pid " + std::to_string(pid) +
                                       ") to fetch its fd " + std::to_string(remote_fd) + ": " +
                                       std::strerror(err) + hint(err));
  }
  if (failed == Step::GetFd) {
    throw Error(ErrorCode::System, "pidfd_getfd(pid " + std::to_string(pid) + ", fd " +
                                       std::to_string(remote_fd) + "): " + std::strerror(err) +
                                       hint(err));
  }
  return fd;
}

UniqueFd try_fetch_fd(pid_t pid, int remote_fd, int* err) noexcept {
  Step failed = Step::None;
  int local_err = 0;
  UniqueFd fd = fetch(pid, remote_fd, &failed, &local_err);
  if (err != nullptr) *err = local_err;
  return fd;
}

ProcessWatch::ProcessWatch(pid_t pid) noexcept : pid_(pid) {
  const long fd = ::syscall(SYS_pidfd_open, pid, 0);
  if (fd >= 0) fd_ = UniqueFd(static_cast<int>(fd));
}

bool ProcessWatch::ended() const noexcept {
  if (!fd_) return false;
  pollfd p{fd_.get(), POLLIN, 0};
  int rc = 0;
  do {
    rc = ::poll(&p, 1, 0);
  } while (rc < 0 && errno == EINTR);
  return rc > 0 && (p.revents & POLLIN) != 0;
}

}  // namespace meshmem::ipc
