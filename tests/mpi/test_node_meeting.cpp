// NodeMeeting (comm/src/node_meeting.hpp), the host meeting of the stream barrier: nobody
// leaves a meeting before every node peer came to it, every rank reads every peer's note of
// that meeting (never of the one before or after), and a missing rank is named on timeout.
#include <unistd.h>

#include <chrono>
#include <random>
#include <thread>

#include "bootstrap.hpp"
#include "fd_exchange.hpp"
#include "meshmem/error.hpp"
#include "mpi_test.hpp"
#include "node_meeting.hpp"
#include "topology.hpp"

namespace meshmem::test {
namespace {

using detail::Bootstrap;
using detail::FdExchange;
using detail::NodeMeeting;
using detail::Topology;

struct Ranks {
  Bootstrap boot;
  Topology topo;
  FdExchange fds;
  explicit Ranks(std::chrono::milliseconds timeout)
      : boot(MPI_COMM_WORLD, timeout),
        topo(Topology::discover(boot, Options::from_environment().simulate_nodes)),
        fds(boot, topo, Options::from_environment().fd_passing) {}
};

class NodeMeetingTest : public MpiTest {};

unsigned note_of(std::uint64_t seed, int meeting, int rank) {
  return static_cast<unsigned>(((seed >> (rank % 8)) ^ static_cast<std::uint64_t>(meeting * 2654435761u + rank * 40503u)) %
                               NodeMeeting::kNoteLimit);
}

TEST_F(NodeMeetingTest, NobodyLeavesEarlyAndNotesAreThatMeetings) {
  Ranks s(std::chrono::milliseconds(60000));
  NodeMeeting meeting(s.boot, s.fds, s.topo, "test");
  // An independent record of arrivals: an MPI shared-memory window of the node.
  MPI_Comm node;
  ASSERT_EQ(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node), MPI_SUCCESS);
  MPI_Win win;
  std::uint64_t* mine = nullptr;
  ASSERT_EQ(MPI_Win_allocate_shared(64, 64, MPI_INFO_NULL, node, &mine, &win), MPI_SUCCESS);
  std::vector<std::uint64_t*> arrived(static_cast<std::size_t>(world_size()), nullptr);
  for (int r : s.topo.node_ranks) {
    int node_rank = -1;
    MPI_Group wg, ng;
    MPI_Comm_group(MPI_COMM_WORLD, &wg);
    MPI_Comm_group(node, &ng);
    MPI_Group_translate_ranks(wg, 1, &r, ng, &node_rank);
    MPI_Group_free(&wg);
    MPI_Group_free(&ng);
    MPI_Aint size = 0;
    int unit = 0;
    ASSERT_EQ(MPI_Win_shared_query(win, node_rank, &size, &unit, &arrived[r]), MPI_SUCCESS);
  }
  __atomic_store_n(mine, 0, __ATOMIC_RELEASE);
  MPI_Barrier(MPI_COMM_WORLD);

  const std::uint64_t seed = shared_seed();
  std::mt19937 gen(static_cast<unsigned>(seed) + world_rank());
  std::vector<unsigned> notes;
  int early = 0, wrong_note = 0;
  for (int m = 1; m <= 5000; ++m) {
    if (gen() % 64 == 0) std::this_thread::sleep_for(std::chrono::microseconds(gen() % 300));  // late now and then
    __atomic_store_n(mine, static_cast<std::uint64_t>(m), __ATOMIC_RELEASE);
    meeting.meet(note_of(seed, m, world_rank()), notes, "test");
    for (int r : s.topo.node_ranks) {
      if (__atomic_load_n(arrived[r], __ATOMIC_ACQUIRE) < static_cast<std::uint64_t>(m)) ++early;
      if (notes[r] != note_of(seed, m, r)) ++wrong_note;
    }
  }
  EXPECT_EQ(early, 0) << "times a rank left a meeting before a node peer had come to it";
  EXPECT_EQ(wrong_note, 0) << "notes read from another meeting";
  MPI_Barrier(MPI_COMM_WORLD);
  MPI_Win_free(&win);
  MPI_Comm_free(&node);
}

TEST_F(NodeMeetingTest, MissingRankIsNamedOnTimeout) {
  Ranks s(std::chrono::milliseconds(300));
  NodeMeeting meeting(s.boot, s.fds, s.topo, "test");
  const int absent = s.topo.node_ranks.back();
  std::vector<unsigned> notes;
  if (s.topo.node_ranks.size() < 2) GTEST_SKIP() << "needs two ranks on a node";
  if (world_rank() != absent) {
    try {
      meeting.meet(0, notes, "comm.barrier(stream)");
      ADD_FAILURE() << "meet() returned without rank " << absent;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Timeout);
      const std::string text = e.what();
      EXPECT_NE(text.find("comm.barrier(stream) on rank " + std::to_string(world_rank())), std::string::npos) << text;
      EXPECT_NE(text.find("rank(s) " + std::to_string(absent) + " did not arrive"), std::string::npos) << text;
    }
    // The Comm is unusable after a timeout: the next meeting says so at once.
    try {
      meeting.meet(0, notes, "comm.barrier(stream)");
      ADD_FAILURE() << "a timed-out meeting was used again";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Timeout);
      EXPECT_NE(std::string(e.what()).find("no longer agree"), std::string::npos) << e.what();
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace
}  // namespace meshmem::test
