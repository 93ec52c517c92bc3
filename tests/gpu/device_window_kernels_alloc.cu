// DeviceWindow: kernels that write into peers through the device API, its block copy at every
// alignment, alloc/free cycles back to the baseline of GPU memory and descriptors, and bad
// arguments.
#include "device_window.hpp"

namespace {
// Device API: every block writes its slice to the right neighbour and signals once.
__global__ void ring_kernel(device::WindowView win, device::SignalsView sig, const unsigned char* src,
                            std::size_t bytes, std::uint64_t value) {
  const int right = (win.rank + 1) % win.size;
  const std::size_t per = (bytes + gridDim.x - 1) / gridDim.x;
  const std::size_t begin = per * blockIdx.x;
  const std::size_t len = begin >= bytes ? 0 : (begin + per > bytes ? bytes - begin : per);
  device::put_signal_block(win, right, begin, src + begin, len, sig, 0, value, SignalOp::Add);
}
__global__ void wait_kernel(device::SignalsView sig, std::uint64_t value) {
  if (threadIdx.x == 0) device::wait_until(sig, 0, Cmp::GE, value);
}
}  // namespace

TEST_F(DeviceWindow, KernelsWriteIntoPeersThroughDeviceApi) {
  const std::size_t bytes = (3u << 20) + 11;
  const unsigned blocks = 24;
  Window win = comm->alloc(bytes);
  const std::string unmapped = meshmem::test::unmapped_peer(*comm, win);
  if (!unmapped.empty()) GTEST_SKIP() << unmapped;
  Signals sig = comm->alloc_signals(1);
  const int right = (me + 1) % n, left = (me + n - 1) % n;
  auto data = pattern(seed, key(bytes, me, right, 3), bytes);
  DeviceBuffer src(bytes);
  upload(src.p, data.data(), bytes);
  CUDA_OK(fill_now(win.local(), kPoison, bytes));
  comm->barrier(stream);
  ring_kernel<<<blocks, 256, 0, stream>>>(win.view(), sig.view(), static_cast<unsigned char*>(src.p), bytes, 1);
  wait_kernel<<<1, 32, 0, stream>>>(sig.view(), blocks);  // one Add per block
  CUDA_OK(cudaStreamSynchronize(stream));
  auto got = to_host(win.local(), bytes);
  auto want = pattern(seed, key(bytes, left, me, 3), bytes);
  EXPECT_EQ(first_difference(got.data(), want.data(), bytes), -1);
  comm->barrier(stream);
  CUDA_OK(cudaStreamSynchronize(stream));
}

namespace {
// One block per (destination offset, source offset, length): device::copy_block between
// pointers of every relative alignment within 16 bytes.
__host__ __device__ constexpr std::size_t copy_len(unsigned block) {
  return block % 4 == 0 ? 1 : block % 4 == 1 ? 15 : block % 4 == 2 ? 33 : 4099;
}
constexpr std::size_t kCopyRegion = 4099 + 64;  // room for both offsets and guard bytes
__global__ void copy_block_kernel(unsigned char* dst, const unsigned char* src) {
  const unsigned b = blockIdx.x;
  const std::size_t len = copy_len(b), so = (b / 4) % 16, doff = b / 64;
  device::copy_block(dst + b * kCopyRegion + 16 + doff, src + b * kCopyRegion + so, len);
}
}  // namespace

// The device API's block copy moves every byte, and only those, whatever the two pointers'
// alignments (a row 8 bytes into a 16-byte line, odd offsets), with the whole block.
TEST_F(DeviceWindow, BlockCopyMovesEveryByteAtEveryRelativeAlignment) {
  const unsigned blocks = 16 * 16 * 4;
  const std::size_t bytes = blocks * kCopyRegion;
  const auto data = pattern(seed, key(bytes, me, me, 11), bytes);
  DeviceBuffer src(bytes), dst(bytes);
  upload(src.p, data.data(), bytes);
  CUDA_OK(fill_now(dst.p, kPoison, bytes));
  copy_block_kernel<<<blocks, 256, 0, stream>>>(static_cast<unsigned char*>(dst.p), static_cast<const unsigned char*>(src.p));
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaStreamSynchronize(stream));
  const auto got = to_host(dst.p, bytes);
  for (unsigned b = 0; b < blocks; ++b) {
    const std::size_t len = copy_len(b), so = (b / 4) % 16, doff = b / 64;
    std::vector<unsigned char> want(kCopyRegion, static_cast<unsigned char>(kPoison));
    std::memcpy(want.data() + 16 + doff, data.data() + b * kCopyRegion + so, len);
    ASSERT_EQ(first_difference(got.data() + b * kCopyRegion, want.data(), kCopyRegion), -1)
        << "block " << b << ": " << len << " bytes from source offset " << so << " to destination offset " << doff;
  }
}

TEST_F(DeviceWindow, AllocFreeCyclesReturnToBaseline) {
  { Window warm = comm->alloc(64u << 20); }
  CUDA_OK(cudaDeviceSynchronize());
  MPI_Barrier(MPI_COMM_WORLD);
  std::size_t free0 = 0, total = 0;
  CUDA_OK(cudaMemGetInfo(&free0, &total));
  const int fds0 = meshmem::test::count_fds();
  for (int cycle = 0; cycle < 20; ++cycle) {
    Window win = comm->alloc((64u << 20) + static_cast<std::size_t>(cycle));
    Signals sig = comm->alloc_signals(8);
    const std::uint64_t v = static_cast<std::uint64_t>(cycle);
    comm->put_signal(win, (me + 1) % n, 0, &v, sizeof(v), sig, 0, 1, SignalOp::Set, stream);
    comm->barrier(stream);
    CUDA_OK(cudaStreamSynchronize(stream));
    if (cycle % 2) win.free();
  }
  CUDA_OK(cudaDeviceSynchronize());
  MPI_Barrier(MPI_COMM_WORLD);  // every rank released its mappings of the others' memory
  std::size_t free1 = 0;
  CUDA_OK(cudaMemGetInfo(&free1, &total));
  EXPECT_EQ(meshmem::test::count_fds(), fds0);
  // Several ranks may share this GPU: allow for their allocator slack, not for a leak
  // (20 cycles of 64 MiB would be 1.25 GiB).
  EXPECT_LE(free0 > free1 ? free0 - free1 : 0, std::size_t{32} << 20) << "GPU memory not returned";
}

TEST_F(DeviceWindow, BadArguments) {
  Window win = comm->alloc(1000);
  Signals sig = comm->alloc_signals(2);
  const std::uint64_t v = 1;
  EXPECT_THROW(comm->put(win, n, 0, &v, 8, stream), Error);
  EXPECT_THROW(comm->put(win, 0, 996, &v, 8, stream), Error);
  EXPECT_THROW(comm->put_signal(win, 0, 0, &v, 8, sig, 2, 1, SignalOp::Set, stream), Error);
  EXPECT_THROW(comm->wait_until(sig, 5, Cmp::GE, 1, stream), Error);
  Window host = comm->alloc(64, Memory::Host);
  EXPECT_THROW(comm->put_signal(host, 0, 0, &v, 8, sig, 0, 1, SignalOp::Set), Error);  // kinds differ
  EXPECT_THROW((void)host.view(), Error);
  comm->barrier(stream);
  CUDA_OK(cudaStreamSynchronize(stream));
}

// HaloExchange on device windows: 2D blocks with strided columns, stream-ordered, several
// rounds, every cell checked.
#include "halo_grid.hpp"

// MESHMEM_HALO_SENDS reaches the device runtime (the halo_sends entries run the halo cases
// with each value): device_info says `serial` where it is set, and only there (`concurrent`
// is the default).
