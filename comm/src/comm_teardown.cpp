// Teardown: a window's collective free, ~Comm, and what they do once the ranks can no longer
// meet (a peer dead or late, ranks in different calls). A teardown with dead peers takes one
// timeout in all: a meeting after a step that failed gets what is left of that timeout. Once
// the ranks are apart, each destructor releases this rank's part without them, and the first
// one says so in one line (led by the error this rank is unwinding from, if it is).
#include <algorithm>
#include <exception>
#include <optional>

#include "comm_impl.hpp"
#include "log.hpp"

namespace meshmem::detail {

namespace {

bool mpi_finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

// The least a meeting after a failed step waits: rank 0 must still take the arrivals that are
// already there.
std::chrono::milliseconds meeting_budget(const Deadline& whole, std::chrono::milliseconds timeout) {
  const auto least = std::min(timeout, std::max(std::chrono::milliseconds(100), timeout / 10));
  return std::max(whole.remaining(), least);
}

}  // namespace

bool CommImpl::ranks_meet() const { return boot.usable() && !boot.apart() && !teardown_apart_; }

std::string CommImpl::apart_reason() const {
  if (!boot.usable()) return "a wait timed out: " + boot.broken_because();
  return "the ranks were found in different calls";
}

void CommImpl::note_error(const Error& e) { last_error_ = e.what(); }

void CommImpl::tell_teardown_once(const std::string& line) {
  if (teardown_told_) return;
  teardown_told_ = true;
  log(LogLevel::Error, line);
}

// Where this rank unwinds from an error of its own last call, that error is the cause the user
// must see first: the first destructor says it before it tries to meet the others (whose
// errors, where this rank's leaving puts them out of step, come after it).
void CommImpl::tell_cause_if_unwinding() {
  if (teardown_told_ || std::uncaught_exceptions() == 0 || last_error_.empty()) return;
  tell_teardown_once("rank " + std::to_string(topo.rank) + " leaves its Comm on an error: " + last_error_);
}

void CommImpl::release(WindowState& state) {
  state.release_memory();
  state.owner = nullptr;
}

void CommImpl::retire(WindowState& state, const char* call) {
  if (state.memory != Memory::Device || !device || !state.storage) {
    release(state);
    return;
  }
  state.owner = nullptr;  // freed, whatever retire() says
  DeviceScope scope(*device, nullptr, false, call);
  device->retire(state, call);
}

// This rank's part, released without the other ranks: peers that mapped it hold their own
// references.
void CommImpl::release_here(WindowState& state, const char* call) {
  live_.erase(state.id);
  try {
    retire(state, call);
  } catch (const std::exception& e) {
    log(LogLevel::Error, e.what());
  }
}

void CommImpl::free_in_destructor(WindowState& state, const char* who) noexcept {
  try {
    tell_cause_if_unwinding();
    if (!mpi_finalized() && !ranks_meet()) {
      release_here(state, "Window::free");
      tell_teardown_once(std::string(who) + " on rank " + std::to_string(topo.rank) +
                         ": the ranks of this Comm no longer meet (" + apart_reason() +
                         "), so its windows and the Comm are released on this rank without them");
      return;
    }
    free_window(state, true);
  } catch (const std::exception& e) {
    if (state.owner != nullptr) {
      // Not freed with the others: the ranks are apart, and later destructors and ~Comm do not
      // try to meet them again.
      teardown_apart_ = true;
      release_here(state, "Window::free");
    }
    tell_teardown_once(std::string(who) + ": " + e.what());
  }
}

void CommImpl::free_window(WindowState& state, bool in_destructor) {
  const char* call = "Window::free";
  if (mpi_finalized()) {
    // The natural end of main(): windows, signals and halo exchanges declared there are
    // destroyed after MPI_Finalize. No collective is possible any more (MPI aborted the
    // process here until issue 13): this rank's part is released, as ~Comm does then.
    release_here(state, call);
    return;
  }
  if (!ranks_meet()) {
    release_here(state, call);
    throw Error(boot.usable() ? ErrorCode::InvalidArgument : ErrorCode::Timeout,
                where(call) + ": window #" + std::to_string(state.id) +
                    " was released on this rank only: the ranks of this Comm no longer meet (" + apart_reason() + ")");
  }
  // A quiet that fails (a transfer with a peer timed out, now or before) still lets this rank
  // free the window with the others, who would otherwise wait a whole timeout in the meeting
  // and lose their Comm; this rank raises the quiet's error once the window is freed.
  const Deadline whole(options.timeout);
  std::optional<Error> unconfirmed;
  try {
    quiet(nullptr, call, true);
  } catch (const Error& e) {
    unconfirmed = e;
  }
  std::uint64_t mine = state.id;
  std::vector<std::uint64_t> all(static_cast<std::size_t>(topo.size));
  try {
    boot.arrive(call, unconfirmed ? meeting_budget(whole, options.timeout) : options.timeout);
    boot.allgather(&mine, all.data(), sizeof(mine), call);
  } catch (const Error& e) {
    // The ranks can no longer meet (a timeout broke the Comm: a dead or late peer). Release
    // this rank's part anyway, as ~Comm does, so that the window is freed and its destructor
    // does not time out again.
    if (!boot.usable()) release_here(state, call);
    if (!unconfirmed) throw;
    if (in_destructor) throw Error(e.code(), std::string(e.message()) + "; before the meeting: " + unconfirmed->message());
    log(LogLevel::Error, where(call) + ": before the meeting: " + unconfirmed->what());
    throw;
  }
  for (int r = 0; r < topo.size; ++r)
    if (all[r] != mine)
      throw Error(ErrorCode::InvalidArgument,
                  where(call) + ": ranks free different windows: this rank frees #" +
                      std::to_string(mine) + ", rank " + std::to_string(r) + " frees #" +
                      std::to_string(all[r]));
  live_.erase(state.id);
  try {
    retire(state, call);
  } catch (const Error& e) {
    if (!unconfirmed) throw;
    throw Error(e.code(), std::string(e.message()) + "; before the meeting: " + unconfirmed->message());
  }
  if (unconfirmed)
    throw Error(unconfirmed->code(), where(call) + ": window #" + std::to_string(mine) +
                                         " was freed on every rank, but this rank's transfers before it are not "
                                         "all confirmed: " + unconfirmed->message());
}

CommImpl::~CommImpl() {
  try {
    tell_cause_if_unwinding();
    if (mpi_finalized()) {
      log(LogLevel::Warn, "meshmem::Comm destroyed after MPI_Finalize: its windows are released "
                          "here without synchronising with the other ranks");
    } else if (!ranks_meet()) {
      tell_teardown_once("~Comm on rank " + std::to_string(topo.rank) + ": the ranks of this Comm no longer meet (" +
                         apart_reason() + "), so it is released on this rank without them");
    } else {
      // A quiet that fails (a peer failed earlier) does not keep this rank from the meeting:
      // the other ranks would wait a whole timeout for it; the meeting then gets what is left
      // of that timeout.
      const Deadline whole(options.timeout);
      bool quiet_failed = false;
      try {
        quiet(nullptr, "~Comm", true);
      } catch (const std::exception& e) {
        quiet_failed = true;
        log(LogLevel::Error, std::string("~Comm: ") + e.what() + "; meeting the other ranks anyway");
      }
      // Staged transfers to hidden peers end only when those peers' agents carried them out:
      // every rank's own end first, then the meeting, then the agents stop.
      for (auto& t : transports) t->settle();
      boot.arrive("~Comm", quiet_failed ? meeting_budget(whole, options.timeout) : options.timeout);
    }
  } catch (const std::exception& e) {
    tell_teardown_once(std::string("~Comm: ") + e.what() + "; releasing local resources anyway");
  }
  // Device windows (the barrier's flags among them) are released together, once the GPU's
  // earlier work is done, with one bounded wait; then the objects that own them go.
  std::vector<std::shared_ptr<WindowState>> alive;
  std::vector<WindowState*> on_device;
  for (auto& [id, weak] : live_)
    if (auto state = weak.lock()) {
      alive.push_back(state);
      if (state->memory == Memory::Device && device) on_device.push_back(state.get());
    }
  if (device) {  // also with no window left: earlier frees' releases end before the transports stop
    device->retire_all(on_device, "~Comm");  // noexcept; makes its device current itself
  }
  for (auto& state : alive) release(*state);
  live_.clear();
  if (device) device->tearing_down();
  stream_barrier.reset();
  for (auto& t : transports) t->stop();
  transports.clear();
  device.reset();
}

}  // namespace meshmem::detail
