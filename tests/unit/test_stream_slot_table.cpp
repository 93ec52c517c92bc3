// StreamSlotTable (the staged stream path's slots): taken in rotation; a stream reuses its own
// slot without asking; another stream's slot only once every event after its last use ended;
// none given where all are held by other streams' unfinished uses; a retired slot never again.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "cuda/staged/stream_slot_table.hpp"

using meshmem::detail::StreamSlotTable;

namespace {
using Table = StreamSlotTable<int, std::string>;  // events are ints, streams names
struct Events {
  std::set<int> ended;
  std::vector<int> asked;
  bool operator()(int e) {
    asked.push_back(e);
    return ended.count(e) != 0;
  }
};
}  // namespace

TEST(StreamSlotTable, NeverUsedSlotsInRotation) {
  Table t(4);
  Events ev;
  std::size_t s = 99;
  for (std::size_t want : {0u, 1u, 2u, 3u}) {
    ASSERT_TRUE(t.choose("a", ev, &s));
    EXPECT_EQ(s, want);
  }
  EXPECT_TRUE(ev.asked.empty()) << "never-used slots need no event asked";
}

TEST(StreamSlotTable, AStreamReusesItsOwnSlotsWithoutAsking) {
  Table t(2);
  Events ev;
  std::size_t s = 0;
  ASSERT_TRUE(t.choose("a", ev, &s));
  t.used(s, "a", {10});
  ASSERT_TRUE(t.choose("a", ev, &s));
  t.used(s, "a", {11});
  ASSERT_TRUE(t.choose("a", ev, &s));  // slot 0 again: its events have not ended, but it is a's
  EXPECT_EQ(s, 0u);
  EXPECT_TRUE(ev.asked.empty());
  EXPECT_EQ(t.last(0), std::vector<int>{10});  // what the next use waits for, on the GPU
}

TEST(StreamSlotTable, AnotherStreamsUnfinishedSlotIsSkippedAndNoneGivenWhenAllAre) {
  Table t(3);
  Events ev;
  std::size_t s = 0;
  for (int e : {20, 21, 22}) {
    ASSERT_TRUE(t.choose("b", ev, &s));
    t.used(s, "b", {e});
  }
  // b's three uses are unfinished (a stream waiting for a peer): a gets none, nothing changes.
  EXPECT_FALSE(t.choose("a", ev, &s));
  EXPECT_EQ(ev.asked, (std::vector<int>{20, 21, 22}));
  // The second one ended: a takes it, and only it.
  ev.ended.insert(21);
  ASSERT_TRUE(t.choose("a", ev, &s));
  EXPECT_EQ(s, 1u);
  t.used(s, "a", {30});
  EXPECT_EQ(t.last(1), std::vector<int>{30});
  // The turn moved past slot 1: b's next choice is slot 2 (its own, not asked), then 0.
  ASSERT_TRUE(t.choose("b", ev, &s));
  EXPECT_EQ(s, 2u);
}

TEST(StreamSlotTable, EveryEventOfAUseMustHaveEnded) {
  Table t(1);
  Events ev;
  std::size_t s = 0;
  ASSERT_TRUE(t.choose("b", ev, &s));
  t.used(s, "b", {40, 41});  // a failed use: events on both streams it touched
  ev.ended.insert(40);
  EXPECT_FALSE(t.choose("a", ev, &s));
  ev.ended.insert(41);
  EXPECT_TRUE(t.choose("a", ev, &s));
}

TEST(StreamSlotTable, ARetiredSlotIsNeverTakenAgain) {
  Table t(2);
  Events ev;
  std::size_t s = 0;
  ASSERT_TRUE(t.choose("a", ev, &s));
  t.retire(s);
  EXPECT_TRUE(t.retired(0));
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(t.choose("a", ev, &s));
    EXPECT_EQ(s, 1u);
  }
  t.retire(1);
  EXPECT_FALSE(t.choose("a", ev, &s));
}

TEST(StreamSlotTable, AllLastListsWhatADrainWaitsFor) {
  Table t(3);
  Events ev;
  std::size_t s = 0;
  EXPECT_TRUE(t.all_last().empty());
  ASSERT_TRUE(t.choose("a", ev, &s));
  t.used(s, "a", {1});
  ASSERT_TRUE(t.choose("b", ev, &s));
  t.used(s, "b", {2, 3});
  const std::vector<int> all = t.all_last();
  EXPECT_EQ(std::multiset<int>(all.begin(), all.end()), (std::multiset<int>{1, 2, 3}));
}
