// The transport table and route selection, driven with fake transports (no MPI, no GPU):
// first match in the order tried, MESHMEM_TRANSPORTS reordering and removing entries, and
// the error that lists every transport's reason when none reaches a rank.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "gpu_part.hpp"
#include "meshmem/comm.hpp"
#include "transport_registry.hpp"

using namespace meshmem;
using namespace meshmem::detail;

namespace {

// Reaches the ranks listed for each memory kind; every other answer is "no" with a reason
// that names the fake.
class FakeTransport final : public Transport {
 public:
  FakeTransport(TransportKind kind, std::set<int> device, std::set<int> host, bool serves_host = true)
      : kind_(kind), device_(std::move(device)), host_(std::move(host)), serves_host_(serves_host) {}
  TransportKind kind() const override { return kind_; }
  Capabilities capabilities() const override { return {}; }
  bool serves(Memory memory) const override { return memory == Memory::Device || serves_host_; }
  Reach reach(int rank, Memory memory) const override {
    const auto& set = memory == Memory::Device ? device_ : host_;
    if (set.count(rank)) return Reach::yes();
    return Reach::no(std::string("fake ") + to_string(kind_) + " skips rank " + std::to_string(rank));
  }
  std::unique_ptr<WindowAttachment> attach(WindowState&, const std::vector<bool>&, const std::string&) override {
    return nullptr;
  }
  void put(const WindowState&, int, std::size_t, const void*, std::size_t, const SignalUpdate&, Stream) override {}
  void get(void*, const WindowState&, int, std::size_t, std::size_t, Stream) override {}
  void quiet(Stream) override {}

 private:
  TransportKind kind_;
  std::set<int> device_, host_;
  bool serves_host_;
};

std::unique_ptr<Transport> no_factory(const CommContext&) { return nullptr; }

// A table shaped like the real one.
const std::vector<TransportEntry> kFakeTable = {
    {TransportKind::Ipc, "ipc", no_factory, ""},
    {TransportKind::Shm, "shm", no_factory, ""},
    {TransportKind::Mpi, "mpi", no_factory, ""},
};

std::vector<TransportKind> kinds(const std::vector<const TransportEntry*>& entries) {
  std::vector<TransportKind> k;
  for (const TransportEntry* e : entries) k.push_back(e->kind);
  return k;
}

}  // namespace

TEST(TransportTable, TheRealTableInOrder) {
  const auto& table = transport_table();
  ASSERT_EQ(table.size(), 6u);
  EXPECT_STREQ(table[0].name, "ipc");
  EXPECT_STREQ(table[1].name, "staged");
  EXPECT_STREQ(table[2].name, "nccl");
  EXPECT_STREQ(table[3].name, "mpi-device");
  EXPECT_STREQ(table[4].name, "shm");
  EXPECT_STREQ(table[5].name, "mpi");
  EXPECT_EQ(table[2].make, nullptr);  // a GPU-part transport: no factory in a core-only program
  EXPECT_STREQ(to_string(TransportKind::Shm), "shm");
  EXPECT_STREQ(to_string(TransportKind::None), "none");
  // MESHMEM_TRANSPORTS names what the table names.
  Options o;
  o.set("MESHMEM_TRANSPORTS", "mpi,IPC");
  EXPECT_EQ(o.transports, (std::vector<TransportKind>{TransportKind::Mpi, TransportKind::Ipc}));
  try {
    o.set("MESHMEM_TRANSPORTS", "shm,tcp");
    ADD_FAILURE() << "accepted tcp";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("from: ipc, staged, nccl, mpi-device, shm, mpi"), std::string::npos) << e.what();
  }
}

// This program links meshmem::core alone: the GPU part's weak references are null, the ipc
// entry has no factory and says why, and no GPU is reported.
TEST(TransportTable, CoreAloneHasNoGpuPart) {
  EXPECT_EQ(transport_table()[0].make, nullptr);
  EXPECT_NE(std::string(transport_table()[0].missing).find("without its GPU part"), std::string::npos);
  std::string why;
  EXPECT_FALSE(meshmem::gpu_available(&why));
  EXPECT_NE(why.find("without its GPU part"), std::string::npos) << why;
  EXPECT_EQ(default_memory(), Memory::Host);
}

TEST(TransportTable, OrderEntriesFollowsTheOverride) {
  std::vector<std::string> left_out;
  EXPECT_EQ(kinds(order_entries(kFakeTable, {TransportKind::Ipc, TransportKind::Shm, TransportKind::Mpi}, &left_out)),
            (std::vector<TransportKind>{TransportKind::Ipc, TransportKind::Shm, TransportKind::Mpi}));
  EXPECT_TRUE(left_out.empty());
  EXPECT_EQ(kinds(order_entries(kFakeTable, {TransportKind::Mpi, TransportKind::Shm}, &left_out)),
            (std::vector<TransportKind>{TransportKind::Mpi, TransportKind::Shm}));
  EXPECT_EQ(left_out, std::vector<std::string>{"ipc: not in MESHMEM_TRANSPORTS"});
}

TEST(TransportTable, FirstTransportThatReachesWins) {
  // 4 ranks: "ipc" reaches device windows of 0..1, "shm" host windows of 0..1, "mpi" host
  // windows of every rank.
  FakeTransport ipc(TransportKind::Ipc, {0, 1}, {});
  FakeTransport shm(TransportKind::Shm, {}, {0, 1});
  FakeTransport mpi(TransportKind::Mpi, {}, {0, 1, 2, 3});
  const RouteTable routes({&ipc, &shm, &mpi}, {}, 4);
  EXPECT_EQ(routes.find(1, Memory::Device), &ipc);
  EXPECT_EQ(routes.find(1, Memory::Host), &shm);
  EXPECT_EQ(routes.find(3, Memory::Host), &mpi);
  EXPECT_TRUE(routes.why_none(3, Memory::Host).empty());
  // Where a later transport reaches a rank, the earlier ones' reasons are kept (meshmem-info
  // --job prints them); none where the first one reaches it. (The fakes serve both kinds;
  // a real ipc's "device windows only" is left out of a host route's reasons.)
  EXPECT_EQ(routes.why_not_earlier(3, Memory::Host), "ipc: fake ipc skips rank 3; shm: fake shm skips rank 3");
  EXPECT_TRUE(routes.why_not_earlier(1, Memory::Device).empty());
  EXPECT_EQ(routes.why_not_earlier(1, Memory::Host), "ipc: fake ipc skips rank 1");
  EXPECT_TRUE(routes.routes_through(&shm, 0));
  EXPECT_FALSE(routes.routes_through(&shm, 2));
  EXPECT_TRUE(routes.routes_through(&ipc, 1, Memory::Device));
  EXPECT_FALSE(routes.routes_through(&ipc, 1, Memory::Host));
  // Reordered (MESHMEM_TRANSPORTS=mpi,shm,ipc): mpi takes every host route.
  const RouteTable reordered({&mpi, &shm, &ipc}, {}, 4);
  EXPECT_EQ(reordered.find(1, Memory::Host), &mpi);
  EXPECT_FALSE(reordered.routes_through(&shm, 1));
  EXPECT_EQ(reordered.find(1, Memory::Device), &ipc);
}

TEST(TransportTable, SkippedReasonsOnlyOfTransportsServingTheMemoryKind) {
  FakeTransport ipc(TransportKind::Ipc, {0}, {}, /*serves_host=*/false);
  FakeTransport shm(TransportKind::Shm, {}, {0});
  FakeTransport mpi(TransportKind::Mpi, {}, {0, 1});
  const RouteTable routes({&ipc, &shm, &mpi}, {}, 2);
  EXPECT_EQ(routes.why_not_earlier(1, Memory::Host), "shm: fake shm skips rank 1");  // not ipc's
  EXPECT_TRUE(routes.why_not_earlier(0, Memory::Host).empty());
  // Where none reaches, every transport says why (ipc included).
  EXPECT_EQ(routes.why_none(1, Memory::Device),
            "ipc: fake ipc skips rank 1; shm: fake shm skips rank 1; mpi: fake mpi skips rank 1");
}

TEST(TransportTable, NoRouteListsEveryReason) {
  FakeTransport shm(TransportKind::Shm, {}, {0, 1});
  FakeTransport mpi(TransportKind::Mpi, {}, {0, 1});
  // MESHMEM_TRANSPORTS=shm,mpi: ipc was left out, and says so last.
  const RouteTable routes({&shm, &mpi}, {"ipc: not in MESHMEM_TRANSPORTS"}, 3);
  EXPECT_EQ(routes.find(2, Memory::Host), nullptr);
  EXPECT_EQ(routes.why_none(2, Memory::Host),
            "shm: fake shm skips rank 2; mpi: fake mpi skips rank 2; ipc: not in MESHMEM_TRANSPORTS");
  EXPECT_EQ(routes.find(0, Memory::Device), nullptr);
  EXPECT_EQ(routes.why_none(0, Memory::Device),
            "shm: fake shm skips rank 0; mpi: fake mpi skips rank 0; ipc: not in MESHMEM_TRANSPORTS");
  const RouteTable none({}, {}, 1);
  EXPECT_EQ(none.why_none(0, Memory::Host), "no transport is allowed");
}
