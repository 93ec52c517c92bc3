// Device objects still alive at MPI_Finalize: a user's main() declares its stream, Comm,
// device window, signals, halo exchange and an instantiated CUDA graph of a put, leaves one
// put in flight (its stream held by a kernel until MPI_Finalize has returned), and calls
// MPI_Finalize, so that everything is released after it, without MPI. Each rank must then
// find its GPU without error and have taken less than half of MESHMEM_TIMEOUT to release it
// all (no wait that ran out), and exit 0 (no crash, no hang, no abort), having checked every
// byte of what landed before. The route is the one the entry names (MESHMEM_TEST_ROUTE: ipc;
// staged forced, whose agents, staging pool and channels outlive MPI). A plain program, not
// GoogleTest: the verdict is each rank's exit code and its line.
#include <cuda_runtime_api.h>
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <meshmem/halo.hpp>
#include <meshmem/meshmem.hpp>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr std::size_t kBytes = (1u << 20) + 13;  // several staged pieces with 256 KiB chunks, an odd size
constexpr std::size_t kHalo = 4096 + 3;

bool cuda_ok(cudaError_t rc, const char* call, int rank) {
  if (rc == cudaSuccess) return true;
  std::printf("[rank %d] %s: %s\n", rank, call, cudaGetErrorString(rc));
  return false;
}

std::vector<unsigned char> pattern(std::uint64_t seed, std::uint64_t key, std::size_t bytes) {
  std::mt19937_64 gen(seed ^ (key * 0x9E3779B97F4A7C15ull));
  std::vector<unsigned char> out(bytes);
  for (auto& b : out) b = static_cast<unsigned char>(gen());
  return out;
}

// Holds its stream until *go is set (mapped host memory), at most ~20 s.
__global__ void hold_until(const volatile int* go) {
  const long long start = clock64();
  while (*go == 0 && clock64() - start < 40000000000ll) __nanosleep(1000);
}

// The user's own objects, released at main's end like the meshmem ones (after MPI_Finalize).
struct OwnedStream {
  cudaStream_t s = nullptr;
  ~OwnedStream() { if (s) cudaStreamDestroy(s); }
};
struct OwnedBuffer {
  void* p = nullptr;
  ~OwnedBuffer() { cudaFree(p); }
};
struct OwnedHostFlag {
  int* p = nullptr;
  ~OwnedHostFlag() { if (p) cudaFreeHost(p); }
};
struct OwnedGraph {
  cudaGraphExec_t exec = nullptr;
  ~OwnedGraph() { if (exec) cudaGraphExecDestroy(exec); }
};

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// MESHMEM_TIMEOUT in seconds as the entries set it (a plain number), else meshmem's default.
double timeout_s() {
  const char* v = std::getenv("MESHMEM_TIMEOUT");
  return v != nullptr ? std::atof(v) : 300.0;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::string why;
  int usable = meshmem::gpu_available(&why) ? 1 : 0, all = 0;
  MPI_Allreduce(&usable, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (all == 0 || size < 2) {
    std::printf("[rank %d] SKIPPED: %s\n", rank,
                size < 2 ? "needs two ranks" : usable ? "another rank has no usable GPU" : ("no usable GPU: " + why).c_str());
    MPI_Finalize();
    return 77;
  }
  meshmem::select_local_device(MPI_COMM_WORLD);
  std::uint64_t seed = std::random_device{}();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  const int right = (rank + 1) % size, left = (rank + size - 1) % size;
  bool ok = true;

  // Declared before the Comm's scope, so released after it: the put left in flight reads `src`.
  OwnedStream stream;
  OwnedBuffer src;
  OwnedHostFlag go;
  if (!cuda_ok(cudaStreamCreateWithFlags(&stream.s, cudaStreamNonBlocking), "cudaStreamCreate", rank) ||
      !cuda_ok(cudaMalloc(&src.p, 2 * kBytes), "cudaMalloc", rank) ||
      !cuda_ok(cudaHostAlloc(reinterpret_cast<void**>(&go.p), sizeof(int), cudaHostAllocMapped), "cudaHostAlloc", rank))
    MPI_Abort(MPI_COMM_WORLD, 1);
  *go.p = 0;
  const char* route_wanted = std::getenv("MESHMEM_TEST_ROUTE");
  double teardown_s = 0;
  {  // the objects of a user's main(), released at its end, after MPI_Finalize
    meshmem::Comm comm(MPI_COMM_WORLD);
    const std::string route = meshmem::to_string(comm.transport(right, meshmem::Memory::Device));
    if (route_wanted != nullptr && route != route_wanted) {
      std::printf("[rank %d] the route to rank %d is %s, not %s\n", rank, right, route.c_str(), route_wanted);
      ok = false;
    }
    // [0, kBytes): put_signal from the left; [kBytes, +kHalo): the left's halo, [.., +kHalo): the
    // right's; then the graph's put from the left and the put left in flight at MPI_Finalize.
    const std::size_t at_halo = kBytes, at_graph = kBytes + 2 * kHalo, at_late = at_graph + kBytes;
    const std::size_t span = at_late + kBytes;
    meshmem::Window win = comm.alloc(span);
    meshmem::Signals sig = comm.alloc_signals(1);
    char* const src_c = static_cast<char*>(src.p);
    char* const mine = static_cast<char*>(win.local());
    const auto put_data = pattern(seed, 1000 + static_cast<std::uint64_t>(rank), kBytes);
    const auto graph_data = pattern(seed, 2000 + static_cast<std::uint64_t>(rank), kBytes);
    const auto halo_data = pattern(seed, 3000 + static_cast<std::uint64_t>(rank), 2 * kHalo);
    ok &= cuda_ok(cudaMemcpy(src_c, put_data.data(), kBytes, cudaMemcpyHostToDevice), "cudaMemcpy", rank);
    ok &= cuda_ok(cudaMemcpy(src_c + kBytes, graph_data.data(), kBytes, cudaMemcpyHostToDevice), "cudaMemcpy", rank);
    ok &= cuda_ok(cudaMemset(mine, 0xA5, span), "cudaMemset", rank);  // poisoned
    // This rank's own halo rows, sent from its part: to the right from [0, kHalo) of halo_data,
    // to the left from the rest, staged in the window's last region (not checked there).
    ok &= cuda_ok(cudaMemcpy(mine + at_late, halo_data.data(), 2 * kHalo, cudaMemcpyHostToDevice), "cudaMemcpy", rank);
    ok &= cuda_ok(cudaMemset(sig.local(), 0, sizeof(std::uint64_t)), "cudaMemset", rank);
    ok &= cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize", rank);
    std::vector<meshmem::HaloRegion> sends{{right, at_late, at_halo, kHalo, 1, 0, 0},
                                           {left, at_late + kHalo, at_halo + kHalo, kHalo, 1, 0, 0}};
    // With two ranks both regions go to the one neighbour.
    meshmem::HaloExchange halo = comm.make_halo(win, sends);
    comm.barrier();

    comm.put_signal(win, right, 0, src_c, kBytes, sig, 0, 1, meshmem::SignalOp::Add, stream.s);
    comm.wait_until(sig, 0, meshmem::Cmp::GE, 1, stream.s);
    halo.exchange(stream.s);
    // A graph of one put, replayed once and left instantiated.
    OwnedGraph graph;
    cudaGraph_t captured = nullptr;
    ok &= cuda_ok(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture", rank);
    comm.put(win, right, at_graph, src_c + kBytes, kBytes, stream.s);
    ok &= cuda_ok(cudaStreamEndCapture(stream.s, &captured), "cudaStreamEndCapture", rank);
    ok &= cuda_ok(cudaGraphInstantiate(&graph.exec, captured, 0), "cudaGraphInstantiate", rank);
    cudaGraphDestroy(captured);
    ok &= cuda_ok(cudaGraphLaunch(graph.exec, stream.s), "cudaGraphLaunch", rank);
    comm.barrier(stream.s);
    ok &= cuda_ok(cudaStreamSynchronize(stream.s), "cudaStreamSynchronize", rank);
    std::vector<unsigned char> got(at_late);
    ok &= cuda_ok(cudaMemcpy(got.data(), mine, at_late, cudaMemcpyDeviceToHost), "cudaMemcpy", rank);
    const auto from_left = pattern(seed, 1000 + static_cast<std::uint64_t>(left), kBytes);
    const auto graph_from_left = pattern(seed, 2000 + static_cast<std::uint64_t>(left), kBytes);
    const auto halo_left = pattern(seed, 3000 + static_cast<std::uint64_t>(left), 2 * kHalo);
    const auto halo_right = pattern(seed, 3000 + static_cast<std::uint64_t>(right), 2 * kHalo);
    const auto same = [&](std::size_t at, const unsigned char* want, std::size_t n, const char* what) {
      if (std::memcmp(got.data() + at, want, n) == 0) return true;
      std::printf("[rank %d] %s: wrong bytes\n", rank, what);
      return false;
    };
    ok &= same(0, from_left.data(), kBytes, "put_signal from the left");
    ok &= same(at_halo, halo_left.data(), kHalo, "halo from the left");
    ok &= same(at_halo + kHalo, halo_right.data() + kHalo, kHalo, "halo from the right");
    ok &= same(at_graph, graph_from_left.data(), kBytes, "the graph's put from the left");
    comm.barrier();
    // One put left in flight: its stream is held until MPI_Finalize has returned, so the put
    // runs while the objects are released; the Comm's end waits for it (bounded), and the
    // target's window, released after its own MPI_Finalize, refuses or takes it.
    hold_until<<<1, 1, 0, stream.s>>>(go.p);
    ok &= cuda_ok(cudaGetLastError(), "hold_until launch", rank);
    comm.put(win, right, at_late, src_c, kBytes, stream.s);
    MPI_Finalize();  // the Comm, window, signals, halo exchange and graph are still alive
    *static_cast<volatile int*>(go.p) = 1;
    std::printf("[rank %d] %s; MPI finalized with meshmem device objects alive (route %s)\n", rank,
                ok ? "data ok" : "DATA WRONG", route.c_str());
    std::fflush(stdout);
    teardown_s = -seconds_now();
  }  // released here, without MPI
  teardown_s += seconds_now();
  ok &= cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize after the release", rank);
  const double limit_s = timeout_s() / 2;
  if (teardown_s > limit_s) {
    std::printf("[rank %d] releasing the objects took %.1f s (half of MESHMEM_TIMEOUT: %.1f s): a wait ran out\n", rank,
                teardown_s, limit_s);
    ok = false;
  }
  std::printf("[rank %d] %s: objects released in %.2f s\n", rank, ok ? "ok" : "FAILED", teardown_s);
  return ok ? 0 : 1;
}
