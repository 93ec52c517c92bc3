// Soak of device windows (issue 13): the host soak's plan and model (tests/support/soak_plan.hpp)
// on device windows, every operation stream-ordered on one of three streams per rank, which
// the plan joins with events here and there (a stream waits for what another had enqueued) and
// before every barrier(stream). Gets land in poisoned device buffers with guards; a rank looks
// at its own window after a wait by copying it on the waiting stream; words are copied on the
// stream after an implying wait; some waits are on the host. Each round: destinations
// poisoned, sources of fresh random data uploaded, one host barrier, the round enqueued, then
// every byte of every window and every word checked against the model. Pairs that no transport
// reaches here are left out of the plan; SignalOp::Add is left out where meshmem refuses it
// (peers without native atomics). A second case captures one round into a CUDA graph and
// replays it with fresh data (the graph resets the words it used, docs/semantics.md "CUDA graphs"),
// where the routes allow capture (not nccl, not the cross-node barrier).
//
// MESHMEM_SOAK_SEED replays a run, MESHMEM_SOAK_OPS / MESHMEM_SOAK_ROUNDS set its length,
// MESHMEM_SOAK_REPLAYS the graph's replays; MESHMEM_SOAK_REQUIRE_ROUTE=ipc|staged|nccl skips
// (with the reason) where no pair of ranks takes that route. Skipped without a GPU.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <meshmem/meshmem.hpp>

#include "gpu_test.hpp"
#include "mpi_test.hpp"
#include "soak_plan.hpp"

using namespace meshmem;
namespace soak = meshmem::soak;
using soak::env_number;

namespace {

constexpr int kStreams = 3;
constexpr std::size_t kGuard = 32;
constexpr int kMaxReports = 8;
constexpr int kFinishSeconds = 150;  // past MESHMEM_TIMEOUT (120 in CTest) of a device wait

// Device or pinned host memory that grows to the largest size asked for.
struct Grow {
  explicit Grow(bool pinned) : pinned(pinned) {}
  ~Grow() { release(); }
  Grow(const Grow&) = delete;
  Grow& operator=(const Grow&) = delete;
  cudaError_t reserve(std::size_t bytes) {
    if (bytes <= cap) return cudaSuccess;
    release();
    const cudaError_t rc = pinned ? cudaMallocHost(&p, bytes) : cudaMalloc(&p, bytes);
    cap = rc == cudaSuccess ? bytes : 0;
    return rc;
  }
  void release() {
    if (p != nullptr) pinned ? cudaFreeHost(p) : cudaFree(p);
    p = nullptr, cap = 0;
  }
  unsigned char* c() const { return static_cast<unsigned char*>(p); }
  bool pinned;
  void* p = nullptr;
  std::size_t cap = 0;
};

const char* route_name(int kind) { return to_string(static_cast<TransportKind>(kind)); }

class DeviceSoak : public meshmem::test::MpiTest {
 protected:
  void SetUp() override {
    const std::string why = meshmem::test::select_gpu_on_every_rank();
    if (!why.empty()) GTEST_SKIP() << why;
    comm_ = std::make_unique<Comm>(MPI_COMM_WORLD);
    me_ = comm_->rank(), n_ = comm_->size();
    seed_ = meshmem::test::shared_seed();
    seed_ = static_cast<std::uint64_t>(env_number("MESHMEM_SOAK_SEED", static_cast<long long>(seed_)));
    std::snprintf(seed_text_, sizeof(seed_text_), "0x%016" PRIx64, seed_);
    for (int s = 0; s < kStreams; ++s) {
      ASSERT_EQ(cudaStreamCreateWithFlags(&streams_[s], cudaStreamNonBlocking), cudaSuccess);
      ASSERT_EQ(cudaEventCreateWithFlags(&events_[s], cudaEventDisableTiming), cudaSuccess);
    }
    // Every rank's routes: the plan leaves out pairs that nothing reaches.
    std::vector<int> mine(static_cast<std::size_t>(n_)), all(static_cast<std::size_t>(n_ * n_));
    for (int t = 0; t < n_; ++t) mine[t] = static_cast<int>(comm_->transport(t, Memory::Device));
    MPI_Allgather(mine.data(), n_, MPI_INT, all.data(), n_, MPI_INT, MPI_COMM_WORLD);
    route_.assign(n_, std::vector<int>(n_));
    cfg_.ranks = n_;
    cfg_.streams = kStreams;
    cfg_.windows = {61, 4099, 300007, (5u << 19) + 1};  // 61 B .. 2.5 MiB
    cfg_.signals = {64, 5};
    cfg_.stream_ordered = true;
    cfg_.reach.assign(n_, std::vector<char>(n_, 0));
    for (int a = 0; a < n_; ++a)
      for (int t = 0; t < n_; ++t) {
        route_[a][t] = all[a * n_ + t];
        cfg_.reach[a][t] = route_[a][t] != static_cast<int>(TransportKind::None);
      }
  }
  void TearDown() override {
    if (comm_) {
      for (cudaStream_t s : streams_) test::end_open_capture(s);  // a failed capture must not outlive the case
      cudaDeviceSynchronize();
      sigs_.clear();
      wins_.clear();
      comm_.reset();
    }
    for (int s = 0; s < kStreams; ++s) {
      if (events_[s]) cudaEventDestroy(events_[s]);
      if (streams_[s]) cudaStreamDestroy(streams_[s]);
    }
    MpiTest::TearDown();
  }

  // Where SignalOp::Add is refused (no native peer atomics), the plan sets words instead.
  // Probed with Add 0 (a word of its own) to every rank reached.
  void probe_add() {
    Signals probe = comm_->alloc_signals(1);
    std::vector<char> mine(static_cast<std::size_t>(n_), 0), all(static_cast<std::size_t>(n_ * n_));
    for (int t = 0; t < n_; ++t) {
      if (!cfg_.reach[me_][t]) continue;
      try {
        comm_->signal(probe, t, 0, 0, SignalOp::Add, streams_[0]);
        mine[t] = 1;
      } catch (const Error& e) {
        if (e.code() != ErrorCode::Unsupported) ADD_FAILURE() << "signal Add 0 to rank " << t << ": " << e.what();
      }
    }
    MPI_Allgather(mine.data(), n_, MPI_CHAR, all.data(), n_, MPI_CHAR, MPI_COMM_WORLD);
    cfg_.add_ok.assign(n_, std::vector<char>(n_, 0));
    for (int a = 0; a < n_; ++a)
      for (int t = 0; t < n_; ++t) cfg_.add_ok[a][t] = all[a * n_ + t];
    comm_->barrier(streams_[0]);
    ASSERT_EQ(cudaStreamSynchronize(streams_[0]), cudaSuccess);
  }

  // The routes between different ranks, counted ("ipc 2, nccl 2"), and whether `want` is one.
  std::string routes(const char* want, bool* found) const {
    int count[8] = {};
    for (int a = 0; a < n_; ++a)
      for (int t = 0; t < n_; ++t)
        if (a != t && route_[a][t] >= 0 && route_[a][t] < 8) count[route_[a][t]]++;
    std::string text;
    *found = want == nullptr || *want == 0;
    for (int k = 0; k < 8; ++k) {
      if (count[k] == 0) continue;
      text += std::string(text.empty() ? "" : ", ") + route_name(k) + " " + std::to_string(count[k]);
      if (want != nullptr && std::string(want) == route_name(k)) *found = true;
    }
    return text.empty() ? "none (one rank)" : text + " ordered pairs";
  }

  void make_windows() {
    for (std::size_t b : cfg_.windows) {
      wins_.push_back(comm_->alloc(b));
      ASSERT_EQ(meshmem::test::fill_now(wins_.back().local(), meshmem::test::kPoison, b), cudaSuccess);
    }
    for (std::size_t c : cfg_.signals) sigs_.push_back(comm_->alloc_signals(c));
  }

  void fail(const std::string& what) {
    ++failures_;
    if (failures_ <= kMaxReports) ADD_FAILURE() << prefix_ << what;
  }

  // Where this rank's sources, read copies and word copies of round r go.
  void layout(const soak::Round& r) {
    src_off_.assign(r.writes.size(), 0);
    std::size_t src = 0;
    for (std::size_t k = 0; k < r.writes.size(); ++k)
      if (r.writes[k].rank == me_ && r.writes[k].src_window < 0) {
        src += k % 8;  // unaligned sources
        src_off_[k] = src;
        src += r.writes[k].bytes;
      }
    src_bytes_ = src;
    scratch_off_.assign(r.ops.size(), 0);
    std::size_t sc = 0;
    for (std::size_t i = 0; i < r.ops.size(); ++i) {
      const soak::Op& op = r.ops[i];
      if (op.rank != me_) continue;
      scratch_off_[i] = sc;
      if (op.kind == soak::Kind::Get) sc += op.bytes + 2 * kGuard;
      if (op.kind == soak::Kind::Check) sc += op.bytes;
      if (op.kind == soak::Kind::Wait && op.implies && !op.on_host) sc += op.count * sizeof(std::uint64_t);
    }
    scratch_bytes_ = sc;
  }

  // Before a round (or a replay): fresh sources uploaded, copies and destinations poisoned.
  ::testing::AssertionResult prepare(const soak::Round& r, const soak::Model& start) {
    if (src_.reserve(src_bytes_ + 1) != cudaSuccess || staging_.reserve(src_bytes_ + 1) != cudaSuccess ||
        scratch_.reserve(scratch_bytes_ + 1) != cudaSuccess)
      return ::testing::AssertionFailure() << "allocating " << src_bytes_ << " + " << scratch_bytes_ << " bytes failed";
    for (std::size_t k = 0; k < r.writes.size(); ++k)
      if (r.writes[k].rank == me_ && r.writes[k].src_window < 0) {
        const auto& data = soak::write_data(seed_, r, start, static_cast<int>(k));
        std::memcpy(staging_.c() + src_off_[k], data.data(), data.size());
      }
    cudaMemcpyAsync(src_.p, staging_.p, src_bytes_, cudaMemcpyHostToDevice, streams_[0]);
    cudaMemsetAsync(scratch_.p, meshmem::test::kPoison, scratch_bytes_, streams_[0]);
    for (const soak::Write& w : r.writes)
      if (w.target == me_) cudaMemsetAsync(static_cast<unsigned char*>(wins_[w.window].local()) + w.offset, r.poison, w.bytes, streams_[0]);
    const cudaError_t rc = cudaDeviceSynchronize();
    if (rc != cudaSuccess) return ::testing::AssertionFailure() << "preparing the round: " << cudaGetErrorString(rc);
    return ::testing::AssertionSuccess();
  }

  // `to` waits for what `from` has enqueued so far.
  void join(int to, int from) {
    cudaEventRecord(events_[from], streams_[from]);
    cudaStreamWaitEvent(streams_[to], events_[from], 0);
  }
  // Enqueues op i if it is this rank's; false where the API raised.
  bool enqueue(const soak::Round& r, const soak::Model& start, int i) {
    const soak::Op& op = r.ops[static_cast<std::size_t>(i)];
    if (op.kind != soak::Kind::Barrier && op.rank != me_) return true;
    cudaStream_t s = streams_[op.stream];
    try {
      switch (op.kind) {
        case soak::Kind::Put:
        case soak::Kind::PutSignal: {
          // Fresh data uploaded before the round, or a range of this rank's own window.
          unsigned char* src = op.src_window >= 0 ? static_cast<unsigned char*>(wins_[op.src_window].local()) + op.src_offset
                                                  : src_.c() + src_off_[op.write];
          if (op.kind == soak::Kind::Put)
            comm_->put(wins_[op.window], op.target, op.offset, src, op.bytes, s);
          else
            comm_->put_signal(wins_[op.window], op.target, op.offset, src, op.bytes, sigs_[op.set], op.index, op.value,
                              op.sig_op, s);
          if (op.src_window < 0) cudaMemsetAsync(src, 0x5A, op.bytes, s);  // the source may be reused once the stream passed the put
          break;
        }
        case soak::Kind::Signal: comm_->signal(sigs_[op.set], op.target, op.index, op.value, op.sig_op, s); break;
        case soak::Kind::Get:
          comm_->get(scratch_.c() + scratch_off_[i] + kGuard, wins_[op.window], op.target, op.offset, op.bytes, s);
          break;
        case soak::Kind::Check:
          cudaMemcpyAsync(scratch_.c() + scratch_off_[i], static_cast<unsigned char*>(wins_[op.window].local()) + op.offset,
                          op.bytes, cudaMemcpyDeviceToDevice, s);
          break;
        case soak::Kind::Wait: {
          const Signals& sig = sigs_[op.set];
          cudaStream_t ws = op.on_host ? nullptr : s;
          if (op.api == soak::WaitApi::Until) comm_->wait_until(sig, op.index, op.cmp, op.value, ws);
          else if (op.api == soak::WaitApi::All) comm_->wait_until_all(sig, op.index, op.count, op.cmp, op.value, ws);
          else comm_->wait_until_all_then_set(sig, op.index, op.count, op.cmp, op.value, op.then, ws);
          if (!op.implies) break;
          if (!op.on_host) {
            cudaMemcpyAsync(scratch_.c() + scratch_off_[i], sig.local() + op.index, op.count * sizeof(std::uint64_t),
                            cudaMemcpyDeviceToDevice, s);
            break;
          }
          for (std::size_t w = 0; w < op.count; ++w) check_word(r, start, i, w, sig.read(op.index + w));
          break;
        }
        case soak::Kind::Quiet: comm_->quiet(s); break;
        case soak::Kind::Join: join(op.stream, op.from_stream); break;
        case soak::Kind::Barrier: {
          const int b = (op.stream + me_) % kStreams;
          for (int k = 0; k < kStreams; ++k)
            if (k != b) join(b, k);
          comm_->barrier(streams_[b]);
          for (int k = 0; k < kStreams; ++k)
            if (k != b) join(k, b);
          break;
        }
      }
      const cudaError_t rc = cudaGetLastError();
      if (rc != cudaSuccess) {
        fail(soak::describe(op, i) + ": CUDA error " + cudaGetErrorString(rc));
        return false;
      }
    } catch (const Error& e) {
      fail(soak::describe(op, i) + " raised: " + e.what());
      return false;
    }
    return true;
  }
  void check_word(const soak::Round& r, const soak::Model& start, int i, std::size_t w, std::uint64_t got) {
    const soak::Op& op = r.ops[static_cast<std::size_t>(i)];
    const std::uint64_t want =
        op.api == soak::WaitApi::AllThenSet ? op.then : soak::updated_word(r, start, me_, op.set, op.index + w);
    if (got != want)
      fail(soak::describe(op, i) + ": word " + std::to_string(op.set) + "/" + std::to_string(op.index + w) + " is " +
           std::to_string(got) + " after the wait, the model says " + std::to_string(want));
  }

  // Waits for every stream, bounded. On a hang: which of this rank's waits are unmet now.
  bool finish(const soak::Round& r) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(kFinishSeconds);
    for (cudaStream_t s : streams_)
      while (cudaStreamQuery(s) == cudaErrorNotReady) {
        if (std::chrono::steady_clock::now() > end) {
          std::string unmet;
          for (std::size_t i = 0; i < r.ops.size(); ++i) {
            const soak::Op& op = r.ops[i];
            if (op.kind != soak::Kind::Wait || op.rank != me_) continue;
            for (std::size_t w = 0; w < op.count; ++w) {
              const std::uint64_t v = sigs_[op.set].read(op.index + w);
              if (!compare(v, op.cmp, op.value) && op.api != soak::WaitApi::AllThenSet)
                unmet += "\n  " + soak::describe(op, static_cast<int>(i)) + ": word " + std::to_string(op.index + w) +
                         " is " + std::to_string(v);
            }
          }
          fail("the streams did not finish within " + std::to_string(kFinishSeconds) +
               " s; this rank's waits not met now:" + (unmet.empty() ? std::string(" none") : unmet));
          return false;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    const cudaError_t rc = cudaDeviceSynchronize();
    if (rc != cudaSuccess) {
      fail(std::string("cudaDeviceSynchronize after the round: ") + cudaGetErrorString(rc));
      return false;
    }
    try {
      comm_->quiet(streams_[0]);  // raises a device wait's timeout recorded during the round
    } catch (const Error& e) {
      fail(std::string("after the round: ") + e.what());
      return false;
    }
    return true;
  }

  // Reads, word copies, every byte of this rank's windows and (with `words`) every word, against
  // the model, which then holds the end of the round.
  void check(const soak::Round& r, const soak::Model& start, soak::Model& model, bool words) {
    std::vector<unsigned char> got(scratch_bytes_);
    if (scratch_bytes_ > 0) cudaMemcpy(got.data(), scratch_.p, scratch_bytes_, cudaMemcpyDeviceToHost);
    for (std::size_t i = 0; i < r.ops.size(); ++i) {
      const soak::Op& op = r.ops[i];
      if (op.rank != me_) continue;
      const unsigned char* at = got.data() + scratch_off_[i];
      if (op.kind == soak::Kind::Get) {
        const long long before = meshmem::test::first_not(at, meshmem::test::kPoison, kGuard);
        const long long after = meshmem::test::first_not(at + kGuard + op.bytes, meshmem::test::kPoison, kGuard);
        if (before >= 0 || after >= 0)
          fail(soak::describe(op, static_cast<int>(i)) + ": wrote outside its destination (" +
               (before >= 0 ? "before" : "after") + " it)");
        at += kGuard;
      }
      if (op.kind == soak::Kind::Get || op.kind == soak::Kind::Check) {
        const auto want = soak::expected_bytes(seed_, r, start, static_cast<int>(i), op.target, op.window, op.offset, op.bytes);
        const std::string bad = soak::read_mismatch(r, static_cast<int>(i), at, want);
        if (!bad.empty()) fail(bad);
      }
      if (op.kind == soak::Kind::Wait && op.implies && !op.on_host)
        for (std::size_t w = 0; w < op.count; ++w) {
          std::uint64_t v = 0;
          std::memcpy(&v, at + w * sizeof(v), sizeof(v));
          check_word(r, start, static_cast<int>(i), w, v);
        }
    }
    soak::apply_round(seed_, r, model);
    for (std::size_t w = 0; w < wins_.size(); ++w) {
      const auto img = meshmem::test::to_host(wins_[w].local(), cfg_.windows[w]);
      const std::string bad = soak::window_mismatch(r, me_, static_cast<int>(w), img.data(), model.win[me_][w]);
      if (!bad.empty()) fail(bad);
    }
    if (words) check_words(model, "after the round");
  }
  void check_words(const soak::Model& model, const std::string& when) {
    for (std::size_t s = 0; s < sigs_.size(); ++s) {
      std::vector<std::uint64_t> words(cfg_.signals[s]);
      cudaMemcpy(words.data(), sigs_[s].local(), words.size() * sizeof(std::uint64_t), cudaMemcpyDeviceToHost);
      for (std::size_t i = 0; i < words.size(); ++i)
        if (words[i] != model.words[me_][s][i])
          fail(when + ", signal word " + std::to_string(s) + "/" + std::to_string(i) + " is " + std::to_string(words[i]) +
               ", the model says " + std::to_string(model.words[me_][s][i]));
    }
    const std::size_t i = static_cast<std::size_t>(seed_ % cfg_.signals[0]);  // and one through the API
    const std::uint64_t v = sigs_[0].read(i);
    if (v != model.words[me_][0][i])
      fail(when + ", Signals::read(" + std::to_string(i) + ") is " + std::to_string(v) + ", the model says " +
           std::to_string(model.words[me_][0][i]));
  }

  // True where every rank is still fine (collective).
  bool all_fine() {
    int any = failures_, all = 0;
    MPI_Allreduce(&any, &all, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    return all == 0;
  }
  // Operations of the plans by the route of their pair ("ipc 1200, nccl 800").
  void count_routes(const soak::Round& r) {
    for (const soak::Op& op : r.ops)
      if (op.target >= 0 && op.rank >= 0 && op.kind != soak::Kind::Check) by_route_[route_[op.rank][op.target]]++;
  }
  std::string route_counts() const {
    std::string text;
    for (int k = 0; k < 8; ++k)
      if (by_route_[k]) text += std::string(text.empty() ? "" : ", ") + route_name(k) + " " + std::to_string(by_route_[k]);
    return text;
  }

  std::unique_ptr<Comm> comm_;
  std::vector<Window> wins_;
  std::vector<Signals> sigs_;
  cudaStream_t streams_[kStreams] = {};
  cudaEvent_t events_[kStreams] = {};
  std::vector<std::vector<int>> route_;
  soak::Config cfg_;
  std::uint64_t seed_ = 0;
  char seed_text_[32] = {};
  int me_ = 0, n_ = 1;
  int failures_ = 0;
  std::string prefix_;
  std::vector<std::size_t> src_off_, scratch_off_;
  std::size_t src_bytes_ = 0, scratch_bytes_ = 0;
  Grow src_{false}, staging_{true}, scratch_{false};
  long long by_route_[8] = {};
};

// The soak proper: rounds of random operations on three streams, eager.
TEST_F(DeviceSoak, RandomStreamOrderedOperationsMatchTheModel) {
  bool found = false;
  const char* want = std::getenv("MESHMEM_SOAK_REQUIRE_ROUTE");
  const std::string pairs = routes(want, &found);
  if (!found) GTEST_SKIP() << "no pair of ranks takes the " << want << " route here (routes: " << pairs << ")";
  probe_add();
  make_windows();
  cfg_.host_waits = true;
  const soak::Length length(3000);
  int no_add = 0;
  for (int a = 0; a < n_; ++a)
    for (int t = 0; t < n_; ++t) no_add += cfg_.reach[a][t] && !cfg_.add_ok[a][t];
  if (me_ == 0)
    std::printf("[ soak ] seed %s, %s, %d ranks on %d node(s), %d streams each; routes: %s%s; replay with "
                "MESHMEM_SOAK_SEED=%s %s\n",
                seed_text_, length.text().c_str(), n_, comm_->node_count(), kStreams, pairs.c_str(),
                no_add ? (", Add refused on " + std::to_string(no_add) + " pairs").c_str() : "", seed_text_,
                length.replay().c_str());
  comm_->barrier();

  soak::Model model(cfg_);
  soak::Stats stats;
  int round = 0;
  for (; length.more(round, stats); ++round) {
    const soak::Round r = soak::Planner(cfg_, model, seed_, round).make();
    prefix_ = std::string("soak seed ") + seed_text_ + ", round " + std::to_string(round) + ", rank " + std::to_string(me_) + ": ";
    soak::apply_poison(r, model);
    const soak::Model start = model;
    layout(r);
    ASSERT_TRUE(prepare(r, start));
    comm_->barrier();  // every rank's destinations poisoned (its streams idle)
    for (int i = 0; i < static_cast<int>(r.ops.size()); ++i)
      if (!enqueue(r, start, i)) break;
    if (finish(r)) check(r, start, model, true);
    stats.add(r);
    count_routes(r);
    if (!all_fine()) {
      if (me_ == 0)
        std::printf("[ soak ] stopped after round %d (a rank found a mismatch); MESHMEM_SOAK_ROUNDS=%d stops there\n", round,
                    round + 1);
      break;
    }
  }
  if (failures_ == 0 && me_ == 0)
    std::printf("[ soak ] verified %d rounds on %d ranks: %s; by route: %s\n", round, n_, stats.text().c_str(),
                route_counts().c_str());
  if (failures_ > kMaxReports) ADD_FAILURE() << prefix_ << failures_ << " mismatches in all (the first " << kMaxReports << " shown)";
}

// One round captured into a CUDA graph (every stream forked from and joined back into the
// first), then replayed with fresh sources each time; the graph ends with a copy of every
// word, their reset to 0 (wait_until_all_then_set GE 0, then 0) and a barrier, so that every
// replay starts from words at 0 (a captured Set or wait has the values of the capture).
TEST_F(DeviceSoak, OneRoundCapturedIntoAGraphReplays) {
  bool found = false;
  const char* want = std::getenv("MESHMEM_SOAK_REQUIRE_ROUTE");
  const std::string pairs = routes(want, &found);
  if (!found) GTEST_SKIP() << "no pair of ranks takes the " << want << " route here (routes: " << pairs << ")";
  probe_add();
  make_windows();
  cfg_.zero_words = true;
  cfg_.ops_per_round = static_cast<int>(env_number("MESHMEM_SOAK_GRAPH_OPS", 120));
  const int replays = static_cast<int>(env_number("MESHMEM_SOAK_REPLAYS", 6));
  soak::Model model(cfg_);
  soak::Round r = soak::Planner(cfg_, model, seed_, 1000000).make();
  if (me_ == 0)
    std::printf("[ soak ] graph: seed %s, one round of %zu ops (%zu writes) captured, %d replays; routes: %s; replay with "
                "MESHMEM_SOAK_SEED=%s\n",
                seed_text_, r.ops.size(), r.writes.size(), replays, pairs.c_str(), seed_text_);
  layout(r);
  std::size_t words = 0;
  for (std::size_t c : cfg_.signals) words += c;
  Grow final_words(false);
  ASSERT_EQ(final_words.reserve(words * sizeof(std::uint64_t)), cudaSuccess);
  ASSERT_TRUE(prepare(r, model));  // sizes the buffers; the graph keeps their addresses
  comm_->barrier();

  prefix_ = std::string("soak graph seed ") + seed_text_ + ", capture, rank " + std::to_string(me_) + ": ";
  ASSERT_EQ(cudaStreamBeginCapture(streams_[0], cudaStreamCaptureModeGlobal), cudaSuccess);
  for (int k = 1; k < kStreams; ++k) join(k, 0);
  bool captured = true;
  const soak::Model zero = model;
  for (int i = 0; i < static_cast<int>(r.ops.size()) && captured; ++i) captured = enqueue(r, zero, i);
  for (int k = 1; k < kStreams; ++k) join(0, k);
  try {
    std::size_t at = 0;
    for (std::size_t s = 0; s < sigs_.size(); ++s) {
      cudaMemcpyAsync(final_words.c() + at, sigs_[s].local(), cfg_.signals[s] * sizeof(std::uint64_t),
                      cudaMemcpyDeviceToDevice, streams_[0]);
      at += cfg_.signals[s] * sizeof(std::uint64_t);
      comm_->wait_until_all_then_set(sigs_[s], 0, cfg_.signals[s], Cmp::GE, 0, 0, streams_[0]);
    }
    comm_->barrier(streams_[0]);  // no rank's next replay updates a word before its reset
  } catch (const Error& e) {
    fail(std::string("capturing the reset: ") + e.what());
    captured = false;
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(streams_[0], &graph);
  if (ended != cudaSuccess) fail(std::string("cudaStreamEndCapture: ") + cudaGetErrorString(ended));
  cudaGraphExec_t exec = nullptr;
  if (captured && ended == cudaSuccess) {
    const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
    if (made != cudaSuccess) fail(std::string("cudaGraphInstantiate: ") + cudaGetErrorString(made));
  }
  if (graph != nullptr) cudaGraphDestroy(graph);
  if (!all_fine()) {  // every rank replays, or none
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    return;
  }

  soak::Stats stats;
  for (int rep = 0; rep < replays; ++rep) {
    r.number = 1000000 + rep;  // fresh data every replay, same destinations
    prefix_ = std::string("soak graph seed ") + seed_text_ + ", replay " + std::to_string(rep) + ", rank " + std::to_string(me_) + ": ";
    soak::apply_poison(r, model);
    const soak::Model start = model;
    ASSERT_TRUE(prepare(r, start));
    comm_->barrier();
    const cudaError_t launched = cudaGraphLaunch(exec, streams_[0]);
    if (launched != cudaSuccess) fail(std::string("cudaGraphLaunch: ") + cudaGetErrorString(launched));
    if (launched == cudaSuccess && finish(r)) {
      check(r, start, model, false);  // the words are checked below: reset to 0 by now
      std::vector<std::uint64_t> before(words);
      cudaMemcpy(before.data(), final_words.p, words * sizeof(std::uint64_t), cudaMemcpyDeviceToHost);
      std::size_t at = 0;
      for (std::size_t s = 0; s < sigs_.size(); ++s)
        for (std::size_t i = 0; i < cfg_.signals[s]; ++i, ++at) {
          if (before[at] != model.words[me_][s][i])
            fail("before the graph's reset, signal word " + std::to_string(s) + "/" + std::to_string(i) + " was " +
                 std::to_string(before[at]) + ", the model says " + std::to_string(model.words[me_][s][i]));
        }
      for (int t = 0; t < n_; ++t)
        for (auto& set : model.words[t]) std::fill(set.begin(), set.end(), 0);
      check_words(model, "after the graph's reset");
    }
    stats.add(r);
    if (!all_fine()) break;
    if (rep + 1 == replays && me_ == 0)
      std::printf("[ soak ] graph: verified %d replays on %d ranks: %s\n", replays, n_, stats.text().c_str());
  }
  cudaGraphExecDestroy(exec);
  if (failures_ > kMaxReports) ADD_FAILURE() << prefix_ << failures_ << " mismatches in all (the first " << kMaxReports << " shown)";
}

}  // namespace
