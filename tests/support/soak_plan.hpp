// The soak's planner (issue 13): derives each round's operations from the seed and the model
// at its start (soak_model.hpp says what a plan promises), and how long a soak runs. No CUDA and
// no MPI calls here.
#pragma once

#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "soak_model.hpp"

namespace meshmem::soak {

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
