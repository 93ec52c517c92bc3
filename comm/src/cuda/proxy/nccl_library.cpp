#define MESHMEM_DEFINING_GPU_PART
#include "cuda/proxy/nccl_library.hpp"

#include <dlfcn.h>

#include <cstddef>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "backoff.hpp"
#include "log.hpp"
#include "cuda/runtime/device_sync.hpp"
#include "meshmem/error.hpp"

// Where nccl.h is at hand (it is not needed to build), the config's layout is checked against
// NCCL's own: the fields meshmem sets must sit where NCCL reads them.
#if __has_include(<nccl.h>)
#include <nccl.h>
static_assert(offsetof(ncclConfig_t, magic) == offsetof(meshmem::detail::NcclConfig, magic) &&
                  offsetof(ncclConfig_t, version) == offsetof(meshmem::detail::NcclConfig, version) &&
                  offsetof(ncclConfig_t, blocking) == offsetof(meshmem::detail::NcclConfig, blocking) &&
                  offsetof(ncclConfig_t, netName) == offsetof(meshmem::detail::NcclConfig, net_name) &&
                  offsetof(ncclConfig_t, splitShare) == offsetof(meshmem::detail::NcclConfig, split_share),
              "NcclConfig no longer matches ncclConfig_t's first fields");
static_assert(NCCL_CONFIG_UNDEF_INT == -2147483647 - 1, "NCCL's 'undefined' config value changed");
static_assert(ncclInt8 == meshmem::detail::NcclLibrary::kInt8 && ncclUint64 == meshmem::detail::NcclLibrary::kUint64 &&
                  ncclSum == meshmem::detail::NcclLibrary::kSum,
              "NCCL's datatype or operation numbers changed");
#endif

namespace meshmem::detail {

namespace {

template <class F>
bool bind(void* handle, const char* name, F* out, std::string* why) {
  *out = reinterpret_cast<F>(dlsym(handle, name));
  if (*out == nullptr) *why = "it has no " + std::string(name) + " (meshmem needs NCCL 2.18 or later)";
  return *out != nullptr;
}

std::unique_ptr<NcclLibrary> load(const std::string& path, std::string* why) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* e = dlerror();
    *why = "cannot load " + path + " (" + (e ? e : "dlopen failed") +
           "); install NCCL or name it with MESHMEM_NCCL_LIBRARY";
    return nullptr;
  }
  auto lib = std::make_unique<NcclLibrary>();
  lib->path = path;
  int (*get_version)(int*) = nullptr;
  std::string missing;
  const bool ok = bind(handle, "ncclGetVersion", &get_version, &missing) &&
                  bind(handle, "ncclGetUniqueId", &lib->get_unique_id, &missing) &&
                  bind(handle, "ncclCommInitRankConfig", &lib->comm_init_rank_config, &missing) &&
                  bind(handle, "ncclCommSplit", &lib->comm_split, &missing) &&
                  bind(handle, "ncclCommDestroy", &lib->comm_destroy, &missing) &&
                  bind(handle, "ncclCommAbort", &lib->comm_abort, &missing) &&
                  bind(handle, "ncclCommGetAsyncError", &lib->comm_get_async_error, &missing) &&
                  bind(handle, "ncclSend", &lib->send, &missing) && bind(handle, "ncclRecv", &lib->recv, &missing) &&
                  bind(handle, "ncclAllReduce", &lib->all_reduce, &missing) &&
                  bind(handle, "ncclGroupStart", &lib->group_start, &missing) &&
                  bind(handle, "ncclGroupEnd", &lib->group_end, &missing) &&
                  bind(handle, "ncclGetErrorString", &lib->error_string, &missing);
  if (!ok) {
    *why = path + ": " + missing;
    return nullptr;  // the handle stays loaded: harmless, and dlclose of NCCL is not safe
  }
  if (get_version(&lib->version) != 0) {
    *why = path + ": ncclGetVersion failed";
    return nullptr;
  }
  return lib;
}

}  // namespace

const NcclLibrary* NcclLibrary::get(const std::string& path, std::string* why) {
  // Per path, once per process; the libraries stay loaded until exit (NCCL's own threads), and
  // so do their tables: never destroyed, as the destroying thread (below) may still use one
  // while the process exits.
  static std::mutex m;
  static auto* loaded = new std::map<std::string, std::pair<std::unique_ptr<NcclLibrary>, std::string>>();
  std::lock_guard<std::mutex> lock(m);
  auto it = loaded->find(path);
  if (it == loaded->end()) {
    std::string reason;
    auto lib = load(path, &reason);
    it = loaded->emplace(path, std::make_pair(std::move(lib), reason)).first;
  }
  if (!it->second.first) *why = it->second.second;
  return it->second.first.get();
}

NcclConfig NcclConfig::make(bool blocking, bool split_share) {
  constexpr int kUndefined = -2147483647 - 1;  // NCCL_CONFIG_UNDEF_INT
  NcclConfig c{};
  c.size = offsetof(NcclConfig, split_share) + sizeof(int);  // the fields NCCL 2.18 has, no padding
  c.magic = 0xcafebeef;                                      // NCCL_API_MAGIC
  c.version = 21800;                                         // NCCL_VERSION(2, 18, 0)
  c.blocking = blocking ? 1 : 0;
  c.cga_cluster_size = c.min_ctas = c.max_ctas = kUndefined;
  c.net_name = nullptr;
  c.split_share = split_share ? 1 : 0;
  return c;
}

std::string NcclLibrary::version_text() const {
  // NCCL_VERSION(X,Y,Z): X*10000 + Y*100 + Z from 2.9 on.
  return std::to_string(version / 10000) + "." + std::to_string(version / 100 % 100) + "." +
         std::to_string(version % 100);
}

void NcclLibrary::check(int rc, const char* call, const std::string& what) const {
  if (rc == 0) return;
  throw Error(ErrorCode::Cuda, what + ": " + call + " failed: " + error_string(rc) + " (ncclResult_t " +
                                   std::to_string(rc) + ")");
}

namespace {

long long milliseconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
}

// The destroying thread (NcclComm): started on first use, never stopped (it sleeps while it
// has nothing to do; communicators given to it at exit may stay undestroyed, as the process
// ends).
struct NcclDestroyer {
  struct Job {
    const NcclLibrary* lib;
    NcclCommHandle comm;
    int device;
  };
  std::mutex m;
  std::condition_variable wake, done;
  std::deque<Job> jobs;
  std::uint64_t given = 0, destroyed = 0;
  std::uint64_t late = 0;  // a job a waiter gave up on: while it is not destroyed, nobody waits
  bool started = false;
  std::map<int, int> live_comms;  // by device: LiveCommMark
  std::uint64_t start_late = 0;   // before_start gave up on the jobs up to this one

  // Throws (and queues nothing) where the thread cannot start.
  void give(const Job& job) {
    {
      std::lock_guard<std::mutex> lock(m);
      if (!started) {
        std::thread([this] { serve(); }).detach();
        started = true;
      }
      jobs.push_back(job);
      ++given;
    }
    wake.notify_all();
  }

  // Everything queued is taken at once: one synchronisation per device for all its
  // communicators, then the destroys in the order given (a split's children before the
  // communicator they were split from).
  void serve() {
    std::unique_lock<std::mutex> lock(m);
    for (;;) {
      wake.wait(lock, [&] { return !jobs.empty(); });
      std::deque<Job> batch;
      batch.swap(jobs);
      lock.unlock();
      std::vector<int> synced;
      for (const Job& job : batch) {
        if (std::find(synced.begin(), synced.end(), job.device) != synced.end()) continue;
        synced.push_back(job.device);
        if (job.device >= 0) (void)cudaSetDevice(job.device);
        const auto t0 = std::chrono::steady_clock::now();
        const cudaError_t rc = synchronize_device_between_captures();  // destroyed after an error too
        if (log_enabled(LogLevel::Debug))
          log(LogLevel::Debug, "NCCL destroys: GPU " + std::to_string(job.device) + " synchronised in " +
                                   std::to_string(milliseconds_since(t0)) + " ms (" + cudaGetErrorString(rc) + ")");
      }
      std::vector<int> warned;
      for (const Job& job : batch) {
        if (job.device >= 0) (void)cudaSetDevice(job.device);
        if (live_on(job.device) && std::find(warned.begin(), warned.end(), job.device) == warned.end()) {
          warned.push_back(job.device);
          log(LogLevel::Warn, "NCCL communicators of a Comm that is gone are destroyed while another Comm uses GPU " +
                                  std::to_string(job.device) +
                                  ": ncclCommDestroy frees pinned memory, which holds up this process's CUDA calls "
                                  "until the GPU's work ends, so that Comm's transfers and barriers may wait for it "
                                  "(README \"Teardown beside a live Comm\")");
        }
        const auto t0 = std::chrono::steady_clock::now();
        const int rc = job.lib->comm_destroy(job.comm);
        if (log_enabled(LogLevel::Debug))
          log(LogLevel::Debug, "NCCL destroys: ncclCommDestroy took " + std::to_string(milliseconds_since(t0)) +
                                   " ms (ncclResult_t " + std::to_string(rc) + ")");
      }
      lock.lock();
      destroyed += batch.size();
      done.notify_all();
    }
  }

  bool live_on(int device) {
    std::lock_guard<std::mutex> lock(m);
    auto it = live_comms.find(device);
    return it != live_comms.end() && it->second > 0;
  }

  // A Comm's start: every communicator given so far destroyed within `bound`, whatever
  // teardowns gave up on; at once where an earlier start gave up on some still not destroyed
  // (each later Comm would wait in vain).
  enum class Start { Done, TimedOut, StillStuck };
  Start before_start(std::chrono::milliseconds bound) {
    std::unique_lock<std::mutex> lock(m);
    if (start_late > destroyed) return Start::StillStuck;
    const std::uint64_t want = given;
    if (done.wait_for(lock, bound, [&] { return destroyed >= want; })) return Start::Done;
    start_late = want;
    return Start::TimedOut;
  }

  enum class Wait { Done, TimedOut, BehindLate };
  Wait wait_within(std::chrono::milliseconds bound) {
    std::unique_lock<std::mutex> lock(m);
    if (late > destroyed) return Wait::BehindLate;
    const std::uint64_t want = given;
    auto all = [&] { return destroyed >= want; };
    if (bound.count() == 0) {
      done.wait(lock, all);
      return Wait::Done;
    }
    if (done.wait_for(lock, bound, all)) return Wait::Done;
    late = want;
    return Wait::TimedOut;
  }
};

NcclDestroyer& destroyer() {
  static auto* d = new NcclDestroyer();  // never destroyed: its thread outlives static destruction
  return *d;
}

}  // namespace

NcclComm::NcclComm(const NcclLibrary* lib, NcclCommHandle c) : lib_(lib), comm_(c) {
  if (cudaGetDevice(&device_) != cudaSuccess) device_ = -1;
}

NcclComm& NcclComm::operator=(NcclComm&& o) noexcept {
  if (this != &o) {
    reset(false);
    lib_ = o.lib_;
    comm_ = o.comm_;
    device_ = o.device_;
    o.comm_ = nullptr;
  }
  return *this;
}

void NcclComm::reset(bool abort) noexcept {
  if (comm_ == nullptr) return;
  if (abort) {
    const auto t0 = std::chrono::steady_clock::now();
    const int rc = lib_->comm_abort(comm_);
    if (log_enabled(LogLevel::Debug))
      log(LogLevel::Debug, "ncclCommAbort took " + std::to_string(milliseconds_since(t0)) + " ms (ncclResult_t " +
                               std::to_string(rc) + ")");
  } else {
    try {
      destroyer().give({lib_, comm_, device_});
    } catch (...) {
      (void)lib_->comm_destroy(comm_);  // no thread: here, as before
    }
  }
  comm_ = nullptr;
}

void finish_earlier_nccl_destroys(std::chrono::milliseconds bound, const std::string& who) {
  // A quarter of the timeout: the other ranks wait in this Comm's next collective step
  // meanwhile, bounded by the same timeout.
  const std::chrono::milliseconds limit =
      bound.count() > 0 ? std::max(bound / 4, std::chrono::milliseconds(1)) : std::chrono::milliseconds(60000);
  const NcclDestroyer::Start outcome = destroyer().before_start(limit);
  if (outcome == NcclDestroyer::Start::Done) return;
  log(LogLevel::Warn, who + ": NCCL communicators of an earlier Comm are still not destroyed " +
                          (outcome == NcclDestroyer::Start::TimedOut
                               ? "after " + describe_timeout(limit)
                               : std::string("(an earlier Comm's start gave up waiting for them)")) +
                          " (a CUDA graph that captured one may still exist, or the GPU's work has not ended); "
                          "their destroy frees pinned memory, which holds up this process's CUDA calls until the "
                          "GPU's work ends, so this Comm's transfers and barriers may wait for it (README \"Teardown beside a live Comm\")");
}

LiveCommMark::LiveCommMark(int device) : device_(device) {
  NcclDestroyer& d = destroyer();
  std::lock_guard<std::mutex> lock(d.m);
  ++d.live_comms[device_];
}

LiveCommMark::~LiveCommMark() {
  NcclDestroyer& d = destroyer();
  std::lock_guard<std::mutex> lock(d.m);
  --d.live_comms[device_];
}

void await_nccl_destroys(std::chrono::milliseconds bound, const std::string& who) {
  switch (destroyer().wait_within(bound)) {
    case NcclDestroyer::Wait::Done:
      return;
    case NcclDestroyer::Wait::TimedOut:
      log(LogLevel::Warn, who + ": work issued on this GPU has not finished after " + describe_timeout(bound) +
                              "; its NCCL communicators are destroyed once that work ends");
      return;
    case NcclDestroyer::Wait::BehindLate:
      log(LogLevel::Warn, who + ": NCCL communicators of an earlier teardown still wait for work issued on this GPU; "
                              "this one's are destroyed after them, without waiting here");
      return;
  }
}

}  // namespace meshmem::detail
