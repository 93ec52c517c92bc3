// HaloExchange on host windows: a 2D block decomposition with strided columns, checked cell
// by cell (halo ring, corners and interior) over several rounds; and the plan's errors.
#include <cmath>
#include <cstring>
#include <meshmem/meshmem.hpp>

#include "halo_grid.hpp"
#include "mpi_test.hpp"

using namespace meshmem;
using meshmem::test::BlockGrid;

namespace {
class Halo : public meshmem::test::MpiTest {
 protected:
  Comm comm{MPI_COMM_WORLD};
  int me = comm.rank();
  int n = comm.size();
  std::uint64_t seed = meshmem::test::shared_seed();
};

const double kPoisonValue = -12345.5;

template <class F>
void expect_invalid(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no error raised";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << e.what();
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "'" << p << "' not in: " << e.what();
  }
}
}  // namespace

TEST_F(Halo, BlockDecompositionWithColumns) {
  BlockGrid g(n, me, 37, 23);  // odd sizes: unaligned rows and columns
  Window win = comm.alloc(g.bytes(), Memory::Host);
  HaloExchange halo = comm.make_halo(win, g.regions());
  auto* grid = static_cast<double*>(win.local());
  for (int round = 0; round < 4; ++round) {
    for (std::size_t i = 0; i < (g.ny + 2) * (g.nx + 2); ++i) grid[i] = kPoisonValue;
    for (std::size_t y = 1; y <= g.ny; ++y)
      for (std::size_t x = 1; x <= g.nx; ++x) grid[y * (g.nx + 2) + x] = meshmem::test::cell(seed, me, round, y, x);
    comm.barrier();  // nobody's halo may land before this rank's poison
    halo.exchange();
    const auto want = meshmem::test::expected_grid(g, seed, me, round, kPoisonValue);
    EXPECT_EQ(meshmem::test::first_difference(grid, want.data(), want.size() * sizeof(double)), -1)
        << "round " << round << ": grid of rank " << me << " (block " << g.cx << "," << g.cy << ")";
    comm.barrier();  // everyone checked before the next round rewrites the grids
  }
  EXPECT_EQ(halo.exchanges(), 4u);
}

TEST_F(Halo, PlanErrorsFailOnEveryRank) {
  Window win = comm.alloc(4096, Memory::Host);
  const int right = (me + 1) % n, left = (me + n - 1) % n;
  // Two regions that land on the same bytes of the right neighbour.
  expect_invalid([&] { comm.make_halo(win, {{right, 0, 100, 64}, {right, 64, 150, 64}, {left, 0, 0, 8}}); },
                 {"comm.make_halo", "overlap", "rank " + std::to_string((n - 1 + 1) % n)});
  // Past the end of the neighbour's window.
  expect_invalid([&] { comm.make_halo(win, {{right, 0, 4090, 8}, {left, 0, 0, 8}}); }, {"writes past the end"});
  // Rank 0 sends to rank 1, which declares nothing for rank 0.
  if (n >= 2) {
    std::vector<HaloRegion> regions;
    if (me == 0) regions.push_back({1, 0, 0, 8});
    expect_invalid([&] { comm.make_halo(win, regions); }, {"rank 0 sends halos to rank 1", "declares none for rank 0"});
  }
  // Strided rows that overlap themselves.
  expect_invalid([&] { comm.make_halo(win, {{right, 0, 0, 16, 4, 8, 8}, {left, 0, 1024, 8}}); }, {"pitch smaller"});
  // The Comm is still usable and a good plan works.
  HaloExchange ok = comm.make_halo(win, {{right, 0, 2048 + 8 * static_cast<std::size_t>(me), 8}, {left, 8, 3072, 8}});
  ok.exchange();
}

// A neighbour that no transport reaches (MESHMEM_TRANSPORTS=shm, ranks on two nodes): the
// plan is refused on every rank with Error(Unsupported) naming the pair and each transport's
// reason, before anything is exchanged.
TEST_F(Halo, UnreachableNeighbourIsRefused) {
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  Options o = Options::from_environment();
  o.simulate_nodes = 2;
  o.transports = {TransportKind::Shm};
  Comm split(MPI_COMM_WORLD, o);
  Window win = split.alloc(4096, Memory::Host);
  const int right = (me + 1) % n, left = (me + n - 1) % n;
  // Rank 0, the lowest rank that fails, reports its first region whose peer is on the
  // other node: its right neighbour where that is on node 1, else its left one (rank n-1).
  const int unreached = split.node_of(1) != split.node_of(0) ? 1 : n - 1;
  try {
    (void)split.make_halo(win, {{right, 0, 2048, 8}, {left, 8, 3072, 8}});
    ADD_FAILURE() << "no error raised";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Unsupported) << e.what();
    for (const std::string& p : std::vector<std::string>{"comm.make_halo on rank 0", "no transport reaches host window",
                                                         "of rank " + std::to_string(unreached),
                                                         "shm: rank " + std::to_string(unreached) + " is on node 1",
                                                         "mpi: not in MESHMEM_TRANSPORTS"})
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "'" << p << "' not in: " << e.what();
  }
  for (int r = 0; r < n; ++r) {
    const bool same = split.node_of(r) == split.node();
    EXPECT_EQ(split.transport(r, Memory::Host), same ? TransportKind::Shm : TransportKind::None) << "rank " << r;
    const std::string why = split.unreachable_reason(r, Memory::Host);
    EXPECT_EQ(why.empty(), same) << why;
    if (!same) EXPECT_NE(why.find("mpi: not in MESHMEM_TRANSPORTS"), std::string::npos) << why;
  }
}
