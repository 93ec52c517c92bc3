// DeviceWindow: the stream barrier 10,000 times in both variants, with busy and idle streams,
// and across (simulated) nodes.
#include "device_window.hpp"

namespace {
// Reads what the left neighbour wrote for iteration `it`; counts mismatches.
__global__ void check_iteration(const std::uint64_t* slot, std::uint64_t want, unsigned* errors) {
  if (*reinterpret_cast<const volatile std::uint64_t*>(slot) != want) atomicAdd(errors, 1u);
}
}  // namespace

// 10,000 rounds (500 in the fast tier) of: put my round number into the right neighbour,
// barrier(stream), check that the left neighbour's round number is there. A barrier that lets
// any rank through early shows up as a stale value. Rank 0 prints the time per barrier and the
// barrier's variant (run_entries.sh's barrier probe compares them): where ranks share a GPU,
// a variant that polls in a kernel waits for the time slices of every other rank's context.
TEST_F(DeviceWindow, BarrierTenThousandRounds) {
  const int rounds = meshmem::test::rounds(10000, 500);
  Window win = comm->alloc(64);
  DeviceBuffer values(static_cast<std::size_t>(rounds) * sizeof(std::uint64_t));
  std::vector<std::uint64_t> host(static_cast<std::size_t>(rounds));
  for (int i = 0; i < rounds; ++i) host[i] = (static_cast<std::uint64_t>(me) << 32) | static_cast<std::uint64_t>(i + 1);
  upload(values.p, host.data(), values.bytes);
  DeviceBuffer errors(sizeof(unsigned));
  CUDA_OK(fill_now(errors.p, 0, sizeof(unsigned)));
  const int left = (me + n - 1) % n;
  comm->barrier(stream);
  CUDA_OK(cudaStreamSynchronize(stream));
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < rounds; ++i) {
    comm->put(win, (me + 1) % n, 0, static_cast<std::uint64_t*>(values.p) + i, sizeof(std::uint64_t), stream);
    comm->barrier(stream);
    check_iteration<<<1, 1, 0, stream>>>(static_cast<const std::uint64_t*>(win.local()),
                                         (static_cast<std::uint64_t>(left) << 32) | static_cast<std::uint64_t>(i + 1),
                                         static_cast<unsigned*>(errors.p));
    comm->barrier(stream);  // nobody overwrites before the check ran
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (me == 0) {
    std::string variant = comm->device_info();
    const std::size_t at = variant.find("barrier(stream)");
    variant = at == std::string::npos ? "?" : variant.substr(at, variant.find('\n', at) - at);
    std::printf("[ barrier timing ] %d ranks, %d rounds, %.2f s, %.1f us per barrier; %s\n", n, rounds, seconds,
                seconds * 1e6 / (2.0 * rounds), variant.c_str());
    std::fflush(stdout);
  }
  unsigned bad = 0;
  CUDA_OK(cudaMemcpy(&bad, errors.p, sizeof(bad), cudaMemcpyDeviceToHost));
  EXPECT_EQ(bad, 0u) << "rounds in which the barrier let a stale value through";
}

namespace {
// Waits `ns` on the GPU, then stores `value` into a peer's window: a put that lands late.
__global__ void late_store(std::uint64_t* dst, std::uint64_t value, unsigned ns) {
  std::uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
  *reinterpret_cast<volatile std::uint64_t*>(dst) = value;
}
}  // namespace

// The barrier with some ranks' streams busy (a store into the right neighbour still waiting
// on the GPU) and others idle (their store done and synchronised): every rank must see its
// left neighbour's store after the barrier, whichever state either was in. Rounds where all
// streams are idle and all are busy are included.
TEST_F(DeviceWindow, BarrierOrdersBusyAndIdleStreams) {
  Window win = comm->alloc(64);
  // A mapped neighbour gets the late store itself; an unmapped (staged) one a put of a word
  // that the late store wrote here.
  auto* right_word = static_cast<std::uint64_t*>(win.peer((me + 1) % n));
  DeviceBuffer outgoing(sizeof(std::uint64_t));
  DeviceBuffer errors(sizeof(unsigned));
  CUDA_OK(fill_now(errors.p, 0, sizeof(unsigned)));
  const int left = (me + n - 1) % n;
  std::mt19937_64 gen(seed);  // the same draws on every rank
  comm->barrier(stream);
  int busy_rounds = 0, idle_rounds = 0;
  const int rounds = meshmem::test::rounds(600, 150);  // 150 in the fast tier
  for (int i = 0; i < rounds; ++i) {
    const std::uint64_t draw = gen();
    const int pattern = static_cast<int>(draw % 4);  // 0: all idle, 1: all busy, else mixed
    const bool busy = pattern == 1 || (pattern >= 2 && ((draw >> 8) + me) % 2 == 0);
    const unsigned ns = busy ? 5000 + static_cast<unsigned>((draw >> 16) % 40000) : 0;
    late_store<<<1, 1, 0, stream>>>(right_word ? right_word : static_cast<std::uint64_t*>(outgoing.p),
                                    (static_cast<std::uint64_t>(me) << 32) | (i + 1), ns);
    CUDA_OK(cudaGetLastError());
    if (right_word == nullptr) comm->put(win, (me + 1) % n, 0, outgoing.p, sizeof(std::uint64_t), stream);
    if (!busy) CUDA_OK(cudaStreamSynchronize(stream));
    (busy ? busy_rounds : idle_rounds)++;
    comm->barrier(stream);
    check_iteration<<<1, 1, 0, stream>>>(static_cast<const std::uint64_t*>(win.local()),
                                         (static_cast<std::uint64_t>(left) << 32) | (i + 1),
                                         static_cast<unsigned*>(errors.p));
    comm->barrier(stream);  // nobody overwrites before the check ran
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  unsigned bad = 0;
  CUDA_OK(cudaMemcpy(&bad, errors.p, sizeof(bad), cudaMemcpyDeviceToHost));
  EXPECT_EQ(bad, 0u) << "rounds in which a rank read its left neighbour's word before the store landed ("
                     << busy_rounds << " busy, " << idle_rounds << " idle rounds on this rank)";
}

// Across (simulated) nodes the barrier is hierarchical (node kernel, the node leaders' NCCL
// all-reduce, node kernel) or goes through a proxy thread: the host must not wait for the
// GPU, and every rank must see its left neighbour's late store after the barrier. The stores
// go through host memory that all ranks of the machine share (an MPI shared window
// registered with CUDA), since device windows do not span nodes.
TEST_F(DeviceWindow, BarrierAcrossNodesOrdersAndDoesNotBlockHost) {
  if (comm->node_count() == 1) GTEST_SKIP() << "needs ranks on several (real or simulated) nodes";
  MPI_Comm machine;
  ASSERT_EQ(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &machine), MPI_SUCCESS);
  int machine_size = 0;
  MPI_Comm_size(machine, &machine_size);
  if (machine_size != n) {
    MPI_Comm_free(&machine);
    GTEST_SKIP() << "needs every rank on this machine (the check goes through shared host memory)";
  }
  {
    // The variant MESHMEM_BARRIER_ACROSS_NODES asks for; `auto` takes the hierarchical one
    // where every pair across nodes is nccl, every node pair ipc, and no GPU is shared.
    int hierarchical_expected = 1;
    for (int r = 0; r < n; ++r)
      if (r != me)
        hierarchical_expected &= comm->transport(r, Memory::Device) ==
                                 (comm->node_of(r) == comm->node_of(me) ? TransportKind::Ipc : TransportKind::Nccl);
    int dev = 0;
    CUDA_OK(cudaGetDevice(&dev));
    char bus[32] = {};
    CUDA_OK(cudaDeviceGetPCIBusId(bus, sizeof(bus), dev));
    std::vector<char> buses(sizeof(bus) * static_cast<std::size_t>(n));
    MPI_Allgather(bus, sizeof(bus), MPI_CHAR, buses.data(), sizeof(bus), MPI_CHAR, machine);
    for (int r = 0; r < n; ++r)
      if (r != me && std::strncmp(bus, buses.data() + r * sizeof(bus), sizeof(bus)) == 0) hierarchical_expected = 0;
    MPI_Allreduce(MPI_IN_PLACE, &hierarchical_expected, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    const char* asked_env = std::getenv("MESHMEM_BARRIER_ACROSS_NODES");
    const std::string asked = asked_env ? asked_env : "auto";
    const std::string info = comm->device_info();
    if (me == 0) std::printf("[ info     ] %s\n", info.c_str());
    const bool hierarchical = info.find("barrier(stream) hierarchical") != std::string::npos;
    if (asked == "nccl") EXPECT_TRUE(hierarchical) << info;
    if (asked == "auto") EXPECT_EQ(hierarchical, hierarchical_expected == 1) << info;
    if (asked == "proxy") EXPECT_FALSE(hierarchical) << info;
  }
  MPI_Win win;
  std::uint64_t* base = nullptr;
  const MPI_Aint bytes = me == 0 ? 4096 : 0;
  ASSERT_EQ(MPI_Win_allocate_shared(bytes, 8, MPI_INFO_NULL, machine, &base, &win), MPI_SUCCESS);
  MPI_Aint got = 0;
  int unit = 0;
  ASSERT_EQ(MPI_Win_shared_query(win, 0, &got, &unit, &base), MPI_SUCCESS);
  if (me == 0) std::memset(base, 0, 4096);
  MPI_Barrier(machine);
  CUDA_OK(cudaHostRegister(base, 4096, cudaHostRegisterMapped | cudaHostRegisterPortable));
  std::uint64_t* slots = nullptr;
  CUDA_OK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&slots), base, 0));
  DeviceBuffer errors(sizeof(unsigned));
  CUDA_OK(fill_now(errors.p, 0, sizeof(unsigned)));
  const int left = (me + n - 1) % n, right = (me + 1) % n;
  comm->barrier(stream);

  // The host does not wait: behind 200 ms of GPU work, barrier(stream) returns at once.
  late_store<<<1, 1, 0, stream>>>(slots + 64, 0, 200u * 1000u * 1000u);
  const auto t0 = std::chrono::steady_clock::now();
  comm->barrier(stream);
  const double host_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(host_ms, 50.0) << "barrier(stream) across nodes blocked the host behind 200 ms of GPU work";
  CUDA_OK(cudaStreamSynchronize(stream));

  std::mt19937_64 gen(seed);
  for (int i = 0; i < 300; ++i) {
    const std::uint64_t draw = gen();
    const int pattern = static_cast<int>(draw % 4);  // 0: all idle, 1: all busy, else mixed
    const bool busy = pattern == 1 || (pattern >= 2 && ((draw >> 8) + me) % 2 == 0);
    const unsigned ns = busy ? 5000 + static_cast<unsigned>((draw >> 16) % 40000) : 0;
    late_store<<<1, 1, 0, stream>>>(slots + right, (static_cast<std::uint64_t>(me) << 32) | (i + 1), ns);
    CUDA_OK(cudaGetLastError());
    if (!busy) CUDA_OK(cudaStreamSynchronize(stream));
    comm->barrier(stream);
    check_iteration<<<1, 1, 0, stream>>>(slots + me, (static_cast<std::uint64_t>(left) << 32) | (i + 1),
                                         static_cast<unsigned*>(errors.p));
    comm->barrier(stream);
  }
  // One node busy for 20 ms, the others idle: a barrier whose node parts pass without the
  // nodes meeting lets the idle nodes read before the busy node's stores (on a GPU shared
  // by the ranks, the short random delays above can hide that behind the time slices).
  for (int i = 300; i < 300 + 2 * comm->node_count(); ++i) {
    const bool busy = comm->node_of(me) == i % comm->node_count();
    late_store<<<1, 1, 0, stream>>>(slots + right, (static_cast<std::uint64_t>(me) << 32) | (i + 1),
                                    busy ? 20u * 1000u * 1000u : 0u);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(busy ? cudaSuccess : cudaStreamSynchronize(stream));
    comm->barrier(stream);
    check_iteration<<<1, 1, 0, stream>>>(slots + me, (static_cast<std::uint64_t>(left) << 32) | (i + 1),
                                         static_cast<unsigned*>(errors.p));
    comm->barrier(stream);
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  unsigned bad = 0;
  CUDA_OK(cudaMemcpy(&bad, errors.p, sizeof(bad), cudaMemcpyDeviceToHost));
  EXPECT_EQ(bad, 0u) << "rounds in which a rank read its left neighbour's word before the store landed";
  CUDA_OK(cudaHostUnregister(base));
  MPI_Win_free(&win);
  MPI_Comm_free(&machine);
}

