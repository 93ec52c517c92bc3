// Helpers shared by the GPU suites (CUDA headers: only the GPU tests include this).
#pragma once

#include <cuda_runtime_api.h>
#include <unistd.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdlib>
#include <string>
#include <vector>

#include <meshmem/meshmem.hpp>

// Fails the test (and returns from it) when a CUDA runtime call does not succeed, with the
// call and CUDA's message.
#define CUDA_OK(call)                                                        \
  do {                                                                       \
    cudaError_t rc_ = (call);                                                \
    ASSERT_EQ(rc_, cudaSuccess) << #call << ": " << cudaGetErrorString(rc_); \
  } while (0)

namespace meshmem::test {

// How many rounds a long loop runs: `fast` in the fast tier (its entries set
// MESHMEM_TEST_TIER=fast, tests/gpu/TIERS.md), `full` in gpu-long and in a run by hand.
inline int rounds(int full, int fast) {
  const char* tier = std::getenv("MESHMEM_TEST_TIER");
  return tier != nullptr && std::string(tier) == "fast" ? fast : full;
}

// Device memory owned for the life of the object.
struct DeviceBuffer {
  explicit DeviceBuffer(std::size_t bytes) : bytes(bytes) { cudaMalloc(&p, bytes ? bytes : 1); }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  char* c() const { return static_cast<char*>(p); }
  void* p = nullptr;
  std::size_t bytes;
};

// Selects this rank's GPU (node-local rank modulo the visible GPUs) only where every rank has
// one, so that the collective steps after it (select_local_device's own gather, a fixture's)
// are entered by every rank or by none: a host that sees no GPU (two namespace hosts with one
// GPU per host on a one-GPU machine) makes every rank skip. "" where the GPU is selected,
// else why not.
inline std::string select_gpu_on_every_rank() {
  std::string why;
  int usable = meshmem::gpu_available(&why) ? 1 : 0;
  int all = 0;
  MPI_Allreduce(&usable, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (all == 0) return usable ? "another rank has no usable GPU" : "no usable GPU: " + why;
  if (meshmem::select_local_device(MPI_COMM_WORLD) < 0) return "no usable GPU";
  return "";
}

// cudaMemcpy from pageable memory may return before the DMA into `dev` is done, and the
// tests' streams do not synchronise with the legacy stream: wait for it.
inline cudaError_t upload(void* dev, const void* host, std::size_t bytes) {
  const cudaError_t rc = cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice);
  return rc != cudaSuccess ? rc : cudaDeviceSynchronize();
}

// The same for cudaMemset (asynchronous for device memory, on the legacy stream): a window
// poisoned this way could otherwise be overwritten after a peer's put landed, since a
// barrier(stream) orders only `stream` (and enqueues nothing at all when streams are idle).
inline cudaError_t fill_now(void* dev, int byte, std::size_t bytes) {
  const cudaError_t rc = cudaMemset(dev, byte, bytes);
  return rc != cudaSuccess ? rc : cudaDeviceSynchronize();
}

// Ends a capture a failed case left open on `s` (and drops its graph and the error it left),
// so that the next case starts clean. For TearDown; does nothing on a stream not capturing.
inline void end_open_capture(cudaStream_t s) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (s == nullptr || cudaStreamIsCapturing(s, &status) != cudaSuccess || status == cudaStreamCaptureStatusNone) return;
  cudaGraph_t g = nullptr;
  (void)cudaStreamEndCapture(s, &g);
  if (g) cudaGraphDestroy(g);
  (void)cudaGetLastError();
}

inline std::vector<unsigned char> to_host(const void* dev, std::size_t bytes) {
  std::vector<unsigned char> h(bytes);
  cudaMemcpy(h.data(), dev, bytes, cudaMemcpyDeviceToHost);
  return h;
}

// Every rank's current GPU as a PCI bus id, by rank (collective over MPI_COMM_WORLD; "" where
// a rank has none).
inline std::vector<std::string> gpu_bus_ids() {
  char bus[64] = {};
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetPCIBusId(bus, sizeof(bus), device) != cudaSuccess) bus[0] = 0;
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  std::vector<char> all(sizeof(bus) * static_cast<std::size_t>(n));
  MPI_Allgather(bus, sizeof(bus), MPI_CHAR, all.data(), sizeof(bus), MPI_CHAR, MPI_COMM_WORLD);
  std::vector<std::string> ids;
  for (int r = 0; r < n; ++r) ids.emplace_back(&all[sizeof(bus) * static_cast<std::size_t>(r)]);
  return ids;
}

// Every rank's hostname, by rank (collective over MPI_COMM_WORLD): ranks of different hosts
// (launch/meshmem-hosts, or real nodes) never share a GPU.
inline std::vector<std::string> host_names() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  std::vector<char> all(sizeof(name) * static_cast<std::size_t>(n));
  MPI_Allgather(name, sizeof(name), MPI_CHAR, all.data(), sizeof(name), MPI_CHAR, MPI_COMM_WORLD);
  std::vector<std::string> names;
  for (int r = 0; r < n; ++r) names.emplace_back(&all[sizeof(name) * static_cast<std::size_t>(r)]);
  return names;
}

// The device API (Window::view(), Window::peer) reaches only peers mapped here (ipc): a
// test of it names the first peer that is not ("" if all are), to skip with the reason
// (under MESHMEM_TRANSPORTS=staged,... or MESHMEM_IPC_PEER_ACCESS=off some pairs are staged).
inline std::string unmapped_peer(const Comm& comm, const Window& win) {
  for (int r = 0; r < comm.size(); ++r)
    if (win.peer(r) == nullptr)
      return "rank " + std::to_string(r) + " is reached through " + to_string(comm.transport(r, Memory::Device)) +
             ", not mapped here: the device API needs mapped peers";
  return "";
}

}  // namespace meshmem::test
