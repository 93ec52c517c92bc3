// The bench/results CSV format (bench/README.md, "Reading the CSV"), written by every
// benchmark: date,commit,machine,benchmark,variant,ranks,size_bytes,latency_us,bandwidth_gbps.
#pragma once

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

namespace bench {

struct ResultRow {
  std::string benchmark, variant;
  int ranks = 0;
  long long size_bytes = -1;    // < 0: empty cell
  double latency_us = -1;       // < 0: empty cell
  double bandwidth_gbps = -1;   // 1e9 bytes/s; < 0: empty cell
};

inline std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

inline std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

enum class CsvMode { Truncate, Append };

// Writes `rows` (the header first when the file is new or empty). Says why on stderr and
// returns false when the file cannot be written.
inline bool write_results_csv(const std::string& path, CsvMode mode, const std::string& date, const std::string& commit,
                              const std::string& machine, const std::vector<ResultRow>& rows, const char* program) {
  std::FILE* f = std::fopen(path.c_str(), mode == CsvMode::Truncate ? "w" : "a");
  if (f == nullptr) {
    std::fprintf(stderr, "%s: cannot open %s: %s\n", program, path.c_str(), std::strerror(errno));
    return false;
  }
  // "a" writes at the end whatever the position; ftell after seeking says if it was empty.
  if (std::fseek(f, 0, SEEK_END) == 0 && std::ftell(f) == 0)
    std::fprintf(f, "date,commit,machine,benchmark,variant,ranks,size_bytes,latency_us,bandwidth_gbps\n");
  for (const ResultRow& r : rows) {
    char size[32] = "", lat[32] = "", bw[32] = "";
    if (r.size_bytes >= 0) std::snprintf(size, sizeof(size), "%lld", r.size_bytes);
    if (r.latency_us >= 0) std::snprintf(lat, sizeof(lat), "%.4f", r.latency_us);
    if (r.bandwidth_gbps >= 0) std::snprintf(bw, sizeof(bw), "%.6f", r.bandwidth_gbps);
    std::fprintf(f, "%s,%s,%s,%s,%s,%d,%s,%s,%s\n", csv_field(date).c_str(), csv_field(commit).c_str(),
                 csv_field(machine).c_str(), csv_field(r.benchmark).c_str(), csv_field(r.variant).c_str(), r.ranks, size,
                 lat, bw);
  }
  const bool ok = std::fflush(f) == 0 && !std::ferror(f);
  if (std::fclose(f) != 0 || !ok) {
    std::fprintf(stderr, "%s: writing %s failed\n", program, path.c_str());
    return false;
  }
  return true;
}

}  // namespace bench
