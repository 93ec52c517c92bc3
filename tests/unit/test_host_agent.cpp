// HostAgentCore (comm/src/cuda/agent/host_agent.hpp) with a fake request: the rules of done-word
// lending, graph words, drain, stop and error keeping that every host-agent transport relies on.
// CUDA-free: runs in CI.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cuda/agent/host_agent.hpp"
#include "meshmem/error.hpp"
#include "meshmem/ipc/awake_clock.hpp"

using meshmem::Error;
using meshmem::ErrorCode;
using meshmem::detail::HostAgentCore;

namespace {

struct FakeRequest {
  std::size_t word = 0;
  std::uint64_t ticket = 0;
  int payload = 0;
};
struct FakeQueue {
  std::deque<FakeRequest> items;
  void push(const FakeRequest& r) { items.push_back(r); }
};
using Core = HostAgentCore<FakeRequest>;
constexpr auto kShort = std::chrono::milliseconds(50);

}  // namespace

TEST(HostAgentCore, LendsEveryWordOnceThenTimesOutNamingTheCount) {
  std::vector<std::uint64_t> words(4, 0);
  Core core(words.data(), words.size(), kShort);
  std::set<std::size_t> taken;
  for (int i = 0; i < 4; ++i) taken.insert(core.take_word("put"));
  EXPECT_EQ(taken, (std::set<std::size_t>{0, 1, 2, 3}));
  const auto t0 = std::chrono::steady_clock::now();
  try {
    core.take_word("comm.put on rank 0");
    FAIL() << "a fifth word was lent out of four";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Timeout);
    EXPECT_NE(std::string(e.what()).find("comm.put on rank 0: all 4 transfers"), std::string::npos) << e.what();
  }
  EXPECT_GE(std::chrono::steady_clock::now() - t0, kShort);
  core.release_word(2);
  EXPECT_EQ(core.take_word("put"), 2u);
}

TEST(HostAgentCore, ATakerWaitsForAWordThatAnEndGivesBack) {
  std::vector<std::uint64_t> words(1, 0);
  Core core(words.data(), words.size(), std::chrono::milliseconds(5000));
  const std::size_t w = core.take_word("put");
  const std::uint64_t ticket = core.submit(FakeRequest{w, 0, 7});
  std::thread ender([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    core.end(w, ticket);
  });
  EXPECT_EQ(core.take_word("put"), w);  // blocks until the end
  ender.join();
  EXPECT_EQ(__atomic_load_n(core.word(w), __ATOMIC_ACQUIRE), ticket);
}

TEST(HostAgentCore, SubmitNumbersTicketsAndTheThreadTakesThemInOrder) {
  std::vector<std::uint64_t> words(8, 0);
  Core core(words.data(), words.size(), kShort);
  std::vector<std::uint64_t> tickets;
  for (int i = 0; i < 5; ++i) tickets.push_back(core.submit(FakeRequest{core.take_word("put"), 0, i}));
  EXPECT_EQ(tickets, (std::vector<std::uint64_t>{1, 2, 3, 4, 5}));
  FakeQueue q;
  ASSERT_TRUE(core.take_requests(q));
  ASSERT_EQ(q.items.size(), 5u);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(q.items[i].payload, i);
    EXPECT_EQ(q.items[i].ticket, tickets[i]);
  }
  FakeQueue again;
  ASSERT_TRUE(core.take_requests(again));
  EXPECT_TRUE(again.items.empty()) << "a request was handed to the thread twice";
}

TEST(HostAgentCore, EndWritesTheTicketAndGivesTheWordBack) {
  std::vector<std::uint64_t> words(2, 0);
  Core core(words.data(), words.size(), kShort);
  const std::size_t a = core.take_word("put"), b = core.take_word("put");
  const std::uint64_t ta = core.submit(FakeRequest{a, 0, 0});
  core.submit(FakeRequest{b, 0, 0});
  core.end(a, ta);
  EXPECT_EQ(words[a], ta);
  EXPECT_EQ(words[b], 0u) << "another transfer's word was written";
  EXPECT_EQ(core.take_word("put"), a);
}

TEST(HostAgentCore, AGraphWordOutlivesItsTransfersUntilTheGraphIsGone) {
  std::vector<std::uint64_t> words(2, 0);
  Core core(words.data(), words.size(), kShort);
  std::size_t g = 99;
  ASSERT_TRUE(core.try_take_graph_word(&g));
  // Two replays in flight, then both end: the word stays the graph's.
  const std::uint64_t t1 = core.submit(FakeRequest{g, 0, 0});
  const std::uint64_t t2 = core.submit(FakeRequest{g, 0, 0});
  core.end(g, t1);
  core.end(g, t2);
  const std::size_t other = core.take_word("put");
  EXPECT_NE(other, g);
  EXPECT_THROW(core.take_word("put"), Error) << "a graph's word was lent to an eager transfer";
  // The graph goes while a replay is in flight: its end gives the word back, once.
  const std::uint64_t t3 = core.submit(FakeRequest{g, 0, 0});
  core.release_graph_word(g);
  EXPECT_THROW(core.take_word("put"), Error) << "a word was freed while its transfer was in flight";
  core.end(g, t3);
  EXPECT_EQ(core.take_word("put"), g);
  EXPECT_THROW(core.take_word("put"), Error) << "the word was given back twice";
}

TEST(HostAgentCore, AGraphWordWithNothingInFlightGoesBackAtOnce) {
  std::vector<std::uint64_t> words(1, 0);
  Core core(words.data(), words.size(), kShort);
  std::size_t g = 99;
  ASSERT_TRUE(core.try_take_graph_word(&g));
  std::size_t none = 99;
  EXPECT_FALSE(core.try_take_graph_word(&none));
  core.release_graph_word(g);
  core.release_graph_word(g);  // a second release of an unknown word does nothing
  EXPECT_EQ(core.take_word("put"), g);
}

TEST(HostAgentCore, DrainWaitsForEveryEndAndIsBounded) {
  std::vector<std::uint64_t> words(4, 0);
  Core core(words.data(), words.size(), std::chrono::milliseconds(2000));
  EXPECT_TRUE(core.drain()) << "nothing submitted: drained at once";
  const std::size_t w = core.take_word("put");
  const std::uint64_t t = core.submit(FakeRequest{w, 0, 0});
  std::atomic<bool> ended{false};
  std::thread ender([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(40));
    ended = true;
    core.end(w, t);
  });
  EXPECT_TRUE(core.drain());
  EXPECT_TRUE(ended) << "drain returned before the transfer ended";
  ender.join();
  Core bounded(words.data(), words.size(), kShort);
  bounded.submit(FakeRequest{bounded.take_word("put"), 0, 0});
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(bounded.drain());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
}

TEST(HostAgentCore, StopEndsTheThreadsLookAndADrainInProgress) {
  std::vector<std::uint64_t> words(2, 0);
  Core core(words.data(), words.size(), std::chrono::milliseconds(0));  // 0: drain waits for ever
  core.submit(FakeRequest{core.take_word("put"), 0, 0});
  std::thread stopper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    core.request_stop();
  });
  EXPECT_FALSE(core.drain()) << "a drain of a transfer that never ends returned true";
  stopper.join();
  FakeQueue q;
  EXPECT_FALSE(core.take_requests(q));
  EXPECT_TRUE(q.items.empty());
}

TEST(HostAgentCore, KeepsTheFirstErrorAndHandsItOverOnce) {
  std::vector<std::uint64_t> words(1, 0);
  Core core(words.data(), words.size(), kShort);
  ErrorCode code = ErrorCode::Internal;
  EXPECT_EQ(core.take_error(&code), "");
  core.note_error("nccl transport on rank 1: ncclSend failed", ErrorCode::Cuda);
  core.note_error("a later failure", ErrorCode::Timeout);
  EXPECT_EQ(core.take_error(&code), "nccl transport on rank 1: ncclSend failed");
  EXPECT_EQ(code, ErrorCode::Cuda);
  EXPECT_EQ(core.take_error(&code), "") << "the error was raised twice";
  core.note_error("after the first was raised", ErrorCode::Timeout);
  EXPECT_EQ(core.take_error(&code), "after the first was raised");
  EXPECT_EQ(code, ErrorCode::Timeout);
}

// ---- words the GPU or another process ends (the staging agent's lanes and hidden peers) ----

TEST(HostAgentCore, AReturnedWordComesBackOnceItsCounterGetsThere) {
  std::vector<std::uint64_t> words(1, 0);
  Core core(words.data(), words.size(), kShort);
  std::size_t w = 99;
  ASSERT_TRUE(core.try_take_word(&w));
  std::uint64_t lane_counter = 0;
  core.return_when(w, &lane_counter, 3, 8, Core::Return::Always);
  std::size_t again = 99;
  lane_counter = 2;
  EXPECT_FALSE(core.try_take_word(&again)) << "a word came back before its lane's counter reached its end";
  __atomic_store_n(&lane_counter, 3, __ATOMIC_RELEASE);
  ASSERT_TRUE(core.try_take_word(&again));
  EXPECT_EQ(again, w);
  EXPECT_FALSE(core.try_take_word(&again)) << "the word came back twice";
}

TEST(HostAgentCore, AWordWhoseEndCarriesARetiredBitIsNeverLentAgain) {
  constexpr std::uint64_t kGivenUp = std::uint64_t(1) << 62;
  std::vector<std::uint64_t> words(2, 0);
  Core core(words.data(), words.size(), kShort, 2, kGivenUp);
  std::size_t a = 99, b = 99;
  ASSERT_TRUE(core.try_take_word(&a));
  ASSERT_TRUE(core.try_take_word(&b));
  core.return_when(a, &words[a], 4, 4, Core::Return::UnlessRetired);
  core.return_when(b, &words[b], 6, 6, Core::Return::UnlessRetired);
  words[a] = 4 | kGivenUp;  // its caller's wait gave up: the reader may still write its end
  words[b] = 6;
  std::size_t w = 99;
  ASSERT_TRUE(core.try_take_word(&w));
  EXPECT_EQ(w, b);
  EXPECT_FALSE(core.try_take_word(&w)) << "a word marked given up was lent again";
  EXPECT_TRUE(core.returns_on(&words[a]).empty()) << "the given-up word's return is still pending";
}

TEST(HostAgentCore, RetireDropsAReturnOnlyWhileItsTransferHasNotEnded) {
  std::vector<std::uint64_t> words(2, 0);
  Core core(words.data(), words.size(), kShort);
  std::size_t a = 99, b = 99;
  ASSERT_TRUE(core.try_take_word(&a));
  ASSERT_TRUE(core.try_take_word(&b));
  core.return_when(a, &words[a], 2, 2, Core::Return::UnlessRetired);
  core.return_when(b, &words[b], 4, 4, Core::Return::UnlessRetired);
  EXPECT_FALSE(core.retire(a, 3)) << "retired another transfer's return";
  EXPECT_TRUE(core.retire(a, 2));
  EXPECT_FALSE(core.retire(a, 2)) << "retired twice";
  words[b] = 4;  // b ended by itself: it goes back as usual
  EXPECT_FALSE(core.retire(b, 4)) << "an ended transfer's word was retired";
  words[a] = 2;  // a late end of the retired transfer
  std::size_t w = 99;
  ASSERT_TRUE(core.try_take_word(&w));
  EXPECT_EQ(w, b);
  EXPECT_FALSE(core.try_take_word(&w)) << "a retired word came back";
}

TEST(HostAgentCore, ReturnsOnListsTheWordsWaitingForOneCounterOldestFirst) {
  std::vector<std::uint64_t> words(4, 0);
  Core core(words.data(), words.size(), kShort);
  std::uint64_t lane0 = 0, lane1 = 0;
  std::size_t w[3];
  for (auto& x : w) ASSERT_TRUE(core.try_take_word(&x));
  core.return_when(w[0], &lane0, 1, 10, Core::Return::Always);
  core.return_when(w[1], &lane1, 1, 12, Core::Return::Always);
  core.return_when(w[2], &lane0, 2, 14, Core::Return::Always);
  using Pending = std::vector<std::pair<std::size_t, std::uint64_t>>;
  EXPECT_EQ(core.returns_on(&lane0), (Pending{{w[0], 10}, {w[2], 14}}));
  EXPECT_EQ(core.returns_on(&lane1), (Pending{{w[1], 12}}));
  lane0 = 1;
  core.reclaim();
  EXPECT_EQ(core.returns_on(&lane0), (Pending{{w[2], 14}})) << "an ended return is still listed";
}

TEST(HostAgentCore, TicketsGoUpByTheStepAndAreNumberedBeforeTheThreadSeesThem) {
  std::vector<std::uint64_t> words(4, 0);
  Core core(words.data(), words.size(), kShort, 2);
  std::vector<std::uint64_t> seen;
  for (int i = 0; i < 3; ++i) {
    std::size_t w = 99;
    ASSERT_TRUE(core.try_take_word(&w));
    const std::uint64_t t = core.submit(FakeRequest{w, 0, i}, [&](const FakeRequest& r) {
      seen.push_back(r.ticket);
      EXPECT_EQ(r.payload, i);
    });
    EXPECT_EQ(t, seen.back());
  }
  EXPECT_EQ(seen, (std::vector<std::uint64_t>{2, 4, 6}));
}

TEST(HostAgentCore, WaitUntilEndedCountsEndsAndOutsideWorkAndSeesAStop) {
  using Clock = meshmem::ipc::AwakeClock;
  std::vector<std::uint64_t> words(2, 0);
  Core core(words.data(), words.size(), kShort);
  EXPECT_EQ(core.wait_until_ended(Clock::now()), Core::Ended::All);
  const std::uint64_t first = core.submit(FakeRequest{0, 0, 0});
  core.add_outside_work();
  EXPECT_EQ(core.wait_until_ended(Clock::now() + kShort), Core::Ended::TimedOut);
  std::thread ender([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    core.count_ended(first);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    core.outside_work_ended();
  });
  const auto t0 = Clock::now();
  EXPECT_EQ(core.wait_until_ended(Clock::now() + std::chrono::seconds(5)), Core::Ended::All);
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(30)) << "returned before the outside work ended";
  ender.join();
  core.submit(FakeRequest{1, 0, 0});
  core.request_stop();
  EXPECT_EQ(core.wait_until_ended(Clock::now() + std::chrono::seconds(5)), Core::Ended::Stopping);
}

TEST(HostAgentCore, TakingRequestsSeeingStopMovesThemAllAlsoWhenStopping) {
  std::vector<std::uint64_t> words(4, 0);
  Core core(words.data(), words.size(), kShort);
  core.submit(FakeRequest{0, 0, 1});
  FakeQueue q;
  EXPECT_FALSE(core.take_requests_seeing_stop(q));
  core.submit(FakeRequest{1, 0, 2});
  core.submit(FakeRequest{2, 0, 3});
  core.request_stop();
  EXPECT_TRUE(core.take_requests_seeing_stop(q));
  ASSERT_EQ(q.items.size(), 3u) << "requests queued before the stop were lost (their streams would wait)";
  EXPECT_EQ(q.items[2].payload, 3);
}

TEST(HostAgentCore, WaitForRequestsWakesOnASubmitAStopAWakeAndIsBounded) {
  std::vector<std::uint64_t> words(4, 0);
  Core core(words.data(), words.size(), kShort);
  const auto t0 = std::chrono::steady_clock::now();
  core.wait_for_requests(std::chrono::milliseconds(30), [] { return false; });
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(30));
  std::atomic<bool> flag{false};
  auto waits_until = [&](auto poke) {
    std::thread poker([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      poke();
    });
    const auto start = std::chrono::steady_clock::now();
    core.wait_for_requests(std::chrono::microseconds(0), [&] { return flag.load(); });  // no bound
    poker.join();
    return std::chrono::steady_clock::now() - start;
  };
  EXPECT_LT(waits_until([&] { core.submit(FakeRequest{0, 0, 0}); }), std::chrono::seconds(5));
  FakeQueue q;
  core.take_requests_seeing_stop(q);
  EXPECT_LT(waits_until([&] {
              flag = true;
              core.wake();
            }),
            std::chrono::seconds(5));
  flag = false;
  EXPECT_LT(waits_until([&] { core.request_stop(); }), std::chrono::seconds(5));
}

// A freed window's drain waits for the transfers handed over before it (tickets up to its
// mark), in whatever order they end, and not for those handed over later, which another
// thread may keep coming: wait_through.
TEST(HostAgentCore, WaitThroughWaitsForTicketsUpToTheMarkOnly) {
  using Clock = meshmem::ipc::AwakeClock;
  std::vector<std::uint64_t> words(8, 0);
  Core core(words.data(), words.size(), kShort, 2);  // the staging agent's ticket step
  EXPECT_EQ(core.last_ticket(), 0u);
  EXPECT_EQ(core.wait_through(0, Clock::now()), Core::Ended::All) << "nothing handed over";
  const std::uint64_t a = core.submit(FakeRequest{0, 0, 0});
  const std::uint64_t b = core.submit(FakeRequest{1, 0, 0});
  const std::uint64_t mark = core.last_ticket();
  EXPECT_EQ(mark, b);
  const std::uint64_t later = core.submit(FakeRequest{2, 0, 0});
  EXPECT_GT(later, mark);
  // Out of order: the later transfer and b end, a does not: not through the mark.
  core.count_ended(later);
  core.end(1, b);
  EXPECT_EQ(core.wait_through(mark, Clock::now() + kShort), Core::Ended::TimedOut)
      << "a transfer before the mark has not ended";
  EXPECT_EQ(core.wait_through(a - 1, Clock::now()), Core::Ended::All) << "nothing up to a ticket before a";
  std::thread ender([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    core.count_ended(a);
  });
  const auto t0 = Clock::now();
  EXPECT_EQ(core.wait_through(mark, Clock::now() + std::chrono::seconds(5)), Core::Ended::All);
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(15)) << "returned before a ended";
  ender.join();
  // Transfers handed over after the mark and still running do not hold it.
  (void)core.submit(FakeRequest{3, 0, 0});
  (void)core.submit(FakeRequest{4, 0, 0});
  EXPECT_EQ(core.wait_through(mark, Clock::now()), Core::Ended::All);
  EXPECT_EQ(core.wait_through(core.last_ticket(), Clock::now() + kShort), Core::Ended::TimedOut);
  core.request_stop();
  EXPECT_EQ(core.wait_through(core.last_ticket(), Clock::now() + std::chrono::seconds(5)), Core::Ended::Stopping);
}
