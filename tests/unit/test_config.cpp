#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <map>
#include <meshmem/config.hpp>
#include <meshmem/error.hpp>

#include "knobs.hpp"
#include "transport_registry.hpp"
#include "topology.hpp"

using namespace meshmem;

namespace {
Options parse(std::map<std::string, std::string> env) {
  return Options::parse([env](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

void expect_invalid(std::map<std::string, std::string> env, const std::string& var) {
  try {
    parse(env);
    ADD_FAILURE() << "accepted " << var;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find(var), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(env.begin()->second), std::string::npos) << e.what();
  }
}
}  // namespace

TEST(Options, Defaults) {
  const Options o = parse({});
  EXPECT_EQ(o.timeout, std::chrono::minutes(5));
  EXPECT_EQ(o.simulate_nodes, 1);
  EXPECT_EQ(o.fd_passing, FdPassing::Auto);
  EXPECT_EQ(o.transports, (std::vector<TransportKind>{TransportKind::Ipc, TransportKind::Staged, TransportKind::Nccl,
                                                      TransportKind::MpiDevice, TransportKind::Shm, TransportKind::Mpi}));
  EXPECT_EQ(o.log_level, LogLevel::Warn);
  EXPECT_TRUE(o.tuning().empty());
  EXPECT_EQ(parse({{"MESHMEM_TIMEOUT", ""}}).timeout, std::chrono::minutes(5));  // empty = unset
}

TEST(Options, Timeout) {
  EXPECT_EQ(parse({{"MESHMEM_TIMEOUT", "30"}}).timeout, std::chrono::seconds(30));
  EXPECT_EQ(parse({{"MESHMEM_TIMEOUT", "2.5s"}}).timeout, std::chrono::milliseconds(2500));
  EXPECT_EQ(parse({{"MESHMEM_TIMEOUT", "500ms"}}).timeout, std::chrono::milliseconds(500));
  EXPECT_EQ(parse({{"MESHMEM_TIMEOUT", " 2min "}}).timeout, std::chrono::minutes(2));
  EXPECT_TRUE(parse({{"MESHMEM_TIMEOUT", "inf"}}).waits_forever());
  EXPECT_TRUE(parse({{"MESHMEM_TIMEOUT", "0"}}).waits_forever());
  EXPECT_EQ(parse({{"MESHMEM_TIMEOUT", "0.0001"}}).timeout, std::chrono::milliseconds(1));
  expect_invalid({{"MESHMEM_TIMEOUT", "soon"}}, "MESHMEM_TIMEOUT");
  expect_invalid({{"MESHMEM_TIMEOUT", "-1"}}, "MESHMEM_TIMEOUT");
  // Only plain decimals: these were read as forever (1e-400 underflows to 0, -0 is not
  // negative) or as 16 s (strtod reads hexadecimal) until issue 13.
  expect_invalid({{"MESHMEM_TIMEOUT", "1e-400"}}, "MESHMEM_TIMEOUT");
  expect_invalid({{"MESHMEM_TIMEOUT", "-0"}}, "MESHMEM_TIMEOUT");
  expect_invalid({{"MESHMEM_TIMEOUT", "0x10"}}, "MESHMEM_TIMEOUT");
  expect_invalid({{"MESHMEM_TIMEOUT", "1e3"}}, "MESHMEM_TIMEOUT");
  expect_invalid({{"MESHMEM_TIMEOUT", "+5"}}, "MESHMEM_TIMEOUT");
  expect_invalid({{"MESHMEM_TIMEOUT", "nan"}}, "MESHMEM_TIMEOUT");
  expect_invalid({{"MESHMEM_TIMEOUT", ".5"}}, "MESHMEM_TIMEOUT");
  EXPECT_TRUE(parse({{"MESHMEM_TIMEOUT", "0.0"}}).waits_forever());
  EXPECT_EQ(parse({{"MESHMEM_TIMEOUT", "0.5s"}}).timeout, std::chrono::milliseconds(500));
  expect_invalid({{"MESHMEM_TIMEOUT", "5 hours"}}, "MESHMEM_TIMEOUT");
  expect_invalid({{"MESHMEM_TIMEOUT", "nan"}}, "MESHMEM_TIMEOUT");
}

TEST(Options, SimulateNodesFdPassingLogLevel) {
  EXPECT_EQ(parse({{"MESHMEM_SIMULATE_NODES", "4"}}).simulate_nodes, 4);
  expect_invalid({{"MESHMEM_SIMULATE_NODES", "0"}}, "MESHMEM_SIMULATE_NODES");
  expect_invalid({{"MESHMEM_SIMULATE_NODES", "2x"}}, "MESHMEM_SIMULATE_NODES");
  EXPECT_EQ(parse({{"MESHMEM_FD_PASSING", "Socket"}}).fd_passing, FdPassing::Socket);
  EXPECT_EQ(parse({{"MESHMEM_FD_PASSING", "pidfd"}}).fd_passing, FdPassing::Pidfd);
  expect_invalid({{"MESHMEM_FD_PASSING", "fifo"}}, "MESHMEM_FD_PASSING");
  EXPECT_EQ(parse({{"MESHMEM_LOG_LEVEL", "debug"}}).log_level, LogLevel::Debug);
  expect_invalid({{"MESHMEM_LOG_LEVEL", "loud"}}, "MESHMEM_LOG_LEVEL");
}

// The GPU part's knobs are declared beside its code in CUDA-free headers, in the table of every
// build (without the GPU part they are checked and reported unused: test_knobs.cpp).
TEST(Options, GpuPartKnobs) {
  // Declared in headers that the GPU part's files and knobs.cpp both include: one object each.
  std::map<std::string, int> seen;
  for (const meshmem::detail::Knob* k : meshmem::detail::knob_table()) ++seen[k->name()];
  for (const auto& [name, count] : seen) EXPECT_EQ(count, 1) << name << " is in the table " << count << " times";
  EXPECT_NE(meshmem::detail::find_knob("MESHMEM_BARRIER"), nullptr);
#ifdef MESHMEM_TEST_HAVE_GPU_PART
  EXPECT_TRUE(meshmem::detail::gpu_part_linked());
#endif
  auto tuned = [](std::map<std::string, std::string> env, const std::string& var) { return parse(env).tuning().at(var); };
  EXPECT_EQ(tuned({{"MESHMEM_IPC_SM_COPY_MAX", "4096"}}, "MESHMEM_IPC_SM_COPY_MAX"), "4096");
  expect_invalid({{"MESHMEM_IPC_SM_COPY_MAX", "-1"}}, "MESHMEM_IPC_SM_COPY_MAX");
  expect_invalid({{"MESHMEM_IPC_SM_COPY_MAX", "4k"}}, "MESHMEM_IPC_SM_COPY_MAX");
  EXPECT_EQ(tuned({{"MESHMEM_BARRIER", "Event "}}, "MESHMEM_BARRIER"), "event");
  expect_invalid({{"MESHMEM_BARRIER", "spin"}}, "MESHMEM_BARRIER");
  EXPECT_EQ(tuned({{"MESHMEM_BARRIER", "kernel"}}, "MESHMEM_BARRIER"), "kernel");
  EXPECT_EQ(tuned({{"MESHMEM_STREAM_WAIT", "kernel"}}, "MESHMEM_STREAM_WAIT"), "kernel");
  EXPECT_EQ(tuned({{"MESHMEM_STREAM_WAIT", "memop"}}, "MESHMEM_STREAM_WAIT"), "memop");
  EXPECT_EQ(tuned({{"MESHMEM_BARRIER", "flag"}}, "MESHMEM_BARRIER"), "flag");
  expect_invalid({{"MESHMEM_STREAM_WAIT", "busy"}}, "MESHMEM_STREAM_WAIT");
  EXPECT_EQ(tuned({{"MESHMEM_IPC_FUSED_SIGNAL_MAX", "0"}}, "MESHMEM_IPC_FUSED_SIGNAL_MAX"), "0");
  // Defaults, as the table prints them.
  const Options o = parse({});
  EXPECT_EQ(meshmem::detail::find_knob("MESHMEM_IPC_SM_COPY_MAX")->text(o), "0");
  EXPECT_EQ(meshmem::detail::find_knob("MESHMEM_IPC_FUSED_SIGNAL_MAX")->text(o), "65536");
  EXPECT_EQ(meshmem::detail::find_knob("MESHMEM_BARRIER")->text(o), "auto");
  EXPECT_EQ(meshmem::detail::find_knob("MESHMEM_STREAM_WAIT")->text(o), "auto");
  // Set from a program, checked the same way; they change what ranks must agree on.
  Options p;
  p.set("MESHMEM_IPC_SM_COPY_MAX", "65536");
  EXPECT_EQ(p.tuning().at("MESHMEM_IPC_SM_COPY_MAX"), "65536");
  EXPECT_NE(p.fingerprint(), o.fingerprint());
  EXPECT_THROW(p.set("MESHMEM_BARRIER", "spin"), Error);
}

// The mpi transport's knob: a time with its unit, canonical in the table; refused without one.
TEST(Options, MpiIdleSleep) {
  auto tuned = [](const std::string& value) {
    return parse({{"MESHMEM_MPI_IDLE_SLEEP", value}}).tuning().at("MESHMEM_MPI_IDLE_SLEEP");
  };
  EXPECT_EQ(meshmem::detail::find_knob("MESHMEM_MPI_IDLE_SLEEP")->text(parse({})), "1ms");
  EXPECT_EQ(tuned("250us"), "250us");
  EXPECT_EQ(tuned(" 2ms "), "2ms");
  EXPECT_EQ(tuned("1000us"), "1ms");
  EXPECT_EQ(tuned("100ms"), "100ms");
  EXPECT_EQ(tuned("0"), "0");
  EXPECT_EQ(tuned("0us"), "0");
  for (const char* bad : {"250", "1s", "-5us", "101ms", "ms", "1.5ms", "5 us", "0x10us", "1000000000us"})
    expect_invalid({{"MESHMEM_MPI_IDLE_SLEEP", bad}}, "MESHMEM_MPI_IDLE_SLEEP");
  EXPECT_NE(parse({{"MESHMEM_MPI_IDLE_SLEEP", "250us"}}).fingerprint(), parse({}).fingerprint());
}

TEST(Options, Set) {
  Options o;
  o.set("MESHMEM_TIMEOUT", "10");
  EXPECT_EQ(o.timeout, std::chrono::seconds(10));
  o.set("MESHMEM_TRANSPORTS", "shm,mpi");
  EXPECT_EQ(o.transports, (std::vector<TransportKind>{TransportKind::Shm, TransportKind::Mpi}));
  try {
    o.set("MESHMEM_TIMEOUTS", "10");
    ADD_FAILURE() << "accepted an unknown variable";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("MESHMEM_TIMEOUTS is not a meshmem setting"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("did you mean MESHMEM_TIMEOUT?"), std::string::npos) << e.what();
  }
}

TEST(Options, Transports) {
  EXPECT_EQ(parse({{"MESHMEM_TRANSPORTS", "mpi"}}).transports, std::vector<TransportKind>{TransportKind::Mpi});
  EXPECT_EQ(parse({{"MESHMEM_TRANSPORTS", "ipc,mpi"}}).transports,
            (std::vector<TransportKind>{TransportKind::Ipc, TransportKind::Mpi}));
  EXPECT_EQ(parse({{"MESHMEM_TRANSPORTS", "mpi, shm"}}).transports,
            (std::vector<TransportKind>{TransportKind::Mpi, TransportKind::Shm}));
  expect_invalid({{"MESHMEM_TRANSPORTS", "shm,tcp"}}, "MESHMEM_TRANSPORTS");
  expect_invalid({{"MESHMEM_TRANSPORTS", "shm,shm"}}, "MESHMEM_TRANSPORTS");
  expect_invalid({{"MESHMEM_TRANSPORTS", ","}}, "MESHMEM_TRANSPORTS");
}

TEST(Options, DescribeAndFingerprint) {
  const Options a = parse({{"MESHMEM_TIMEOUT", "10"}});
  const Options b = parse({{"MESHMEM_TIMEOUT", "10"}, {"MESHMEM_LOG_LEVEL", "debug"}});
  const Options c = parse({{"MESHMEM_TIMEOUT", "10"}, {"MESHMEM_SIMULATE_NODES", "2"}});
  EXPECT_EQ(a.fingerprint(), b.fingerprint());  // the log level may differ per rank
  EXPECT_NE(a.fingerprint(), c.fingerprint());
  const auto lines = a.describe();
  const auto table = meshmem::detail::knob_table();
  ASSERT_EQ(lines.size(), table.size());
  for (std::size_t i = 0; i < lines.size(); ++i)
    EXPECT_EQ(lines[i].rfind(std::string(table[i]->name()) + "=", 0), 0u) << lines[i];
  EXPECT_EQ(lines[0].rfind("MESHMEM_TIMEOUT=10000ms", 0), 0u) << lines[0];
  EXPECT_EQ(a.fingerprint().find("MESHMEM_LOG_LEVEL"), std::string::npos) << a.fingerprint();
}

TEST(Error, MessageAndCode) {
  const Error e(ErrorCode::Timeout, "comm.barrier on rank 3: rank(s) 1 did not arrive");
  EXPECT_EQ(e.code(), ErrorCode::Timeout);
  EXPECT_STREQ(e.what(), "meshmem: comm.barrier on rank 3: rank(s) 1 did not arrive");
  EXPECT_STREQ(e.message(), "comm.barrier on rank 3: rank(s) 1 did not arrive");
  const Error nested(e.code(), std::string("outer: ") + e.message());
  EXPECT_STREQ(nested.what(), "meshmem: outer: comm.barrier on rank 3: rank(s) 1 did not arrive");
  EXPECT_STREQ(to_string(ErrorCode::InvalidArgument), "invalid argument");
}

TEST(Topology, AssignNodes) {
  using meshmem::detail::assign_nodes;
  using meshmem::detail::RealPlacement;
  // 4 ranks on one host.
  std::vector<RealPlacement> one = {{0, 0, 4}, {0, 1, 4}, {0, 2, 4}, {0, 3, 4}};
  EXPECT_EQ(assign_nodes(one, 1), (std::vector<int>{0, 0, 0, 0}));
  EXPECT_EQ(assign_nodes(one, 2), (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(assign_nodes(one, 3), (std::vector<int>{0, 0, 1, 2}));
  EXPECT_EQ(assign_nodes(one, 4), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(assign_nodes(one, 99), (std::vector<int>{0, 1, 2, 3}));  // at most one node a rank
  // Two real hosts (ranks interleaved), each split in two.
  std::vector<RealPlacement> two = {{0, 0, 2}, {1, 0, 2}, {0, 1, 2}, {1, 1, 2}};
  EXPECT_EQ(assign_nodes(two, 1), (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(assign_nodes(two, 2), (std::vector<int>{0, 1, 2, 3}));
}

// Nodes from node ids: ranks with equal ids form a node whatever their order, its host is its
// lowest rank, local ranks follow rank order; two hosts whose names are equal but whose
// kernels differ are two nodes.
TEST(Topology, PlaceById) {
  using meshmem::detail::node_id;
  using meshmem::detail::place_by_id;
  const auto placement =
      place_by_id({node_id("h2/b"), node_id("h1/a"), node_id("h2/b"), node_id("h1/a"), node_id("h1/c")});
  ASSERT_EQ(placement.size(), 5u);
  const std::vector<std::vector<int>> want = {{0, 0, 2}, {1, 0, 2}, {0, 1, 2}, {1, 1, 2}, {4, 0, 1}};
  for (std::size_t r = 0; r < want.size(); ++r) {
    EXPECT_EQ(placement[r].host, want[r][0]) << "rank " << r;
    EXPECT_EQ(placement[r].local_rank, want[r][1]) << "rank " << r;
    EXPECT_EQ(placement[r].local_size, want[r][2]) << "rank " << r;
  }
  EXPECT_EQ(meshmem::detail::assign_nodes(placement, 1), (std::vector<int>{0, 1, 0, 1, 2}));
  EXPECT_TRUE(place_by_id({}).empty());
  // The hash every rank computes alike (FNV-1a's published 64-bit values).
  EXPECT_EQ(node_id(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(node_id("a"), 0xaf63dc4c8601ec8cull);
}

TEST(Topology, NodeKeyNamesThisHostItsBootAndNamespaces) {
  const std::string key = meshmem::detail::node_key();
  char name[256] = {};
  ASSERT_EQ(gethostname(name, sizeof(name) - 1), 0);
  EXPECT_EQ(key.rfind(name, 0), 0u) << key;  // starts with the host name
  EXPECT_EQ(key.rfind(meshmem::detail::machine_key() + "/", 0), 0u) << key;  // then the boot id
  EXPECT_GT(key.size(), std::string(name).size() + 1) << "no boot id in '" << key << "'";
  EXPECT_NE(key.find("/net:"), std::string::npos) << key;
  EXPECT_NE(key.find("/pid:"), std::string::npos) << key;
  EXPECT_EQ(meshmem::detail::node_key(), key) << "the key changed between two calls";
}

// The node key of a process in a network namespace of its own, same host name and kernel.
static std::string node_key_in_new_netns(bool* unshared) {
  int fds[2];
  if (pipe(fds) != 0) return "";
  const pid_t child = fork();
  if (child < 0) {
    close(fds[0]);
    close(fds[1]);
    *unshared = false;
    return "";
  }
  if (child == 0) {
    close(fds[0]);
    const char ok = unshare(CLONE_NEWNET) == 0 ? 'y' : 'n';
    const std::string key = ok == 'y' ? meshmem::detail::node_key() : "";
    (void)!write(fds[1], &ok, 1);
    (void)!write(fds[1], key.data(), key.size());
    _exit(0);
  }
  close(fds[1]);
  std::string got;
  char buf[512];
  for (ssize_t n; (n = read(fds[0], buf, sizeof(buf))) > 0;) got.append(buf, static_cast<std::size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(child, &status, 0);
  *unshared = !got.empty() && got[0] == 'y';
  return got.empty() ? "" : got.substr(1);
}

// Two containers of one machine whose host names are equal, each in a network namespace of
// its own, cannot pass each other descriptors (abstract Unix sockets are per network
// namespace): they must be two nodes. With host name and boot id alone they were one.
TEST(Topology, ANetworkNamespaceOfItsOwnIsAnotherNode) {
  bool unshared = false;
  const std::string other = node_key_in_new_netns(&unshared);
  if (!unshared) GTEST_SKIP() << "unshare(CLONE_NEWNET) is not permitted here";
  const std::string mine = meshmem::detail::node_key();
  EXPECT_NE(other, mine);
  EXPECT_NE(meshmem::detail::node_id(other), meshmem::detail::node_id(mine));
  // Its GPUs are still this machine's: the machine key (node_local_rank's) is the same.
  EXPECT_EQ(other.substr(0, other.find("/net:")), meshmem::detail::machine_key());
}

// Every transport of the table has its factory in a program that links the GPU part: a GPU
// transport whose object the GPU part's anchor (comm/src/cuda/gpu_part.cpp) does not name is
// left out by the linker and reports "built without its GPU part" at run time.
TEST(GpuPart, EveryTransportOfTheTableIsLinked) {
#ifdef MESHMEM_TEST_HAVE_GPU_PART
  for (const meshmem::detail::TransportEntry& e : meshmem::detail::transport_table())
    EXPECT_NE(e.make, nullptr) << e.name << " is in the table but not linked: " << e.missing;
#else
  GTEST_SKIP() << "meshmem was built without its GPU part";
#endif
}
