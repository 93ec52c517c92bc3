// What stream_path_lab needs beside its measurements: owners of the streams and events, of
// the VMM allocation this rank exports, of the peer's allocation imported here and of the
// node-shared pinned slots; a descriptor taken from the peer (pidfd_getfd, or SCM_RIGHTS over
// an abstract Unix socket where ptrace is refused); the random data every row is checked
// against; and the busy load (1 ms kernels back to back on a stream of their own). CUDA,
// the driver and MPI only: no meshmem.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <fcntl.h>
#include <mpi.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <utility>

#include "bench_check.hpp"

namespace spl {

// A system call's result, or the job ended naming the call, the rank and errno.
inline long sys_checked(long rc, const char* call, const char* file, int line) {
  if (rc < 0) bench::fail(call, std::strerror(errno), file, line);
  return rc;
}
#define SY(call) spl::sys_checked(static_cast<long>(call), #call, __FILE__, __LINE__)

// Teardown: says what failed and goes on (a destructor never ends the job).
inline void warn_cu(CUresult rc, const char* call) {
  if (rc != CUDA_SUCCESS) std::fprintf(stderr, "rank %d: %s failed at teardown: CUresult %d\n", bench::check_rank(), call, rc);
}
inline void warn_rt(cudaError_t rc, const char* call) {
  if (rc != cudaSuccess)
    std::fprintf(stderr, "rank %d: %s failed at teardown: %s\n", bench::check_rank(), call, cudaGetErrorString(rc));
}

inline double now_us() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

class Fd {
 public:
  explicit Fd(int fd = -1) noexcept : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

// Makes `device` current for the scope, the previous device current again after it.
class OnDevice {
 public:
  explicit OnDevice(int device) {
    CK(cudaGetDevice(&previous_));
    if (device != previous_) CK(cudaSetDevice(device));
  }
  ~OnDevice() { warn_rt(cudaSetDevice(previous_), "cudaSetDevice (restore)"); }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;

 private:
  int previous_ = 0;
};

// A non-blocking stream of `device` (made with that device current).
class Stream {
 public:
  Stream() = default;
  explicit Stream(int device) {
    OnDevice on(device);
    CK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking));
  }
  Stream(Stream&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
  Stream& operator=(Stream&& o) noexcept {
    std::swap(s_, o.s_);
    return *this;
  }
  ~Stream() {
    if (s_ != nullptr) warn_rt(cudaStreamDestroy(s_), "cudaStreamDestroy");
  }
  operator cudaStream_t() const noexcept { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// An event of `device` (an event is recorded only on streams of its device; any stream may wait on it).
class Event {
 public:
  Event() = default;
  explicit Event(int device, unsigned flags = cudaEventDisableTiming) {
    OnDevice on(device);
    CK(cudaEventCreateWithFlags(&e_, flags));
  }
  Event(Event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  Event& operator=(Event&& o) noexcept {
    std::swap(e_, o.e_);
    return *this;
  }
  ~Event() {
    if (e_ != nullptr) warn_rt(cudaEventDestroy(e_), "cudaEventDestroy");
  }
  operator cudaEvent_t() const noexcept { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

// Device memory of this process's GPU.
class DeviceBuffer {
 public:
  DeviceBuffer(int device, std::size_t bytes) {
    OnDevice on(device);
    CK(cudaMalloc(&p_, bytes));
  }
  ~DeviceBuffer() { warn_rt(cudaFree(p_), "cudaFree"); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  std::uint8_t* get() const noexcept { return static_cast<std::uint8_t*>(p_); }

 private:
  void* p_ = nullptr;
};

inline CUmemAccessDesc read_write_for(int device) {
  CUmemAccessDesc a{};
  a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a.location.id = device;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return a;
}

// A VMM mapping of `size` bytes of `handle` for `device`: reserved, mapped, made accessible;
// unmapped, freed and released at the end.
class VmmMapping {
 public:
  VmmMapping(CUmemGenericAllocationHandle handle, std::size_t size, int device) : handle_(handle), size_(size) {
    CU(cuMemAddressReserve(&ptr_, size_, 0, 0, 0));
    CU(cuMemMap(ptr_, size_, 0, handle_, 0));
    const CUmemAccessDesc access = read_write_for(device);
    CU(cuMemSetAccess(ptr_, size_, &access, 1));
  }
  ~VmmMapping() {
    warn_cu(cuMemUnmap(ptr_, size_), "cuMemUnmap");
    warn_cu(cuMemAddressFree(ptr_, size_), "cuMemAddressFree");
    warn_cu(cuMemRelease(handle_), "cuMemRelease");
  }
  VmmMapping(const VmmMapping&) = delete;
  VmmMapping& operator=(const VmmMapping&) = delete;
  std::uint8_t* get() const noexcept { return reinterpret_cast<std::uint8_t*>(ptr_); }
  std::size_t size() const noexcept { return size_; }
  CUmemGenericAllocationHandle handle() const noexcept { return handle_; }

 private:
  CUmemGenericAllocationHandle handle_;
  std::size_t size_;
  CUdeviceptr ptr_ = 0;
};

// Device memory of `device` made with cuMemCreate, exportable as a POSIX descriptor, at least
// `bytes` (rounded up to the recommended granularity). A context must be current.
inline CUmemGenericAllocationHandle vmm_create(std::size_t* bytes, int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  std::size_t granularity = 0;
  CU(cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  *bytes = (*bytes + granularity - 1) / granularity * granularity;
  CUmemGenericAllocationHandle handle = 0;
  CU(cuMemCreate(&handle, *bytes, &prop, 0));
  return handle;
}

inline Fd vmm_export(CUmemGenericAllocationHandle handle) {
  int fd = -1;
  CU(cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  return Fd(fd);
}

inline CUmemGenericAllocationHandle vmm_import(const Fd& fd) {
  CUmemGenericAllocationHandle handle = 0;
  CU(cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<std::intptr_t>(fd.get())),
                                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  return handle;
}

// Host memory shared by the node's processes (shm_open + mmap), pinned for every GPU of this
// process (cudaHostRegisterPortable): the node pool's slots. The creator names it; the name is
// unlinked once both have it open (unlink_name).
class SharedPinned {
 public:
  SharedPinned(const std::string& name, std::size_t bytes, bool create) : name_(name), bytes_(bytes) {
    Fd fd(static_cast<int>(SY(shm_open(name.c_str(), create ? O_CREAT | O_EXCL | O_RDWR : O_RDWR, 0600))));
    if (create) SY(ftruncate(fd.get(), static_cast<off_t>(bytes)));
    p_ = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (p_ == MAP_FAILED) bench::fail("mmap (shared slots)", std::strerror(errno), __FILE__, __LINE__);
    CK(cudaHostRegister(p_, bytes, cudaHostRegisterPortable));
  }
  ~SharedPinned() {
    warn_rt(cudaHostUnregister(p_), "cudaHostUnregister");
    if (::munmap(p_, bytes_) != 0) std::fprintf(stderr, "rank %d: munmap: %s\n", bench::check_rank(), std::strerror(errno));
  }
  SharedPinned(const SharedPinned&) = delete;
  SharedPinned& operator=(const SharedPinned&) = delete;
  void unlink_name() const { SY(shm_unlink(name_.c_str())); }
  std::uint8_t* get() const noexcept { return static_cast<std::uint8_t*>(p_); }

 private:
  std::string name_;
  std::size_t bytes_;
  void* p_ = nullptr;
};

// Descriptor `remote_fd` of process `pid`, duplicated here (pidfd_getfd: the kernel allows it
// where this process may ptrace that one); empty, with errno in *err, where refused.
inline Fd try_fetch_fd(pid_t pid, int remote_fd, int* err) {
  Fd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
  if (!pidfd) {
    *err = errno;
    return Fd();
  }
  Fd fd(static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd.get(), remote_fd, 0)));
  if (!fd) *err = errno;
  return fd;
}

inline sockaddr_un abstract_address(pid_t pid, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const std::string name = "meshmem-stream-path-lab-" + std::to_string(pid);
  std::memcpy(a.sun_path + 1, name.data(), name.size());  // sun_path[0] == 0: the abstract namespace
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return a;
}

// The peer's descriptor `their_fd` (process `their_pid`) here, and ours there: pidfd_getfd where
// both ranks may use it, else SCM_RIGHTS over abstract Unix sockets (rank 0 sends first).
inline Fd exchange_fd(int rank, const Fd& mine, pid_t their_pid, int their_fd) {
  int err = 0;
  Fd got = try_fetch_fd(their_pid, their_fd, &err);
  int ok = got ? 1 : 0, both = 0;
  MK(MPI_Allreduce(&ok, &both, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
  if (both) return got;
  got.reset();
  if (!ok) std::printf("# rank %d: pidfd_getfd refused (%s); descriptors go over a Unix socket\n", rank, std::strerror(err));
  socklen_t len = 0;
  sockaddr_un me = abstract_address(getpid(), &len);
  Fd listener(static_cast<int>(SY(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0))));
  SY(::bind(listener.get(), reinterpret_cast<sockaddr*>(&me), len));
  SY(::listen(listener.get(), 1));
  MK(MPI_Barrier(MPI_COMM_WORLD));  // both listen: a connect is queued until accepted
  for (int sender = 0; sender < 2; ++sender) {
    if (rank == sender) {
      Fd conn(static_cast<int>(SY(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC))));
      ucred cred{};
      socklen_t cl = sizeof(cred);
      SY(::getsockopt(conn.get(), SOL_SOCKET, SO_PEERCRED, &cred, &cl));
      if (cred.pid != their_pid) bench::fail("accept (fd socket)", "connected by another process", __FILE__, __LINE__);
      char byte = 0;
      iovec iov{&byte, 1};
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      const int fd = mine.get();
      std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
      SY(::sendmsg(conn.get(), &msg, MSG_NOSIGNAL));
    } else {
      socklen_t tl = 0;
      sockaddr_un them = abstract_address(their_pid, &tl);
      Fd conn(static_cast<int>(SY(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0))));
      SY(::connect(conn.get(), reinterpret_cast<sockaddr*>(&them), tl));
      char byte = 0;
      iovec iov{&byte, 1};
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      SY(::recvmsg(conn.get(), &msg, MSG_CMSG_CLOEXEC));
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      if (c == nullptr || c->cmsg_type != SCM_RIGHTS) bench::fail("recvmsg (fd socket)", "no descriptor came", __FILE__, __LINE__);
      int fd = -1;
      std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
      got = Fd(fd);
    }
  }
  return got;
}

// Random bytes that both ranks can make from the seed alone (splitmix64 per 8-byte word).
inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
inline void fill_random(std::uint8_t* out, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = 0; i < n; i += 8) {
    const std::uint64_t w = mix(seed ^ mix(i));
    std::memcpy(out + i, &w, std::min<std::size_t>(8, n - i));
  }
}

__device__ __forceinline__ std::uint64_t global_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins for `ns` of GPU time; the first block says it started.
__global__ void busy_kernel(std::uint64_t ns, volatile int* started) {
  if (blockIdx.x == 0 && threadIdx.x == 0) *started = 1;
  const std::uint64_t t0 = global_ns();
  while (global_ns() - t0 < ns) {
  }
}

// The target process's own work: kernels of `ns` each, `blocks` x `threads`, back to back on
// a stream of its own from a thread of its own (at most two queued, so that stop() ends it
// within one kernel), from start() until stop().
class BusyLoad {
 public:
  BusyLoad(int device, int blocks, int threads, std::uint64_t ns)
      : device_(device), blocks_(blocks), threads_(threads), ns_(ns), stream_(device) {
    for (auto& e : done_) e = Event(device, cudaEventDisableTiming | cudaEventBlockingSync);
    void* p = nullptr;
    CK(cudaHostAlloc(&p, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
    started_ = static_cast<volatile int*>(p);
  }
  ~BusyLoad() {
    stop();
    warn_rt(cudaFreeHost(const_cast<int*>(started_)), "cudaFreeHost");
  }
  BusyLoad(const BusyLoad&) = delete;
  BusyLoad& operator=(const BusyLoad&) = delete;

  // Returns once the first kernel runs.
  void start() {
    *started_ = 0;
    stop_.store(false, std::memory_order_relaxed);
    thread_ = std::thread([this] { loop(); });
    const double give_up = now_us() + 10e6;
    while (*started_ == 0)
      if (now_us() > give_up) bench::fail("BusyLoad::start", "the busy kernel did not start in 10 s", __FILE__, __LINE__);
  }
  void stop() {
    if (!thread_.joinable()) return;
    stop_.store(true, std::memory_order_release);
    thread_.join();
  }

 private:
  void loop() {
    CK(cudaSetDevice(device_));
    for (unsigned k = 0; !stop_.load(std::memory_order_acquire); ++k) {
      busy_kernel<<<blocks_, threads_, 0, stream_>>>(ns_, started_);
      CK(cudaGetLastError());
      CK(cudaEventRecord(done_[k & 1], stream_));
      CK(cudaEventSynchronize(done_[(k + 1) & 1]));  // the one before (none yet: passes)
    }
    CK(cudaStreamSynchronize(stream_));
  }
  int device_, blocks_, threads_;
  std::uint64_t ns_;
  Stream stream_;
  Event done_[2];
  volatile int* started_ = nullptr;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace spl
