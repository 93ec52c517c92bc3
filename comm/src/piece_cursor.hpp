// PieceCursor: how the staged transports cut a transfer into pieces that fit a staging slot.
// No CUDA here, so it is unit-tested anywhere.
#pragma once

#include <algorithm>
#include <cstddef>

namespace meshmem::detail {

// The pieces a transfer of `rows` rows of `width` bytes is cut into, at most a chunk each:
// whole rows where a row fits (packed in the slot), otherwise a chunk of one row.
//
// With a first piece `first` (0: none; at most half a chunk, as the last piece may take up to
// twice it), a one-row transfer of more than two such pieces ramps:
// its pieces start at `first` and double up to the chunk, and toward its end each takes half
// of what is left (rounded down to kRampAlign, at least `first`), the last one holding between
// `first` and 2 x `first`. Why: the target's host-to-device copy of a piece starts only once
// the source's device-to-host copy of it ended, and the last piece's copy to the target runs
// alone, so chunk-sized pieces at both ends cost about two chunks' copy time (4 MiB chunks at
// 64 MiB: 0.895 x min(d2h, h2d) at best, bench/results/2026-11-28-nvidia-h200-x4-pipeline-lab-
// c11d6a2.txt); small ones at the ends start the target's copies sooner and end them sooner,
// chunk-sized ones between keep the copies few.
class PieceCursor {
 public:
  static constexpr std::size_t kRampAlign = std::size_t(64) << 10;
  struct Piece {
    std::size_t row = 0, col = 0, rows = 0, width = 0;
    bool last = false;  // no piece follows
  };
  PieceCursor() = default;
  PieceCursor(std::size_t width, std::size_t rows, std::size_t chunk, std::size_t first = 0)
      : width_(width),
        rows_(rows),
        rows_per_(width == 0 ? 1 : width <= chunk ? chunk / width : 1),
        cut_(width <= chunk ? width : chunk),
        chunk_(chunk),
        first_(rows == 1 && first > 0 && 2 * first <= chunk && width > 2 * first ? first : 0) {}
  bool done() const { return width_ == 0 || row_ >= rows_; }
  bool ramps() const { return first_ != 0; }  // then no piece is smaller than `first`
  Piece current() const {
    Piece p{row_, col_, std::min(rows_per_, rows_ - row_), std::min(cut(), width_ - col_), false};
    p.last = row_ + p.rows >= rows_ && col_ + p.width >= width_;
    return p;
  }
  void advance() {
    col_ += cut();
    ++index_;
    if (col_ >= width_) {
      col_ = 0;
      row_ += rows_per_;
    }
  }

 private:
  // The width of the piece at col_ (of a one-row transfer, where it ramps).
  std::size_t cut() const {
    if (first_ == 0) return cut_;
    const std::size_t left = width_ - col_;
    if (left <= 2 * first_) return left;
    const std::size_t up = index_ < 32 ? std::min(chunk_, first_ << index_) : chunk_;
    const std::size_t half = left / 2 / kRampAlign * kRampAlign;
    return std::min(up, std::max(first_, half));
  }
  std::size_t width_ = 0, rows_ = 0, rows_per_ = 1, cut_ = 0, chunk_ = 0, first_ = 0;
  std::size_t row_ = 0, col_ = 0, index_ = 0;
};

}  // namespace meshmem::detail
