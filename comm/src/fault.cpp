#include "fault.hpp"

#include <signal.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cctype>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <thread>

#include "knobs.hpp"
#include "log.hpp"
#include "meshmem/error.hpp"

namespace meshmem::detail {

namespace {

struct PointInfo {
  FaultPoint point;
  const char* name;
  const char* where;  // for the knob's documentation
  bool can_fail = false;  // the code there fails its call on `fail`
};
// The one list of points: names for the parser, the printer and the documentation.
constexpr PointInfo kPoints[kFaultPointCount] = {
    {FaultPoint::CommStart, "comm.start", "a Comm's constructor, before the Comm's communicator exists"},
    {FaultPoint::CommJoined, "comm.joined", "the Comm's communicator is made, before its ranks first meet"},
    {FaultPoint::FdExchange, "fd.exchange",
     "a descriptor exchange between node peers, as when a window shared on the node is made, before this rank offers "
     "its descriptor"},
    {FaultPoint::MpiPutAfterHeader, "mpi.put.after_header",
     "an mpi transport put of more than 1 KiB (a smaller one is one message), its header sent, its data not yet"},
    {FaultPoint::MpiServePut, "mpi.serve.put",
     "the target's progress thread has a put's header (up to 1 KiB: with its bytes), before it takes the data in"},
    {FaultPoint::MpiServeGet, "mpi.serve.get", "the target's progress thread has a get's header, before the answer"},
    {FaultPoint::MpiServeFlush, "mpi.serve.flush", "the target's progress thread has a flush, sent by quiet, before the answer"},
    {FaultPoint::NcclConnect, "nccl.connect",
     "the nccl transport's connect (in the Comm's constructor) has its peers' NCCL ids, before it makes its NCCL "
     "communicators"},
    {FaultPoint::ProxyHeader, "proxy.header",
     "a proxy thread of the nccl or mpi-device transport has a peer's header (a put, a get's request or answer, an "
     "acknowledgement), before it handles it"},
    {FaultPoint::LeadersEnqueue, "leaders.enqueue",
     "a node leader's barrier(stream) across nodes, before it enqueues the all-reduce among the node leaders; "
     "`fail` makes that ncclAllReduce fail",
     true},
    {FaultPoint::StagedCarry, "staged.carry",
     "a staged transport agent has a node peer's descriptor (a chunk, or a get's request) from its channel, before it "
     "carries it out"},
    {FaultPoint::StagedAnswer, "staged.answer",
     "a staged transport agent has posted a chunk of its answer to a node peer's get on the channel, before it goes on"},
    {FaultPoint::StagedCopyIn, "staged.copy_in",
     "a staged transport agent enqueues the copies onto its GPU of the chunks that one look at its channels took "
     "(with faults armed, each descriptor's alone); `fail` makes those copies fail as if the driver refused them: their "
     "transfers are refused (no signal), the writer's next call says so",
     true},
    {FaultPoint::StagedEndsIn, "staged.ends_in",
     "a staged transport agent enqueues the stream writes that end the chunks it carried out from node peers "
     "(signals, done words, consumed counts); `fail` makes that enqueue fail as if the driver refused it: those "
     "transfers' waits end at MESHMEM_TIMEOUT or when their peer's process is seen to end, and this rank's next call "
     "says so",
     true},
    {FaultPoint::MpiCancel, "mpi.cancel",
     "the mpi transport gives a transfer up (its origin stalled or died, or its window is freed) and cancels its MPI "
     "requests; `fail` makes none of them end, as for a receive MPI has matched already: they are kept, with the memory "
     "they use, until MPI ends them",
     true},
};

constexpr int kMaxRank = 1 << 20;
constexpr long long kMaxMilliseconds = 3600 * 1000;  // an hour
constexpr long long kMaxHit = 1000000000;

std::size_t index_of(FaultPoint point) { return static_cast<std::size_t>(point); }

std::string point_names() {
  std::string names;
  for (const PointInfo& p : kPoints) names += (names.empty() ? "" : ", ") + std::string(p.name);
  return names;
}

[[noreturn]] void refuse(const char* var, const std::string& raw, const std::string& problem) {
  throw Error(ErrorCode::InvalidArgument,
              std::string(var) + "='" + raw + "' is not valid: " + problem +
                  "; expected comma-separated <rank>:<point>:<action>[:hit=<n>] with <action> kill, delay=<ms>, "
                  "stop=<ms> or fail (where the point can fail), and <point> one of: " +
                  point_names());
}

// A decimal number from `min` to `max`, nothing else (no sign, no unit).
bool parse_number(const std::string& text, long long min, long long max, long long* out) {
  if (text.empty() || text.size() > 12) return false;
  for (char c : text)
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  const long long n = std::stoll(text);
  if (n < min || n > max) return false;
  *out = n;
  return true;
}

std::vector<std::string> split(const std::string& s, char separator) {
  std::vector<std::string> parts;
  std::stringstream in(s);
  std::string part;
  while (std::getline(in, part, separator)) parts.push_back(part);
  if (!s.empty() && s.back() == separator) parts.emplace_back();  // getline drops a trailing empty field
  return parts;
}

FaultEntry parse_entry(const char* var, const std::string& raw, const std::string& entry) {
  const std::vector<std::string> fields = split(entry, ':');
  const std::string quoted = "entry '" + entry + "'";
  if (fields.size() < 3 || fields.size() > 4) refuse(var, raw, quoted + " does not have 3 or 4 fields");
  FaultEntry e;
  long long n = 0;
  if (!parse_number(fields[0], 0, kMaxRank, &n)) refuse(var, raw, quoted + ": '" + fields[0] + "' is not a rank");
  e.rank = static_cast<int>(n);
  const PointInfo* found = nullptr;
  for (const PointInfo& p : kPoints)
    if (fields[1] == p.name) found = &p;
  if (found == nullptr) refuse(var, raw, quoted + ": '" + fields[1] + "' is not a fault point");
  e.point = found->point;
  const std::string& action = fields[2];
  const auto eq = action.find('=');
  const std::string verb = action.substr(0, eq);
  const std::string value = eq == std::string::npos ? std::string() : action.substr(eq + 1);
  if (action == "kill") {
    e.action = FaultAction::Kill;
  } else if (action == "fail") {
    if (!found->can_fail) refuse(var, raw, quoted + ": '" + fields[1] + "' cannot fail (only delay, stop or kill)");
    e.action = FaultAction::Fail;
  } else if ((verb == "delay" || verb == "stop") && eq != std::string::npos) {
    e.action = verb == "delay" ? FaultAction::Delay : FaultAction::Stop;
    if (!parse_number(value, e.action == FaultAction::Stop ? 1 : 0, kMaxMilliseconds, &n))
      refuse(var, raw, quoted + ": '" + value + "' is not a number of milliseconds up to an hour");
    e.duration = std::chrono::milliseconds(n);
  } else {
    refuse(var, raw, quoted + ": '" + action + "' is not an action");
  }
  if (fields.size() == 4) {
    const std::string prefix = "hit=";
    if (fields[3].compare(0, prefix.size(), prefix) != 0 ||
        !parse_number(fields[3].substr(prefix.size()), 1, kMaxHit, &n))
      refuse(var, raw, quoted + ": '" + fields[3] + "' is not hit=<n> with n from 1");
    e.hit = static_cast<unsigned>(n);
  }
  return e;
}

std::string entry_text(const FaultEntry& e) {
  std::string s = std::to_string(e.rank) + ":" + to_string(e.point) + ":";
  switch (e.action) {
    case FaultAction::Kill: s += "kill"; break;
    case FaultAction::Delay: s += "delay=" + std::to_string(e.duration.count()); break;
    case FaultAction::Stop: s += "stop=" + std::to_string(e.duration.count()); break;
    case FaultAction::Fail: s += "fail"; break;
  }
  if (e.hit != 1) s += ":hit=" + std::to_string(e.hit);
  return s;
}

std::string knob_doc() {
  std::string doc =
      "Fault injection, to test dead and stalled peers. Comma-separated "
      "`<rank>:<point>:<action>[:hit=<n>]`: when a thread of that rank of the Comm reaches the point (the n-th "
      "time; default the first) it takes the action once: `kill` (the process dies at once, as in a crash), "
      "`delay=<ms>` (the thread sleeps, then goes on), `stop=<ms>` (the thread stops until the test resumes it, "
      "at most that long) or, where the point says so, `fail` (the call made there fails as if its library had "
      "returned an error). An unknown point, a rank outside the Comm or a malformed action fails the Comm's "
      "construction. Points:";
  for (std::size_t i = 0; i < kFaultPointCount; ++i)
    doc += std::string("\n- `") + kPoints[i].name + "` (" + kPoints[i].where + ")";
  return doc;
}

// Built before the knob that points at it (one translation unit: declaration order).
const std::string kFaultDoc = knob_doc();
const TuningKnob<std::vector<FaultEntry>> kFault{
    Tier::Testing, "testing", "MESHMEM_FAULT", {}, parse_faults, print_faults,
    "fault injection at named points of meshmem (a test): `<rank>:<point>:<action>[:hit=<n>]`, comma-separated",
    kFaultDoc.c_str(), /*must_agree=*/false};

// What this process did at each point, and the stops under way (process-wide: tests observe
// and resume them without reaching into a Comm).
struct ProcessFaults {
  std::array<std::atomic<std::uint64_t>, kFaultPointCount> taken{};
  std::array<std::atomic<std::uint64_t>, kFaultPointCount> over{};
  std::mutex mutex;
  std::condition_variable resumed;
  std::uint64_t resumes = 0;  // under mutex
};
ProcessFaults& process_faults() {
  static ProcessFaults state;
  return state;
}

}  // namespace

const char* to_string(FaultPoint point) noexcept {
  for (const PointInfo& p : kPoints)
    if (p.point == point) return p.name;
  return "?";
}

std::vector<FaultEntry> parse_faults(const char* var, const std::string& raw) {
  std::string text;
  for (char c : raw)
    if (c != ' ' && c != '\t') text += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::vector<FaultEntry> entries;
  if (text == "none") return entries;
  if (text.empty()) refuse(var, raw, "it is empty");
  for (const std::string& entry : split(text, ',')) {
    if (entry.empty()) refuse(var, raw, "an entry is empty");
    entries.push_back(parse_entry(var, raw, entry));
  }
  return entries;
}

std::string print_faults(const std::vector<FaultEntry>& entries) {
  if (entries.empty()) return "none";
  std::string s;
  for (const FaultEntry& e : entries) s += (s.empty() ? "" : ",") + entry_text(e);
  return s;
}

struct FaultPlan::Armed {
  int rank = 0;
  std::vector<FaultEntry> entries;  // this rank's
  std::array<std::atomic<unsigned>, kFaultPointCount> hits{};
};

FaultPlan::FaultPlan(const Options& options, int rank, int size) {
  const std::vector<FaultEntry> all = kFault.get(options);
  std::vector<FaultEntry> mine;
  for (const FaultEntry& e : all) {
    if (e.rank >= size)
      throw Error(ErrorCode::InvalidArgument,
                  std::string(kFault.name()) + "='" + print_faults(all) + "' is not valid for this Comm: entry '" +
                      entry_text(e) + "' names rank " + std::to_string(e.rank) + ", but the Comm has " +
                      std::to_string(size) + " rank(s)");
    if (e.rank == rank) mine.push_back(e);
  }
  if (mine.empty()) return;
  armed_ = std::make_shared<Armed>();
  armed_->rank = rank;
  armed_->entries = std::move(mine);
}

bool FaultPlan::take(FaultPoint point) const {
  const unsigned hit = armed_->hits[index_of(point)].fetch_add(1, std::memory_order_relaxed) + 1;
  bool fail = false;
  for (const FaultEntry& e : armed_->entries) {
    if (e.point != point || e.hit != hit) continue;
    const std::string what = "fault injected (MESHMEM_FAULT) at " + std::string(to_string(point)) + " on rank " +
                             std::to_string(armed_->rank) + " (hit " + std::to_string(hit) + ")";
    ProcessFaults& process = process_faults();
    switch (e.action) {
      case FaultAction::Kill:
        log(LogLevel::Error, what + ": the process dies now, as in a crash");
        ::kill(::getpid(), SIGKILL);
        std::_Exit(128 + SIGKILL);  // not reached: SIGKILL cannot be caught
      case FaultAction::Delay:
        log(LogLevel::Warn, what + ": this thread sleeps " + std::to_string(e.duration.count()) + " ms");
        process.taken[index_of(point)].fetch_add(1, std::memory_order_release);
        std::this_thread::sleep_for(e.duration);
        log(LogLevel::Warn, what + ": the thread goes on");
        process.over[index_of(point)].fetch_add(1, std::memory_order_release);
        break;
      case FaultAction::Stop: {
        std::unique_lock<std::mutex> lock(process.mutex);
        // Counted under the lock after reading the resume count: a test that sees the stop
        // counted and then resumes it is never missed.
        const std::uint64_t resumes = process.resumes;
        process.taken[index_of(point)].fetch_add(1, std::memory_order_release);
        log(LogLevel::Warn, what + ": this thread stops until resumed, at most " +
                                std::to_string(e.duration.count()) + " ms");
        const bool resumed =
            process.resumed.wait_for(lock, e.duration, [&] { return process.resumes != resumes; });
        log(LogLevel::Warn, what + (resumed ? ": resumed" : ": not resumed in time; the thread goes on"));
        process.over[index_of(point)].fetch_add(1, std::memory_order_release);
        break;
      }
      case FaultAction::Fail:
        log(LogLevel::Warn, what + ": the call made here fails");
        process.taken[index_of(point)].fetch_add(1, std::memory_order_release);
        process.over[index_of(point)].fetch_add(1, std::memory_order_release);
        fail = true;
        break;
    }
  }
  return fail;
}

std::uint64_t faults_taken(FaultPoint point) {
  return process_faults().taken[index_of(point)].load(std::memory_order_acquire);
}

std::uint64_t faults_over(FaultPoint point) {
  return process_faults().over[index_of(point)].load(std::memory_order_acquire);
}

void resume_stopped_faults() {
  ProcessFaults& process = process_faults();
  {
    std::lock_guard<std::mutex> lock(process.mutex);
    ++process.resumes;
  }
  process.resumed.notify_all();
}

}  // namespace meshmem::detail
