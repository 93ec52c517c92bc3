// Soak of host windows (issue 13): a seeded random sequence of put, get, put_signal, signal,
// wait_until (every comparison; wait_until_all and wait_until_all_then_set too), quiet and
// barrier over several windows of different sizes and two signal arrays, checked against a
// model of every window and word (tests/support/soak_plan.hpp says what a plan promises and
// why it cannot deadlock). Each round the destinations are poisoned first, every write
// carries fresh random data, reads are checked against the model as of when they ran, and
// afterwards every rank checks every byte of its windows and every signal word.
//
// MESHMEM_SOAK_SEED (default: fresh, printed) replays a run; MESHMEM_SOAK_OPS (about how many
// operations in all) or MESHMEM_SOAK_ROUNDS sets its length (a tenth under AddressSanitizer).
// CTest runs it under every placement of the host suite (tests/mpi/CMakeLists.txt).
#include <meshmem/meshmem.hpp>

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "mpi_test.hpp"
#include "soak_plan.hpp"

using namespace meshmem;
namespace soak = meshmem::soak;

namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

constexpr std::size_t kGuard = 32;
constexpr int kMaxReports = 8;  // failure messages per rank

using soak::env_number;

class HostSoak : public meshmem::test::MpiTest {
 protected:
  // Runs the soak; every failure names the seed, the round, the op, the rank and the bytes.
  void soak_run();

  // Records a failure (the first kMaxReports are printed).
  void fail(const std::string& what) {
    ++failures_;
    if (failures_ <= kMaxReports) ADD_FAILURE() << prefix_ << what;
  }
  bool run_op(const soak::Round& r, const soak::Model& start, int i);
  void check_round(const soak::Round& r, const soak::Model& model);

  std::unique_ptr<Comm> comm_;
  std::vector<Window> wins_;
  std::vector<Signals> sigs_;
  std::uint64_t seed_ = 0;
  int me_ = 0, n_ = 1;
  int failures_ = 0;
  std::string prefix_;
};

// One op of the plan, if it is this rank's; false where the API raised (the round stops here).
bool HostSoak::run_op(const soak::Round& r, const soak::Model& start, int i) {
  const soak::Op& op = r.ops[static_cast<std::size_t>(i)];
  if (op.kind != soak::Kind::Barrier && op.rank != me_) return true;
  try {
    switch (op.kind) {
      case soak::Kind::Put:
      case soak::Kind::PutSignal: {
        // A buffer of fresh data (scribbled over once the call returned: the source may be
        // reused then), or a range of this rank's own window.
        std::vector<unsigned char> data;
        const void* src = nullptr;
        if (op.src_window >= 0) {
          src = static_cast<const unsigned char*>(wins_[op.src_window].local()) + op.src_offset;
        } else {
          data = soak::write_data(seed_, r, start, op.write);
          src = data.data();
        }
        if (op.kind == soak::Kind::Put)
          comm_->put(wins_[op.window], op.target, op.offset, src, op.bytes);
        else
          comm_->put_signal(wins_[op.window], op.target, op.offset, src, op.bytes, sigs_[op.set], op.index, op.value,
                            op.sig_op);
        if (!data.empty()) std::memset(data.data(), 0x5A, data.size());
        break;
      }
      case soak::Kind::Signal: comm_->signal(sigs_[op.set], op.target, op.index, op.value, op.sig_op); break;
      case soak::Kind::Get:
      case soak::Kind::Check: {
        std::vector<unsigned char> got;
        if (op.kind == soak::Kind::Get) {
          got.assign(op.bytes + 2 * kGuard, meshmem::test::kPoison);
          comm_->get(got.data() + kGuard, wins_[op.window], op.target, op.offset, op.bytes);
          const long long before = meshmem::test::first_not(got.data(), meshmem::test::kPoison, kGuard);
          const long long after = meshmem::test::first_not(got.data() + kGuard + op.bytes, meshmem::test::kPoison, kGuard);
          if (before >= 0 || after >= 0)
            fail(soak::describe(op, i) + ": wrote outside its destination (" + (before >= 0 ? "before" : "after") + " it)");
        } else {
          const auto* p = static_cast<const unsigned char*>(wins_[op.window].local()) + op.offset;
          got.assign(p, p + op.bytes);
          got.insert(got.begin(), kGuard, 0);
          got.insert(got.end(), kGuard, 0);
        }
        const auto want = soak::expected_bytes(seed_, r, start, i, op.target, op.window, op.offset, op.bytes);
        const std::string bad = soak::read_mismatch(r, i, got.data() + kGuard, want);
        if (!bad.empty()) fail(bad);
        break;
      }
      case soak::Kind::Wait: {
        const Signals& sig = sigs_[op.set];
        if (op.api == soak::WaitApi::Until) comm_->wait_until(sig, op.index, op.cmp, op.value);
        else if (op.api == soak::WaitApi::All) comm_->wait_until_all(sig, op.index, op.count, op.cmp, op.value);
        else comm_->wait_until_all_then_set(sig, op.index, op.count, op.cmp, op.value, op.then);
        // Every update of the round to these words has landed, and nothing else writes them.
        if (op.implies)
          for (std::size_t w = 0; w < op.count; ++w) {
            const std::uint64_t want = op.api == soak::WaitApi::AllThenSet
                                           ? op.then
                                           : soak::updated_word(r, start, me_, op.set, op.index + w);
            const std::uint64_t got = sig.read(op.index + w);
            if (got != want)
              fail(soak::describe(op, i) + ": word " + std::to_string(op.set) + "/" + std::to_string(op.index + w) + " is " +
                   std::to_string(got) + " after the wait, the model says " + std::to_string(want));
          }
        break;
      }
      case soak::Kind::Quiet: comm_->quiet(); break;
      case soak::Kind::Barrier: comm_->barrier(); break;
      case soak::Kind::Join: break;  // streams: device windows only
    }
  } catch (const Error& e) {
    fail(soak::describe(op, i) + " raised: " + e.what());
    return false;
  }
  return true;
}

// Every byte of this rank's windows and every word of its signals against the model.
void HostSoak::check_round(const soak::Round& r, const soak::Model& model) {
  for (std::size_t w = 0; w < wins_.size(); ++w) {
    const std::string bad = soak::window_mismatch(r, me_, static_cast<int>(w),
                                                  static_cast<const unsigned char*>(wins_[w].local()), model.win[me_][w]);
    if (!bad.empty()) fail(bad);
  }
  for (std::size_t s = 0; s < sigs_.size(); ++s)
    for (std::size_t i = 0; i < sigs_[s].count(); ++i) {
      const std::uint64_t got = sigs_[s].read(i), want = model.words[me_][s][i];
      if (got != want)
        fail("after the round, signal word " + std::to_string(s) + "/" + std::to_string(i) + " is " + std::to_string(got) +
             ", the model says " + std::to_string(want));
    }
}

void HostSoak::soak_run() {
  comm_ = std::make_unique<Comm>(MPI_COMM_WORLD);
  me_ = comm_->rank(), n_ = comm_->size();
  seed_ = meshmem::test::shared_seed();
  seed_ = static_cast<std::uint64_t>(env_number("MESHMEM_SOAK_SEED", static_cast<long long>(seed_)));
  soak::Config cfg;
  cfg.ranks = n_;
  cfg.windows = {61, 4099, 300007, (5u << 19) + 1};  // 61 B .. 2.5 MiB
  cfg.signals = {64, 5};
  cfg.reach.assign(n_, std::vector<char>(n_, 1));
  cfg.add_ok = cfg.reach;
  cfg.overlap_ok = true;  // a put within this rank's own window acts like memmove (docs/semantics.md)
  soak::Length length(3000);
  if (kSanitized) length.ops = std::max(1LL, length.ops / 10);

  for (std::size_t b : cfg.windows) {
    wins_.push_back(comm_->alloc(b, Memory::Host));
    std::memset(wins_.back().local(), meshmem::test::kPoison, b);
  }
  for (std::size_t c : cfg.signals) sigs_.push_back(comm_->alloc_signals(c, Memory::Host));
  std::string routes;
  for (int t = 0; t < n_; ++t) routes += std::string(t ? " " : "") + to_string(comm_->transport(t, Memory::Host));
  char seed_text[32];
  std::snprintf(seed_text, sizeof(seed_text), "0x%016" PRIx64, seed_);
  if (me_ == 0)
    std::printf("[ soak ] seed %s, %s%s, %d ranks on %d node(s), rank 0's routes: %s; replay with MESHMEM_SOAK_SEED=%s %s\n",
                seed_text, length.text().c_str(), kSanitized ? " (a tenth: sanitizers)" : "", n_, comm_->node_count(),
                routes.c_str(), seed_text, length.replay().c_str());
  comm_->barrier();  // every window poisoned before any put

  soak::Model model(cfg);
  soak::Stats stats;
  int round = 0;
  for (; length.more(round, stats); ++round) try {
    const soak::Round r = soak::Planner(cfg, model, seed_, round).make();
    prefix_ = std::string("soak seed ") + seed_text + ", round " + std::to_string(round) + ", rank " + std::to_string(me_) + ": ";
    soak::apply_poison(r, model);
    for (const soak::Write& w : r.writes)
      if (w.target == me_) std::memset(static_cast<unsigned char*>(wins_[w.window].local()) + w.offset, r.poison, w.bytes);
    comm_->barrier();  // destinations poisoned everywhere (the previous round was checked)
    for (int i = 0; i < static_cast<int>(r.ops.size()); ++i)
      if (!run_op(r, model, i)) break;
    soak::apply_round(seed_, r, model);
    check_round(r, model);
    stats.add(r);
    int any = failures_, all = 0;
    MPI_Allreduce(&any, &all, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (all != 0) {
      if (me_ == 0)
        std::printf("[ soak ] stopped after round %d (a rank found a mismatch); MESHMEM_SOAK_ROUNDS=%d stops there\n", round,
                    round + 1);
      break;
    }
  } catch (const Error& e) {  // the barrier that starts a round
    fail(std::string("the barrier before the round raised: ") + e.what());
    break;
  }
  if (failures_ == 0 && me_ == 0)
    std::printf("[ soak ] verified %d rounds on %d ranks: %s\n", round, n_, stats.text().c_str());
  if (failures_ > kMaxReports) ADD_FAILURE() << prefix_ << failures_ << " mismatches in all (the first " << kMaxReports << " shown)";
  // Windows, signals and the Comm are freed collectively (after a timeout they give up
  // within MESHMEM_TIMEOUT and log it).
  sigs_.clear();
  wins_.clear();
  comm_.reset();
}

}  // namespace

TEST_F(HostSoak, RandomOperationsMatchTheModel) { soak_run(); }
