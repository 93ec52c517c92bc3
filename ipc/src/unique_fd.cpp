#include "meshmem/ipc/unique_fd.hpp"

#include <errno.h>
#include <unistd.h>

namespace meshmem::ipc {

void UniqueFd::reset(int fd) noexcept {
  if (fd_ >= 0 && fd_ != fd) {
    // Destructors run on error paths between a failing call and the read of its errno:
    // keep errno as it was so a cleanup never changes the error that gets reported.
    const int saved_errno = errno;
    // On Linux the descriptor is released even when close() reports EINTR, so retrying
    // could close a descriptor another thread has just been given. Close exactly once;
    // there is nothing useful to do with an error from close here.
    (void)::close(fd_);
    errno = saved_errno;
  }
  fd_ = fd;
}

}  // namespace meshmem::ipc
