// Support for multi-rank GoogleTest suites: every rank runs every test; MpiTest agrees the
// verdict across ranks in TearDown, so a failure on any rank fails the test on all of them
// (and rank 0's report is the job's report).
#pragma once

#include <dirent.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace meshmem::test {

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
inline int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

// Prints a failure on a rank other than 0 (whose gtest printer is removed), prefixed with the
// rank, so that every rank's failures reach the log.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_, result.file_name() ? result.file_name() : "?",
                 result.line_number(), result.summary());
  }

 private:
  int rank_;
};

class MpiTest : public ::testing::Test {
 protected:
  void TearDown() override {
    int mine = HasFailure() ? 1 : 0;
    std::vector<int> all(static_cast<std::size_t>(world_size()));
    MPI_Allgather(&mine, 1, MPI_INT, all.data(), 1, MPI_INT, MPI_COMM_WORLD);
    std::string failed;
    for (std::size_t r = 0; r < all.size(); ++r)
      if (all[r] && static_cast<int>(r) != world_rank()) failed += " " + std::to_string(r);
    if (!failed.empty()) ADD_FAILURE() << "the test failed on rank(s)" << failed;
  }
};

// A seed that is fresh for every test run, the same on every rank.
inline std::uint64_t shared_seed() {
  std::uint64_t seed = 0;
  if (world_rank() == 0) seed = (static_cast<std::uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  return seed;
}

// Deterministic bytes for (seed, stream): every rank can recompute what another sent.
inline std::vector<unsigned char> pattern(std::uint64_t seed, std::uint64_t stream, std::size_t bytes) {
  std::vector<unsigned char> out(bytes);
  std::mt19937_64 gen(seed ^ (stream * 0x9E3779B97F4A7C15ull));
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    const std::uint64_t v = gen();
    std::memcpy(out.data() + i, &v, 8);
  }
  if (i < bytes) {
    const std::uint64_t v = gen();
    std::memcpy(out.data() + i, &v, bytes - i);
  }
  return out;
}

inline constexpr unsigned char kPoison = 0xA5;

// Index of the first byte that differs, or -1. (Byte-by-byte EXPECT_EQ would flood the log.)
inline long long first_difference(const void* a, const void* b, std::size_t bytes) {
  if (std::memcmp(a, b, bytes) == 0) return -1;
  const auto* x = static_cast<const unsigned char*>(a);
  const auto* y = static_cast<const unsigned char*>(b);
  for (std::size_t i = 0; i < bytes; ++i)
    if (x[i] != y[i]) return static_cast<long long>(i);
  return -1;
}

inline long long first_not(const void* a, unsigned char value, std::size_t bytes) {
  const auto* x = static_cast<const unsigned char*>(a);
  for (std::size_t i = 0; i < bytes; ++i)
    if (x[i] != value) return static_cast<long long>(i);
  return -1;
}

// `make()` on every rank, or every rank tries again, up to `tries` times; null on every rank
// after the last (`why`: this rank's last Failure). For setup steps bounded by a short timeout
// (a Comm's construction, its first alloc): on a loaded machine such a step can expire on one
// rank, and ranks that parted ways there would hang in different collectives, so they agree
// over plain MPI instead. What a failed try made on the other ranks is torn down before the
// next (its teardown times out where a peer has none; bounded).
template <class Failure, class Make>
auto made_on_every_rank(Make make, int tries, std::string* why) -> std::unique_ptr<decltype(make())> {
  for (int attempt = 1;; ++attempt) {
    MPI_Barrier(MPI_COMM_WORLD);
    why->clear();
    std::unique_ptr<decltype(make())> made;
    try {
      made = std::make_unique<decltype(make())>(make());
    } catch (const Failure& e) {
      *why = e.what();
    }
    int ok = made ? 1 : 0, all = 0;
    MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (all) return made;
    made.reset();
    if (attempt == tries) return nullptr;
  }
}

// Open descriptors of this process (for leak checks).
inline int count_fds() {
  int count = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d) != nullptr) ++count;
    closedir(d);
  }
  return count;
}

}  // namespace meshmem::test
