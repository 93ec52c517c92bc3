// HaloExchange: a persistent neighbour exchange over one window, declared once and run every
// iteration. Each rank lists the regions of its part that go to each neighbour and where
// they land in the neighbour's part; exchange(stream) moves them all, tells each neighbour
// its halos have landed, and waits until every neighbour's halos have landed here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "meshmem/comm.hpp"

namespace meshmem {

// `height` rows of `width` bytes: row i starts at offset + i * pitch (pitch 0: contiguous).
// A column of a row-major grid of doubles is width 8, height = rows, pitch = row bytes.
struct HaloRegion {
  int peer = -1;                // the neighbour that receives the region
  std::size_t src_offset = 0;   // in this rank's part of the window
  std::size_t dst_offset = 0;   // in the neighbour's part
  std::size_t width = 0;        // bytes per row
  std::size_t height = 1;       // rows
  std::size_t src_pitch = 0;    // bytes from one row to the next here (0: width)
  std::size_t dst_pitch = 0;    // bytes from one row to the next there (0: width)
};

namespace detail {
struct HaloState;
}

class HaloExchange {
 public:
  HaloExchange();
  HaloExchange(HaloExchange&&) noexcept;
  HaloExchange& operator=(HaloExchange&&) noexcept;
  ~HaloExchange();  // collective (frees the plan's signal words)

  // Puts every region, then signals each neighbour; then waits for every neighbour's
  // signal. Device windows: stream-ordered, the host does not wait. Host windows: null
  // stream, returns when this rank's halos have landed. Once it completes, a neighbour may
  // overwrite this rank's halos again only after this rank's next exchange(): keep two
  // windows (or two halo areas) in alternation when computing reads the halos while the
  // next exchange runs, as Jacobi's two grids do.
  void exchange(Stream stream = nullptr);

  // For halos that kernels wrote into the neighbours' windows themselves (device API,
  // Window::view()): the same signals and waits as exchange(), without the copies. The
  // writes must be ordered before this call on `stream` (the kernel ran on it). Refused
  // (Unsupported) on every rank when some rank of the exchange has a neighbour whose window
  // it cannot map (the staged transport): kernels cannot write there.
  void complete(Stream stream = nullptr);

  std::uint64_t exchanges() const;  // exchange() and complete() calls issued so far (refused ones not counted)
  const std::vector<int>& neighbours() const;  // ranks this rank receives from

 private:
  friend class Comm;
  explicit HaloExchange(std::unique_ptr<detail::HaloState> state);
  std::unique_ptr<detail::HaloState> state_;
};

}  // namespace meshmem
