// fill_lab: what a stream-filled staged put (MESHMEM_STAGED_STREAM_FILL) costs the GPU, against
// the copy engine that the staging agent's copy uses. The fill kernel copies a put of at most
// 64 KiB from device memory into a pinned host slot with device::copy_block (the library's
// block copy) before it sets the transfer's ready word; the question is how many blocks that
// copy wants, and how the source's alignment (a grid row 8 bytes into a 16-byte line, as in
// Jacobi) changes it.
//
// One process, GPU 0, pinned host memory (cudaMallocHost). Each row enqueues --reps operations
// back to back on one stream and times them with events: GPU time per operation, launch gaps
// included (the floor is the empty kernel's row).
//   empty            a kernel of one block that does nothing
//   copy-engine      cudaMemcpyAsync device -> pinned (the agent's copy)
//   fill BxT +A      B blocks of T threads, each copying its share of the bytes with
//                    device::copy_block, then __threadfence_system (as the fill kernel), source
//                    at offset A (0: both 16-byte aligned; 8: 8 bytes into a line; 1: odd, so
//                    byte accesses, as every misaligned row was before 76fa6ef)
//   copy-engine-h2d  cudaMemcpyAsync pinned -> device, then a batch of 3 stream writes (the staging
//                    agent's reader side for one chunk)
//   pull 1x1024      one block of 1024 threads copying the chunk from the pinned slot into device
//                    memory, then writing the 3 words (the reader's side as one kernel)
//   fill_lab [--sizes 4K,16K,32K,64K] [--reps 2000]
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <meshmem/device/device.cuh>

#include "bench_check.hpp"
#include "lab_gpu.hpp"

namespace {

__global__ void empty_kernel() {}

__global__ void pull_kernel(char* dst, const char* slot, std::size_t bytes, std::uint64_t* words, std::uint64_t value) {
  meshmem::device::copy_block(dst, slot, bytes);
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x < 3) reinterpret_cast<volatile std::uint64_t*>(words)[8 * threadIdx.x] = value;
}

using bench::write_op;

__global__ void fill_kernel(char* dst, const char* src, std::size_t bytes) {
  // Each block a 16-byte multiple share, the last block the rest.
  const std::size_t share = ((bytes / gridDim.x) + 15) & ~std::size_t(15);
  const std::size_t begin = share * blockIdx.x;
  if (begin < bytes) meshmem::device::copy_block(dst + begin, src + begin, begin + share > bytes ? bytes - begin : share);
  __threadfence_system();
}

template <class Enqueue>
double us_per_op(cudaStream_t s, int reps, Enqueue&& enqueue) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 50; ++i) enqueue();  // warm-up
  CK(cudaEventRecord(a, s));
  for (int i = 0; i < reps; ++i) enqueue();
  CK(cudaEventRecord(b, s));
  CK(cudaEventSynchronize(b));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  CK(cudaGetLastError());
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return 1000.0 * ms / reps;
}

// "4K,16K,32K" -> bytes (bench::parse_bytes per item); false on a bad item.
bool parse_sizes(const std::string& list, std::vector<std::size_t>* out) {
  std::size_t at = 0;
  while (at <= list.size()) {
    std::size_t end = list.find(',', at);
    if (end == std::string::npos) end = list.size();
    std::size_t bytes = 0;
    if (!bench::parse_bytes(list.substr(at, end - at), &bytes)) return false;
    out->push_back(bytes);
    at = end + 1;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::string sizes = "4K,16K,32K,64K";
  int reps = 2000;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--sizes" && i + 1 < argc) sizes = argv[++i];
    else if (a == "--reps" && i + 1 < argc) reps = std::stoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: fill_lab [--sizes 4K,16K,32K,64K] [--reps 2000]\n");
      return 2;
    }
  }
  std::vector<std::size_t> list;
  if (!parse_sizes(sizes, &list)) {
    std::fprintf(stderr, "fill_lab: --sizes '%s' is not a list of sizes such as 4K,16K,32K\n", sizes.c_str());
    return 2;
  }
  std::size_t most = 0;
  for (std::size_t b : list) most = b > most ? b : most;
  cudaDeviceProp prop{};
  if (!bench::use_gpu0("fill_lab", &prop)) return 0;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  char* src = nullptr;
  char* slot = nullptr;
  CK(cudaMalloc(&src, most + 64));
  CK(cudaMallocHost(&slot, most + 64));
  char* dst = nullptr;
  std::uint64_t* words = nullptr;
  CK(cudaMalloc(&dst, most + 64));
  CK(cudaMallocHost(&words, 4096));
  CK(cudaMemset(src, 7, most + 64));
  std::printf("# fill_lab: GPU 0 (%s), device memory -> pinned host memory, %d operations back to back per row\n",
              prop.name, reps);
  std::printf("# %-18s %10s %12s\n", "case", "bytes", "us per op");
  const double floor = us_per_op(s, reps, [&] { empty_kernel<<<1, 32, 0, s>>>(); });
  std::printf("%-20s %10d %12.2f\n", "empty", 0, floor);
  const int shapes[][2] = {{1, 256}, {1, 1024}, {4, 256}, {8, 256}, {16, 256}, {32, 256}};
  for (std::size_t bytes : list) {
    const double ce = us_per_op(s, reps, [&] { CK(cudaMemcpyAsync(slot, src, bytes, cudaMemcpyDeviceToHost, s)); });
    std::printf("%-20s %10zu %12.2f\n", "copy-engine", bytes, ce);
    std::uint64_t value = 0;
    const double ce_in = us_per_op(s, reps, [&] {
      CK(cudaMemcpyAsync(dst, slot, bytes, cudaMemcpyHostToDevice, s));
      ++value;
      CUstreamBatchMemOpParams ops[3] = {write_op(words, value), write_op(words + 8, value), write_op(words + 16, value)};
      CU(cuStreamBatchMemOp(reinterpret_cast<CUstream>(s), 3, ops, 0));
    });
    std::printf("%-20s %10zu %12.2f\n", "copy-engine-h2d", bytes, ce_in);
    const double pull = us_per_op(s, reps, [&] { pull_kernel<<<1, 1024, 0, s>>>(dst, slot, bytes, words, ++value); });
    std::printf("%-20s %10zu %12.2f\n", "pull 1x1024", bytes, pull);
    for (int shift : {0, 8, 1})
      for (const auto& sh : shapes) {
        const double t = us_per_op(s, reps, [&] { fill_kernel<<<sh[0], sh[1], 0, s>>>(slot, src + shift, bytes); });
        const std::string name = "fill " + std::to_string(sh[0]) + "x" + std::to_string(sh[1]) + " +" + std::to_string(shift);
        std::printf("%-20s %10zu %12.2f\n", name.c_str(), bytes, t);
      }
  }
  CK(cudaFreeHost(words));
  CK(cudaFree(dst));
  CK(cudaFreeHost(slot));
  CK(cudaFree(src));
  CK(cudaStreamDestroy(s));
  return 0;
}
