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

// A ramped one-row transfer: pieces in order, back to back, every byte once, none above a
// chunk nor below the first piece; the first is `first`, they double up to the chunk, and the
// last holds more than `first` and at most twice it.
void check_ramp(std::size_t width, std::size_t chunk, std::size_t first) {
  SCOPED_TRACE("width " + std::to_string(width) + " chunk " + std::to_string(chunk) + " first " + std::to_string(first));
  PieceCursor cursor(width, 1, chunk, first);
  std::vector<std::size_t> widths;
  std::size_t at = 0;
  for (; !cursor.done(); cursor.advance()) {
    const PieceCursor::Piece p = cursor.current();
    ASSERT_EQ(p.row, 0u);
    ASSERT_EQ(p.rows, 1u);
    ASSERT_EQ(p.col, at) << "pieces not back to back";
    ASSERT_GT(p.width, 0u);
    ASSERT_LE(p.width, chunk);
    at += p.width;
    ASSERT_EQ(p.last, at == width);
    widths.push_back(p.width);
    ASSERT_LT(widths.size(), 1u << 20);
  }
  ASSERT_EQ(at, width);
  ASSERT_GE(widths.size(), 2u);
  EXPECT_EQ(widths.front(), first);
  EXPECT_GT(widths.back(), first);
  EXPECT_LE(widths.back(), 2 * first);
  for (std::size_t w : widths) EXPECT_GE(w, first);
  // Doubling up to the chunk, as far as the transfer's first half goes.
  for (std::size_t i = 1; i < widths.size() && (first << i) <= chunk && (first << (i + 1)) <= width / 2; ++i)
    EXPECT_EQ(widths[i], first << i) << "piece " << i;
  // Few pieces: the chunks between, and two ramps of about log2(chunk / first) each.
  std::size_t steps = 0;
  while ((first << steps) < chunk) ++steps;
  EXPECT_LE(widths.size(), width / chunk + 2 * steps + 3);
}

TEST(PieceCursor, ARampedTransferStartsAndEndsWithSmallPieces) {
  constexpr std::size_t K = 1024, M = K * K;
  check_ramp(64 * M, 4 * M, 256 * K);
  check_ramp(1 * M, 4 * M, 256 * K);
  check_ramp(512 * K + 1, 4 * M, 256 * K);
  check_ramp(16 * M + 12345, 4 * M, 256 * K);
  check_ramp(1024 * M + 7, 4 * M, 64 * K);
  std::mt19937_64 rng(20261129);
  for (int i = 0; i < 300; ++i) {
    const std::size_t first = (1 + rng() % 8) * PieceCursor::kRampAlign;
    const std::size_t chunk = first * (2 + rng() % 64);
    check_ramp(2 * first + 1 + rng() % (40 * chunk), chunk, first);
  }
}

// A 64 MiB put with 4 MiB chunks: 256 KiB, 512 KiB, 1, 2, then 4 MiB pieces, halving at the end.
TEST(PieceCursor, A64MiBTransferRampsAsDocumented) {
  constexpr std::size_t K = 1024;
  PieceCursor cursor(64 * K * K, 1, 4 * K * K, 256 * K);
  std::vector<std::size_t> kib;
  for (; !cursor.done(); cursor.advance()) kib.push_back(cursor.current().width / K);
  const std::vector<std::size_t> want{256,  512,  1024, 2048, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096,
                                      4096, 4096, 4096, 4096, 4096, 4096, 2176, 1088, 512,  256,  320};
  EXPECT_EQ(kib, want);
}

// No ramp where it cannot pay or fit: several rows, two first pieces or less, a first piece
// over half a chunk, or none asked for: the plain chunks.
TEST(PieceCursor, NoRampWhereItCannotPay) {
  constexpr std::size_t K = 1024;
  const auto widths = [](PieceCursor c) {
    std::vector<std::size_t> w;
    for (; !c.done(); c.advance()) w.push_back(c.current().width * c.current().rows);
    return w;
  };
  EXPECT_EQ(widths(PieceCursor(512 * K, 1, 4096 * K, 256 * K)), widths(PieceCursor(512 * K, 1, 4096 * K)));
  EXPECT_EQ(widths(PieceCursor(9000 * K, 3, 4096 * K, 256 * K)), widths(PieceCursor(9000 * K, 3, 4096 * K)));
  EXPECT_EQ(widths(PieceCursor(64 * K * K, 1, 256 * K, 256 * K)), widths(PieceCursor(64 * K * K, 1, 256 * K)));
  // A first piece over half a chunk: its last piece (up to twice it) would not fit a slot.
  EXPECT_EQ(widths(PieceCursor(12 * K * K, 1, 4096 * K, 3072 * K)), widths(PieceCursor(12 * K * K, 1, 4096 * K)));
  EXPECT_EQ(widths(PieceCursor(12 * K * K, 1, 4096 * K, 2112 * K)), widths(PieceCursor(12 * K * K, 1, 4096 * K)));
  EXPECT_EQ(widths(PieceCursor(64 * K * K, 1, 4096 * K, 0)), widths(PieceCursor(64 * K * K, 1, 4096 * K)));
}

}  // namespace
