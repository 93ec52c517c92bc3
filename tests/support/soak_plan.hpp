// The soak's plan and model (issue 13), shared by the host-window soak (tests/mpi/test_soak.cpp)
// and the device-window soak (tests/gpu/test_soak.cu). No CUDA and no MPI calls here.
//
// A soak runs rounds. From the seed and the round number every rank derives the same plan: a
// list of operations in one global order, each made by one rank (a barrier by all), and the
// model of every window and signal word of every rank. Each rank runs its own operations in
// that order, so a wait only waits for updates that come earlier in the order: no plan can
// deadlock. What a plan promises is decided with the API's rules only:
//  * the destinations of one round's writes (put, put_signal) are disjoint, and every write
//    carries fresh random data;
//  * a signal word takes, in one round, either one Set or any number of Adds (they commute),
//    so its value at the end of the round is known;
//  * a read (get, or a rank looking at its own window after a wait) only covers bytes whose
//    writes of this round the reader KNOWS are complete: its own writes after quiet (host) or
//    once the stream passed them (device); a write whose signal it waited for (put_signal);
//    the writes that the signaller knew of, or had made earlier to the same target (on the
//    same stream), when it signalled; everything before a barrier. Knowledge travels through
//    chains of signals (a rank that waited signals another, which then reads).
//  * a wait compares with a value that the word reaches; the planner prefers values that the
//    word takes only once every update of the round to it has landed ("implying" waits),
//    which is what turns a wait into knowledge.
// After each round every rank checks every byte of its own windows and its signal words
// against the model; reads are checked against the model as it was when they ran.
#pragma once

#include <meshmem/types.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "mpi_test.hpp"  // pattern, kPoison

namespace meshmem::soak {

// Signal values stay below this (Add never wraps).
inline constexpr std::uint64_t kMaxValue = std::uint64_t{1} << 62;

inline std::uint64_t mix(std::uint64_t x) {  // splitmix64's finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

inline const char* cmp_name(Cmp c) {
  switch (c) {
    case Cmp::EQ: return "EQ";
    case Cmp::NE: return "NE";
    case Cmp::GT: return "GT";
    case Cmp::GE: return "GE";
    case Cmp::LT: return "LT";
    case Cmp::LE: return "LE";
  }
  return "?";
}
inline const char* op_name(SignalOp o) { return o == SignalOp::Set ? "Set" : "Add"; }

struct Config {
  int ranks = 2;
  int streams = 1;                         // per rank (device windows); the host soak has one
  std::vector<std::size_t> windows;        // bytes of each window
  std::vector<std::size_t> signals;        // words of each Signals object
  std::vector<std::vector<char>> reach;    // [from][to]: operations allowed
  std::vector<std::vector<char>> add_ok;   // [from][to]: SignalOp::Add allowed
  int ops_per_round = 60;                  // operations of a round, roughly
  bool stream_ordered = false;             // device semantics: a put is complete once its stream passed it
  bool host_waits = false;                 // device signals: some waits on the host (null stream)
  bool zero_words = false;                 // graph replays: every word starts the round at 0 (reset in the graph)
  bool overlap_ok = false;                 // a put to this rank's own window may overlap its source (memmove)
  std::size_t big_max = (1u << 20) + 77;   // largest write or read
};

enum class Kind : std::uint8_t { Put, PutSignal, Signal, Get, Wait, Check, Quiet, Barrier, Join };
enum class WaitApi : std::uint8_t { Until, All, AllThenSet };

struct Op {
  Kind kind = Kind::Quiet;
  int rank = -1;            // who makes it (Barrier: every rank)
  int stream = 0;           // its stream (Barrier: rank r uses (stream + r) % streams)
  int target = -1;          // Put, PutSignal, Signal, Get; Check: the rank itself
  int window = -1;
  std::size_t offset = 0, bytes = 0;
  int write = -1;           // Put, PutSignal: index in Round::writes
  int set = -1;             // PutSignal, Signal, Wait: which Signals object
  std::size_t index = 0;    // its word (Wait: the first)
  std::size_t count = 1;    // Wait: words
  std::uint64_t value = 0;  // PutSignal, Signal: the operand; Wait: compared with
  SignalOp sig_op = SignalOp::Set;
  Cmp cmp = Cmp::EQ;
  WaitApi api = WaitApi::Until;
  std::uint64_t then = 0;   // WaitApi::AllThenSet
  bool implies = false;     // Wait: true only once every update of the round to its words landed
  bool on_host = false;     // Wait on device signals: the host waits (null stream)
  int from_stream = -1;     // Join: `stream` waits for what was enqueued on from_stream so far
  int src_window = -1;      // Put, PutSignal: the source is [src_offset, +bytes) of the issuer's own
  std::size_t src_offset = 0;  // window src_window (-1: a buffer of fresh random data)
};

struct Write {
  int op, rank, stream, target, window;
  std::size_t offset, bytes;
  int src_window = -1;  // as in Op
  std::size_t src_offset = 0;
};

struct Model;
struct Round {
  int number = 0;            // data of write k: pattern(seed, data_key(number, k)), or its source window's bytes
  unsigned char poison = 0;  // destinations of this round's writes hold it when the round starts
  std::vector<Op> ops;
  std::vector<Write> writes;
  // write_data's results for (number, start model)
  mutable std::vector<std::vector<unsigned char>> data;
  mutable int data_number = -1;
  mutable const Model* data_start = nullptr;
};

inline std::uint64_t data_key(int number, int write) {
  return mix((static_cast<std::uint64_t>(number) << 24) ^ static_cast<std::uint64_t>(write) ^ 0x736f616bull << 40);
}
inline std::vector<unsigned char> expected_bytes(std::uint64_t seed, const Round& r, const Model& start, int before,
                                                 int target, int window, std::size_t offset, std::size_t bytes);
// What write k of round r writes, where the round started from `start`: fresh random data, or
// what its source (a range of the issuer's window) held when the put was made.
inline const std::vector<unsigned char>& write_data(std::uint64_t seed, const Round& r, const Model& start, int k) {
  if (r.data_number != r.number || r.data_start != &start || r.data.size() != r.writes.size()) {
    r.data.assign(r.writes.size(), {});
    r.data_number = r.number, r.data_start = &start;
  }
  auto& d = r.data[static_cast<std::size_t>(k)];
  const Write& w = r.writes[static_cast<std::size_t>(k)];
  if (d.size() != w.bytes) {
    d = w.src_window < 0 ? meshmem::test::pattern(seed, data_key(r.number, k), w.bytes)
                         : expected_bytes(seed, r, start, w.op, w.rank, w.src_window, w.src_offset, w.bytes);
  }
  return d;
}

// Every window and signal word of every rank.
struct Model {
  std::vector<std::vector<std::vector<unsigned char>>> win;   // [rank][window]
  std::vector<std::vector<std::vector<std::uint64_t>>> words; // [rank][set]
  explicit Model(const Config& c) {
    win.resize(static_cast<std::size_t>(c.ranks));
    words.resize(static_cast<std::size_t>(c.ranks));
    for (int r = 0; r < c.ranks; ++r) {
      for (std::size_t b : c.windows) win[r].emplace_back(b, meshmem::test::kPoison);
      for (std::size_t n : c.signals) words[r].emplace_back(n, 0);
    }
  }
};

inline bool overlaps(std::size_t a, std::size_t alen, std::size_t b, std::size_t blen) {
  return a < b + blen && b < a + alen;
}

// The round's destinations hold its poison byte when it starts.
inline void apply_poison(const Round& r, Model& m) {
  for (const Write& w : r.writes)
    std::memset(m.win[w.target][w.window].data() + w.offset, r.poison, w.bytes);
}

// Bytes [offset, offset + bytes) of `window` of rank `target` as op `before` of the round sees
// them: the model at the start of the round (poisoned) and the round's writes made earlier.
inline std::vector<unsigned char> expected_bytes(std::uint64_t seed, const Round& r, const Model& start, int before,
                                                 int target, int window, std::size_t offset, std::size_t bytes) {
  const auto& img = start.win[target][window];
  std::vector<unsigned char> out(img.begin() + static_cast<long>(offset), img.begin() + static_cast<long>(offset + bytes));
  for (std::size_t k = 0; k < r.writes.size(); ++k) {
    const Write& w = r.writes[k];
    if (w.op >= before || w.target != target || w.window != window || !overlaps(w.offset, w.bytes, offset, bytes)) continue;
    const auto& data = write_data(seed, r, start, static_cast<int>(k));
    const std::size_t lo = std::max(w.offset, offset), hi = std::min(w.offset + w.bytes, offset + bytes);
    std::memcpy(out.data() + (lo - offset), data.data() + (lo - w.offset), hi - lo);
  }
  return out;
}

// The model after the round: every write, then every signal update and reset in plan order.
// `m` holds the start of the round when called.
inline void apply_round(std::uint64_t seed, const Round& r, Model& m) {
  for (std::size_t k = 0; k < r.writes.size(); ++k) write_data(seed, r, m, static_cast<int>(k));  // before m changes
  for (std::size_t k = 0; k < r.writes.size(); ++k) {
    const Write& w = r.writes[k];
    std::memcpy(m.win[w.target][w.window].data() + w.offset, r.data[k].data(), w.bytes);
  }
  r.data_start = nullptr;  // m is no longer the start
  for (const Op& op : r.ops) {
    if (op.kind == Kind::PutSignal || op.kind == Kind::Signal) {
      std::uint64_t& word = m.words[op.target][op.set][op.index];
      word = op.sig_op == SignalOp::Set ? op.value : word + op.value;
    } else if (op.kind == Kind::Wait && op.api == WaitApi::AllThenSet) {
      for (std::size_t i = 0; i < op.count; ++i) m.words[op.rank][op.set][op.index + i] = op.then;
    }
  }
}

// The value of word `index` of Signals `set` of `rank` once every update of the round to it
// landed (before any reset by a wait_until_all_then_set).
inline std::uint64_t updated_word(const Round& r, const Model& start, int rank, int set, std::size_t index) {
  std::uint64_t v = start.words[rank][set][index];
  for (const Op& op : r.ops)
    if ((op.kind == Kind::PutSignal || op.kind == Kind::Signal) && op.target == rank && op.set == set && op.index == index)
      v = op.sig_op == SignalOp::Set ? op.value : v + op.value;
  return v;
}

inline std::string describe(const Op& op, int index) {
  std::ostringstream s;
  s << "op #" << index << " ";
  auto range = [&] { s << " window " << op.window << " [" << op.offset << ", +" << op.bytes << ")"; };
  if (op.src_window >= 0)
    s << "(from its own window " << op.src_window << " [" << op.src_offset << ", +" << op.bytes << ")) ";
  switch (op.kind) {
    case Kind::Put: s << "put by rank " << op.rank << " (stream " << op.stream << ") to rank " << op.target; range(); break;
    case Kind::PutSignal:
      s << "put_signal by rank " << op.rank << " (stream " << op.stream << ") to rank " << op.target;
      range();
      s << ", signal " << op.set << "/" << op.index << " " << op_name(op.sig_op) << " " << op.value;
      break;
    case Kind::Signal:
      s << "signal by rank " << op.rank << " (stream " << op.stream << ") to rank " << op.target << ", word " << op.set
        << "/" << op.index << " " << op_name(op.sig_op) << " " << op.value;
      break;
    case Kind::Get: s << "get by rank " << op.rank << " (stream " << op.stream << ") from rank " << op.target; range(); break;
    case Kind::Check: s << "check by rank " << op.rank << " (stream " << op.stream << ") of its own"; range(); break;
    case Kind::Wait:
      s << (op.api == WaitApi::Until ? "wait_until" : op.api == WaitApi::All ? "wait_until_all" : "wait_until_all_then_set")
        << " by rank " << op.rank << (op.on_host ? " (host)" : "") << " (stream " << op.stream << ") words " << op.set
        << "/" << op.index << (op.count > 1 ? "+" + std::to_string(op.count) : std::string()) << " " << cmp_name(op.cmp)
        << " " << op.value;
      if (op.api == WaitApi::AllThenSet) s << " then " << op.then;
      s << (op.implies ? " (implying)" : "");
      break;
    case Kind::Quiet: s << "quiet by rank " << op.rank << " (stream " << op.stream << ")"; break;
    case Kind::Barrier: s << "barrier (stream " << op.stream << " + rank)"; break;
    case Kind::Join: s << "join by rank " << op.rank << ": stream " << op.stream << " waits for stream " << op.from_stream; break;
  }
  return s.str();
}

// Which write of the round covers byte `offset` of `window` of rank `target` (its op index), or -1.
inline int writer_of(const Round& r, int target, int window, std::size_t offset) {
  for (const Write& w : r.writes)
    if (w.target == target && w.window == window && offset >= w.offset && offset < w.offset + w.bytes) return w.op;
  return -1;
}

inline std::string hex(unsigned v) {
  char b[8];
  std::snprintf(b, sizeof(b), "0x%02x", v & 0xffu);
  return b;
}

inline long long env_number(const char* name, long long fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != 0 ? static_cast<long long>(std::strtoull(v, nullptr, 0)) : fallback;
}

// "" where the bytes that op i (a get or a check) read are the model's, else what differs.
inline std::string read_mismatch(const Round& r, int i, const unsigned char* got, const std::vector<unsigned char>& want) {
  const Op& op = r.ops[static_cast<std::size_t>(i)];
  const long long at = meshmem::test::first_difference(got, want.data(), op.bytes);
  if (at < 0) return "";
  std::size_t bad = 0;
  for (std::size_t b = 0; b < op.bytes; ++b) bad += got[b] != want[b];
  const int writer = writer_of(r, op.target, op.window, op.offset + static_cast<std::size_t>(at));
  return describe(op, i) + ": byte " + std::to_string(op.offset + static_cast<std::size_t>(at)) + " of rank " +
         std::to_string(op.target) + "'s window " + std::to_string(op.window) + " reads " + hex(got[at]) +
         ", the model says " + hex(want[static_cast<std::size_t>(at)]) + " (" +
         (writer >= 0 ? "written by op #" + std::to_string(writer) : std::string("not written this round")) +
         "; round poison " + hex(r.poison) + "); " + std::to_string(bad) + " of " + std::to_string(op.bytes) +
         " bytes differ";
}

// "" where window w of `rank` after round r is the model's, else the first byte that differs,
// which op wrote it and how many bytes differ.
inline std::string window_mismatch(const Round& r, int rank, int w, const unsigned char* got,
                                   const std::vector<unsigned char>& want) {
  const long long at = meshmem::test::first_difference(got, want.data(), want.size());
  if (at < 0) return "";
  std::size_t bad = 0;
  for (std::size_t b = 0; b < want.size(); ++b) bad += got[b] != want[b];
  const int writer = writer_of(r, rank, w, static_cast<std::size_t>(at));
  return "after the round, byte " + std::to_string(at) + " of window " + std::to_string(w) + " (" +
         std::to_string(want.size()) + " bytes) is " + hex(got[at]) + ", the model says " +
         hex(want[static_cast<std::size_t>(at)]) + " (" +
         (writer >= 0 ? describe(r.ops[static_cast<std::size_t>(writer)], writer) : std::string("not written this round")) +
         "; round poison " + hex(r.poison) + "); " + std::to_string(bad) + " bytes differ";
}

// How a word may move in a round: it starts at `start`, ends at `final`; before its last
// update lands it holds values within [lo, hi].
struct WordFate {
  std::uint64_t start, final, lo, hi;
};

// Picks cmp and x such that every word's final value compares true; `implies` where no
// value a word holds before its last update does (then the wait returning means all landed).
// `want_implying`: prefer such a pair where one exists.
inline bool choose_condition(std::mt19937_64& rng, const std::vector<WordFate>& fates, bool want_implying, Cmp& cmp,
                             std::uint64_t& x, bool& implies) {
  Cmp order[] = {Cmp::EQ, Cmp::NE, Cmp::GT, Cmp::GE, Cmp::LT, Cmp::LE};
  for (int i = 5; i > 0; --i) std::swap(order[i], order[rng() % static_cast<std::uint64_t>(i + 1)]);
  auto pick = [&](std::uint64_t a, std::uint64_t b) {  // in [a, b], often an end
    const std::uint64_t k = rng() % 4;
    if (k == 0) return a;
    if (k == 1) return b;
    return a + (b - a == ~0ull ? rng() : rng() % (b - a + 1));
  };
  std::uint64_t fmin = ~0ull, fmax = 0, lomin = ~0ull, himax = 0;
  bool single = true, same_final = true;
  for (const WordFate& f : fates) {
    fmin = std::min(fmin, f.final), fmax = std::max(fmax, f.final);
    lomin = std::min(lomin, f.lo), himax = std::max(himax, f.hi);
    single = single && f.lo == f.hi && f.lo == fates[0].lo;
    same_final = same_final && f.final == fates[0].final;
  }
  auto in_any_path = [&](std::uint64_t v) {
    for (const WordFate& f : fates)
      if (v >= f.lo && v <= f.hi) return true;
    return false;
  };
  auto is_final = [&](std::uint64_t v) {
    for (const WordFate& f : fates)
      if (v == f.final) return true;
    return false;
  };
  for (int pass = want_implying ? 0 : 1; pass < 2; ++pass) {
    for (Cmp c : order) {
      // valid: [vlo, vhi]; implying: [ilo, ihi] (empty where ilo > ihi)
      std::uint64_t vlo = 1, vhi = 0, ilo = 1, ihi = 0;
      switch (c) {
        case Cmp::EQ:
          if (!same_final) continue;
          vlo = vhi = fmin;
          if (!in_any_path(fmin)) ilo = ihi = fmin;
          break;
        case Cmp::NE: {
          if (single && !is_final(lomin)) {
            if (pass == 0) { cmp = c, x = lomin, implies = true; return true; }
          }
          if (pass == 0) continue;
          std::uint64_t v = rng() % kMaxValue;
          while (is_final(v)) ++v;
          cmp = c, x = v, implies = single && v == lomin;
          return true;
        }
        case Cmp::GT:
          if (fmin == 0) continue;
          vlo = 0, vhi = fmin - 1, ilo = himax, ihi = fmin - 1;
          break;
        case Cmp::GE:
          vlo = 0, vhi = fmin, ilo = himax + 1, ihi = fmin;
          break;
        case Cmp::LT:
          vlo = fmax + 1, vhi = kMaxValue, ilo = fmax + 1, ihi = lomin;
          break;
        case Cmp::LE:
          vlo = fmax, vhi = kMaxValue;
          if (lomin == 0) break;
          ilo = fmax, ihi = lomin - 1;
          break;
      }
      if (pass == 0) {
        if (ilo > ihi) continue;
        cmp = c, x = pick(ilo, ihi), implies = true;
        return true;
      }
      if (vlo > vhi) continue;
      cmp = c, x = pick(vlo, vhi), implies = ilo <= ihi && x >= ilo && x <= ihi;
      return true;
    }
  }
  return false;
}

struct Stats {
  long long ops[9] = {};  // by Kind
  long long implying = 0, then_set = 0, host_waits = 0, from_window = 0, bytes_written = 0, bytes_read = 0;
  void add(const Round& r) {
    for (const Op& op : r.ops) {
      ops[static_cast<int>(op.kind)]++;
      if (op.kind == Kind::Wait) implying += op.implies, then_set += op.api == WaitApi::AllThenSet, host_waits += op.on_host;
      if (op.kind == Kind::Put || op.kind == Kind::PutSignal)
        bytes_written += static_cast<long long>(op.bytes), from_window += op.src_window >= 0;
      if (op.kind == Kind::Get || op.kind == Kind::Check) bytes_read += static_cast<long long>(op.bytes);
    }
  }
  long long total() const {
    long long t = 0;
    for (long long v : ops) t += v;
    return t;
  }
  std::string text() const {
    std::ostringstream s;
    s << total() << " ops: " << ops[0] << " put, " << ops[1] << " put_signal, " << ops[2] << " signal, " << ops[3]
      << " get, " << ops[4] << " wait (" << implying << " implying, " << then_set << " then-set";
    if (host_waits) s << ", " << host_waits << " on the host";
    s << "), " << ops[5] << " checks after waits, " << ops[6] << " quiet, " << ops[7] << " barrier";
    if (ops[8]) s << ", " << ops[8] << " stream joins";
    s << "; " << bytes_written << " bytes written (" << from_window << " writes from the issuer's own window), "
      << bytes_read << " bytes read back";
    return s.str();
  }
};

// Derives round `number` from the seed and the model at its start (every rank the same).
class Planner {
 public:
  Planner(const Config& c, const Model& m, std::uint64_t seed, int number)
      : c_(c), m_(m), rng_(mix(seed ^ mix(static_cast<std::uint64_t>(number) + 1))) {
    round_.number = number;
    round_.poison = static_cast<unsigned char>(meshmem::test::kPoison ^ (number * 37 + 11));
  }

  Round make() {
    reserve_writes();
    plan_words();
    schedule();
    return std::move(round_);
  }

 private:
  struct Contribution {
    int rank, stream;
    SignalOp op;
    std::uint64_t value;
    int write;  // -1: a signal of its own
    int word;   // index in words_
    bool emitted = false;
    std::vector<char> carry;  // writes a reader knows complete once it sees this update
  };
  struct Word {
    int owner, set;
    std::size_t index;
    SignalOp mode;
    std::uint64_t start;
    int group;
    std::vector<int> contributions;
  };
  struct Group {  // consecutive words of one owner waited for together (or not at all)
    int owner, set;
    std::size_t first, count;
    std::vector<int> words;
    bool wait;
    int stream;
    std::uint64_t common;  // the Set value of every word, where count > 1
  };
  struct Item {
    enum Type { WriteI, SignalI, WaitI } type;
    int ref;
  };

  std::uint64_t below(std::uint64_t n) { return n ? rng_() % n : 0; }
  // (No std:: distributions: their results differ between standard libraries, and a seed must
  // replay the same plan wherever the test is built.)
  bool chance(double p) { return static_cast<double>(rng_() >> 11) * 0x1.0p-53 < p; }
  int rank() { return static_cast<int>(below(static_cast<std::uint64_t>(c_.ranks))); }
  int stream() { return static_cast<int>(below(static_cast<std::uint64_t>(c_.streams))); }
  int reachable_from(int a) {  // a random target a reaches, or -1
    std::vector<int> ts;
    for (int t = 0; t < c_.ranks; ++t)
      if (c_.reach[a][t]) ts.push_back(t);
    return ts.empty() ? -1 : ts[below(ts.size())];
  }

  std::size_t draw_size(std::size_t max) {
    const std::uint64_t p = below(100);
    std::size_t lo = 1, hi = 64;
    if (p >= 45) lo = 65, hi = 4096;
    if (p >= 75) lo = 4097, hi = 65536;
    if (p >= 92) lo = 65537, hi = 262144;
    if (p >= 98) lo = 262145, hi = c_.big_max;
    hi = std::min(hi, max);
    lo = std::min(lo, hi);
    return lo + below(hi - lo + 1);
  }
  int draw_window() {  // larger windows more often
    const std::uint64_t w = below(100);
    const int n = static_cast<int>(c_.windows.size());
    return w < 10 ? 0 : w < 30 ? std::min(1, n - 1) : w < 60 ? std::min(2, n - 1) : n - 1;
  }

  // Pass 1: the round's writes, disjoint per destination window.
  void reserve_writes() {
    const int n = c_.ops_per_round / 4 + static_cast<int>(below(static_cast<std::uint64_t>(c_.ops_per_round / 5 + 1)));
    for (int i = 0; i < n; ++i) {
      const int a = rank(), t = reachable_from(a);
      if (t < 0) continue;
      const int w = draw_window();
      const std::size_t wb = c_.windows[w];
      for (int attempt = 0; attempt < 10; ++attempt) {
        const std::size_t bytes = draw_size(std::max<std::size_t>(1, wb / 2));
        const std::size_t off = below(wb - bytes + 1);
        bool clash = false;
        for (const Write& x : round_.writes)
          clash = clash || (x.target == t && x.window == w && overlaps(x.offset, x.bytes, off, bytes));
        if (clash) continue;
        round_.writes.push_back(Write{-1, a, stream(), t, w, off, bytes});
        put_signal_.push_back(chance(0.4));
        break;
      }
    }
    for (std::size_t k = 0; k < round_.writes.size(); ++k) write_contribution_.push_back(-1);
  }

  // A free run of `count` words of rank `owner` (any set), or false.
  bool take_words(int owner, std::size_t count, int& set, std::size_t& first) {
    for (int attempt = 0; attempt < 12; ++attempt) {
      set = static_cast<int>(below(c_.signals.size()));
      const std::size_t n = c_.signals[set];
      if (count > n) continue;
      first = below(n - count + 1);
      bool free = true;
      for (std::size_t i = 0; i < count; ++i) free = free && !used(owner, set, first + i);
      if (!free) continue;
      for (std::size_t i = 0; i < count; ++i) used(owner, set, first + i) = 1;
      return true;
    }
    return false;
  }
  char& used(int owner, int set, std::size_t i) {
    if (used_.empty()) {
      used_.resize(static_cast<std::size_t>(c_.ranks));
      for (auto& u : used_)
        for (std::size_t n : c_.signals) u.emplace_back(n, 0);
    }
    return used_[owner][set][i];
  }
  std::uint64_t start_of(int owner, int set, std::size_t i) const {
    return c_.zero_words ? 0 : m_.words[owner][set][i];
  }

  // A Set value for a word starting at `start` (never `start`), going up or down.
  std::uint64_t set_value(std::uint64_t start, bool up) {
    if (!up && start > 0) return below(start);
    return start + 1 + below(std::min<std::uint64_t>(std::uint64_t{1} << 40, kMaxValue - start - 2));
  }

  int add_contribution(int word, int rank, int stream, SignalOp op, std::uint64_t value, int write) {
    contributions_.push_back(Contribution{rank, stream, op, value, write, word, false, {}});
    const int id = static_cast<int>(contributions_.size()) - 1;
    words_[word].contributions.push_back(id);
    if (write >= 0) write_contribution_[write] = id;
    else items_.push_back(Item{Item::SignalI, id});
    return id;
  }

  // A group of `count` words on `owner`, all Set or all Add; -1 if no room. The Set words of
  // a group of several take one value (above or below every start), so that one comparison
  // can cover them all.
  int new_group(int owner, std::size_t count, bool add, bool wait) {
    int set = 0;
    std::size_t first = 0;
    if (!take_words(owner, count, set, first)) return -1;
    std::uint64_t lo = ~0ull, hi = 0;
    for (std::size_t i = 0; i < count; ++i)
      lo = std::min(lo, start_of(owner, set, first + i)), hi = std::max(hi, start_of(owner, set, first + i));
    const std::uint64_t common = lo > 0 && chance(0.5) ? below(lo) : set_value(hi, true);
    groups_.push_back(Group{owner, set, first, count, {}, wait, stream(), common});
    const int g = static_cast<int>(groups_.size()) - 1;
    for (std::size_t i = 0; i < count; ++i) {
      words_.push_back(Word{owner, set, first + i, add ? SignalOp::Add : SignalOp::Set, start_of(owner, set, first + i), g, {}});
      groups_[g].words.push_back(static_cast<int>(words_.size()) - 1);
    }
    if (wait) items_.push_back(Item{Item::WaitI, g});
    return g;
  }
  // The operand of a new update of word w.
  std::uint64_t operand(int w) {
    const Word& word = words_[w];
    if (word.mode == SignalOp::Add) return 1 + below(999);
    const Group& g = groups_[word.group];
    return g.count > 1 ? g.common : set_value(word.start, chance(0.5));
  }
  std::vector<int> senders_to(int t, bool add) {
    std::vector<int> s;
    for (int a = 0; a < c_.ranks; ++a)
      if (c_.reach[a][t] && (!add || c_.add_ok[a][t])) s.push_back(a);
    return s;
  }
  // Gives every word of group g that has no update yet one Set or one to three Adds.
  void fill_group(int g) {
    for (int w : groups_[g].words) {
      if (!words_[w].contributions.empty()) continue;
      const bool add = words_[w].mode == SignalOp::Add;
      const std::vector<int> senders = senders_to(groups_[g].owner, add);
      if (senders.empty()) continue;
      const int k = add ? 1 + static_cast<int>(below(2)) : 1;
      for (int i = 0; i < k; ++i) add_contribution(w, senders[below(senders.size())], stream(), words_[w].mode, operand(w), -1);
    }
  }

  void plan_words() {
    // Every put_signal updates a word of its target: one of its own, or one more Add.
    for (std::size_t k = 0; k < round_.writes.size(); ++k) {
      if (!put_signal_[k]) continue;
      const Write& x = round_.writes[k];
      const bool add_allowed = c_.add_ok[x.rank][x.target];
      int word = -1;
      if (add_allowed && chance(0.3))
        for (int i = static_cast<int>(words_.size()) - 1; i >= 0 && word < 0; --i)
          if (words_[i].owner == x.target && words_[i].mode == SignalOp::Add && groups_of_one_.count(i)) word = i;
      if (word < 0) {
        const bool add = add_allowed && chance(0.4);
        const std::size_t count = chance(0.15) ? 2 + below(3) : 1;
        const int g = new_group(x.target, count, add, chance(0.85));
        if (g < 0) { put_signal_[k] = false; continue; }
        word = groups_[g].words[0];
        if (count == 1) groups_of_one_.insert(word);
      }
      add_contribution(word, x.rank, x.stream, words_[word].mode, operand(word), static_cast<int>(k));
    }
    // Words updated by signals alone.
    const int extra = c_.ops_per_round / 16 + static_cast<int>(below(static_cast<std::uint64_t>(c_.ops_per_round / 10 + 1)));
    for (int i = 0; i < extra; ++i) {
      const int t = rank();
      const bool add = !senders_to(t, true).empty() && chance(0.5);
      if (senders_to(t, false).empty()) continue;
      new_group(t, chance(0.2) ? 2 + below(3) : 1, add, chance(0.85));
    }
    for (std::size_t g = 0; g < groups_.size(); ++g) fill_group(static_cast<int>(g));
    // More Adds into words that already take Adds.
    for (std::size_t w = 0; w < words_.size(); ++w)
      if (words_[w].mode == SignalOp::Add && chance(0.2)) {
        const std::vector<int> senders = senders_to(words_[w].owner, true);
        if (!senders.empty())
          add_contribution(static_cast<int>(w), senders[below(senders.size())], stream(), SignalOp::Add, operand(static_cast<int>(w)), -1);
      }
    for (std::size_t k = 0; k < round_.writes.size(); ++k) items_.push_back(Item{Item::WriteI, static_cast<int>(k)});
  }

  // ---- pass 2: the order ----
  using Bits = std::vector<char>;
  Bits& known(int r, int s) { return known_[r][s]; }
  void merge(Bits& into, const Bits& from) {
    if (from.size() != into.size()) return;  // an update not made yet carries nothing
    for (std::size_t i = 0; i < into.size(); ++i) into[i] = into[i] || from[i];
  }
  int emit(Op op) {
    round_.ops.push_back(op);
    return static_cast<int>(round_.ops.size()) - 1;
  }
  // Whether rank r may read [off, off + bytes) of `window` of `target` on stream s now.
  bool readable(int r, int s, int target, int window, std::size_t off, std::size_t bytes) {
    for (std::size_t k = 0; k < round_.writes.size(); ++k) {
      const Write& w = round_.writes[k];
      if (w.target == target && w.window == window && overlaps(w.offset, w.bytes, off, bytes) && !known(r, s)[k])
        return false;
    }
    return true;
  }
  // A read by r (stream s) of `target`'s window: around write k (which r knows), or anywhere.
  void read(int r, int s, int target, int k) {
    int window = 0;
    std::size_t off = 0, bytes = 0;
    bool ok = false;
    for (int attempt = 0; attempt < 6 && !ok; ++attempt) {
      if (k >= 0) {
        const Write& w = round_.writes[k];
        window = w.window;
        const std::size_t before = attempt < 3 ? below(65) : 0, after = attempt < 3 ? below(65) : 0;
        off = w.offset >= before ? w.offset - before : 0;
        bytes = std::min(w.offset + w.bytes + after, c_.windows[window]) - off;
      } else {
        window = draw_window();
        bytes = draw_size(c_.windows[window]);
        off = below(c_.windows[window] - bytes + 1);
      }
      ok = readable(r, s, target, window, off, bytes);
    }
    if (!ok) return;
    Op op;
    op.kind = target == r && chance(0.5) ? Kind::Check : Kind::Get;
    op.rank = r, op.stream = s, op.target = target, op.window = window, op.offset = off, op.bytes = bytes;
    emit(op);
  }
  void random_read() {
    const int r = rank(), s = stream();
    std::vector<int> mine;
    for (std::size_t k = 0; k < round_.writes.size(); ++k)
      if (known(r, s)[k] && c_.reach[r][round_.writes[k].target]) mine.push_back(static_cast<int>(k));
    if (!mine.empty() && chance(0.6)) {
      const int k = mine[below(mine.size())];
      read(r, s, round_.writes[k].target, k);
    } else {
      const int t = reachable_from(r);
      if (t >= 0) read(r, s, t, -1);
    }
  }
  void barrier() {
    Op op;
    op.kind = Kind::Barrier, op.stream = stream();
    emit(op);
    for (int r = 0; r < c_.ranks; ++r)
      for (int s = 0; s < c_.streams; ++s) known(r, s) = issued_;
  }

  // Sometimes the source of write k is a range of its issuer's own window that the issuer may
  // read now and that nothing else writes this round (host windows: it may overlap the
  // destination, as memmove).
  void window_source(int k) {
    Write& x = round_.writes[k];
    for (int attempt = 0; attempt < 4; ++attempt) {
      int sw = draw_window();
      std::size_t so = 0;
      if (attempt == 0 && x.target == x.rank && c_.overlap_ok && chance(0.5)) {  // its own destination, shifted
        sw = x.window;
        const std::size_t shift = below(x.bytes), limit = c_.windows[sw] - x.bytes;
        so = chance(0.5) ? std::min(x.offset + shift, limit) : x.offset - std::min(x.offset, shift);
      } else {
        if (c_.windows[sw] < x.bytes) continue;
        so = below(c_.windows[sw] - x.bytes + 1);
      }
      const bool self_overlap = x.target == x.rank && sw == x.window && overlaps(x.offset, x.bytes, so, x.bytes);
      if (self_overlap && !c_.overlap_ok) continue;
      bool ok = true;
      for (std::size_t j = 0; j < round_.writes.size() && ok; ++j) {
        const Write& w = round_.writes[j];
        if (static_cast<int>(j) != k && w.target == x.rank && w.window == sw && overlaps(w.offset, w.bytes, so, x.bytes))
          ok = known(x.rank, x.stream)[j];
      }
      if (!ok) continue;
      x.src_window = sw, x.src_offset = so;
      return;
    }
  }

  void emit_write(int k) {
    Write& x = round_.writes[k];
    if (chance(0.2)) window_source(k);
    Op op;
    op.kind = put_signal_[k] ? Kind::PutSignal : Kind::Put;
    op.rank = x.rank, op.stream = x.stream, op.target = x.target, op.window = x.window;
    op.offset = x.offset, op.bytes = x.bytes, op.write = k, op.src_window = x.src_window, op.src_offset = x.src_offset;
    if (put_signal_[k]) {
      Contribution& u = contributions_[write_contribution_[k]];
      const Word& w = words_[u.word];
      op.set = w.set, op.index = w.index, op.value = u.value, op.sig_op = u.op;
      u.carry = known(x.rank, x.stream);
      u.carry[k] = 1;
      u.emitted = true;
    }
    x.op = emit(op);
    issued_[k] = 1;
    if (c_.stream_ordered) known(x.rank, x.stream)[k] = 1;
  }
  void emit_signal(int id) {
    Contribution& u = contributions_[id];
    const Word& w = words_[u.word];
    Op op;
    op.kind = Kind::Signal, op.rank = u.rank, op.stream = u.stream, op.target = w.owner;
    op.set = w.set, op.index = w.index, op.value = u.value, op.sig_op = u.op;
    emit(op);
    // Ordered after this rank's earlier writes to the same target (on the same stream).
    u.carry = known(u.rank, u.stream);
    for (std::size_t k = 0; k < round_.writes.size(); ++k) {
      const Write& x = round_.writes[k];
      if (issued_[k] && x.rank == u.rank && x.target == w.owner && (!c_.stream_ordered || x.stream == u.stream))
        u.carry[k] = 1;
    }
    u.emitted = true;
  }
  bool ready(const Group& g) const {
    for (int w : g.words)
      for (int id : words_[w].contributions)
        if (!contributions_[id].emitted) return false;
    return true;
  }
  void emit_wait(int gi) {
    const Group g = groups_[gi];
    std::vector<WordFate> fates;
    for (int w : g.words) {
      const Word& word = words_[w];
      std::uint64_t final = word.start, least = ~0ull;
      for (int id : word.contributions) {
        const Contribution& u = contributions_[id];
        final = u.op == SignalOp::Set ? u.value : final + u.value;
        least = std::min(least, u.value);
      }
      const std::uint64_t hi = word.mode == SignalOp::Add && !word.contributions.empty() ? final - least : word.start;
      fates.push_back(WordFate{word.start, final, word.start, hi});
    }
    Op op;
    op.kind = Kind::Wait, op.rank = g.owner, op.stream = g.stream, op.set = g.set, op.index = g.first, op.count = g.count;
    if (!choose_condition(rng_, fates, chance(0.85), op.cmp, op.value, op.implies)) return;
    const std::uint64_t a = below(100);
    op.api = g.count > 1 ? (a < 60 ? WaitApi::All : WaitApi::AllThenSet) : (a < 70 ? WaitApi::Until : a < 85 ? WaitApi::All : WaitApi::AllThenSet);
    if (op.api == WaitApi::AllThenSet && !op.implies) op.api = g.count > 1 ? WaitApi::All : WaitApi::Until;
    if (op.api == WaitApi::AllThenSet) op.then = chance(0.5) ? 0 : below(std::uint64_t{1} << 40);
    op.on_host = c_.host_waits && chance(0.1);
    emit(op);
    if (!op.implies) return;
    Bits learned(issued_.size(), 0);
    for (int w : g.words)
      for (int id : words_[w].contributions) merge(learned, contributions_[id].carry);
    std::vector<int> fresh;
    for (std::size_t k = 0; k < learned.size(); ++k)
      if (learned[k] && !known(g.owner, g.stream)[k]) fresh.push_back(static_cast<int>(k));
    for (int s = 0; s < c_.streams; ++s)
      if (op.on_host || s == g.stream) merge(known(g.owner, s), learned);
    // Use what was learned: read a write it covers, and pass the knowledge on.
    if (!fresh.empty() && chance(0.7)) {
      const int k = fresh[below(fresh.size())];
      if (c_.reach[g.owner][round_.writes[k].target]) read(g.owner, g.stream, round_.writes[k].target, k);
    }
    if (chance(0.35)) relay(g.owner, g.stream);
  }
  // r (stream s) signals another rank's fresh word with Set; that rank waits for it.
  void relay(int r, int s) {
    const int b = reachable_from(r);
    if (b < 0) return;
    const int g = new_group(b, 1, false, true);
    if (g < 0) return;
    const int w = groups_[g].words[0];
    add_contribution(w, r, s, SignalOp::Set, operand(w), -1);
  }

  void schedule() {
    issued_.assign(round_.writes.size(), 0);
    known_.assign(static_cast<std::size_t>(c_.ranks),
                  std::vector<Bits>(static_cast<std::size_t>(c_.streams), Bits(round_.writes.size(), 0)));
    bool mid_barrier = chance(0.3);
    while (!items_.empty()) {
      const std::uint64_t p = below(100);
      if (p < 12) { random_read(); continue; }
      if (p < 18) {
        Op op;
        op.kind = Kind::Quiet, op.rank = rank(), op.stream = stream();
        emit(op);
        if (!c_.stream_ordered)
          for (std::size_t k = 0; k < round_.writes.size(); ++k)
            if (issued_[k] && round_.writes[k].rank == op.rank) known(op.rank, 0)[k] = 1;
        continue;
      }
      if (p < 23 && c_.streams > 1) {
        Op op;
        op.kind = Kind::Join, op.rank = rank(), op.stream = stream(), op.from_stream = stream();
        if (op.from_stream == op.stream) continue;
        emit(op);
        std::vector<int> fresh;
        for (std::size_t k = 0; k < round_.writes.size(); ++k)
          if (known(op.rank, op.from_stream)[k] && !known(op.rank, op.stream)[k] && c_.reach[op.rank][round_.writes[k].target])
            fresh.push_back(static_cast<int>(k));
        merge(known(op.rank, op.stream), known(op.rank, op.from_stream));
        if (!fresh.empty() && chance(0.5)) {  // read on the joined stream what it learned
          const int k = fresh[below(fresh.size())];
          read(op.rank, op.stream, round_.writes[k].target, k);
        }
        continue;
      }
      if (p < 25 && mid_barrier && round_.ops.size() > 8) {
        mid_barrier = false;
        barrier();
        continue;
      }
      // A random item that is ready (a wait: once every update it covers was made).
      std::vector<std::size_t> ready_items;
      for (std::size_t i = 0; i < items_.size(); ++i)
        if (items_[i].type != Item::WaitI || ready(groups_[items_[i].ref])) ready_items.push_back(i);
      const std::size_t i = ready_items[below(ready_items.size())];
      const Item item = items_[i];
      items_.erase(items_.begin() + static_cast<long>(i));
      if (item.type == Item::WriteI) emit_write(item.ref);
      else if (item.type == Item::SignalI) emit_signal(item.ref);
      else emit_wait(item.ref);
    }
    barrier();
  }

  const Config& c_;
  const Model& m_;
  std::mt19937_64 rng_;
  Round round_;
  std::vector<char> put_signal_;
  std::vector<int> write_contribution_;
  std::vector<Contribution> contributions_;
  std::vector<Word> words_;
  std::vector<Group> groups_;
  std::set<int> groups_of_one_;
  std::vector<Item> items_;
  std::vector<std::vector<std::vector<char>>> used_;
  Bits issued_;
  std::vector<std::vector<Bits>> known_;
};

// How long a soak runs: MESHMEM_SOAK_ROUNDS rounds where set, else rounds until the plans
// hold MESHMEM_SOAK_OPS operations (`ops` by default; every rank counts the same).
struct Length {
  long long ops;
  int rounds;  // 0: by ops
  explicit Length(long long default_ops)
      : ops(env_number("MESHMEM_SOAK_OPS", default_ops)), rounds(static_cast<int>(env_number("MESHMEM_SOAK_ROUNDS", 0))) {}
  bool more(int round, const Stats& done) const { return rounds > 0 ? round < rounds : done.total() < ops; }
  std::string text() const {
    return rounds > 0 ? std::to_string(rounds) + " rounds" : "rounds up to " + std::to_string(ops) + " ops";
  }
  std::string replay() const {
    return rounds > 0 ? "MESHMEM_SOAK_ROUNDS=" + std::to_string(rounds) : "MESHMEM_SOAK_OPS=" + std::to_string(ops);
  }
};

}  // namespace meshmem::soak
