// DeviceWindow: halo exchanges, graphs of put_signal and get, and routes and halos across
// (simulated) nodes.
#include "device_window.hpp"

TEST_F(DeviceWindow, HaloExchangeSendsAsTheKnobSays) {
  const char* knob = std::getenv("MESHMEM_HALO_SENDS");
  const bool serial = knob != nullptr && std::strcmp(knob, "serial") == 0;
  EXPECT_EQ(comm->device_info().find("halo sends serial") != std::string::npos, serial)
      << "rank " << me << ", MESHMEM_HALO_SENDS=" << (knob ? knob : "(unset)") << ": " << comm->device_info();
}

TEST_F(DeviceWindow, HaloBlockDecompositionWithColumns) {
  meshmem::test::BlockGrid g(n, me, 301, 157);
  Window win = comm->alloc(g.bytes());
  HaloExchange halo = comm->make_halo(win, g.regions());
  const double poison = -7.25;
  const std::size_t cells = (g.ny + 2) * (g.nx + 2);
  for (int round = 0; round < 5; ++round) {
    std::vector<double> mine(cells, poison);
    for (std::size_t y = 1; y <= g.ny; ++y)
      for (std::size_t x = 1; x <= g.nx; ++x) mine[y * (g.nx + 2) + x] = meshmem::test::cell(seed, me, round, y, x);
    upload(win.local(), mine.data(), cells * sizeof(double));
    comm->barrier(stream);
    halo.exchange(stream);
    CUDA_OK(cudaStreamSynchronize(stream));
    auto got = to_host(win.local(), cells * sizeof(double));
    const auto want = meshmem::test::expected_grid(g, seed, me, round, poison);
    EXPECT_EQ(first_difference(got.data(), want.data(), cells * sizeof(double)), -1) << "round " << round << ", rank " << me;
    comm->barrier(stream);
    CUDA_OK(cudaStreamSynchronize(stream));
  }
}

// Columns: strided regions (unaligned offsets, different pitches here and there) to both ring
// neighbours, fresh data every round, the whole window poisoned first and every byte checked.
// Between nodes (nccl) the rows go packed, as one transfer unpacked at the target.
TEST_F(DeviceWindow, StridedHaloRegionsEveryByte) {
  constexpr std::size_t kWidth = 24, kHeight = 157, kSrcPitch = 1000, kDstPitch = 1240;
  constexpr std::size_t kToRight = 5;                                   // rows sent right
  constexpr std::size_t kToLeft = kToRight + kSrcPitch * kHeight + 3;   // other rows, sent left
  constexpr std::size_t kFromLeft = kToLeft + kSrcPitch * kHeight + 11;     // the left neighbour's land here
  constexpr std::size_t kFromRight = kFromLeft + kDstPitch * kHeight + 13;  // the right one's here
  const std::size_t bytes = kFromRight + kDstPitch * kHeight + 64;
  const int right = (me + 1) % n, left = (me + n - 1) % n;
  Window win = comm->alloc(bytes);
  HaloExchange halo = comm->make_halo(win, {{right, kToRight, kFromLeft, kWidth, kHeight, kSrcPitch, kDstPitch},
                                            {left, kToLeft, kFromRight, kWidth, kHeight, kSrcPitch, kDstPitch}});
  for (int round = 0; round < 4; ++round) {
    // Different rows each way, so that two ranks that are both neighbours cannot swap them.
    const auto rows_of = [&](int rank, int way) { return pattern(seed, key(round, rank, way, 7), kWidth * kHeight); };
    const auto place = [&](std::vector<unsigned char>& image, std::size_t at, std::size_t pitch, int rank, int way) {
      const auto rows = rows_of(rank, way);
      for (std::size_t y = 0; y < kHeight; ++y) std::memcpy(image.data() + at + y * pitch, rows.data() + y * kWidth, kWidth);
    };
    std::vector<unsigned char> image(bytes, kPoison);
    place(image, kToRight, kSrcPitch, me, 0);
    place(image, kToLeft, kSrcPitch, me, 1);
    upload(win.local(), image.data(), bytes);
    comm->barrier(stream);
    halo.exchange(stream);
    CUDA_OK(cudaStreamSynchronize(stream));
    place(image, kFromLeft, kDstPitch, left, 0);
    place(image, kFromRight, kDstPitch, right, 1);
    const auto got = to_host(win.local(), bytes);
    EXPECT_EQ(first_difference(got.data(), image.data(), bytes), -1)
        << "round " << round << ", rank " << me << " (left " << left << " through "
        << to_string(comm->transport(left, Memory::Device)) << ", right " << right << " through "
        << to_string(comm->transport(right, Memory::Device)) << ")";
    comm->barrier(stream);
    CUDA_OK(cudaStreamSynchronize(stream));
  }
}

// A put_signal (Add) to the right neighbour and a get from it, captured once into a CUDA graph
// and replayed with fresh data every time: each route's transfers (ipc, staged, nccl across
// nodes) are correct on every replay. Destinations poisoned first, every byte checked, the
// signal counting the replays.
void DeviceWindow::graph_of_put_signal_and_get_replays(cudaStream_t s) {
  constexpr std::size_t kBytes = 65536 + 13, kGetFrom = kBytes + 8, kWindow = 2 * kBytes + 16;
  constexpr int kReplays = 20;
  const int right = (me + 1) % n, left = (me + n - 1) % n;
  Window win = comm->alloc(kWindow);
  Signals sig = comm->alloc_signals(static_cast<std::size_t>(n));
  DeviceBuffer src(kBytes), got(kBytes);
  CUDA_OK(cudaMemset(sig.local(), 0, static_cast<std::size_t>(n) * sizeof(std::uint64_t)));
  comm->barrier(s);
  CUDA_OK(cudaStreamSynchronize(s));
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  comm->put_signal(win, right, 0, src.p, kBytes, sig, static_cast<std::size_t>(me), 1, SignalOp::Add, s);
  comm->get(got.p, win, right, kGetFrom, kBytes, s);
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphDestroy(graph));  // the instantiation keeps what the capture made
  int bad = 0;
  for (int rep = 0; rep < kReplays; ++rep) {
    const auto put_data = [&](int rank) { return pattern(seed, key(rep, rank, 0, 3), kBytes); };
    const auto get_data = [&](int rank) { return pattern(seed, key(rep, rank, 0, 4), kBytes); };
    std::vector<unsigned char> image(kWindow, kPoison);
    const auto serve = get_data(me);
    std::memcpy(image.data() + kGetFrom, serve.data(), kBytes);
    upload(win.local(), image.data(), kWindow);
    const auto mine = put_data(me);
    upload(src.p, mine.data(), kBytes);
    CUDA_OK(cudaMemset(got.p, kPoison, kBytes));
    CUDA_OK(cudaDeviceSynchronize());
    MPI_Barrier(MPI_COMM_WORLD);  // every source and window of this replay is in place
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    MPI_Barrier(MPI_COMM_WORLD);  // every put of this replay is at its target
    const auto from_left = put_data(left);
    std::memcpy(image.data(), from_left.data(), kBytes);
    const auto window_now = to_host(win.local(), kWindow);
    const auto fetched = to_host(got.p, kBytes);
    const auto want = get_data(right);
    const std::uint64_t count = sig.read(static_cast<std::size_t>(left));
    if ((first_difference(window_now.data(), image.data(), kWindow) >= 0 ||
         first_difference(fetched.data(), want.data(), kBytes) >= 0 || count != static_cast<std::uint64_t>(rep + 1)) &&
        ++bad <= 3)
      ADD_FAILURE() << "replay " << rep << " on rank " << me << ": window first differs at "
                    << first_difference(window_now.data(), image.data(), kWindow) << ", get at "
                    << first_difference(fetched.data(), want.data(), kBytes) << ", signal " << count << " (want "
                    << rep + 1 << "); routes: left " << to_string(comm->transport(left, Memory::Device)) << ", right "
                    << to_string(comm->transport(right, Memory::Device));
    MPI_Barrier(MPI_COMM_WORLD);
  }
  EXPECT_EQ(bad, 0);
  CUDA_OK(cudaGraphExecDestroy(exec));
}

TEST_F(DeviceWindow, GraphOfPutSignalAndGetReplays) { graph_of_put_signal_and_get_replays(stream); }
// The per-thread default stream can be captured too (the legacy one cannot). (These calls
// passed there before meshmem saw such a capture; HaloExchange did not: see
// GraphReplay.HaloExchangeCapturedOnThePerThreadStreamReplays.)
TEST_F(DeviceWindow, GraphOfPutSignalAndGetReplaysOnThePerThreadStream) {
  graph_of_put_signal_and_get_replays(cudaStreamPerThread);
}

// A halo neighbour on another (real or simulated) node has no device route yet: the plan is
// refused on every rank with Error(Unsupported) naming the pair and each transport's reason
// (an early version accepted it, and complete() then stored signals through a null peer pointer).
TEST_F(DeviceWindow, HaloAcrossNodesRefusesUnreachableNeighbour) {
  if (comm->node_count() == 1) GTEST_SKIP() << "needs ranks on several (real or simulated) nodes";
  Window win = comm->alloc(4096);
  const int right = (me + 1) % n, left = (me + n - 1) % n;
  // Whether to skip is decided alike on every rank (make_halo is collective): the lowest rank
  // with an unreachable neighbour reports its first such region (its right neighbour where
  // that is unreachable, else its left one). Only a rank's own routes are known to it.
  const bool right_none = comm->transport(right, Memory::Device) == TransportKind::None;
  const bool left_none = comm->transport(left, Memory::Device) == TransportKind::None;
  const int mine = right_none || left_none ? me : n;
  int reporter = n;
  MPI_Allreduce(&mine, &reporter, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (reporter == n) GTEST_SKIP() << "every halo neighbour is reached (nccl between the nodes' GPUs)";
  int unreached = right_none ? right : left;
  MPI_Bcast(&unreached, 1, MPI_INT, reporter, MPI_COMM_WORLD);
  try {
    HaloExchange halo = comm->make_halo(win, {{right, 0, 2048, 8}, {left, 8, 3072, 8}});
    ADD_FAILURE() << "make_halo accepted a neighbour that no transport reaches";
    return;  // complete() would store through a null peer pointer
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Unsupported) << e.what();
    for (const std::string& p : std::vector<std::string>{"comm.make_halo on rank " + std::to_string(reporter), "no transport reaches device window",
                                "of rank " + std::to_string(unreached), "ipc: rank " + std::to_string(unreached)})
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "'" << p << "' not in: " << e.what();
  }
  // The Comm stays usable.
  comm->barrier(stream);
  CUDA_OK(cudaStreamSynchronize(stream));
}

// A rank late to the nccl transport's connect by more than the timeout (delayed after the
// NCCL ids are exchanged, before it makes its NCCL communicators): the others' NCCL
// initialisation gives up within MESHMEM_TIMEOUT and their constructors raise, naming the
// late rank, instead of waiting inside NCCL until it comes; the late rank raises too.
TEST_F(DeviceWindow, NcclConnectWithALatePeerIsBounded) {
  int every_rank_uses_nccl = 0;
  for (int r = 0; r < n; ++r) every_rank_uses_nccl |= comm->transport(r, Memory::Device) == TransportKind::Nccl;
  MPI_Allreduce(MPI_IN_PLACE, &every_rank_uses_nccl, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!every_rank_uses_nccl) GTEST_SKIP() << "needs every rank to reach some rank through nccl";
  const int late = n - 1;
  constexpr double kTimeout = 3, kLate = 12;
  Options o = options_from_env();
  o.timeout = std::chrono::milliseconds(static_cast<int>(kTimeout * 1000));
  o.set("MESHMEM_FAULT", std::to_string(late) + ":nccl.connect:delay=" + std::to_string(static_cast<int>(kLate * 1000)));
  const auto t0 = std::chrono::steady_clock::now();
  std::string message;
  ErrorCode code = ErrorCode::Internal;
  try {
    Comm late_comm(MPI_COMM_WORLD, o);
    ADD_FAILURE() << "rank " << me << ": the Comm was made although rank " << late << " came "
                  << kLate << " s late with a " << kTimeout << " s timeout";
  } catch (const Error& e) {
    message = e.what();
    code = e.code();
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (me != late) {
    EXPECT_EQ(code, ErrorCode::Timeout) << message;
    EXPECT_GE(took, kTimeout - 0.5) << "rank " << me << " gave up before the timeout: " << message;
    EXPECT_LT(took, kLate - 1) << "rank " << me << " waited for the late rank: " << message;
    // A rank that connects with the late one over NCCL names it (alone, or in the list of its
    // group); a node peer of the late rank waits for ranks that wait for it, and names those.
    const std::string name = std::to_string(late);
    const bool named = message.find("rank " + name) != std::string::npos ||
                       std::regex_search(message, std::regex("rank\\(s\\) ([0-9]+, )*" + name + "\\b"));
    if (comm->transport(late, Memory::Device) == TransportKind::Nccl)
      EXPECT_TRUE(named) << "rank " << me << " did not name the late rank " << late << ": " << message;
    else
      EXPECT_NE(message.find("holds up all"), std::string::npos) << message;
  }
  std::printf("rank %d: the constructor ended after %.1f s: %s\n", me, took, message.empty() ? "made" : message.c_str());
  // Every rank is back (the late one last) before the next case.
  MPI_Barrier(MPI_COMM_WORLD);
}

// Every pair without a device route says why, transport by transport.
TEST_F(DeviceWindow, RoutesAcrossNodesNameEveryReason) {
  if (comm->node_count() == 1) GTEST_SKIP() << "needs ranks on several (real or simulated) nodes";
  for (int r = 0; r < n; ++r) {
    const std::string why = comm->unreachable_reason(r, Memory::Device);
    const TransportKind want = expected_route(*comm, me, r);
    if (comm->node_of(r) == comm->node() || want != TransportKind::None) {
      EXPECT_EQ(comm->transport(r, Memory::Device), want) << "rank " << me << " -> " << r;
      EXPECT_TRUE(why.empty()) << why;
    } else {
      EXPECT_EQ(comm->transport(r, Memory::Device), TransportKind::None);
      EXPECT_NE(why.find("nccl: "), std::string::npos) << why;
      EXPECT_NE(why.find("ipc: rank " + std::to_string(r) + " is on node"), std::string::npos) << why;
      EXPECT_NE(why.find("shm: host windows only"), std::string::npos) << why;
      EXPECT_NE(why.find("mpi: host windows only"), std::string::npos) << why;
    }
  }
}
