#include "meshmem/ipc/shared_memory.hpp"

#include <errno.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "meshmem/error.hpp"

namespace meshmem::ipc {
namespace {

[[noreturn]] void throw_system(const std::string& what, int err) {
  throw Error(ErrorCode::System, what + ": " + std::strerror(err));
}

std::size_t page_size() {
  static const long page = ::sysconf(_SC_PAGESIZE);
  // Cannot fail on Linux; checked so a broken libc gives a clear error, not a division by 0.
  if (page <= 0) throw Error(ErrorCode::Internal, "sysconf(_SC_PAGESIZE) returned no page size");
  return static_cast<std::size_t>(page);
}

}  // namespace

std::size_t round_to_pages(std::size_t bytes) {
  const std::size_t page = page_size();
  if (bytes == 0) return page;
  if (bytes > std::numeric_limits<std::size_t>::max() - (page - 1)) {
    throw Error(ErrorCode::InvalidArgument,
                "size of " + std::to_string(bytes) + " bytes overflows when rounded up to pages");
  }
  return (bytes + page - 1) / page * page;
}

MappedRegion::MappedRegion(MappedRegion&& other) noexcept
    : addr_(std::exchange(other.addr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

MappedRegion& MappedRegion::operator=(MappedRegion&& other) noexcept {
  if (this != &other) {
    MappedRegion old(std::move(*this));  // unmapped when `old` goes out of scope
    addr_ = std::exchange(other.addr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

MappedRegion::~MappedRegion() {
  // munmap only fails for arguments we never produce; a destructor cannot report it anyway.
  if (addr_ != nullptr) (void)::munmap(addr_, bytes_);
}

SharedMemory SharedMemory::create(std::size_t bytes, const char* debug_name) {
  const std::size_t size = round_to_pages(bytes);
  if (size > static_cast<std::uint64_t>(std::numeric_limits<off_t>::max())) {
    throw Error(ErrorCode::InvalidArgument,
                "shared memory of " + std::to_string(size) + " bytes is larger than a file can be");
  }
  const char* name = (debug_name != nullptr && debug_name[0] != '\0') ? debug_name : "meshmem";

  SharedMemory shm;
  // MFD_CLOEXEC: the memory is handed to peers explicitly, never leaked into exec'd programs.
  const int fd = ::memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) throw_system(std::string("memfd_create(\"") + name + "\")", errno);
  shm.fd_.reset(fd);

  // A fresh memfd reads as zeros, so the pages need no clearing.
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    throw_system(std::string("ftruncate of memfd \"") + name + "\" to " + std::to_string(size) +
                     " bytes",
                 errno);
  }
  // MAP_POPULATE: fault the pages in now, not in the first put (which measured 10-20x
  // slower than later ones without it).
  void* addr = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (addr == MAP_FAILED) {
    throw_system(std::string("mmap of memfd \"") + name + "\" (" + std::to_string(size) +
                     " bytes)",
                 errno);
  }
  shm.mapping_ = MappedRegion(addr, size);
  return shm;
}

MappedRegion map_shared(int fd, std::size_t bytes) {
  const std::size_t size = round_to_pages(bytes);
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw_system("fstat(fd " + std::to_string(fd) + ")", errno);
  // A peer's file that is shorter than promised would fault (SIGBUS) on first touch past
  // its end; refuse it here with a clear message instead.
  if (st.st_size < 0 || static_cast<std::uint64_t>(st.st_size) < size) {
    throw Error(ErrorCode::InvalidArgument,
                "map_shared(fd " + std::to_string(fd) + "): the file holds " +
                    std::to_string(st.st_size) + " bytes, fewer than the " + std::to_string(size) +
                    " to map (" + std::to_string(bytes) + " requested, rounded up to pages)");
  }
  // MAP_POPULATE: fault the pages in now, not in the first put (which measured 10-20x
  // slower than later ones without it).
  void* addr = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (addr == MAP_FAILED) {
    throw_system("mmap(fd " + std::to_string(fd) + ", " + std::to_string(size) + " bytes)", errno);
  }
  return MappedRegion(addr, size);
}

}  // namespace meshmem::ipc
