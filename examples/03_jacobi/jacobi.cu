// 03_jacobi: 2D Jacobi (5-point stencil, double) on GPUs, the halo exchange done five ways:
//   --halo=mpi                classic: edge rows/columns device -> host, MPI_Isend/Irecv, host -> device
//   --halo=nccl               ncclSend/ncclRecv in a group (columns packed into buffers)
//   --halo=meshmem            a meshmem::HaloExchange declared once; exchange(stream) every iteration
//   --halo=meshmem-device     the compute kernel writes its edge cells straight into the neighbours'
//                             windows; HaloExchange::complete(stream) only signals and waits
//   --halo=meshmem-putsignal  row bands only: Comm::put_signal of each edge row into the neighbour's
//                             halo row, wait_until_all_then_set on this rank's words (waits, then
//                             resets them; the nearest one-sided counterpart of MPI_Sendrecv of two rows)
// --decomp=rows|blocks splits the grid into row bands or 2D blocks.
// --norm-every N (default 0: only after the timed loop) takes the L2 norm of the update every N
// iterations inside the timed loop, as a convergence check does: a reduction kernel, a copy to
// the host, a stream synchronisation and MPI_Allreduce.
// --graph captures two iterations (both grid parities) into a CUDA graph after the warm-up and
// times iters/2 replays (iters and N even; not --halo=mpi, whose host waits cannot be captured).
// Prints the L2 norm of the last update, time per iteration and (--check) the largest
// difference from a single-GPU run. --csv appends a row; its variant is the halo, then
// "-blocks", "-norm<N>" (N > 0) and "-graph" where they apply.
//   mpirun -np 4 03_jacobi --nx 4096 --ny 4096 --iters 2000 --halo=meshmem-device --check
//   mpirun -np 4 03_jacobi --size 4096 --iters 2000 --halo=meshmem-putsignal --norm-every 2 --graph --check
#include <cuda_runtime_api.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <meshmem/meshmem.hpp>
#include <string>
#include <vector>

#ifdef JACOBI_HAVE_NCCL
#include <nccl.h>
#endif

#include "results_csv.hpp"  // bench/: the results format

namespace {

int g_rank = 0;

void fail(const char* what, const char* detail, const char* file, int line) {
  std::fprintf(stderr, "rank %d: %s failed: %s (%s:%d)\n", g_rank, what, detail, file, line);
  MPI_Abort(MPI_COMM_WORLD, 1);
}
#define CK(call) \
  do { cudaError_t rc_ = (call); if (rc_ != cudaSuccess) fail(#call, cudaGetErrorString(rc_), __FILE__, __LINE__); } while (0)
#define MK(call) \
  do { int rc_ = (call); if (rc_ != MPI_SUCCESS) fail(#call, "MPI error", __FILE__, __LINE__); } while (0)
#ifdef JACOBI_HAVE_NCCL
#define NK(call) \
  do { ncclResult_t rc_ = (call); if (rc_ != ncclSuccess) fail(#call, ncclGetErrorString(rc_), __FILE__, __LINE__); } while (0)
#endif

constexpr double kPi = 3.14159265358979323846;

// Where each neighbour's copy of the array being written lives, for the device variant:
// pointers into the neighbours' windows (mapped here) and their pitches / sizes.
struct Neighbours {
  double* north = nullptr;  // its bottom halo row receives our first row
  double* south = nullptr;  // its top halo row receives our last row
  double* west = nullptr;   // its right halo column receives our first column
  double* east = nullptr;   // its left halo column receives our last column
  int north_rows = 0, west_cols = 0, west_pitch = 0, east_pitch = 0;
};

template <bool kPutEdges>
__global__ void jacobi_kernel(const double* __restrict__ a, double* __restrict__ anew, int rows, int cols, int pitch,
                              Neighbours nb) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x + 1;
  const int i = blockIdx.y * blockDim.y + threadIdx.y + 1;
  if (i > rows || j > cols) return;
  const double v = 0.25 * (a[i * pitch + j + 1] + a[i * pitch + j - 1] + a[(i + 1) * pitch + j] + a[(i - 1) * pitch + j]);
  anew[i * pitch + j] = v;
  if (kPutEdges) {
    if (i == 1 && nb.north) nb.north[(nb.north_rows + 1) * pitch + j] = v;
    if (i == rows && nb.south) nb.south[j] = v;
    if (j == 1 && nb.west) nb.west[i * nb.west_pitch + nb.west_cols + 1] = v;
    if (j == cols && nb.east) nb.east[i * nb.east_pitch] = v;
  }
}

// Sum of (anew - a)^2 over the interior, added to *sum. Blocks of 32 x kBlockRows threads (a
// warp per block row): one atomicAdd per block, not per cell, since millions of atomics on one
// address would cost more than the iteration itself with --norm-every 1.
constexpr int kBlockRows = 8;
__global__ void residual_kernel(const double* a, const double* anew, int rows, int cols, int pitch, double* sum) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x + 1;
  const int i = blockIdx.y * blockDim.y + threadIdx.y + 1;
  double d2 = 0;
  if (i <= rows && j <= cols) {
    const double d = anew[i * pitch + j] - a[i * pitch + j];
    d2 = d * d;
  }
  for (int o = 16; o > 0; o /= 2) d2 += __shfl_down_sync(0xffffffffu, d2, o);
  __shared__ double warp_sum[kBlockRows];
  if (threadIdx.x == 0) warp_sum[threadIdx.y] = d2;
  __syncthreads();
  if (threadIdx.y != 0) return;
  d2 = threadIdx.x < blockDim.y ? warp_sum[threadIdx.x] : 0.0;
  for (int o = 16; o > 0; o /= 2) d2 += __shfl_down_sync(0xffffffffu, d2, o);
  if (threadIdx.x == 0) atomicAdd(sum, d2);
}

// Column `col` of the local array <-> a contiguous buffer of `rows` doubles (rows 1..rows).
__global__ void pack_column(const double* a, int rows, int pitch, int col, double* buf) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < rows) buf[i] = a[(i + 1) * pitch + col];
}
__global__ void unpack_column(double* a, int rows, int pitch, int col, const double* buf) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < rows) a[(i + 1) * pitch + col] = buf[i];
}

struct Split {
  int start, count;
};
Split split(int total, int parts, int index) {
  const int base = total / parts, extra = total % parts;
  return {index * base + std::min(index, extra), base + (index < extra ? 1 : 0)};
}

// This rank's block of the (ny x nx) grid: interior rows/cols split between py x px ranks;
// the local array has a one-cell ring (neighbours' cells or the fixed boundary).
struct Block {
  int nx, ny, px, py, cx, cy;
  int row0, col0, rows, cols, pitch;  // global row/col of local (1,1); interior size; row length
  int north = -1, south = -1, west = -1, east = -1;
  Block(int nx_, int ny_, int ranks, int rank, bool blocks) : nx(nx_), ny(ny_) {
    px = 1;
    if (blocks)
      for (int d = 1; d * d <= ranks; ++d)
        if (ranks % d == 0) px = d;
    py = ranks / px;
    cx = rank % px;
    cy = rank / px;
    const Split r = split(ny - 2, py, cy), c = split(nx - 2, px, cx);
    row0 = 1 + r.start;
    rows = r.count;
    col0 = 1 + c.start;
    cols = c.count;
    pitch = cols + 2;
    auto at = [&](int x, int y) { return (x < 0 || y < 0 || x >= px || y >= py) ? -1 : y * px + x; };
    north = at(cx, cy - 1);
    south = at(cx, cy + 1);
    west = at(cx - 1, cy);
    east = at(cx + 1, cy);
  }
  std::size_t cells() const { return static_cast<std::size_t>(rows + 2) * pitch; }
  std::size_t bytes() const { return cells() * sizeof(double); }
  std::size_t at(int i, int j) const { return (static_cast<std::size_t>(i) * pitch + j) * sizeof(double); }
};

// Fixed boundary: left and right columns sin(2 pi y / (ny-1)), top and bottom rows 0.
std::vector<double> initial(const Block& b) {
  std::vector<double> v(b.cells(), 0.0);
  for (int i = 0; i < b.rows + 2; ++i) {
    const int gy = b.row0 - 1 + i;
    const double s = std::sin(2.0 * kPi * gy / (b.ny - 1));
    if (b.col0 == 1) v[static_cast<std::size_t>(i) * b.pitch] = s;
    if (b.col0 + b.cols == b.nx - 1) v[static_cast<std::size_t>(i) * b.pitch + b.cols + 1] = s;
  }
  return v;
}

std::vector<meshmem::HaloRegion> halo_regions(const Block& b, const std::vector<Block>& all) {
  std::vector<meshmem::HaloRegion> out;
  const std::size_t row = b.cols * sizeof(double), pitch = b.pitch * sizeof(double);
  if (b.north >= 0) out.push_back({b.north, b.at(1, 1), all[b.north].at(all[b.north].rows + 1, 1), row, 1, 0, 0});
  if (b.south >= 0) out.push_back({b.south, b.at(b.rows, 1), all[b.south].at(0, 1), row, 1, 0, 0});
  if (b.west >= 0)
    out.push_back({b.west, b.at(1, 1), all[b.west].at(1, all[b.west].cols + 1), sizeof(double), static_cast<std::size_t>(b.rows),
                   pitch, all[b.west].pitch * sizeof(double)});
  if (b.east >= 0)
    out.push_back({b.east, b.at(1, b.cols), all[b.east].at(1, 0), sizeof(double), static_cast<std::size_t>(b.rows), pitch,
                   all[b.east].pitch * sizeof(double)});
  return out;
}

// Jacobi on one GPU over the whole grid: the reference for --check.
std::vector<double> single_gpu(int nx, int ny, int iters) {
  Block b(nx, ny, 1, 0, false);
  std::vector<double> h = initial(b);
  double *a, *anew;
  CK(cudaMalloc(&a, b.bytes()));
  CK(cudaMalloc(&anew, b.bytes()));
  CK(cudaMemcpy(a, h.data(), b.bytes(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(anew, h.data(), b.bytes(), cudaMemcpyHostToDevice));
  const dim3 block(32, 8), grid((b.cols + 31) / 32, (b.rows + 7) / 8);
  for (int it = 0; it < iters; ++it) {
    jacobi_kernel<false><<<grid, block>>>(a, anew, b.rows, b.cols, b.pitch, Neighbours{});
    std::swap(a, anew);
  }
  CK(cudaGetLastError());
  CK(cudaMemcpy(h.data(), a, b.bytes(), cudaMemcpyDeviceToHost));
  CK(cudaFree(a));
  CK(cudaFree(anew));
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  int nranks = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &nranks);
  int nx = 4096, ny = 4096, iters = 1000, warmup = 20, norm_every = 0;
  std::string halo = "meshmem-device", decomp = "rows", csv, commit = "unknown", machine = "unknown", date = bench::utc_now().substr(0, 10);
  bool check = false, graph = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const std::string& key) -> const char* {
      if (a.rfind(key + "=", 0) == 0) return argv[i] + key.size() + 1;
      if (a == key && i + 1 < argc) return argv[++i];
      return nullptr;
    };
    if (const char* v = value("--nx")) nx = std::atoi(v);
    else if (const char* v = value("--ny")) ny = std::atoi(v);
    else if (const char* v = value("--size")) nx = ny = std::atoi(v);
    else if (const char* v = value("--iters")) iters = std::atoi(v);
    else if (const char* v = value("--warmup")) warmup = std::atoi(v);
    else if (const char* v = value("--halo")) halo = v;
    else if (const char* v = value("--decomp")) decomp = v;
    else if (const char* v = value("--csv")) csv = v;
    else if (const char* v = value("--commit")) commit = v;
    else if (const char* v = value("--machine")) machine = v;
    else if (const char* v = value("--date")) date = v;
    else if (const char* v = value("--norm-every")) norm_every = std::atoi(v);
    else if (a == "--check") check = true;
    else if (a == "--graph") graph = true;
    else {
      if (g_rank == 0) std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
  }
  const bool use_mpi = halo == "mpi", use_nccl = halo == "nccl", use_mm = halo == "meshmem", use_dev = halo == "meshmem-device",
             use_ps = halo == "meshmem-putsignal", use_win = use_mm || use_dev || use_ps;
  if (!(use_mpi || use_nccl || use_win) || (decomp != "rows" && decomp != "blocks")) {
    if (g_rank == 0) std::fprintf(stderr, "--halo=mpi|nccl|meshmem|meshmem-device|meshmem-putsignal, --decomp=rows|blocks\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  // Combinations that cannot run: every rank sees the same arguments, so all leave here.
  const char* reject = nullptr;
  if (use_ps && decomp != "rows")
    reject = "--halo=meshmem-putsignal exchanges rows only (one put_signal per north/south neighbour): use --decomp=rows";
  else if (norm_every < 0)
    reject = "--norm-every N needs N >= 0 (0: the norm only after the timed loop)";
  else if (graph && use_mpi)
    reject = "--graph does not work with --halo=mpi: its exchange waits on the host (cudaStreamSynchronize, MPI_Waitall), "
             "which a CUDA graph cannot capture";
  else if (graph && iters % 2 != 0)
    reject = "--graph replays a pair of iterations: --iters must be even";
  else if (graph && norm_every % 2 != 0)
    reject = "--graph replays a pair of iterations: --norm-every must be even (the norm is taken between replays)";
  if (reject) {
    if (g_rank == 0) std::fprintf(stderr, "03_jacobi: %s\n", reject);
    MPI_Finalize();
    return 1;
  }
#ifndef JACOBI_HAVE_NCCL
  if (use_nccl) {
    if (g_rank == 0) std::fprintf(stderr, "this build has no NCCL\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
#endif
  std::string why;
  if (!meshmem::gpu_available(&why)) {
    if (g_rank == 0) std::fprintf(stderr, "03_jacobi needs a GPU: %s\n", why.c_str());
    MPI_Finalize();
    return 2;
  }
  meshmem::select_local_device(MPI_COMM_WORLD);
  const Block b(nx, ny, nranks, g_rank, decomp == "blocks");
  std::vector<Block> all;
  for (int r = 0; r < nranks; ++r) all.emplace_back(nx, ny, nranks, r, decomp == "blocks");
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  // The two grids: meshmem windows for the meshmem variants, plain device memory otherwise.
  std::unique_ptr<meshmem::Comm> comm;
  meshmem::Window win[2];
  meshmem::HaloExchange plan[2];
  meshmem::Signals sig;  // putsignal: word (parity * 2 + d), d = 0 from north, 1 from south
  double* grid[2] = {nullptr, nullptr};
  if (use_win) {
    comm = std::make_unique<meshmem::Comm>(MPI_COMM_WORLD);
    // Windows are symmetric: every rank asks for the largest block (bands differ by a row).
    std::size_t largest = 0;
    for (const Block& o : all) largest = std::max(largest, o.bytes());
    for (int k = 0; k < 2; ++k) {
      win[k] = comm->alloc(largest);
      grid[k] = static_cast<double*>(win[k].local());
      if (!use_ps) plan[k] = comm->make_halo(win[k], halo_regions(b, all));
    }
    if (use_ps) sig = comm->alloc_signals(4);
  } else {
    for (auto& g : grid) CK(cudaMalloc(&g, b.bytes()));
  }
  const std::vector<double> init = initial(b);
  for (auto* g : grid) CK(cudaMemcpy(g, init.data(), b.bytes(), cudaMemcpyHostToDevice));
  CK(cudaDeviceSynchronize());
  // One-sided halos: a neighbour's first put must not land before this rank's grids are
  // initialised (two-sided MPI and NCCL wait for the receive; puts do not).
  MK(MPI_Barrier(MPI_COMM_WORLD));

  // Per-variant state.
  Neighbours nb[2];  // device variant: where the neighbours' copy of grid k is
  if (use_dev)
    for (int k = 0; k < 2; ++k) {
      auto peer = [&](int r) { return r < 0 ? nullptr : static_cast<double*>(win[k].peer(r)); };
      nb[k].north = peer(b.north);
      nb[k].south = peer(b.south);
      nb[k].west = peer(b.west);
      nb[k].east = peer(b.east);
      if (b.north >= 0) nb[k].north_rows = all[b.north].rows;
      if (b.west >= 0) { nb[k].west_cols = all[b.west].cols; nb[k].west_pitch = all[b.west].pitch; }
      if (b.east >= 0) nb[k].east_pitch = all[b.east].pitch;
      if ((b.north >= 0 && !nb[k].north) || (b.south >= 0 && !nb[k].south) || (b.west >= 0 && !nb[k].west) ||
          (b.east >= 0 && !nb[k].east)) {
        std::fprintf(stderr, "rank %d: a neighbour's window is not mapped here (another node?): use --halo=meshmem\n", g_rank);
        MPI_Abort(MPI_COMM_WORLD, 2);
      }
    }
  // mpi / nccl: staging for edges. Index 0..3 = north, south, west, east.
  const int nbr[4] = {b.north, b.south, b.west, b.east};
  const std::size_t edge_len[4] = {static_cast<std::size_t>(b.cols), static_cast<std::size_t>(b.cols),
                                   static_cast<std::size_t>(b.rows), static_cast<std::size_t>(b.rows)};
  double *h_send[4] = {}, *h_recv[4] = {}, *d_send[4] = {}, *d_recv[4] = {};
  if (use_mpi || use_nccl)
    for (int e = 0; e < 4; ++e) {
      if (nbr[e] < 0) continue;
      CK(cudaMalloc(&d_send[e], edge_len[e] * sizeof(double)));
      CK(cudaMalloc(&d_recv[e], edge_len[e] * sizeof(double)));
      if (use_mpi) {
        CK(cudaMallocHost(&h_send[e], edge_len[e] * sizeof(double)));
        CK(cudaMallocHost(&h_recv[e], edge_len[e] * sizeof(double)));
      }
    }
#ifdef JACOBI_HAVE_NCCL
  ncclComm_t nccl = nullptr;
  if (use_nccl) {
    ncclUniqueId id;
    if (g_rank == 0) NK(ncclGetUniqueId(&id));
    MK(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD));
    NK(ncclCommInitRank(&nccl, nranks, id, g_rank));
  }
#endif
  const dim3 block(32, kBlockRows), blocks((b.cols + 31) / 32, (b.rows + kBlockRows - 1) / kBlockRows);
  // Edges of grid `g` into the staging buffers (pack) and from them into its ring (unpack).
  // Rows: first/last interior row; columns: first/last interior column.
  auto pack = [&](double* g) {
    for (int e = 0; e < 4; ++e) {
      if (nbr[e] < 0) continue;
      if (e < 2) {
        const int row = e == 0 ? 1 : b.rows;
        CK(cudaMemcpyAsync(d_send[e], g + static_cast<std::size_t>(row) * b.pitch + 1, b.cols * sizeof(double), cudaMemcpyDeviceToDevice, s));
      } else {
        pack_column<<<(b.rows + 255) / 256, 256, 0, s>>>(g, b.rows, b.pitch, e == 2 ? 1 : b.cols, d_send[e]);
      }
    }
  };
  auto unpack = [&](double* g) {
    for (int e = 0; e < 4; ++e) {
      if (nbr[e] < 0) continue;
      if (e < 2) {
        const int row = e == 0 ? 0 : b.rows + 1;
        CK(cudaMemcpyAsync(g + static_cast<std::size_t>(row) * b.pitch + 1, d_recv[e], b.cols * sizeof(double), cudaMemcpyDeviceToDevice, s));
      } else {
        unpack_column<<<(b.rows + 255) / 256, 256, 0, s>>>(g, b.rows, b.pitch, e == 2 ? 0 : b.cols + 1, d_recv[e]);
      }
    }
  };
  // The tag says which of our edges a message fills at the receiver: a north neighbour's
  // message fills our north ring row, and it sent its south edge.
  const int opposite[4] = {1, 0, 3, 2};

  // putsignal: where our edge rows land in the neighbours' parts (their bottom / top halo
  // rows), and the signal words we wait on. Words are indexed by iteration parity so that a
  // neighbour's signal of iteration i+2 cannot land before we reset the word of iteration i:
  // it needs our signal of i+1 first, which our stream sends after the reset.
  const std::size_t row_bytes = b.cols * sizeof(double);
  const std::size_t north_halo = b.north >= 0 ? all[b.north].at(all[b.north].rows + 1, 1) : 0;
  const std::size_t south_halo = b.south >= 0 ? all[b.south].at(0, 1) : 0;
  const std::size_t first_word = b.north >= 0 ? 0 : 1;             // d of the words we wait on:
  const std::size_t words = (b.north >= 0 ? 1 : 0) + (b.south >= 0 ? 1 : 0);  // first_word .. + words - 1

  int cur = 0;        // grid[cur] holds the latest values
  long iteration = 0;  // iterations enqueued (captured ones counted once; only its parity matters)
  auto step = [&]() {
    const int nxt = 1 - cur;
    if (use_ps) {
      jacobi_kernel<false><<<blocks, block, 0, s>>>(grid[cur], grid[nxt], b.rows, b.cols, b.pitch, Neighbours{});
      const std::size_t parity = static_cast<std::size_t>(iteration % 2);
      // Our first row is the north neighbour's signal "from south" (d = 1), our last row the
      // south neighbour's "from north" (d = 0). Constants only: the same on every graph replay.
      if (b.north >= 0)
        comm->put_signal(win[nxt], b.north, north_halo, grid[nxt] + b.pitch + 1, row_bytes, sig, parity * 2 + 1, 1,
                         meshmem::SignalOp::Set, s);
      if (b.south >= 0)
        comm->put_signal(win[nxt], b.south, south_halo, grid[nxt] + static_cast<std::size_t>(b.rows) * b.pitch + 1,
                         row_bytes, sig, parity * 2 + 0, 1, meshmem::SignalOp::Set, s);
      // Wait for both neighbours' rows, then reset their words for iteration i+2: one stream operation.
      if (words > 0)
        comm->wait_until_all_then_set(sig, parity * 2 + first_word, words, meshmem::Cmp::GE, 1, 0, s);
    } else if (use_dev) {
      jacobi_kernel<true><<<blocks, block, 0, s>>>(grid[cur], grid[nxt], b.rows, b.cols, b.pitch, nb[nxt]);
      plan[nxt].complete(s);
    } else {
      jacobi_kernel<false><<<blocks, block, 0, s>>>(grid[cur], grid[nxt], b.rows, b.cols, b.pitch, Neighbours{});
      if (use_mm) {
        plan[nxt].exchange(s);
      } else if (use_mpi) {
        pack(grid[nxt]);
        for (int e = 0; e < 4; ++e)
          if (nbr[e] >= 0) CK(cudaMemcpyAsync(h_send[e], d_send[e], edge_len[e] * sizeof(double), cudaMemcpyDeviceToHost, s));
        CK(cudaStreamSynchronize(s));
        MPI_Request reqs[8];
        int nreq = 0;
        for (int e = 0; e < 4; ++e) {
          if (nbr[e] < 0) continue;
          MK(MPI_Irecv(h_recv[e], static_cast<int>(edge_len[e]), MPI_DOUBLE, nbr[e], opposite[e], MPI_COMM_WORLD, &reqs[nreq++]));
          MK(MPI_Isend(h_send[e], static_cast<int>(edge_len[e]), MPI_DOUBLE, nbr[e], e, MPI_COMM_WORLD, &reqs[nreq++]));
        }
        MK(MPI_Waitall(nreq, reqs, MPI_STATUSES_IGNORE));
        for (int e = 0; e < 4; ++e)
          if (nbr[e] >= 0) CK(cudaMemcpyAsync(d_recv[e], h_recv[e], edge_len[e] * sizeof(double), cudaMemcpyHostToDevice, s));
        unpack(grid[nxt]);
      } else {
#ifdef JACOBI_HAVE_NCCL
        pack(grid[nxt]);
        NK(ncclGroupStart());
        for (int e = 0; e < 4; ++e) {
          if (nbr[e] < 0) continue;
          NK(ncclSend(d_send[e], edge_len[e], ncclDouble, nbr[e], nccl, s));
          NK(ncclRecv(d_recv[e], edge_len[e], ncclDouble, nbr[e], nccl, s));
        }
        NK(ncclGroupEnd());
        unpack(grid[nxt]);
#endif
      }
    }
    cur = nxt;
    ++iteration;
  };

  // L2 norm of the last update (grid[cur] - grid[1-cur]) over the whole grid, on the compute
  // stream; the host waits for it (a convergence check has to).
  double* d_sum = nullptr;
  double* h_sum = nullptr;  // pinned: the copy is a real async copy on the stream
  CK(cudaMalloc(&d_sum, sizeof(double)));
  CK(cudaMallocHost(&h_sum, sizeof(double)));
  auto norm = [&]() {
    CK(cudaMemsetAsync(d_sum, 0, sizeof(double), s));
    residual_kernel<<<blocks, block, 0, s>>>(grid[1 - cur], grid[cur], b.rows, b.cols, b.pitch, d_sum);
    CK(cudaGetLastError());
    CK(cudaMemcpyAsync(h_sum, d_sum, sizeof(double), cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    double total = 0;
    MK(MPI_Allreduce(h_sum, &total, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
    return std::sqrt(total);
  };

  for (int it = 0; it < warmup; ++it) step();
  // --graph: one pair of iterations, both parities (grid k, win[k], plan[k], signal words), so
  // every replay starts where the previous one ended; the two swaps leave cur as it was.
  // Capturing runs nothing: the grids still hold the warm-up's result.
  cudaGraphExec_t pair = nullptr;
  if (graph) {
    cudaGraph_t captured = nullptr;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    step();
    step();
    CK(cudaStreamEndCapture(s, &captured));
    CK(cudaGraphInstantiate(&pair, captured, 0));
    CK(cudaGraphDestroy(captured));
    CK(cudaGraphUpload(pair, s));  // not in the first timed launch
  }
  CK(cudaStreamSynchronize(s));
  MK(MPI_Barrier(MPI_COMM_WORLD));
  const auto t0 = std::chrono::steady_clock::now();
  if (pair) {
    const int launches_per_norm = norm_every / 2;
    for (int k = 0; k < iters / 2; ++k) {
      CK(cudaGraphLaunch(pair, s));
      if (norm_every > 0 && (k + 1) % launches_per_norm == 0) norm();
    }
  } else {
    for (int it = 0; it < iters; ++it) {
      step();
      if (norm_every > 0 && (it + 1) % norm_every == 0) norm();
    }
  }
  CK(cudaStreamSynchronize(s));
  const double mine = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
  CK(cudaGetLastError());
  double per_iter = 0;
  MK(MPI_Allreduce(&mine, &per_iter, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));

  const double l2 = norm();
  CK(cudaFree(d_sum));
  CK(cudaFreeHost(h_sum));

  // --check: gather the interiors and compare with the same iterations on one GPU.
  double maxdiff = -1;
  if (check) {
    std::vector<double> h(b.cells());
    CK(cudaMemcpy(h.data(), grid[cur], b.bytes(), cudaMemcpyDeviceToHost));
    std::vector<double> interior(static_cast<std::size_t>(b.rows) * b.cols);
    for (int i = 0; i < b.rows; ++i)
      std::memcpy(&interior[static_cast<std::size_t>(i) * b.cols], &h[static_cast<std::size_t>(i + 1) * b.pitch + 1], b.cols * sizeof(double));
    if (g_rank == 0) {
      const std::vector<double> ref = single_gpu(nx, ny, warmup + iters);
      maxdiff = 0;
      for (int r = 0; r < nranks; ++r) {
        const Block& o = all[r];
        std::vector<double> part_r(static_cast<std::size_t>(o.rows) * o.cols);
        if (r == 0) part_r = interior;
        else MK(MPI_Recv(part_r.data(), static_cast<int>(part_r.size()), MPI_DOUBLE, r, 99, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
        for (int i = 0; i < o.rows; ++i)
          for (int j = 0; j < o.cols; ++j)
            maxdiff = std::max(maxdiff, std::fabs(part_r[static_cast<std::size_t>(i) * o.cols + j] -
                                                  ref[static_cast<std::size_t>(o.row0 + i) * (nx) + (o.col0 + j)]));
      }
    } else {
      MK(MPI_Send(interior.data(), static_cast<int>(interior.size()), MPI_DOUBLE, 0, 99, MPI_COMM_WORLD));
    }
  }

  if (g_rank == 0) {
    std::string variant = nranks == 1 ? "single-gpu" : (halo + (decomp == "blocks" ? "-blocks" : ""));
    if (norm_every > 0) variant += "-norm" + std::to_string(norm_every);
    if (graph) variant += "-graph";
    std::printf("jacobi %dx%d, %d ranks (%dx%d %s), halo=%s, norm_every=%d%s: %d iterations, %.2f us per iteration, "
                "L2 norm of last update %.10e",
                nx, ny, nranks, b.px, b.py, decomp.c_str(), halo.c_str(), norm_every, graph ? ", graph" : "", iters, per_iter, l2);
    if (check) std::printf(", max |diff| vs single GPU %.3e %s", maxdiff, maxdiff < 1e-10 ? "(OK)" : "(MISMATCH)");
    std::printf("\n");
    if (!csv.empty())
      bench::write_results_csv(csv, bench::CsvMode::Append, date, commit, machine,
                               {{"jacobi", variant, nranks, nx, per_iter, -1}}, "03_jacobi");
  }
  const int rc = (check && g_rank == 0 && !(maxdiff < 1e-10)) ? 1 : 0;
  if (pair) CK(cudaGraphExecDestroy(pair));  // before the NCCL comm and windows it refers to
#ifdef JACOBI_HAVE_NCCL
  if (nccl) NK(ncclCommDestroy(nccl));
#endif
  for (int e = 0; e < 4; ++e) {
    if (d_send[e]) cudaFree(d_send[e]);
    if (d_recv[e]) cudaFree(d_recv[e]);
    if (h_send[e]) cudaFreeHost(h_send[e]);
    if (h_recv[e]) cudaFreeHost(h_recv[e]);
  }
  if (!use_win)
    for (auto* g : grid) cudaFree(g);
  for (auto& p : plan) p = meshmem::HaloExchange();
  for (auto& w : win) w = meshmem::Window();
  sig = meshmem::Signals();
  comm.reset();
  CK(cudaStreamDestroy(s));
  int any = 0;
  MPI_Allreduce(&rc, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}
