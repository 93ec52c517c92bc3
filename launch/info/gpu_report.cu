// The GPU half of the node report: each visible GPU (PCI, VMM, POSIX-fd and host-NUMA
// allocations, tried for real), and every ordered pair: what the driver says, whether
// enabling peer access works, and whether it really works (write-and-verify with the copy
// engine and with a kernel's stores and loads: a pair the driver grants but an IOMMU or a
// VM breaks corrupts data or hangs, which users of every library in this field report).
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <meshmem/meshmem.hpp>
#include <string>
#include <vector>

#include "meshmem/ipc/vmm.hpp"
#include "node_report.hpp"

namespace meshmem::info {
namespace {

constexpr std::size_t kVerifyWords = (4u << 20) / sizeof(std::uint64_t);  // 4 MiB per pair
constexpr std::size_t kBandwidthBytes = 256u << 20;

__host__ __device__ std::uint64_t word_of(std::uint64_t seed, std::size_t i) {
  return (seed + i) * 0x9E3779B97F4A7C15ull ^ (i << 7);
}

// On `from`: store the pattern into the peer's buffer, then load it back into a local one.
__global__ void store_to_peer(std::uint64_t* peer, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    peer[i] = word_of(seed, i);
}
__global__ void load_from_peer(std::uint64_t* local, const std::uint64_t* peer, std::size_t n) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    local[i] = peer[i];
}

std::string cuda_error(const char* call, cudaError_t rc) {
  return std::string(call) + ": " + cudaGetErrorName(rc) + " (" + cudaGetErrorString(rc) + ")";
}

// A device buffer freed with its owner.
class DeviceBuffer {
 public:
  DeviceBuffer(int device, std::size_t bytes) : device_(device) {
    cudaSetDevice(device);
    if (cudaMalloc(&ptr_, bytes) != cudaSuccess) ptr_ = nullptr;
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) {
      cudaSetDevice(device_);
      cudaFree(ptr_);
    }
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T>
  T* as() const { return static_cast<T*>(ptr_); }
  bool ok() const { return ptr_ != nullptr; }

 private:
  int device_;
  void* ptr_ = nullptr;
};

bool matches(const std::vector<std::uint64_t>& got, std::uint64_t seed) {
  for (std::size_t i = 0; i < got.size(); ++i)
    if (got[i] != word_of(seed, i)) return false;
  return true;
}

// Write-and-verify of one enabled pair, both ways the transports move data.
void verify_pair(PeerFacts* p) {
  DeviceBuffer src(p->from, kVerifyWords * 8), local(p->from, kVerifyWords * 8), dst(p->to, kVerifyWords * 8);
  if (!src.ok() || !local.ok() || !dst.ok()) {
    p->reason = "could not allocate memory to verify with";
    return;
  }
  std::vector<std::uint64_t> host(kVerifyWords);
  const std::uint64_t copy_seed = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = word_of(copy_seed, i);
  cudaSetDevice(p->from);
  bool ok = cudaMemcpy(src.as<void>(), host.data(), kVerifyWords * 8, cudaMemcpyHostToDevice) == cudaSuccess;
  cudaSetDevice(p->to);
  ok = ok && cudaMemset(dst.as<void>(), 0xA5, kVerifyWords * 8) == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess;
  cudaSetDevice(p->from);
  ok = ok && cudaMemcpy(dst.as<void>(), src.as<void>(), kVerifyWords * 8, cudaMemcpyDeviceToDevice) == cudaSuccess;
  std::fill(host.begin(), host.end(), 0);
  ok = ok && cudaMemcpy(host.data(), dst.as<void>(), kVerifyWords * 8, cudaMemcpyDeviceToHost) == cudaSuccess;
  p->copy_verified = ok && matches(host, copy_seed);

  const std::uint64_t kernel_seed = copy_seed ^ 0x5555;
  cudaSetDevice(p->from);
  store_to_peer<<<132, 256>>>(dst.as<std::uint64_t>(), kVerifyWords, kernel_seed);
  ok = cudaGetLastError() == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess;
  ok = ok && cudaMemset(local.as<void>(), 0, kVerifyWords * 8) == cudaSuccess;
  load_from_peer<<<132, 256>>>(local.as<std::uint64_t>(), dst.as<std::uint64_t>(), kVerifyWords);
  ok = ok && cudaGetLastError() == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess;
  std::vector<std::uint64_t> stored(kVerifyWords), loaded(kVerifyWords);
  ok = ok && cudaMemcpy(loaded.data(), local.as<void>(), kVerifyWords * 8, cudaMemcpyDeviceToHost) == cudaSuccess;
  cudaSetDevice(p->to);  // what landed, read by the owner of the memory
  ok = ok && cudaMemcpy(stored.data(), dst.as<void>(), kVerifyWords * 8, cudaMemcpyDeviceToHost) == cudaSuccess;
  p->kernel_verified = ok && matches(stored, kernel_seed) && matches(loaded, kernel_seed);
}

double copy_gbs(int device, void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
  cudaSetDevice(device);
  cudaStream_t s = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) return -1;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  constexpr int kReps = 5;
  cudaMemcpyAsync(dst, src, bytes, kind, s);  // warm-up
  cudaEventRecord(start, s);
  for (int i = 0; i < kReps; ++i) cudaMemcpyAsync(dst, src, bytes, kind, s);
  cudaEventRecord(stop, s);
  float ms = 0;
  const bool ok = cudaEventSynchronize(stop) == cudaSuccess && cudaEventElapsedTime(&ms, start, stop) == cudaSuccess;
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(s);
  return ok && ms > 0 ? kReps * static_cast<double>(bytes) / (ms * 1e6) : -1;
}

void check_allocations(GpuFacts* g) {
  try {
    const std::size_t gran = ipc::vmm_granularity(g->ordinal);
    ipc::VmmAllocation a = ipc::VmmAllocation::create(gran, g->ordinal);
    g->vmm = true;
    g->posix_fd = static_cast<bool>(a.export_fd());
  } catch (const Error& e) {
    g->vmm_error = e.what();
  }
  try {
    g->host_numa_node = ipc::host_numa_node_of(g->ordinal);
    if (g->host_numa_node >= 0) {
      ipc::SharedHostMemory h =
          ipc::SharedHostMemory::create(ipc::host_numa_granularity(g->host_numa_node), g->host_numa_node, {g->ordinal});
      g->host_numa_alloc = h.data() != nullptr;
    } else if (g->vmm_error.empty()) {
      g->vmm_error = "host-NUMA VMM memory not supported by this device or driver";
    }
  } catch (const Error& e) {
    if (g->vmm_error.empty()) g->vmm_error = e.what();
  }
}

}  // namespace

void collect_gpu_facts(NodeReport* r, bool bandwidth) {
  r->gpu_part = true;
  std::string why;
  if (!gpu_available(&why)) {
    r->gpu_why = why;
    return;
  }
  int n = 0;
  cudaError_t rc = cudaGetDeviceCount(&n);
  if (rc != cudaSuccess || n == 0) {
    r->gpu_why = rc != cudaSuccess ? cuda_error("cudaGetDeviceCount", rc) : "no CUDA device visible";
    return;
  }
  r->gpus_usable = true;
  cudaDriverGetVersion(&r->driver_version);
  cudaRuntimeGetVersion(&r->runtime_version);
  for (int d = 0; d < n; ++d) {
    GpuFacts g;
    g.ordinal = d;
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, d);
    g.name = prop.name;
    g.memory_bytes = prop.totalGlobalMem;
    g.cc_major = prop.major;
    g.cc_minor = prop.minor;
    char bus[32] = {};
    cudaDeviceGetPCIBusId(bus, sizeof bus, d);
    g.pci_bus_id = bus;
    read_pci_sysfs(g.pci_bus_id, &g);
    check_allocations(&g);
    r->gpus.push_back(g);
  }
  for (int a = 0; a < n; ++a)
    for (int b = 0; b < n; ++b) {
      if (a == b) continue;
      PeerFacts p;
      p.from = a;
      p.to = b;
      int can = 0;
      cudaDeviceCanAccessPeer(&can, a, b);
      p.driver_allows = can != 0;
      if (p.driver_allows) {
        int v = 0;
        if (cudaDeviceGetP2PAttribute(&v, cudaDevP2PAttrNativeAtomicSupported, a, b) == cudaSuccess) p.native_atomics = v != 0;
        if (cudaDeviceGetP2PAttribute(&v, cudaDevP2PAttrPerformanceRank, a, b) == cudaSuccess) p.performance_rank = v;
        cudaSetDevice(a);
        rc = cudaDeviceEnablePeerAccess(b, 0);
        const bool was_on = rc == cudaErrorPeerAccessAlreadyEnabled;
        if (was_on) cudaGetLastError();
        p.enabled = rc == cudaSuccess || was_on;
        if (p.enabled) verify_pair(&p);
        if (bandwidth) {
          DeviceBuffer s(a, kBandwidthBytes), d(b, kBandwidthBytes);
          if (s.ok() && d.ok()) p.bandwidth_gbs = copy_gbs(a, d.as<void>(), s.as<void>(), kBandwidthBytes, cudaMemcpyDefault);
        }
        cudaSetDevice(a);
        if (rc == cudaSuccess) cudaDeviceDisablePeerAccess(b);  // leave the process as found
      } else if (bandwidth) {  // the driver's own staging, for comparison with meshmem's staged route
        DeviceBuffer s(a, kBandwidthBytes), d(b, kBandwidthBytes);
        if (s.ok() && d.ok()) p.bandwidth_gbs = copy_gbs(a, d.as<void>(), s.as<void>(), kBandwidthBytes, cudaMemcpyDefault);
      }
      explain_pair(r->gpus[static_cast<std::size_t>(a)], r->gpus[static_cast<std::size_t>(b)], &p);
      r->pairs.push_back(p);
    }
  if (bandwidth)
    for (int d = 0; d < n; ++d) {
      HostCopyFacts h;
      h.ordinal = d;
      void* pinned = nullptr;
      DeviceBuffer dev(d, kBandwidthBytes);
      if (dev.ok() && cudaMallocHost(&pinned, kBandwidthBytes) == cudaSuccess) {
        h.d2h_gbs = copy_gbs(d, pinned, dev.as<void>(), kBandwidthBytes, cudaMemcpyDeviceToHost);
        h.h2d_gbs = copy_gbs(d, dev.as<void>(), pinned, kBandwidthBytes, cudaMemcpyHostToDevice);
        cudaFreeHost(pinned);
      }
      r->host_copies.push_back(h);
    }
}

}  // namespace meshmem::info
