// LandingWindows: what a peer's (window id, offset, rows) resolves to here, and what is
// refused with its reason (a window freed, a range past its end, an offset that wraps).
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cuda/agent/landing_windows.hpp"

using meshmem::detail::LandingWindows;

TEST(LandingWindows, ResolvesRangesInsideTheWindowOnly) {
  std::vector<char> memory(4096);
  LandingWindows windows;
  windows.add(7, memory.data(), memory.size());
  const auto lock = windows.lock();
  std::string problem;
  EXPECT_EQ(windows.resolve(7, 0, 4096, 1, 0, &problem), memory.data());
  EXPECT_EQ(windows.resolve(7, 100, 10, 4, 1000, &problem), memory.data() + 100);  // ends at 100 + 3010
  EXPECT_EQ(windows.resolve(7, 4096, 0, 1, 0, &problem), memory.data() + 4096);   // nothing, at the end
  EXPECT_EQ(windows.resolve(7, 0, 0, 0, 0, &problem), memory.data());             // no rows
  EXPECT_TRUE(problem.empty()) << problem;

  EXPECT_EQ(windows.resolve(7, 1, 4096, 1, 0, &problem), nullptr);
  EXPECT_EQ(problem, "bytes 1 .. 4097 are outside window #7 (4096 bytes here)");
  problem.clear();
  EXPECT_EQ(windows.resolve(7, 100, 10, 5, 1000, &problem), nullptr);  // the fifth row ends at 4110
  EXPECT_NE(problem.find("outside window #7"), std::string::npos) << problem;
  problem.clear();
  EXPECT_EQ(windows.resolve(7, 4097, 0, 1, 0, &problem), nullptr);
  EXPECT_NE(problem.find("outside window #7"), std::string::npos) << problem;
  problem.clear();
  const std::uint64_t huge = std::numeric_limits<std::uint64_t>::max() - 10;  // offset + width wraps
  EXPECT_EQ(windows.resolve(7, 16, huge, 1, 0, &problem), nullptr);
  EXPECT_NE(problem.find("outside window #7"), std::string::npos) << problem;
}

TEST(LandingWindows, AWindowErasedOrNeverAddedIsRefused) {
  std::vector<char> a(64), b(128);
  LandingWindows windows;
  windows.add(1, a.data(), a.size());
  windows.add(2, b.data(), b.size());
  windows.erase(1);
  std::string problem;
  auto lock = windows.lock();
  EXPECT_EQ(windows.resolve(1, 0, 8, 1, 0, &problem), nullptr);
  EXPECT_EQ(problem, "window #1 is not (or no longer) allocated here");
  problem.clear();
  EXPECT_EQ(windows.resolve(3, 0, 8, 1, 0, &problem), nullptr);
  EXPECT_EQ(problem, "window #3 is not (or no longer) allocated here");
  problem.clear();
  EXPECT_EQ(windows.resolve(2, 120, 8, 1, 0, &problem), b.data() + 120);
  windows.erase_locked(2);
  EXPECT_EQ(windows.resolve(2, 0, 8, 1, 0, &problem), nullptr);
  lock.unlock();
  windows.add(2, a.data(), a.size());  // an id given again (a new window) resolves to the new memory
  lock.lock();
  problem.clear();
  EXPECT_EQ(windows.resolve(2, 0, 64, 1, 0, &problem), a.data());
  EXPECT_EQ(windows.resolve(2, 0, 65, 1, 0, &problem), nullptr);
}
