// FreeRanges (comm/src/free_ranges.hpp): the first-fit ranges of a block-pool chunk.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <random>
#include <vector>

#include "free_ranges.hpp"

namespace meshmem::detail {
namespace {

TEST(FreeRanges, TakesFirstFitAndSaysWhenNothingFits) {
  FreeRanges r(1000);
  EXPECT_EQ(r.take(100), 0u);
  EXPECT_EQ(r.take(300), 100u);
  EXPECT_EQ(r.held(), 400u);
  EXPECT_EQ(r.take(601), r.size()) << "more than is left";
  EXPECT_EQ(r.take(600), 400u);
  EXPECT_EQ(r.take(1), r.size()) << "full";
  r.put(0, 100);
  EXPECT_EQ(r.take(200), r.size()) << "the hole is too small";
  EXPECT_EQ(r.take(100), 0u) << "the hole is reused";
}

TEST(FreeRanges, FreedNeighboursMergeIntoOneRange) {
  FreeRanges r(4096);
  const std::size_t a = r.take(1024), b = r.take(1024), c = r.take(1024), d = r.take(1024);
  r.put(b, 1024);
  r.put(d, 1024);
  EXPECT_EQ(r.ranges(), 2u);
  r.put(c, 1024);  // joins b and d
  EXPECT_EQ(r.ranges(), 1u);
  EXPECT_EQ(r.take(3072), b) << "b..d is one range again";
  r.put(b, 3072);
  r.put(a, 1024);
  EXPECT_EQ(r.ranges(), 1u);
  EXPECT_EQ(r.held(), 0u);
  EXPECT_EQ(r.take(4096), 0u);
}

// Random takes and gives back, checked against a byte map: no two held blocks overlap,
// every held block is inside the chunk, and once all is given back the chunk is one range.
TEST(FreeRanges, RandomUseNeverOverlapsAndEndsWhole) {
  std::mt19937_64 rng(0x5eed);
  const std::size_t size = 1 << 16;
  FreeRanges r(size);
  std::vector<int> owner(size, -1);
  struct Held {
    std::size_t offset, bytes;
  };
  std::vector<Held> held;
  for (int step = 0; step < 20000; ++step) {
    if (held.empty() || rng() % 3 != 0) {
      const std::size_t want = 1 + rng() % 3000;
      const std::size_t at = r.take(want);
      if (at == size) continue;
      ASSERT_LE(at + want, size);
      for (std::size_t i = at; i < at + want; ++i) {
        ASSERT_EQ(owner[i], -1) << "byte " << i << " handed out twice";
        owner[i] = step;
      }
      held.push_back({at, want});
    } else {
      const std::size_t k = rng() % held.size();
      r.put(held[k].offset, held[k].bytes);
      std::fill(owner.begin() + held[k].offset, owner.begin() + held[k].offset + held[k].bytes, -1);
      held.erase(held.begin() + k);
    }
    std::size_t sum = 0;
    for (const Held& h : held) sum += h.bytes;
    ASSERT_EQ(r.held(), sum);
  }
  for (const Held& h : held) r.put(h.offset, h.bytes);
  EXPECT_EQ(r.held(), 0u);
  EXPECT_EQ(r.ranges(), 1u);
  EXPECT_EQ(r.take(size), 0u);
}

}  // namespace
}  // namespace meshmem::detail
