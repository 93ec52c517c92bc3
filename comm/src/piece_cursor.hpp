// PieceCursor: how the staged transports cut a transfer into pieces that fit a staging slot.
// No CUDA here, so it is unit-tested anywhere.
#pragma once

#include <algorithm>
#include <cstddef>

namespace meshmem::detail {

// The pieces a transfer of `rows` rows of `width` bytes is cut into, at most a chunk each:
// whole rows where a row fits (packed in the slot), otherwise a chunk of one row.
class PieceCursor {
 public:
  struct Piece {
    std::size_t row = 0, col = 0, rows = 0, width = 0;
    bool last = false;  // no piece follows
  };
  PieceCursor() = default;
  PieceCursor(std::size_t width, std::size_t rows, std::size_t chunk)
      : width_(width),
        rows_(rows),
        rows_per_(width == 0 ? 1 : width <= chunk ? chunk / width : 1),
        cut_(width <= chunk ? width : chunk) {}
  bool done() const { return width_ == 0 || row_ >= rows_; }
  Piece current() const {
    Piece p{row_, col_, std::min(rows_per_, rows_ - row_), std::min(cut_, width_ - col_), false};
    p.last = row_ + p.rows >= rows_ && col_ + p.width >= width_;
    return p;
  }
  void advance() {
    col_ += cut_;
    if (col_ >= width_) {
      col_ = 0;
      row_ += rows_per_;
    }
  }

 private:
  std::size_t width_ = 0, rows_ = 0, rows_per_ = 1, cut_ = 0, row_ = 0, col_ = 0;
};

}  // namespace meshmem::detail
