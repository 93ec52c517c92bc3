// The soak's model (issue 13): its configuration, operations and rounds, the model of every
// window and signal word, and the checks against it. The planner is soak_plan.hpp; shared by the
// host-window soak (tests/mpi/test_soak.cpp) and the device-window soak (tests/gpu/test_soak.cu).
// No CUDA and no MPI calls here.
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

}  // namespace meshmem::soak
