// The knob table's rules (tiers, one-line docs, one prefix per transport), old names, the
// warning for MESHMEM_* variables that are no setting, and the GPU part's knobs in a program
// without the GPU part. Links meshmem::core alone: no GPU part in any build.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <map>
#include <meshmem/config.hpp>
#include <meshmem/error.hpp>
#include <set>

#include "knob_notices.hpp"
#include "knobs.hpp"

using namespace meshmem;
using meshmem::detail::Knob;
using meshmem::detail::Tier;

namespace {
Options parse(std::map<std::string, std::string> env) {
  return Options::parse([env](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}
bool has_notice(const Options& o, const std::string& piece) {
  return std::any_of(o.notices().begin(), o.notices().end(),
                     [&](const std::string& n) { return n.find(piece) != std::string::npos; });
}
std::string all_notices(const Options& o) {
  std::string s;
  for (const std::string& n : o.notices()) s += n + "\n";
  return s;
}
const Options::Setting& setting(const std::vector<Options::Setting>& all, const std::string& name) {
  for (const Options::Setting& s : all)
    if (s.name == name) return s;
  throw std::runtime_error("no setting " + name);
}
}  // namespace

// What the README and meshmem-info promise: a few user settings, each explained in one line.
TEST(Knobs, TiersAndOneLineDocs) {
  const auto table = detail::knob_table();
  ASSERT_GE(table.size(), 25u);
  std::size_t user = 0;
  for (const Knob* k : table) {
    const std::string doc = k->doc();
    EXPECT_LE(doc.size(), 160u) << k->name() << ": " << doc.size() << " characters";
    EXPECT_EQ(doc.find('\n'), std::string::npos) << k->name();
    EXPECT_FALSE(doc.empty()) << k->name();
    if (k->tier() == Tier::User) ++user;
  }
  EXPECT_GE(user, 5u);
  EXPECT_LE(user, 10u);
  EXPECT_EQ(detail::find_knob("MESHMEM_TIMEOUT")->tier(), Tier::User);
  EXPECT_EQ(detail::find_knob("MESHMEM_FAULT")->tier(), Tier::Testing);
  EXPECT_EQ(detail::find_knob("MESHMEM_SIMULATE_NODES")->tier(), Tier::Testing);
  EXPECT_EQ(detail::find_knob("MESHMEM_IPC_PEER_VERIFY_CORRUPT")->tier(), Tier::Testing);
  EXPECT_STREQ(detail::to_string(Tier::Tuning), "tuning");
}

// Every name (old names too) once; a transport's knobs carry its prefix.
TEST(Knobs, NamesAreUniqueAndPrefixedByTransport) {
  std::set<std::string> names;
  const std::map<std::string, std::string> prefix = {
      {"staged", "MESHMEM_STAGED_"}, {"ipc", "MESHMEM_IPC_"}, {"nccl", "MESHMEM_NCCL_"}, {"mpi", "MESHMEM_MPI_"}};
  for (const Knob* k : detail::knob_table()) {
    EXPECT_TRUE(names.insert(k->name()).second) << k->name() << " twice";
    if (k->old_name() != nullptr) EXPECT_TRUE(names.insert(k->old_name()).second) << k->old_name() << " twice";
    EXPECT_EQ(std::string(k->name()).rfind("MESHMEM_", 0), 0u) << k->name();
    const auto p = prefix.find(k->group());
    if (p != prefix.end()) EXPECT_EQ(std::string(k->name()).rfind(p->second, 0), 0u) << k->name();
  }
}

// An old name is read for the new one, says so once, and loses to the new name where both are set.
TEST(Knobs, OldNamesWorkAndWarn) {
  const Options o = parse({{"MESHMEM_STAGING_CHUNK", "8192"}});
  EXPECT_EQ(o.tuning().at("MESHMEM_STAGED_CHUNK"), "8192");
  EXPECT_EQ(o.tuning().count("MESHMEM_STAGING_CHUNK"), 0u);
  EXPECT_TRUE(has_notice(o, "MESHMEM_STAGING_CHUNK is the old name of MESHMEM_STAGED_CHUNK")) << all_notices(o);
  EXPECT_EQ(setting(o.settings(), "MESHMEM_STAGED_CHUNK").source, "env (old name MESHMEM_STAGING_CHUNK)");
  EXPECT_EQ(setting(o.settings(), "MESHMEM_STAGED_CHUNK").old_name, "MESHMEM_STAGING_CHUNK");
  // Same fingerprint as the new name: ranks that mix the two still agree.
  EXPECT_EQ(o.fingerprint(), parse({{"MESHMEM_STAGED_CHUNK", "8192"}}).fingerprint());
  // An old name's value is checked like the new one's.
  EXPECT_THROW(parse({{"MESHMEM_STAGING_CHUNK", "100"}}), Error);
  const Options both = parse({{"MESHMEM_STAGING_CHUNK", "8192"}, {"MESHMEM_STAGED_CHUNK", "16384"}});
  EXPECT_EQ(both.tuning().at("MESHMEM_STAGED_CHUNK"), "16384");
  EXPECT_TRUE(has_notice(both, "MESHMEM_STAGING_CHUNK is ignored: MESHMEM_STAGED_CHUNK is set too")) << all_notices(both);
  Options set;
  set.set("MESHMEM_PEER_ACCESS", "off");
  EXPECT_EQ(set.tuning().at("MESHMEM_IPC_PEER_ACCESS"), "off");
  EXPECT_TRUE(has_notice(set, "set MESHMEM_IPC_PEER_ACCESS instead")) << all_notices(set);
  // Every renamed knob: the old name reads as the new.
  for (const Knob* k : detail::knob_table()) {
    if (k->old_name() == nullptr) continue;
    const Options d = parse({{k->old_name(), k->default_text()}});
    EXPECT_EQ(k->text(d), k->default_text()) << k->old_name();
    EXPECT_EQ(setting(d.settings(), k->name()).source, std::string("env (old name ") + k->old_name() + ")");
  }
}

// A test-only value moved to a Testing knob; the old value says where it went.
TEST(Knobs, CorruptMovedToItsOwnKnob) {
  try {
    parse({{"MESHMEM_IPC_PEER_VERIFY", "corrupt"}});
    ADD_FAILURE() << "accepted corrupt";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MESHMEM_IPC_PEER_VERIFY_CORRUPT=on"), std::string::npos) << e.what();
  }
  EXPECT_EQ(parse({{"MESHMEM_IPC_PEER_VERIFY_CORRUPT", "on"}}).tuning().at("MESHMEM_IPC_PEER_VERIFY_CORRUPT"), "on");
}

TEST(Knobs, ClosestKnob) {
  auto closest = [](const std::string& n) {
    const Knob* k = detail::closest_knob(n);
    return k == nullptr ? std::string() : std::string(k->name());
  };
  EXPECT_EQ(closest("MESHMEM_TIMOUT"), "MESHMEM_TIMEOUT");
  EXPECT_EQ(closest("MESHMEM_TIEMOUT"), "MESHMEM_TIMEOUT");  // two letters swapped
  EXPECT_EQ(closest("MESHMEM_TIMEOUTS"), "MESHMEM_TIMEOUT");
  EXPECT_EQ(closest("MESHMEM_BARIER"), "MESHMEM_BARRIER");
  EXPECT_EQ(closest("MESHMEM_STAGED_CHUNKS"), "MESHMEM_STAGED_CHUNK");
  EXPECT_EQ(closest("MESHMEM_STAGING_SLOT"), "MESHMEM_STAGED_SLOTS");  // near an old name: the new one
  EXPECT_EQ(closest("MESHMEM_LOGLEVEL"), "MESHMEM_LOG_LEVEL");
  EXPECT_EQ(closest("MESHMEM_QWERTYUIOP"), "");
  EXPECT_EQ(closest("MESHMEM_X"), "");
}

TEST(Knobs, UnknownVariables) {
  const std::string n = detail::unknown_variable_notice("MESHMEM_TIMOUT");
  EXPECT_NE(n.find("MESHMEM_TIMOUT is not a meshmem setting and is ignored"), std::string::npos) << n;
  EXPECT_NE(n.find("did you mean MESHMEM_TIMEOUT?"), std::string::npos) << n;
  EXPECT_NE(detail::unknown_variable_notice("MESHMEM_QWERTYUIOP").find("meshmem-info --all"), std::string::npos);
  // Knobs, old names and the exempt variables of tests, launchers and the build: no notice.
  for (const char* quiet : {"MESHMEM_TIMEOUT", "MESHMEM_STAGING_CHUNK", "MESHMEM_TEST_ROUTE", "MESHMEM_TEST_ISOLATE",
                            "MESHMEM_SOAK_OPS", "MESHMEM_HOSTS_IP", "MESHMEM_BUILD_TESTS", "MESHMEM_ENABLE_CUDA",
                            "OMPI_COMM_WORLD_RANK", "CUDA_VISIBLE_DEVICES"})
    EXPECT_EQ(detail::unknown_variable_notice(quiet), "") << quiet;
  EXPECT_TRUE(detail::exempt_variable("MESHMEM_TEST_WATCHDOG_S"));
  EXPECT_FALSE(detail::exempt_variable("MESHMEM_TIMOUT"));
}

// from_environment reads the real environment: a misspelt name is one notice.
TEST(Knobs, FromEnvironmentNotesAMisspeltName) {
  ASSERT_EQ(setenv("MESHMEM_TIMOUT", "5", 1), 0);
  const Options o = Options::from_environment();
  unsetenv("MESHMEM_TIMOUT");
  EXPECT_EQ(std::count_if(o.notices().begin(), o.notices().end(),
                          [](const std::string& s) { return s.find("MESHMEM_TIMOUT ") != std::string::npos; }),
            1)
      << all_notices(o);
  EXPECT_TRUE(has_notice(o, "did you mean MESHMEM_TIMEOUT?")) << all_notices(o);
  EXPECT_EQ(o.timeout, Options{}.timeout);  // ignored
  EXPECT_FALSE(has_notice(Options::from_environment(), "MESHMEM_TIMOUT"));
}

// Issue 55: the GPU part's knobs where it is not linked: a bad value refused like any other,
// a good one accepted and reported unused.
TEST(Knobs, GpuKnobsWithoutTheGpuPart) {
  ASSERT_FALSE(detail::gpu_part_linked()) << "this test links meshmem::core alone";
  try {
    parse({{"MESHMEM_BARRIER", "foo"}});
    ADD_FAILURE() << "accepted MESHMEM_BARRIER=foo";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("MESHMEM_BARRIER='foo' is not valid"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse({{"MESHMEM_STAGED_SLOTS", "1"}}), Error);
  EXPECT_THROW(parse({{"MESHMEM_STREAM_WAIT", "busy"}}), Error);
  const Options o = parse({{"MESHMEM_BARRIER", "flag"}});
  EXPECT_EQ(o.tuning().at("MESHMEM_BARRIER"), "flag");
  EXPECT_TRUE(has_notice(o, "MESHMEM_BARRIER=flag has no effect: meshmem was built without its GPU part"))
      << all_notices(o);
  EXPECT_FALSE(setting(o.settings(), "MESHMEM_BARRIER").used);
  EXPECT_TRUE(setting(o.settings(), "MESHMEM_TIMEOUT").used);
  EXPECT_TRUE(parse({}).notices().empty());
  EXPECT_TRUE(parse({{"MESHMEM_TIMEOUT", "5"}}).notices().empty());
}

// The staged stream path's size: `off` or 1 byte to 1 MiB (each rank pins 16 slots of it), as
// the knob's doc says; printed back as given.
TEST(Knobs, StagedStreamPathSizes) {
  EXPECT_EQ(parse({}).tuning().count("MESHMEM_STAGED_STREAM_PATH"), 0u);  // off unless set
  EXPECT_EQ(parse({{"MESHMEM_STAGED_STREAM_PATH", "off"}}).tuning().at("MESHMEM_STAGED_STREAM_PATH"), "off");
  EXPECT_EQ(parse({{"MESHMEM_STAGED_STREAM_PATH", "65536"}}).tuning().at("MESHMEM_STAGED_STREAM_PATH"), "65536");
  EXPECT_EQ(parse({{"MESHMEM_STAGED_STREAM_PATH", "1048576"}}).tuning().at("MESHMEM_STAGED_STREAM_PATH"), "1048576");
  for (const char* bad : {"0", "1048577", "on", "-1", "64K"}) {
    try {
      parse({{"MESHMEM_STAGED_STREAM_PATH", bad}});
      ADD_FAILURE() << "accepted MESHMEM_STAGED_STREAM_PATH=" << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << bad;
      EXPECT_NE(std::string(e.what()).find("MESHMEM_STAGED_STREAM_PATH='" + std::string(bad) + "' is not valid"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(parse({{"MESHMEM_STAGED_STREAM_PATH_SPLIT", "on"}}).tuning().at("MESHMEM_STAGED_STREAM_PATH_SPLIT"), "on");
  EXPECT_THROW(parse({{"MESHMEM_STAGED_STREAM_PATH_SPLIT", "yes"}}), Error);
}

TEST(Knobs, SettingsSayWhereEachCameFrom) {
  Options o = parse({{"MESHMEM_TIMEOUT", "5"}});
  o.set("MESHMEM_LOG_LEVEL", "debug");
  o.fd_passing = FdPassing::Socket;
  const auto all = o.settings();
  EXPECT_EQ(all.size(), detail::knob_table().size());
  const Options::Setting& t = setting(all, "MESHMEM_TIMEOUT");
  EXPECT_EQ(t.value, "5000ms");
  EXPECT_EQ(t.default_value, "300000ms");
  EXPECT_EQ(t.tier, "user");
  EXPECT_EQ(t.source, "env");
  EXPECT_EQ(setting(all, "MESHMEM_LOG_LEVEL").source, "set");
  EXPECT_EQ(setting(all, "MESHMEM_FD_PASSING").source, "program");
  EXPECT_EQ(setting(all, "MESHMEM_TRANSPORTS").source, "default");
  EXPECT_EQ(setting(all, "MESHMEM_FAULT").tier, "testing");
}

TEST(Knobs, SetUnknownNamesTheNearest) {
  Options o;
  try {
    o.set("MESHMEM_TIMOUT", "5");
    ADD_FAILURE() << "accepted MESHMEM_TIMOUT";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("did you mean MESHMEM_TIMEOUT?"), std::string::npos) << e.what();
  }
}

// Rank 0's lines: one per distinct notice, naming the ranks it came from.
TEST(Knobs, MergeNotices) {
  using detail::merge_notices;
  EXPECT_EQ(merge_notices({{}, {"a"}}), (std::vector<std::string>{"a; on rank 1"}));
  EXPECT_EQ(merge_notices({{"a", "b"}, {"a"}}), (std::vector<std::string>{"a; on every rank", "b; on rank 0"}));
  EXPECT_EQ(merge_notices({{"a"}, {}, {"a"}}), (std::vector<std::string>{"a; on ranks 0, 2"}));
  EXPECT_EQ(merge_notices({{"a"}}), (std::vector<std::string>{"a; on rank 0"}));
  EXPECT_TRUE(merge_notices({{}, {}}).empty());
}
