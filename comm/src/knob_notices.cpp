#include "knob_notices.hpp"

#include <cstdint>
#include <mutex>
#include <set>

#include "bootstrap.hpp"
#include "log.hpp"

namespace meshmem::detail {

std::vector<std::string> merge_notices(const std::vector<std::vector<std::string>>& by_rank) {
  std::vector<std::string> order;
  std::vector<std::vector<int>> ranks;
  for (std::size_t r = 0; r < by_rank.size(); ++r)
    for (const std::string& n : by_rank[r]) {
      std::size_t i = 0;
      while (i < order.size() && order[i] != n) ++i;
      if (i == order.size()) {
        order.push_back(n);
        ranks.emplace_back();
      }
      if (ranks[i].empty() || ranks[i].back() != static_cast<int>(r)) ranks[i].push_back(static_cast<int>(r));
    }
  std::vector<std::string> lines;
  for (std::size_t i = 0; i < order.size(); ++i) {
    const std::vector<int>& from = ranks[i];
    const std::string where = by_rank.size() > 1 && from.size() == by_rank.size() ? "every rank"
                              : from.size() == 1 ? "rank " + std::to_string(from[0])
                                                 : "ranks " + rank_list(from);
    lines.push_back(order[i] + "; on " + where);
  }
  return lines;
}

namespace {
// Rank 0 of a second Comm in the same process does not repeat them.
std::mutex logged_m;
std::set<std::string>& logged() {
  static std::set<std::string> lines;
  return lines;
}

std::string joined(const std::vector<std::string>& lines) {
  std::string s;
  for (const std::string& l : lines) s += l + '\n';
  return s;
}
std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> lines;
  for (std::size_t at = 0; at < s.size();) {
    const std::size_t end = s.find('\n', at);
    lines.push_back(s.substr(at, end - at));
    at = end + 1;
  }
  return lines;
}
}  // namespace

void report_knob_notices(Bootstrap& boot, const Options& options, const std::string& what) {
  const std::string mine = joined(options.notices());
  const std::uint64_t len = mine.size();
  std::vector<std::uint64_t> lens(static_cast<std::size_t>(boot.size()));
  boot.allgather(&len, lens.data(), sizeof(len), what);
  std::vector<std::vector<std::string>> by_rank(static_cast<std::size_t>(boot.size()));
  for (int r = 0; r < boot.size(); ++r) {
    if (lens[r] == 0) continue;
    std::string text = boot.rank() == r ? mine : std::string(lens[r], '\0');
    boot.broadcast(text.data(), text.size(), r, what);
    by_rank[r] = split(text);
  }
  if (boot.rank() != 0) return;
  std::lock_guard<std::mutex> lock(logged_m);
  for (const std::string& line : merge_notices(by_rank))
    if (logged().insert(line).second) log(LogLevel::Warn, line);
}

}  // namespace meshmem::detail
