// rows_end: where a strided copy's rows end, and every way the arithmetic can overflow (the
// shapes come from other ranks: a halo plan's regions, an nccl put's header).
#include <gtest/gtest.h>

#include <cstdint>

#include "strided_rows.hpp"

using meshmem::detail::rows_end;

namespace {
constexpr std::uint64_t kMax = UINT64_MAX;
}

TEST(StridedRows, EndOfRows) {
  std::uint64_t end = 0;
  ASSERT_TRUE(rows_end(5, 24, 157, 1000, &end));
  EXPECT_EQ(end, 5u + 156u * 1000u + 24u);
  ASSERT_TRUE(rows_end(0, 64, 10, 64, &end));  // contiguous
  EXPECT_EQ(end, 640u);
  ASSERT_TRUE(rows_end(7, 8, 1, kMax, &end));  // one row: the pitch is never stepped
  EXPECT_EQ(end, 15u);
  ASSERT_TRUE(rows_end(9, 100, 0, 100, &end));  // no rows
  EXPECT_EQ(end, 9u);
}

TEST(StridedRows, LastByteOfTheAddressSpace) {
  std::uint64_t end = 0;
  ASSERT_TRUE(rows_end(kMax - 30, 10, 3, 10, &end));
  EXPECT_EQ(end, kMax);
  EXPECT_FALSE(rows_end(kMax - 29, 10, 3, 10, &end));  // one byte more
}

TEST(StridedRows, EveryOverflowIsRefused) {
  std::uint64_t end = 0;
  EXPECT_FALSE(rows_end(0, 1, 3, kMax / 2 + 1, &end));  // rows x pitch
  EXPECT_FALSE(rows_end(kMax, 1, 2, 1, &end));          // offset + rows x pitch
  EXPECT_FALSE(rows_end(kMax - 5, 10, 1, 0, &end));     // ... + width
  EXPECT_FALSE(rows_end(0, kMax, 2, 1, &end));
}
