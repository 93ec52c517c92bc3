// The public value handles (Window, Signals, Comm): argument checks of their own, then the
// Comm's implementation. A call that may reach MPI is refused once MPI_Finalize has begun.
#include <cstdint>
#include <exception>
#include <string>

#include "comm_impl.hpp"
#include "log.hpp"
#include "meshmem/comm.hpp"

namespace meshmem {

// Frees a live window from a destructor or move-assignment, where nothing may throw.
void Window::release_noexcept() noexcept {
  if (!state_ || state_->freed()) return;
  state_->owner->free_in_destructor(*state_, "Window destructor");
}

Window& Window::operator=(Window&& other) noexcept {
  if (this != &other) {
    release_noexcept();
    state_ = std::move(other.state_);
  }
  return *this;
}

Window::~Window() { release_noexcept(); }

void Window::free() {
  if (!state_) throw Error(ErrorCode::InvalidArgument, "Window::free: the window is empty");
  if (state_->freed())
    throw Error(ErrorCode::InvalidArgument, "Window::free: window #" + std::to_string(state_->id) + " was freed already");
  detail::CommImpl& owner = *state_->owner;
  try {
    owner.free_window(*state_);
  } catch (const Error& e) {
    owner.note_error(e);
    throw;
  }
}

bool Window::valid() const noexcept { return state_ && !state_->freed(); }

namespace {
const detail::WindowState& live_state(const std::shared_ptr<detail::WindowState>& s, const char* call) {
  if (!s) throw Error(ErrorCode::InvalidArgument, std::string(call) + ": the window is empty");
  if (s->freed())
    throw Error(ErrorCode::InvalidArgument, std::string(call) + ": window #" + std::to_string(s->id) + " was freed");
  return *s;
}
}  // namespace

std::size_t Window::size() const { return live_state(state_, "Window::size").bytes; }
Memory Window::memory() const { return live_state(state_, "Window::memory").memory; }
void* Window::local() const { return live_state(state_, "Window::local").local; }
void* Window::peer(int rank) const {
  const auto& s = live_state(state_, "Window::peer");
  if (rank < 0 || static_cast<std::size_t>(rank) >= s.peer.size())
    throw Error(ErrorCode::InvalidArgument, "Window::peer: rank " + std::to_string(rank) +
                                                " is out of range (the Comm has " +
                                                std::to_string(s.peer.size()) + " ranks)");
  return s.peer[rank];
}

device::WindowView Window::view() const {
  const auto& s = live_state(state_, "Window::view");
  if (s.memory != Memory::Device)
    throw Error(ErrorCode::InvalidArgument, "Window::view: window #" + std::to_string(s.id) + " is a host window; views are for device windows");
  return device::WindowView{static_cast<void* const*>(s.device_peer_table), s.bytes,
                            s.owner->topo.rank, s.owner->topo.size};
}

device::SignalsView Signals::view() const {
  const auto v = words_.view();
  return device::SignalsView{reinterpret_cast<std::uint64_t* const*>(v.peers), v.bytes / sizeof(std::uint64_t), v.rank, v.size};
}

std::size_t Signals::count() const { return words_.size() / sizeof(std::uint64_t); }

std::uint64_t Signals::read(std::size_t index) const {
  if (index >= count())
    throw Error(ErrorCode::InvalidArgument, "Signals::read: index " + std::to_string(index) +
                                                " is out of range (" + std::to_string(count()) + " signals)");
  const auto& s = *words_.state_;
  return s.owner->read_signal(s, index);
}

Comm::Comm(MPI_Comm comm) : impl_(detail::CommImpl::from_environment(comm)) {}
Comm::Comm(MPI_Comm comm, const Options& options)
    : impl_(std::make_unique<detail::CommImpl>(comm, options)) {}
Comm::~Comm() = default;
Comm::Comm(Comm&&) noexcept = default;
Comm& Comm::operator=(Comm&&) noexcept = default;

namespace {
detail::CommImpl& live(const std::unique_ptr<detail::CommImpl>& impl) {
  if (!impl) throw Error(ErrorCode::InvalidArgument, "meshmem::Comm: used after being moved from");
  return *impl;
}

// A call that may reach MPI: refused once MPI_Finalize has begun (MPI would abort the process),
// and its error noted as this rank's last (the cause that teardown while it unwinds names first).
template <class F>
auto reaching(const std::unique_ptr<detail::CommImpl>& impl, const char* call, F&& f) -> decltype(f(*impl)) {
  detail::CommImpl& c = live(impl);
  c.require_mpi_alive(call);
  try {
    struct Succeeded {  // a call that returns leaves no cause behind (void calls included)
      detail::CommImpl& c;
      ~Succeeded() {
        if (std::uncaught_exceptions() == 0) c.forget_error();
      }
    } succeeded{c};
    return f(c);
  } catch (const Error& e) {
    c.note_error(e);
    throw;
  }
}
}  // namespace

int Comm::rank() const { return live(impl_).topo.rank; }
int Comm::size() const { return live(impl_).topo.size; }
int Comm::node() const { return live(impl_).topo.node(); }
int Comm::node_of(int rank) const {
  live(impl_).check_rank(rank, "comm.node_of", "peer");
  return impl_->topo.node_of[rank];
}
int Comm::node_count() const { return live(impl_).topo.node_count; }
MPI_Comm Comm::mpi_comm() const { return live(impl_).boot.comm(); }
const Options& Comm::options() const { return live(impl_).options; }
FdPassing Comm::fd_passing() const { return live(impl_).fds->mode(); }
std::string Comm::device_info() const { return live(impl_).device_info(); }

Window Comm::alloc(std::size_t bytes, Memory memory) {
  return Window(reaching(impl_, "comm.alloc", [&](detail::CommImpl& c) { return c.alloc(bytes, memory, false, "comm.alloc"); }));
}

Signals Comm::alloc_signals(std::size_t count, Memory memory) {
  if (count > SIZE_MAX / sizeof(std::uint64_t))
    throw Error(ErrorCode::InvalidArgument, "comm.alloc_signals: count " + std::to_string(count) + " is too large");
  return Signals(Window(reaching(impl_, "comm.alloc_signals", [&](detail::CommImpl& c) {
    return c.alloc(count * sizeof(std::uint64_t), memory, true, "comm.alloc_signals");
  })));
}

void Comm::put(const Window& win, int target, std::size_t dst_offset, const void* src,
               std::size_t bytes, Stream stream) {
  reaching(impl_, "comm.put", [&](detail::CommImpl& c) {
    c.put(win, target, dst_offset, src, bytes, nullptr, 0, 0, SignalOp::Set, stream, "comm.put");
  });
}

void Comm::get(void* dst, const Window& win, int target, std::size_t src_offset, std::size_t bytes,
               Stream stream) {
  reaching(impl_, "comm.get", [&](detail::CommImpl& c) { c.get(dst, win, target, src_offset, bytes, stream); });
}

void Comm::put_signal(const Window& win, int target, std::size_t dst_offset, const void* src,
                      std::size_t bytes, const Signals& sig, std::size_t index, std::uint64_t value,
                      SignalOp op, Stream stream) {
  reaching(impl_, "comm.put_signal", [&](detail::CommImpl& c) {
    c.put(win, target, dst_offset, src, bytes, &sig, index, value, op, stream, "comm.put_signal");
  });
}

void Comm::signal(const Signals& sig, int target, std::size_t index, std::uint64_t value, SignalOp op,
                  Stream stream) {
  reaching(impl_, "comm.signal", [&](detail::CommImpl& c) { c.signal(sig, target, index, value, op, stream); });
}

void Comm::wait_until(const Signals& sig, std::size_t index, Cmp cmp, std::uint64_t value, Stream stream) {
  reaching(impl_, "comm.wait_until",
           [&](detail::CommImpl& c) { c.wait_until(sig, index, 1, cmp, value, stream, "comm.wait_until"); });
}

void Comm::wait_until_all(const Signals& sig, std::size_t first, std::size_t count, Cmp cmp, std::uint64_t value,
                          Stream stream) {
  reaching(impl_, "comm.wait_until_all",
           [&](detail::CommImpl& c) { c.wait_until(sig, first, count, cmp, value, stream, "comm.wait_until_all"); });
}

void Comm::wait_until_all_then_set(const Signals& sig, std::size_t first, std::size_t count, Cmp cmp,
                                   std::uint64_t value, std::uint64_t then, Stream stream) {
  reaching(impl_, "comm.wait_until_all_then_set", [&](detail::CommImpl& c) {
    c.wait_until(sig, first, count, cmp, value, stream, "comm.wait_until_all_then_set", then);
  });
}

void Comm::quiet(Stream stream) {
  reaching(impl_, "comm.quiet", [&](detail::CommImpl& c) { c.quiet(stream, "comm.quiet"); });
}
void Comm::barrier(Stream stream) {
  reaching(impl_, "comm.barrier", [&](detail::CommImpl& c) { c.barrier(stream); });
}
void Comm::barrier() {
  reaching(impl_, "comm.barrier", [&](detail::CommImpl& c) { c.barrier_host(); });
}

TransportKind Comm::transport(int rank, Memory memory) const {
  return live(impl_).transport(rank, memory, "comm.transport");
}

std::string Comm::unreachable_reason(int rank, Memory memory) const {
  return live(impl_).unreachable_reason(rank, memory, "comm.unreachable_reason");
}

std::string Comm::skipped_reason(int rank, Memory memory) const {
  return live(impl_).skipped_reason(rank, memory, "comm.skipped_reason");
}

}  // namespace meshmem
