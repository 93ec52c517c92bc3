// The soak's planner (tests/support/soak_plan.hpp) against the API's ordering rules, without
// MPI or a GPU: each plan is run many times by a simulator that executes every rank's
// operations in a random interleaving the rules allow, and every read must see what the plan
// expects, every implying wait the words' final values, no interleaving may deadlock, and the
// end state must be the model's. Device rules (the GPU soak cannot run on this machine):
// three streams per rank, a put complete when its stream passes it, joins (events) between
// streams, barrier(stream) after joining every stream, some waits on the host blocking what
// the host enqueues next. Host rules: a put lands at any moment until its rank's quiet, a
// barrier, its rank's signal to the same target, or (put_signal) its own signal.
#include <gtest/gtest.h>

#include <deque>
#include <random>
#include <string>
#include <vector>

#include "soak_plan.hpp"

using namespace meshmem;
namespace soak = meshmem::soak;

namespace {

class Simulator {
 public:
  Simulator(const soak::Config& c, std::uint64_t seed, const soak::Round& r, const soak::Model& start,
            std::uint64_t order)
      : c_(c), seed_(seed), r_(r), start_(start), mem_(start), rng_(order) {
    q_.assign(c.ranks, std::vector<std::deque<Entry>>(c.streams));
    enqueued_.assign(c.ranks, std::vector<std::size_t>(c.streams, 0));
    done_.assign(c.ranks, std::vector<std::size_t>(c.streams, 0));
    cursor_.assign(c.ranks, 0);
    barriers_.assign(c.ranks, 0);
  }

  // Runs the round to its end; false with errors() where a read or word was wrong or nothing
  // could go on (a deadlock).
  bool run() {
    while (true) {
      std::vector<std::pair<int, int>> moves;  // (rank, -1): the host enqueues; (rank, s): stream s runs
      bool finished = true;
      for (int rank = 0; rank < c_.ranks; ++rank) {
        if (cursor_[rank] < static_cast<int>(r_.ops.size())) {
          finished = false;
          if (host_can_go(rank)) moves.emplace_back(rank, -1);
        }
        for (int s = 0; s < c_.streams; ++s) {
          if (q_[rank][s].empty()) continue;
          finished = false;
          if (runnable(rank, s)) moves.emplace_back(rank, s);
        }
      }
      if (!inflight_.empty()) {
        finished = false;
        moves.emplace_back(-1, -1);  // a write in flight lands
      }
      if (finished) break;
      if (moves.empty()) {
        std::string at;
        for (int rank = 0; rank < c_.ranks; ++rank) {
          at += " rank " + std::to_string(rank) + ": host at op " + std::to_string(cursor_[rank]);
          for (int s = 0; s < c_.streams; ++s)
            if (!q_[rank][s].empty()) at += ", stream " + std::to_string(s) + " at " + head_text(q_[rank][s].front());
          at += ";";
        }
        error("deadlock:" + at);
        return false;
      }
      const auto [rank, s] = moves[rng_() % moves.size()];
      if (rank < 0) land(static_cast<int>(rng_() % inflight_.size()));
      else if (s < 0) enqueue(rank);
      else step(rank, s);
      if (errors_.size() > 5) return false;
    }
    while (!inflight_.empty()) land(0);
    soak::Model want = start_;
    soak::apply_round(seed_, r_, want);
    for (int rank = 0; rank < c_.ranks; ++rank) {
      for (std::size_t w = 0; w < c_.windows.size(); ++w) {
        const std::string bad = soak::window_mismatch(r_, rank, static_cast<int>(w), mem_.win[rank][w].data(), want.win[rank][w]);
        if (!bad.empty()) error("rank " + std::to_string(rank) + ": " + bad);
      }
      if (mem_.words[rank] != want.words[rank]) error("rank " + std::to_string(rank) + ": words differ from the model");
    }
    return errors_.empty();
  }
  const std::vector<std::string>& errors() const { return errors_; }

 private:
  struct Entry {
    enum Type { Op, Join, Barrier, Quiet } type;
    int op;             // index in the plan
    int from = -1;      // Join: the stream waited for
    std::size_t need = 0;  // Join: entries of `from` that must be done
    int barrier = -1;   // Barrier: its number
  };

  void error(const std::string& what) { errors_.push_back("round " + std::to_string(r_.number) + ": " + what); }
  std::string head_text(const Entry& e) const {
    if (e.type == Entry::Join) return "a join on stream " + std::to_string(e.from);
    if (e.type == Entry::Barrier) return "barrier " + std::to_string(e.barrier);
    return soak::describe(r_.ops[static_cast<std::size_t>(e.op)], e.op);
  }
  bool holds(const soak::Op& op) const {
    for (std::size_t w = 0; w < op.count; ++w)
      if (!compare(mem_.words[op.rank][op.set][op.index + w], op.cmp, op.value)) return false;
    return true;
  }
  // The host of `rank` may enqueue its next op: not held by a host wait.
  bool host_can_go(int rank) const {
    const soak::Op& op = r_.ops[static_cast<std::size_t>(cursor_[rank])];
    return !(op.kind == soak::Kind::Wait && op.rank == rank && op.on_host && !holds(op));
  }
  void push(int rank, int s, Entry e) {
    q_[rank][s].push_back(e);
    enqueued_[rank][s]++;
  }
  void join(int rank, int to, int from, int op) {
    push(rank, to, Entry{Entry::Join, op, from, enqueued_[rank][from]});
  }
  void enqueue(int rank) {
    const int i = cursor_[rank]++;
    const soak::Op& op = r_.ops[static_cast<std::size_t>(i)];
    if (op.kind == soak::Kind::Barrier) {
      const int b = (op.stream + rank) % c_.streams;
      for (int k = 0; k < c_.streams; ++k)
        if (k != b) join(rank, b, k, i);
      push(rank, b, Entry{Entry::Barrier, i, -1, 0, barriers_[rank]++});
      for (int k = 0; k < c_.streams; ++k)
        if (k != b) join(rank, k, b, i);
      return;
    }
    if (op.rank != rank) return;
    if (op.kind == soak::Kind::Join) return join(rank, op.stream, op.from_stream, i);
    if (op.kind == soak::Kind::Quiet) {
      if (!c_.stream_ordered) push(rank, 0, Entry{Entry::Quiet, i});
      return;
    }
    if (op.kind == soak::Kind::Wait && op.on_host) {  // host_can_go said it holds
      finish_wait(op, i);
      return;
    }
    push(rank, op.stream, Entry{Entry::Op, i});
  }
  bool runnable(int rank, int s) {
    const Entry& e = q_[rank][s].front();
    switch (e.type) {
      case Entry::Join: return done_[rank][e.from] >= e.need;
      case Entry::Barrier: {
        if (e.barrier < static_cast<int>(released_.size()) && released_[e.barrier]) return true;
        // Every rank has this barrier at the head of one of its streams.
        for (int q = 0; q < c_.ranks; ++q) {
          bool there = false;
          for (int k = 0; k < c_.streams; ++k)
            there = there || (!q_[q][k].empty() && q_[q][k].front().type == Entry::Barrier && q_[q][k].front().barrier == e.barrier);
          if (!there) return false;
        }
        return true;
      }
      case Entry::Quiet: return true;
      case Entry::Op: {
        const soak::Op& op = r_.ops[static_cast<std::size_t>(e.op)];
        return op.kind != soak::Kind::Wait || holds(op);
      }
    }
    return false;
  }
  // Write k starts: its data is taken now (from its source range of the issuer's window, as
  // the memory holds it now, or fresh), and lands later (host rules) or at once (device).
  void start_write(int k) {
    const soak::Write& w = r_.writes[static_cast<std::size_t>(k)];
    if (w.src_window >= 0) {
      const auto& img = mem_.win[w.rank][w.src_window];
      inflight_.push_back({k, std::vector<unsigned char>(img.begin() + static_cast<long>(w.src_offset),
                                                         img.begin() + static_cast<long>(w.src_offset + w.bytes))});
    } else {
      inflight_.push_back({k, soak::write_data(seed_, r_, start_, k)});
    }
  }
  void land(int at) {
    const auto [k, data] = inflight_[static_cast<std::size_t>(at)];
    inflight_.erase(inflight_.begin() + at);
    const soak::Write& w = r_.writes[static_cast<std::size_t>(k)];
    std::memcpy(mem_.win[w.target][w.window].data() + w.offset, data.data(), w.bytes);
  }
  void land_where(int rank, int target) {  // every write in flight of rank (to target; -1: any)
    for (std::size_t j = 0; j < inflight_.size();) {
      const soak::Write& w = r_.writes[static_cast<std::size_t>(inflight_[j].first)];
      if ((rank < 0 || w.rank == rank) && (target < 0 || w.target == target)) land(static_cast<int>(j));
      else ++j;
    }
  }
  void finish_wait(const soak::Op& op, int i) {
    if (op.implies)
      for (std::size_t w = 0; w < op.count; ++w) {
        const std::uint64_t got = mem_.words[op.rank][op.set][op.index + w];
        const std::uint64_t want = soak::updated_word(r_, start_, op.rank, op.set, op.index + w);
        if (got != want)
          error(soak::describe(op, i) + ": word " + std::to_string(op.index + w) + " is " + std::to_string(got) +
                " when the wait returns, not its final " + std::to_string(want));
      }
    if (op.api == soak::WaitApi::AllThenSet)
      for (std::size_t w = 0; w < op.count; ++w) mem_.words[op.rank][op.set][op.index + w] = op.then;
  }
  void step(int rank, int s) {
    const Entry e = q_[rank][s].front();
    q_[rank][s].pop_front();
    done_[rank][s]++;
    if (e.type == Entry::Join) return;
    if (e.type == Entry::Quiet) return land_where(rank, -1);
    if (e.type == Entry::Barrier) {
      if (e.barrier >= static_cast<int>(released_.size())) released_.resize(static_cast<std::size_t>(e.barrier) + 1, 0);
      if (!released_[e.barrier]) land_where(-1, -1);  // every put before the barrier is complete
      released_[e.barrier] = 1;
      return;
    }
    const soak::Op& op = r_.ops[static_cast<std::size_t>(e.op)];
    switch (op.kind) {
      case soak::Kind::Put:
        start_write(op.write);
        if (c_.stream_ordered) land(static_cast<int>(inflight_.size()) - 1);
        break;
      case soak::Kind::PutSignal:
        start_write(op.write);
        land(static_cast<int>(inflight_.size()) - 1);  // its data, then its signal
        signal(op);
        break;
      case soak::Kind::Signal:
        if (!c_.stream_ordered) land_where(op.rank, op.target);  // after this rank's earlier puts to the target
        signal(op);
        break;
      case soak::Kind::Get:
      case soak::Kind::Check: {
        const auto& img = mem_.win[op.target][op.window];
        const std::vector<unsigned char> got(img.begin() + static_cast<long>(op.offset),
                                             img.begin() + static_cast<long>(op.offset + op.bytes));
        const auto want = soak::expected_bytes(seed_, r_, start_, e.op, op.target, op.window, op.offset, op.bytes);
        const std::string bad = soak::read_mismatch(r_, e.op, got.data(), want);
        if (!bad.empty()) error(bad);
        break;
      }
      case soak::Kind::Wait: finish_wait(op, e.op); break;
      default: break;
    }
  }
  void signal(const soak::Op& op) {
    std::uint64_t& word = mem_.words[op.target][op.set][op.index];
    word = op.sig_op == SignalOp::Set ? op.value : word + op.value;
  }

  const soak::Config& c_;
  std::uint64_t seed_;
  const soak::Round& r_;
  const soak::Model& start_;
  soak::Model mem_;
  std::mt19937_64 rng_;
  std::vector<std::vector<std::deque<Entry>>> q_;
  std::vector<std::vector<std::size_t>> enqueued_, done_;
  std::vector<int> cursor_, barriers_;
  std::vector<char> released_;
  std::vector<std::pair<int, std::vector<unsigned char>>> inflight_;  // (write, its data)
  std::vector<std::string> errors_;
};

soak::Config small_config(int ranks, bool device, std::uint64_t seed) {
  soak::Config c;
  c.ranks = ranks;
  c.streams = device ? 3 : 1;
  c.windows = {61, 4099, 30011, 90001};
  c.signals = {64, 5};
  c.big_max = 40000;
  c.stream_ordered = device;
  c.overlap_ok = !device;
  c.host_waits = device;
  c.reach.assign(ranks, std::vector<char>(ranks, 1));
  c.add_ok = c.reach;
  std::mt19937_64 rng(seed);
  if (device && seed % 3 == 0)  // pairs without routes or without Add, as on some machines
    for (int a = 0; a < ranks; ++a)
      for (int t = 0; t < ranks; ++t) {
        if (a != t && rng() % 4 == 0) c.reach[a][t] = 0;
        if (a != t && rng() % 3 == 0) c.add_ok[a][t] = 0;
      }
  return c;
}

// Rounds of `seeds` soaks, each run under `orders` interleavings.
void simulate(bool device, bool graph, int seeds, int rounds, int orders) {
  long long ops = 0;
  for (int seed = 1; seed <= seeds; ++seed) {
    const int ranks = 2 + seed % 3;
    soak::Config c = small_config(ranks, device, static_cast<std::uint64_t>(seed));
    c.zero_words = graph;
    if (graph) c.host_waits = false;
    soak::Model model(c);
    for (int round = 0; round < rounds; ++round) {
      const soak::Round r = soak::Planner(c, model, static_cast<std::uint64_t>(seed), round).make();
      soak::apply_poison(r, model);
      if (graph)
        for (auto& words : model.words)
          for (auto& set : words) std::fill(set.begin(), set.end(), 0);
      ops += static_cast<long long>(r.ops.size());
      for (int k = 0; k < orders; ++k) {
        Simulator sim(c, static_cast<std::uint64_t>(seed), r, model, soak::mix(static_cast<std::uint64_t>(seed * 1000 + round * 10 + k)));
        if (!sim.run()) {
          std::string all;
          for (const std::string& e : sim.errors()) all += "\n  " + e;
          FAIL() << (device ? "device" : "host") << " rules, seed " << seed << ", " << ranks << " ranks, interleaving " << k
                 << ":" << all;
        }
      }
      soak::apply_round(static_cast<std::uint64_t>(seed), r, model);
    }
  }
  std::printf("%lld planned ops simulated, each under %d interleavings\n", ops, orders);
}

// Fewer in the sanitizer build (unoptimised): about a second each here, as optimised.
#if defined(__SANITIZE_ADDRESS__) || !defined(__OPTIMIZE__)
constexpr int kScale = 6;
#else
constexpr int kScale = 1;
#endif

}  // namespace

TEST(SoakPlan, HostRulesHoldInRandomInterleavings) { simulate(false, false, 12 / kScale, 12, 6); }
TEST(SoakPlan, DeviceRulesHoldInRandomInterleavings) { simulate(true, false, 24 / kScale, 15, 6); }
TEST(SoakPlan, GraphRoundsHoldInRandomInterleavings) { simulate(true, true, 6 / kScale + 1, 6, 6); }

// The condition chooser: every choice holds for the final values, and an implying one for no
// value a word takes before.
TEST(SoakPlan, ConditionsHoldAtTheEndAndImplyingOnesOnlyThere) {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 20000; ++i) {
    std::vector<soak::WordFate> fates;
    const std::size_t n = 1 + rng() % 3;
    const bool add = rng() % 2;
    for (std::size_t k = 0; k < n; ++k) {
      const std::uint64_t start = rng() % 4 == 0 ? 0 : rng() % 1000;
      if (add) {
        const std::uint64_t least = 1 + rng() % 10, more = rng() % 3 == 0 ? 0 : rng() % 50;
        fates.push_back({start, start + least + more, start, start + more});
      } else {
        std::uint64_t v = rng() % 1000;
        if (v == start) ++v;
        fates.push_back({start, v, start, start});
      }
    }
    Cmp cmp{};
    std::uint64_t x = 0;
    bool implies = false;
    ASSERT_TRUE(soak::choose_condition(rng, fates, rng() % 2, cmp, x, implies));
    for (const soak::WordFate& f : fates) {
      ASSERT_TRUE(compare(f.final, cmp, x)) << soak::cmp_name(cmp) << " " << x << " at the end " << f.final;
      if (!implies) continue;
      for (std::uint64_t v = f.lo; v <= f.hi; ++v)
        ASSERT_FALSE(compare(v, cmp, x)) << soak::cmp_name(cmp) << " " << x << " holds at " << v << " before the end";
    }
  }
}
