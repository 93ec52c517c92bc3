// FillSlotTable: a stream keeps its fill slot; a slot passes to another stream only once its
// last transfer ended; a retired slot is never handed out; a slot whose last put was given up
// is retired; with every slot held by unfinished transfers of other streams, none is given.
#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <vector>

#include "cuda/staged/fill_slot_table.hpp"

using meshmem::detail::ControlWords;
using meshmem::detail::FillSlots;
using meshmem::detail::FillSlotTable;

namespace {
constexpr std::uint64_t kGivenUp = std::uint64_t(1) << 62;

struct Words {
  std::vector<std::uint64_t> memory = std::vector<std::uint64_t>(ControlWords::kWords, 0);
  ControlWords control{memory.data(), 2, 2};
};
const void* stream(int i) { return reinterpret_cast<const void*>(static_cast<std::uintptr_t>(0x1000 + 16 * i)); }
}  // namespace

TEST(FillSlotTable, AStreamKeepsItsSlotAndEachStreamGetsItsOwn) {
  Words w;
  FillSlotTable table(w.control, kGivenUp);
  std::vector<std::uint64_t> done(FillSlots::kSlots, 0);
  std::set<std::size_t> seen;
  for (int s = 0; s < static_cast<int>(FillSlots::kSlots); ++s) {
    std::size_t slot = 99;
    ASSERT_TRUE(table.slot_of(stream(s), &slot));
    EXPECT_TRUE(seen.insert(slot).second) << "slot " << slot << " given twice";
    EXPECT_EQ(table.last(slot).done, nullptr);  // never used: the first fill waits for nothing
    table.used(slot, {&done[slot], 2, 1});      // its transfer has not ended (done 0 < 2)
    std::size_t again = 99;
    ASSERT_TRUE(table.slot_of(stream(s), &again));
    EXPECT_EQ(again, slot);
    EXPECT_EQ(table.last(again).ticket, 2u);
  }
  std::size_t slot = 0;
  EXPECT_FALSE(table.slot_of(stream(100), &slot)) << "every slot is held by an unfinished transfer";
  done[5] = 2;  // slot 5's transfer ended: a new stream takes it over
  ASSERT_TRUE(table.slot_of(stream(100), &slot));
  EXPECT_EQ(slot, 5u);
  EXPECT_EQ(table.last(5).done, &done[5]);  // what its first fill waits for (ended already)
}

TEST(FillSlotTable, RetiredAndGivenUpSlotsAreNeverHandedOutAgain) {
  Words w;
  FillSlotTable table(w.control, kGivenUp);
  std::uint64_t done0 = 0, done1 = 0;
  std::size_t a = 99, b = 99;
  ASSERT_TRUE(table.slot_of(stream(0), &a));
  table.used(a, {&done0, 4, 1});
  ASSERT_TRUE(table.slot_of(stream(1), &b));
  ASSERT_NE(a, b);
  table.used(b, {&done1, 6, 1});
  // A fill kernel found slot a held by a transfer that timed out: retired. Its stream moves on.
  *w.control.fill_retired(a) = 1;
  std::size_t moved = 99;
  ASSERT_TRUE(table.slot_of(stream(0), &moved));
  EXPECT_NE(moved, a);
  EXPECT_NE(moved, b);
  // Slot b's put was given up (its wait timed out): its reader may still copy out of it.
  done1 = 6 | kGivenUp;
  std::set<std::size_t> handed;
  for (int s = 10; s < 10 + static_cast<int>(FillSlots::kSlots); ++s) {
    std::size_t slot = 99;
    if (table.slot_of(stream(s), &slot)) handed.insert(slot);
  }
  EXPECT_EQ(handed.count(a), 0u);
  EXPECT_EQ(handed.count(b), 0u);
  EXPECT_EQ(*w.control.fill_retired(b), 1u) << "the given-up slot is retired for the fill kernels too";
}
