// PieceCursor: every byte of a 2D transfer lies in exactly one piece, no piece exceeds a
// chunk, pieces come in order and only the final one is marked last.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "piece_cursor.hpp"

namespace {

using meshmem::detail::PieceCursor;

void check_cover(std::size_t width, std::size_t rows, std::size_t chunk) {
  SCOPED_TRACE("width " + std::to_string(width) + " rows " + std::to_string(rows) + " chunk " + std::to_string(chunk));
  std::vector<int> hits(width * rows, 0);
  PieceCursor cursor(width, rows, chunk);
  std::size_t pieces = 0;
  bool saw_last = false;
  while (!cursor.done()) {
    ASSERT_FALSE(saw_last) << "a piece after the one marked last";
    const PieceCursor::Piece p = cursor.current();
    ASSERT_GT(p.rows, 0u);
    ASSERT_GT(p.width, 0u);
    ASSERT_LE(p.rows * p.width, chunk) << "a piece larger than a chunk";
    ASSERT_LE(p.row + p.rows, rows);
    ASSERT_LE(p.col + p.width, width);
    if (p.rows > 1) ASSERT_EQ(p.width, width) << "several rows in a piece must be whole rows";
    for (std::size_t r = 0; r < p.rows; ++r)
      for (std::size_t c = 0; c < p.width; ++c) ++hits[(p.row + r) * width + p.col + c];
    saw_last = p.last;
    cursor.advance();
    ASSERT_LT(++pieces, 1u << 20);
  }
  if (width > 0 && rows > 0) EXPECT_TRUE(saw_last) << "no piece marked last";
  for (std::size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i], 1) << "byte " << i;
}

TEST(PieceCursor, EveryByteInExactlyOnePieceOfAtMostAChunk) {
  for (std::size_t chunk : {1u, 7u, 64u, 4096u})
    for (std::size_t width : {0u, 1u, 3u, 7u, 8u, 63u, 64u, 65u, 200u, 4096u, 5000u})
      for (std::size_t rows : {0u, 1u, 2u, 5u, 9u, 64u}) check_cover(width, rows, chunk);
}

TEST(PieceCursor, RandomShapes) {
  std::mt19937_64 rng(20261123);
  for (int i = 0; i < 500; ++i) {
    const std::size_t chunk = 1 + rng() % 300;
    check_cover(rng() % 700, rng() % 20, chunk);
  }
}

TEST(PieceCursor, AContiguousTransferIsCutIntoChunks) {
  PieceCursor cursor(10 * 1024 + 5, 1, 1024);
  std::size_t n = 0;
  for (; !cursor.done(); cursor.advance()) {
    const auto p = cursor.current();
    EXPECT_EQ(p.col, n * 1024);
    EXPECT_EQ(p.width, n < 10 ? 1024u : 5u);
    EXPECT_EQ(p.last, n == 10);
    ++n;
  }
  EXPECT_EQ(n, 11u);
}

}  // namespace
