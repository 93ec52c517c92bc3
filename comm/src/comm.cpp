#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>

#include "backoff.hpp"
#include "comm_impl.hpp"
#include "gpu_part.hpp"
#include "helper_cpus.hpp"
#include "host_window.hpp"
#include "knob_notices.hpp"
#include "log.hpp"
#include "memory_limits.hpp"
#include "topology.hpp"
#include "meshmem/comm.hpp"

namespace meshmem {

const char* to_string(Memory memory) noexcept {
  return memory == Memory::Device ? "device" : "host";
}

Memory default_memory() { return gpu_available() ? Memory::Device : Memory::Host; }

bool gpu_available(std::string* why) {
  if (detail::gpu_available == nullptr) {
    if (why) *why = detail::kNoGpuPart;
    return false;
  }
  return detail::gpu_available(why);
}

int node_local_rank(MPI_Comm comm) {
  const char* what = "meshmem::node_local_rank";
  int rank = 0, size = 0;
  detail::check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank", what);
  detail::check_mpi(MPI_Comm_size(comm, &size), "MPI_Comm_size", what);
  const std::uint64_t mine = detail::node_id(detail::machine_key());
  std::vector<std::uint64_t> ids(static_cast<std::size_t>(size));
  detail::check_mpi(MPI_Allgather(&mine, 1, MPI_UINT64_T, ids.data(), 1, MPI_UINT64_T, comm), "MPI_Allgather", what);
  return detail::place_by_id(ids)[static_cast<std::size_t>(rank)].local_rank;
}

int select_local_device(MPI_Comm comm) {
  const int local = node_local_rank(comm);
  return detail::gpu_set_device_modulo != nullptr ? detail::gpu_set_device_modulo(local) : -1;
}

namespace detail {

namespace {

std::atomic<std::uint64_t> g_next_comm_uid{1};

const char* cmp_text(Cmp cmp) {
  switch (cmp) {
    case Cmp::EQ: return "==";
    case Cmp::NE: return "!=";
    case Cmp::GT: return ">";
    case Cmp::GE: return ">=";
    case Cmp::LT: return "<";
    case Cmp::LE: return "<=";
  }
  return "?";
}

// Enum values from the caller are checked: a cast integer (SignalOp(7)) would otherwise be
// applied as some other operation.
// `at()` names the call: built only for a message, as the checks run on every operation.
template <class At>
void check_enum(int value, int count, const char* type, const At& at) {
  if (value < 0 || value >= count)
    throw Error(ErrorCode::InvalidArgument, at() + ": " + type + "(" + std::to_string(value) +
                                                ") is not one of its " + std::to_string(count) + " values; nothing was done");
}
template <class At>
void check_op(SignalOp op, const At& at) { check_enum(static_cast<int>(op), 2, "SignalOp", at); }
template <class At>
void check_cmp(Cmp cmp, const At& at) { check_enum(static_cast<int>(cmp), 6, "Cmp", at); }
template <class At>
void check_memory(Memory memory, const At& at) { check_enum(static_cast<int>(memory), 2, "Memory", at); }

std::uint64_t fnv1a(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

int world_rank() {
  int r = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

// Set as MPI_Finalize begins (an attribute of MPI_COMM_SELF is deleted then), so that a call
// after it raises instead of reaching MPI (which aborts the process), at the cost of a load.
std::atomic<bool> g_finalize_begun{false};
std::atomic<bool> g_finalize_watched{false};

int note_finalize(MPI_Comm, int, void*, void*) {
  g_finalize_begun.store(true, std::memory_order_release);
  return MPI_SUCCESS;
}

void watch_finalize() {
  static std::once_flag once;
  std::call_once(once, [] {
    int key = MPI_KEYVAL_INVALID;
    if (MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, note_finalize, &key, nullptr) == MPI_SUCCESS &&
        MPI_Comm_set_attr(MPI_COMM_SELF, key, nullptr) == MPI_SUCCESS)
      g_finalize_watched.store(true, std::memory_order_release);
  });
}

void require_mpi() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!initialized || finalized)
    throw Error(ErrorCode::InvalidArgument,
                "meshmem::Comm: MPI must be initialised (and not finalised) before a Comm is made");
}

// MESHMEM_FAULT's entries for this rank of `comm` (ranks are the same in the Comm's own
// communicator, a duplicate).
FaultPlan fault_plan(MPI_Comm comm, const Options& options) {
  int rank = 0, size = 0;
  check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank", "meshmem::Comm");
  check_mpi(MPI_Comm_size(comm, &size), "MPI_Comm_size", "meshmem::Comm");
  return FaultPlan(options, rank, size);
}

// The first steps of every Comm: its own communicator, then a first meeting of its ranks, so
// that a rank missing from then on (late or dead) is named in the others' Timeout (the steps
// after it are collectives, which cannot tell who did not come). A rank that never comes to
// the communicator cannot be named: MPI_Comm_idup does not say who is missing, and the
// caller's communicator carries no messages of meshmem's.
CommImpl::Start start_comm(MPI_Comm comm, const Options& options, FaultPlan faults) {
  set_log_level(options.log_level);
  set_log_rank(world_rank());
  watch_finalize();
  faults.hit(FaultPoint::CommStart);
  Bootstrap boot(comm, options.timeout);
  faults.hit(FaultPoint::CommJoined);
  boot.arrive("meshmem::Comm");
  return CommImpl::Start{std::move(faults), std::move(boot)};
}

// Every rank must run with the same MESHMEM_* settings, or they would pick different
// transports for one pair of ranks.
void agree_on_options(Bootstrap& boot, const Options& options) {
  report_knob_notices(boot, options, "meshmem::Comm");  // first: a misspelt name may explain a difference
  const std::string mine = options.fingerprint();
  const std::uint64_t hash = fnv1a(mine);
  std::vector<std::uint64_t> all(static_cast<std::size_t>(boot.size()));
  boot.allgather(&hash, all.data(), sizeof(hash), "meshmem::Comm");
  int differs = -1;
  for (int r = 0; r < boot.size(); ++r)
    if (all[r] != all[0]) { differs = r; break; }
  if (differs < 0) return;
  std::string theirs[2];
  const int speakers[2] = {0, differs};
  for (int i = 0; i < 2; ++i) {
    std::uint64_t len = boot.rank() == speakers[i] ? mine.size() : 0;
    boot.broadcast(&len, sizeof(len), speakers[i], "meshmem::Comm");
    theirs[i].assign(len, '\0');
    if (boot.rank() == speakers[i]) theirs[i] = mine;
    boot.broadcast(theirs[i].data(), len, speakers[i], "meshmem::Comm");
  }
  throw Error(ErrorCode::InvalidArgument,
              "meshmem::Comm on rank " + std::to_string(boot.rank()) +
                  ": MESHMEM_* settings differ between ranks: rank 0 has {" + theirs[0] +
                  "}, rank " + std::to_string(differs) + " has {" + theirs[1] + "}");
}

}  // namespace

CommImpl::CommImpl(MPI_Comm comm, const Options& opts)
    : CommImpl((require_mpi(), start_comm(comm, opts, fault_plan(comm, opts))), opts) {}

// Comm(MPI_Comm) reads MESHMEM_* itself: a value that one rank cannot parse (a typo in that
// rank's environment, MESHMEM_FAULT naming a rank the Comm does not have) fails every rank
// with that rank's error, instead of leaving the others waiting in the constructor. The
// agreement runs on the Bootstrap the Comm then keeps.
std::unique_ptr<CommImpl> CommImpl::from_environment(MPI_Comm comm) {
  require_mpi();
  Options options;
  FaultPlan faults;
  bool ok = true;
  ErrorCode code = ErrorCode::InvalidArgument;
  std::string problem;
  try {
    options = Options::from_environment();
    faults = fault_plan(comm, options);
  } catch (const Error& e) {
    ok = false;
    code = e.code();
    problem = e.message();
  }
  Start start = start_comm(comm, ok ? options : Options{}, ok ? faults : FaultPlan{});
  start.boot.agree(ok, code, problem, "meshmem::Comm (reading MESHMEM_*)");
  return std::make_unique<CommImpl>(std::move(start), options);
}

CommImpl::CommImpl(Start start, const Options& opts)
    : options(opts),
      faults(std::move(start.faults)),
      boot(std::move(start.boot)),
      topo((agree_on_options(boot, opts), Topology::discover(boot, opts.simulate_nodes))),
      uid(g_next_comm_uid++) {
  fds = std::make_unique<FdExchange>(boot, topo, options.fd_passing, faults);
  settle_helpers();
  HelperCpusScope placing(helpers);  // threads started while the Comm is made go where it decided
  if (gpu_start_device_runtime != nullptr)
    device = gpu_start_device_runtime(context(), &device_why);
  else
    device_why = kNoGpuPart;
  try {
    select_transports();
    if (device) {
      std::vector<const Transport*> connected;
      for (const auto& t : transports) connected.push_back(t.get());
      const BarrierContext bctx{*routes, connected, [this](std::size_t bytes) {
                                  return alloc(bytes, Memory::Device, true, "meshmem::Comm (barrier setup)");
                                }};
      stream_barrier = device->make_barrier(context(), bctx);
    }
  } catch (...) {
    if (device) device->tearing_down();  // the members' teardown that follows is this Comm's own
    throw;
  }
  std::string names;
  for (const auto& t : transports) names += (names.empty() ? "" : ",") + std::string(to_string(t->kind()));
  log(LogLevel::Info, "Comm #" + std::to_string(uid) + ": rank " + std::to_string(topo.rank) + " of " +
                          std::to_string(topo.size) + ", node " + std::to_string(topo.node()) + " of " +
                          std::to_string(topo.node_count) + ", fd passing " + to_string(fds->mode()) +
                          ", transports in use: " + (names.empty() ? "none" : names) + ", device: " + device_info());
}

// The transports of the table that MESHMEM_TRANSPORTS allows are made (collectively: every
// rank makes the same ones), every (rank, memory kind) is routed to the first that reaches
// it, and the transports that some rank routes through are connected; the others are dropped.
void CommImpl::select_transports() {
  const char* what = "meshmem::Comm";
  std::vector<std::string> left_out;
  std::vector<std::unique_ptr<Transport>> made;
  for (const TransportEntry* e : order_entries(transport_table(), options.transports, &left_out)) {
    if (e->make == nullptr) {
      left_out.push_back(std::string(e->name) + ": " + e->missing);
      continue;
    }
    made.push_back(e->make(context()));
  }
  std::vector<Transport*> tried;
  for (const auto& t : made) tried.push_back(t.get());
  routes = std::make_unique<RouteTable>(tried, left_out, topo.size);
  if (device) {
    for (int r = 0; r < topo.size; ++r) {
      const Transport* t = routes->find(r, Memory::Device);
      if (r != topo.rank && t != nullptr && t->capabilities().own_streams) {
        device->note_own_stream_route("rank " + std::to_string(r) + " through " + std::string(to_string(t->kind())));
        break;
      }
    }
  }
  for (auto& t : made) {
    const std::vector<bool> routed = routes->ranks_through(t.get());
    const bool any = std::find(routed.begin(), routed.end(), true) != routed.end();
    if (boot.allreduce_max(any ? 1 : 0, what) == 0) continue;  // nobody uses it: dropped
    t->connect(routed);
    transports.push_back(std::move(t));
  }
}

// Where this Comm's busy threads run: every rank says which CPUs it is bound to where that is
// one core, and those CPUs of the node are left to their ranks.
void CommImpl::settle_helpers() {
  const char* what = "meshmem::Comm (helper threads' CPUs)";
  const std::vector<int> mine = cpus_of_this_thread();
  std::uint64_t bits[16] = {};  // CPUs 0-1023 of a rank bound to one core; none otherwise
  if (bound_to_one_core(mine))
    for (int c : mine) bits[c / 64] |= std::uint64_t{1} << (c % 64);
  std::vector<std::uint64_t> all(16 * static_cast<std::size_t>(topo.size));
  boot.allgather(bits, all.data(), sizeof bits, what);
  std::vector<int> taken;
  for (int r : topo.node_ranks)
    for (int c = 0; c < 1024; ++c)
      if (all[16 * static_cast<std::size_t>(r) + c / 64] >> (c % 64) & 1) taken.push_back(c);
  std::sort(taken.begin(), taken.end());
  helpers = settle_helper_cpus(options, taken);
}

std::string CommImpl::device_info() const {
  if (!device) return "none: " + device_why + (helpers.text.empty() ? "" : "; " + helpers.text);
  std::string info = device->describe() + ", barrier(stream) " + stream_barrier->describe();
  if (!helpers.text.empty()) info += ", " + helpers.text;
  for (const auto& t : transports) {
    const std::string more = t->describe();
    if (!more.empty()) info += "; " + std::string(to_string(t->kind())) + ": " + more;
  }
  return info;
}

std::string CommImpl::where(const char* call) const {
  return std::string(call) + " on rank " + std::to_string(topo.rank);
}

void CommImpl::require_mpi_alive(const char* call) const {
  bool begun = g_finalize_begun.load(std::memory_order_acquire);
  if (!begun && !g_finalize_watched.load(std::memory_order_acquire)) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    begun = finalized != 0;
  }
  if (begun)
    throw Error(ErrorCode::InvalidArgument,
                where(call) + ": called after MPI_Finalize (meshmem reaches the other ranks through MPI, which may "
                              "not be called any more); nothing was done");
}

void CommImpl::check_rank(int rank, const char* call, const char* what) const {
  if (rank < 0 || rank >= topo.size)
    throw Error(ErrorCode::InvalidArgument, where(call) + ": " + what + " rank " +
                                                std::to_string(rank) + " is out of range (the Comm has " +
                                                std::to_string(topo.size) + " ranks)");
}

const WindowState& CommImpl::checked(const Window& win, const char* call) const {
  const WindowState* s = win.state_.get();
  if (s == nullptr)
    throw Error(ErrorCode::InvalidArgument, where(call) + ": the window is empty (default-constructed or moved from)");
  if (s->freed())
    throw Error(ErrorCode::InvalidArgument,
                where(call) + ": window #" + std::to_string(s->id) + " was freed");
  if (s->owner != this)
    throw Error(ErrorCode::InvalidArgument,
                where(call) + ": window #" + std::to_string(s->id) + " belongs to Comm #" +
                    std::to_string(s->comm_uid) + ", not to this Comm #" + std::to_string(uid));
  return *s;
}

void CommImpl::check_range(const WindowState& win, int target, std::size_t offset, std::size_t bytes,
                           const char* call, const char* offset_name) const {
  if (offset > win.bytes || bytes > win.bytes - offset)
    throw Error(ErrorCode::InvalidArgument,
                where(call) + ": " + offset_name + " " + std::to_string(offset) + " + bytes " +
                    std::to_string(bytes) + " is past the end of window #" + std::to_string(win.id) +
                    " (" + std::to_string(win.bytes) + " bytes) of rank " + std::to_string(target));
}

void CommImpl::check_stream(const WindowState& win, Stream stream, const char* call) const {
  if (stream != nullptr && win.memory == Memory::Host)
    throw Error(ErrorCode::Unsupported,
                where(call) + ": stream-ordered operations on host windows are not implemented "
                              "yet; pass a null stream (the call then runs on the host)");
}

void CommImpl::check_index(const WindowState& sig, std::size_t index, const char* call) const {
  if (!sig.is_signals)
    throw Error(ErrorCode::Internal, where(call) + ": window #" + std::to_string(sig.id) + " is not a signals window");
  const std::size_t count = sig.bytes / sizeof(std::uint64_t);
  if (index >= count)
    throw Error(ErrorCode::InvalidArgument,
                where(call) + ": signal index " + std::to_string(index) + " is out of range (" +
                    std::to_string(count) + " signals)");
}

Transport& CommImpl::route(const WindowState& win, int target, const char* call) const {
  Transport* t = routes->find(target, win.memory);
  if (t == nullptr)
    throw Error(ErrorCode::Unsupported, where(call) + ": no transport reaches " + to_string(win.memory) + " window #" +
                                            std::to_string(win.id) + " of rank " + std::to_string(target) + " (" +
                                            routes->why_none(target, win.memory) + ")");
  return *t;
}

TransportKind CommImpl::transport(int rank, Memory memory, const char* call) const {
  check_rank(rank, call, "peer");
  check_memory(memory, [&] { return where(call); });
  if (memory == Memory::Device && !device) return TransportKind::None;
  const Transport* t = routes->find(rank, memory);
  return t ? t->kind() : TransportKind::None;
}

std::string CommImpl::unreachable_reason(int rank, Memory memory, const char* call) const {
  check_rank(rank, call, "peer");
  check_memory(memory, [&] { return where(call); });
  if (memory == Memory::Device && !device) return "device windows are unavailable: " + device_why;
  return routes->find(rank, memory) ? std::string() : routes->why_none(rank, memory);
}

std::string CommImpl::skipped_reason(int rank, Memory memory, const char* call) const {
  check_rank(rank, call, "peer");
  check_memory(memory, [&] { return where(call); });
  if (memory == Memory::Device && !device) return "device windows are unavailable: " + device_why;
  return routes->why_not_earlier(rank, memory);
}

std::shared_ptr<WindowState> CommImpl::alloc(std::size_t bytes, Memory memory, bool signals,
                                             const std::string& call) {
  const std::string at = where(call.c_str());
  boot.arrive(call);
  // Every rank checks the same gathered values, so all raise the same error together.
  struct Ask {
    std::uint64_t bytes;
    std::uint64_t id;
    std::int32_t memory;
    std::int32_t signals;
  } mine{bytes, next_window_id_, static_cast<std::int32_t>(memory), signals ? 1 : 0};
  std::vector<Ask> all(static_cast<std::size_t>(topo.size));
  boot.allgather(&mine, all.data(), sizeof(Ask), call);
  for (int r = 1; r < topo.size; ++r) {
    const Ask& a = all[r];
    const Ask& z = all[0];
    if (a.bytes != z.bytes || a.memory != z.memory)
      throw Error(ErrorCode::InvalidArgument,
                  at + ": ranks asked for different windows: rank 0 " + std::to_string(z.bytes) +
                      (signals ? " signal bytes" : " bytes") + " of " +
                      to_string(static_cast<Memory>(z.memory)) + " memory, rank " +
                      std::to_string(r) + " " + std::to_string(a.bytes) + " bytes of " +
                      to_string(static_cast<Memory>(a.memory)) + " memory");
    if (a.id != z.id || a.signals != z.signals)
      throw Error(ErrorCode::InvalidArgument,
                  at + ": collective calls out of order: rank 0 makes window #" +
                      std::to_string(z.id) + ", rank " + std::to_string(r) + " window #" +
                      std::to_string(a.id) + " (every rank must alloc and free in the same order)");
  }
  check_memory(memory, [&] { return at; });  // the same value on every rank (compared above): refused everywhere
  if (memory == Memory::Device && !device)
    throw Error(ErrorCode::Unsupported, at + ": Memory::Device windows are unavailable: " + device_why);
  if (memory == Memory::Host) {
    // Refused on every rank before any rank allocates, where the window would not fit under a
    // rank's memory limits: past them the kernel kills a process instead of failing the
    // allocation. This rank's address space also holds the node peers' parts that shm maps.
    int mapped = 0;
    for (const auto& t : transports) {
      if (t->kind() != TransportKind::Shm) continue;
      const std::vector<bool> routed = routes->ranks_through(t.get(), Memory::Host);
      for (int r = 0; r < topo.size; ++r) mapped += (r != topo.rank && routed[r]) ? 1 : 0;
    }
    check_host_window_fits(boot, bytes, mapped, at, call);
  }

  auto state = std::make_shared<WindowState>();
  state->owner = this;
  state->comm_uid = uid;
  state->id = next_window_id_++;
  state->bytes = bytes;
  state->memory = memory;
  state->is_signals = signals;
  std::optional<DeviceScope> scope;
  if (memory == Memory::Device) {
    device->make_room(bytes, call.c_str());
    agreed_step(boot, call, [&] { scope.emplace(*device, nullptr, false, call.c_str()); });
    agreed_step(boot, call, [&] { device->create_local(*state, call); });
  }
  else
    create_host_part(*state, boot, call);
  // Each transport that serves this memory kind attaches the window, collectively and
  // agreed, so that a failure anywhere fails the call everywhere. No peer can use the
  // window before every rank passed the last agreement (the mpi transport's progress
  // thread knows the window by then).
  try {
    for (const auto& t : transports) {
      if (!t->serves(memory)) continue;
      const std::vector<bool> routed = routes->ranks_through(t.get(), memory);
      agreed_step(boot, call, [&] {
        if (auto a = t->attach(*state, routed, call)) state->attachments.push_back(std::move(a));
      });
    }
    if (memory == Memory::Device) agreed_step(boot, call, [&] { device->publish(*state, call); });
  } catch (...) {
    state->release_memory();
    throw;
  }
  live_[state->id] = state;
  return state;
}

const WindowState& CommImpl::checked_transfer(const Window& win, int target, std::size_t offset, std::size_t bytes,
                                              const void* local, Stream stream, const char* call, const char* offset_name,
                                              const char* local_name) const {
  const WindowState& w = checked(win, call);
  check_rank(target, call, "target");
  check_range(w, target, offset, bytes, call, offset_name);
  if (bytes > 0 && local == nullptr)
    throw Error(ErrorCode::InvalidArgument, where(call) + ": " + local_name + " is null for a transfer of " +
                                                std::to_string(bytes) + " bytes");
  check_stream(w, stream, call);
  return w;
}

void CommImpl::put(const Window& win, int target, std::size_t offset, const void* src,
                   std::size_t bytes, const Signals* sig, std::size_t index, std::uint64_t value,
                   SignalOp op, Stream stream, const char* call) {
  const WindowState& w = checked_transfer(win, target, offset, bytes, src, stream, call, "dst_offset", "src");
  SignalUpdate update;
  if (sig != nullptr) {
    check_op(op, [&] { return where(call); });
    const WindowState& s = checked(sig->words(), call);
    check_index(s, index, call);
    check_stream(s, stream, call);
    if (s.memory != w.memory)
      throw Error(ErrorCode::Unsupported, where(call) + ": the data window and the signals differ in memory kind");
    update = SignalUpdate{&s, index, value, op};
  }
  if (w.memory == Memory::Device) {
    DeviceScope scope(*device, stream, false, call);
    route(w, target, call).put(w, target, offset, src, bytes, update, stream);
    return;
  }
  route(w, target, call).put(w, target, offset, src, bytes, update, stream);
}

void CommImpl::get(void* dst, const Window& win, int target, std::size_t offset, std::size_t bytes,
                   Stream stream) {
  const char* call = "comm.get";
  const WindowState& w = checked_transfer(win, target, offset, bytes, dst, stream, call, "src_offset", "dst");
  if (w.memory == Memory::Device) {
    DeviceScope scope(*device, stream, false, call);
    route(w, target, call).get(dst, w, target, offset, bytes, stream);
    return;
  }
  route(w, target, call).get(dst, w, target, offset, bytes, stream);
}

void CommImpl::signal(const Signals& sig, int target, std::size_t index, std::uint64_t value,
                      SignalOp op, Stream stream) {
  const char* call = "comm.signal";
  check_op(op, [&] { return where(call); });
  const WindowState& s = checked(sig.words(), call);
  check_rank(target, call, "target");
  check_index(s, index, call);
  check_stream(s, stream, call);
  std::optional<DeviceScope> scope;
  if (s.memory == Memory::Device) scope.emplace(*device, stream, false, call);
  route(s, target, call).put(s, target, 0, nullptr, 0, SignalUpdate{&s, index, value, op}, stream);
}

void CommImpl::wait_until(const Signals& sig, std::size_t index, std::size_t count, Cmp cmp, std::uint64_t value,
                          Stream stream, const char* call, std::optional<std::uint64_t> then) {
  check_cmp(cmp, [&] { return where(call); });
  const WindowState& s = checked(sig.words(), call);
  if (count == 0) return;
  check_index(s, index, call);
  check_index(s, index + count - 1, call);
  check_stream(s, stream, call);
  if (s.memory == Memory::Device) {
    DeviceScope scope(*device, stream, false, call);
    if (stream == nullptr) {
      wait_device_words(s, index, count, cmp, value, call);
      if (then) device->write_words(s, index, count, *then, call);
      return;
    }
    device->wait_until(s, index, count, cmp, value, then, stream, call);
    return;
  }
  auto* words = static_cast<std::uint64_t*>(s.local) + index;
  auto first_pending = [&] {
    for (std::size_t i = 0; i < count; ++i)
      if (!compare(__atomic_load_n(words + i, __ATOMIC_ACQUIRE), cmp, value)) return i;
    return count;
  };
  wait_host([&] { return first_pending() == count; },
            [&] {
              const std::size_t i = first_pending();
              return where(call) + ": signal " + std::to_string(index + i) + " is " +
                     std::to_string(__atomic_load_n(words + i, __ATOMIC_ACQUIRE)) + ", still not " + cmp_text(cmp) + " " +
                     std::to_string(value) + " after " + describe_timeout(options.timeout);
            });
  if (then)
    for (std::size_t i = 0; i < count; ++i) __atomic_store_n(words + i, *then, __ATOMIC_RELEASE);
}

// The host waits for device signal words: reads them from the GPU with backoff.
void CommImpl::wait_device_words(const WindowState& s, std::size_t index, std::size_t count, Cmp cmp,
                                 std::uint64_t value, const char* call) {
  std::size_t pending = 0;
  std::uint64_t seen = 0;
  auto done = [&] {
    for (; pending < count; ++pending) {
      seen = device->read_word(s, index + pending);
      if (!compare(seen, cmp, value)) return false;
    }
    return true;
  };
  wait_host(done, [&] {
    return where(call) + ": signal " + std::to_string(index + pending) + " is " + std::to_string(seen) + ", still not " +
           cmp_text(cmp) + " " + std::to_string(value) + " after " + describe_timeout(options.timeout);
  });
}

std::uint64_t CommImpl::read_signal(const WindowState& s, std::size_t index) {
  if (s.memory != Memory::Device) return __atomic_load_n(static_cast<const std::uint64_t*>(s.local) + index, __ATOMIC_ACQUIRE);
  DeviceScope scope(*device, nullptr, false, "Signals::read");
  return device->read_word(s, index);
}

void CommImpl::quiet(Stream stream, const char* call, bool on_host) {
  if (stream != nullptr && !device)
    throw Error(ErrorCode::Unsupported, where(call) + ": a stream was given but device windows are unavailable: " + device_why);
  std::optional<DeviceScope> scope;
  if (stream != nullptr) scope.emplace(*device, stream, false, call);
  // Every transport's quiet runs (the mpi flush, the shm fence) even where another raises a
  // transfer known to have failed; the first error is raised after them.
  std::exception_ptr first;
  for (const auto& t : transports) {
    // On the host first (it leaves nothing for the stream to wait for), and whatever quiet
    // raises: Window::free frees on after an error, its puts must have landed.
    if (on_host) {
      try {
        t->complete_on_host(call);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    try {
      t->quiet(stream);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

void CommImpl::barrier(Stream stream) {
  const char* call = "comm.barrier";
  if (!device) {
    if (stream != nullptr)
      throw Error(ErrorCode::Unsupported, where(call) + ": a stream was given but device windows are unavailable: " + device_why);
    barrier_host();
    return;
  }
  // The stream's staged puts with source completion land before it arrives.
  quiet(stream, call);
  DeviceScope scope(*device, stream, true, call);
  stream_barrier->arrive(stream, scope.capturing());
}

void CommImpl::barrier_host() {
  quiet(nullptr, "comm.barrier", true);
  boot.arrive("comm.barrier");
}

}  // namespace detail

}  // namespace meshmem
