// A 2D block decomposition for halo tests: each rank owns ny x nx doubles inside a
// (ny+2) x (nx+2) grid whose outer ring is the halo. Shared by the host and GPU suites.
#pragma once

#include <meshmem/halo.hpp>

#include <cstddef>
#include <vector>

namespace meshmem::test {

struct BlockGrid {
  int px, py;        // ranks along x and y
  int cx, cy;        // this rank's block
  std::size_t nx, ny;

  BlockGrid(int ranks, int rank, std::size_t nx_, std::size_t ny_) : nx(nx_), ny(ny_) {
    px = ranks >= 4 && ranks % 2 == 0 ? 2 : 1;
    py = ranks / px;
    cx = rank % px;
    cy = rank / px;
  }
  std::size_t pitch() const { return (nx + 2) * sizeof(double); }
  std::size_t bytes() const { return (ny + 2) * pitch(); }
  std::size_t at(std::size_t y, std::size_t x) const { return y * pitch() + x * sizeof(double); }
  int rank_of(int x, int y) const { return (x < 0 || y < 0 || x >= px || y >= py) ? -1 : y * px + x; }

  // Interior edge rows/columns to the four neighbours' halo ring (no corners).
  std::vector<HaloRegion> regions() const {
    std::vector<HaloRegion> out;
    const int north = rank_of(cx, cy - 1), south = rank_of(cx, cy + 1);
    const int west = rank_of(cx - 1, cy), east = rank_of(cx + 1, cy);
    const std::size_t row = nx * sizeof(double);
    if (north >= 0) out.push_back({north, at(1, 1), at(ny + 1, 1), row, 1, 0, 0});
    if (south >= 0) out.push_back({south, at(ny, 1), at(0, 1), row, 1, 0, 0});
    if (west >= 0) out.push_back({west, at(1, 1), at(1, nx + 1), sizeof(double), ny, pitch(), pitch()});
    if (east >= 0) out.push_back({east, at(1, nx), at(1, 0), sizeof(double), ny, pitch(), pitch()});
    return out;
  }
};

// Value of interior cell (y, x) (1-based) of `rank` in round `round`: every rank can compute
// what its neighbours hold.
inline double cell(std::uint64_t seed, int rank, int round, std::size_t y, std::size_t x) {
  std::uint64_t h = seed ^ (static_cast<std::uint64_t>(rank) << 40) ^ (static_cast<std::uint64_t>(round) << 52) ^
                    (static_cast<std::uint64_t>(y) << 20) ^ x;
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  return static_cast<double>(h % 1000003) / 7.0 + rank;
}

// The grid `rank` should hold after an exchange of `round`: its interior, its neighbours'
// edges in its halo ring, and `poison` in the four corners.
inline std::vector<double> expected_grid(const BlockGrid& g, std::uint64_t seed, int rank, int round, double poison) {
  std::vector<double> v((g.ny + 2) * (g.nx + 2), poison);
  auto idx = [&](std::size_t y, std::size_t x) { return y * (g.nx + 2) + x; };
  for (std::size_t y = 1; y <= g.ny; ++y)
    for (std::size_t x = 1; x <= g.nx; ++x) v[idx(y, x)] = cell(seed, rank, round, y, x);
  const int cx = rank % g.px, cy = rank / g.px;
  const int north = g.rank_of(cx, cy - 1), south = g.rank_of(cx, cy + 1);
  const int west = g.rank_of(cx - 1, cy), east = g.rank_of(cx + 1, cy);
  for (std::size_t x = 1; x <= g.nx; ++x) {
    if (north >= 0) v[idx(0, x)] = cell(seed, north, round, g.ny, x);
    if (south >= 0) v[idx(g.ny + 1, x)] = cell(seed, south, round, 1, x);
  }
  for (std::size_t y = 1; y <= g.ny; ++y) {
    if (west >= 0) v[idx(y, 0)] = cell(seed, west, round, y, g.nx);
    if (east >= 0) v[idx(y, g.nx + 1)] = cell(seed, east, round, y, 1);
  }
  return v;
}

}  // namespace meshmem::test
