// What the ipc/ unit tests share (test_ipc.cpp, test_fd_channel.cpp): descriptor checks,
// pipes, a forked child that reports through its exit status, byte patterns, whole reads
// and writes, and a private socket name.
#pragma once

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "meshmem/error.hpp"
#include "meshmem/ipc/fd_channel.hpp"
#include "meshmem/ipc/pidfd.hpp"
#include "meshmem/ipc/shared_memory.hpp"
#include "meshmem/ipc/unique_fd.hpp"

namespace meshmem::test::ipc_support {

using meshmem::Error;
using meshmem::ErrorCode;
using meshmem::ipc::FdListener;
using meshmem::ipc::FdMessage;
using meshmem::ipc::MappedRegion;
using meshmem::ipc::SharedMemory;
using meshmem::ipc::UniqueFd;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

inline bool is_closed(int fd) { return ::fcntl(fd, F_GETFD) == -1 && errno == EBADF; }

inline bool is_cloexec(int fd) {
  const int flags = ::fcntl(fd, F_GETFD);
  return flags >= 0 && (flags & FD_CLOEXEC) != 0;
}

struct Pipe {
  UniqueFd read;
  UniqueFd write;
};

inline Pipe make_pipe(int flags = O_CLOEXEC) {
  int fds[2];
  if (::pipe2(fds, flags) != 0) throw std::runtime_error(std::string("pipe2: ") + strerror(errno));
  return Pipe{UniqueFd(fds[0]), UniqueFd(fds[1])};
}

// True when every write end of the pipe is closed: a non-blocking read sees EOF, whereas
// any remaining writer (say, a leaked copy in this process) makes it fail with EAGAIN.
inline bool writers_gone(int read_fd) {
  const int flags = ::fcntl(read_fd, F_GETFL);
  if (flags < 0 || ::fcntl(read_fd, F_SETFL, flags | O_NONBLOCK) != 0) return false;
  char c;
  const ssize_t r = ::read(read_fd, &c, 1);
  return r == 0;
}

inline int count_open_fds() {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int n = 0;
  while (const dirent* e = ::readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(dir);
  return n;  // includes the directory's own descriptor, the same in every call
}

// A socket path in a directory only this user may enter, made once for the test process.
inline std::string socket_name() {
  static meshmem::ipc::PrivateDir dir;
  return dir.path() + "/s-" + meshmem::ipc::random_token().substr(0, 12);
}

// A forked child running `body`; its return value is the exit status. If the test leaves
// early (a failed ASSERT), the destructor kills and reaps the child.
class Child {
 public:
  explicit Child(const std::function<int()>& body) {
    std::fflush(nullptr);  // do not let the child flush the parent's buffered output again
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error(std::string("fork: ") + strerror(errno));
    if (pid_ == 0) {
      int code = 120;
      try {
        code = body();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "child %d: exception: %s\n", static_cast<int>(::getpid()), e.what());
        code = 121;
      } catch (...) {
        code = 122;
      }
      std::fflush(nullptr);
      ::_exit(code);  // never run gtest's (the parent's) atexit handlers or return into it
    }
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      wait();
    }
  }

  pid_t pid() const { return pid_; }

  // Exit status, or 128 + signal number; -1 if waitpid fails.
  int wait() {
    int status = 0;
    pid_t r;
    do {
      r = ::waitpid(pid_, &status, 0);
    } while (r < 0 && errno == EINTR);
    pid_ = -1;
    if (r < 0) return -1;
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    return -1;
  }

 private:
  pid_t pid_ = -1;
};

// For children: report why they fail on stderr, return the code.
inline int child_fail(int code, const std::string& why) {
  std::fprintf(stderr, "child %d: %s\n", static_cast<int>(::getpid()), why.c_str());
  return code;
}

inline std::uint8_t pattern_byte(std::size_t i, unsigned seed) {
  return static_cast<std::uint8_t>((i * 131 + seed * 7 + (i >> 9)) & 0xff);
}

inline void fill_pattern(void* p, std::size_t n, unsigned seed) {
  auto* b = static_cast<std::uint8_t*>(p);
  for (std::size_t i = 0; i < n; ++i) b[i] = pattern_byte(i, seed);
}

// Index of the first byte that differs from the pattern, or n.
inline std::size_t check_pattern(const void* p, std::size_t n, unsigned seed) {
  const auto* b = static_cast<const std::uint8_t*>(p);
  for (std::size_t i = 0; i < n; ++i) {
    if (b[i] != pattern_byte(i, seed)) return i;
  }
  return n;
}

inline bool write_all(int fd, const void* data, std::size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t r = ::write(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

inline bool read_all(int fd, void* data, std::size_t n) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

inline const auto accept_all = [](const FdMessage&) { return true; };


}  // namespace meshmem::test::ipc_support
