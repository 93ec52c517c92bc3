// meshmem::Comm: one-sided put / get / signal / barrier over symmetric windows.
//
// A Comm is built collectively from an MPI communicator (which it duplicates). Every
// collective call (the constructor, alloc, alloc_signals, Window::free, barrier, the
// destructor) must be made by all ranks of the Comm in the same order. A Comm is used
// from one thread at a time.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "meshmem/config.hpp"
#include "meshmem/device/views.hpp"
#include "meshmem/error.hpp"
#include "meshmem/types.hpp"

namespace meshmem {

const char* to_string(Memory memory) noexcept;
class HaloExchange;
struct HaloRegion;

namespace detail {
class CommImpl;
struct WindowState;
}  // namespace detail

// A symmetric window: `bytes` on every rank of a Comm. Move-only; its destructor frees it
// collectively (as Window::free does), so every rank must let go of it at the same point.
class Window {
 public:
  Window() = default;
  Window(Window&&) noexcept = default;
  Window& operator=(Window&& other) noexcept;
  Window(const Window&) = delete;
  Window& operator=(const Window&) = delete;
  ~Window();

  // Collective. The handle is empty afterwards; using it raises Error(InvalidArgument).
  void free();

  bool valid() const noexcept;
  std::size_t size() const;    // bytes, as asked for in alloc
  Memory memory() const;
  void* local() const;         // this rank's part
  void* peer(int rank) const;  // rank's part mapped here, or nullptr if not mapped
  device::WindowView view() const;  // for kernels (device windows)

 private:
  friend class Comm;
  friend class Signals;
  friend class detail::CommImpl;
  explicit Window(std::shared_ptr<detail::WindowState> state) : state_(std::move(state)) {}
  void release_noexcept() noexcept;
  std::shared_ptr<detail::WindowState> state_;
};

// `count` symmetric 64-bit signal words, zero at allocation. Move-only, collective free.
class Signals {
 public:
  Signals() = default;
  std::size_t count() const;
  bool valid() const noexcept { return words_.valid(); }
  void free() { words_.free(); }
  // This rank's words: host memory for Memory::Host signals (atomics recommended), GPU
  // memory for Memory::Device ones (kernels only; the host uses read()).
  std::uint64_t* local() const { return static_cast<std::uint64_t*>(words_.local()); }
  // This rank's word `index` as it is now, with acquire ordering. Device signals: one
  // 8-byte copy from the GPU on a stream of meshmem's own; it does not wait for other
  // streams' work (synchronise them first to read what they wrote).
  std::uint64_t read(std::size_t index) const;
  const Window& words() const { return words_; }
  device::SignalsView view() const;  // for kernels (device signals)

 private:
  friend class Comm;
  explicit Signals(Window words) : words_(std::move(words)) {}
  Window words_;
};

class Comm {
 public:
  explicit Comm(MPI_Comm comm);
  Comm(MPI_Comm comm, const Options& options);
  ~Comm();  // collective: quiet, barrier, free every live window
  Comm(Comm&&) noexcept;
  Comm& operator=(Comm&&) noexcept;
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  int rank() const;
  int size() const;
  int node() const;            // index of this rank's (real or simulated) node
  int node_of(int rank) const;
  int node_count() const;
  MPI_Comm mpi_comm() const;   // the duplicated communicator meshmem uses for collectives
  const Options& options() const;

  // Collective; every rank passes the same size.
  Window alloc(std::size_t bytes, Memory memory = Memory::Device);
  Signals alloc_signals(std::size_t count, Memory memory = Memory::Device);

  // Copies `bytes` from `src` (local memory) into `target`'s part of `win` at `dst_offset`.
  // With a null stream the call returns when `src` may be reused; the data is complete at
  // the target after quiet() or barrier().
  void put(const Window& win, int target, std::size_t dst_offset, const void* src,
           std::size_t bytes, Stream stream = nullptr);
  // Copies from `target`'s part of `win` into `dst`; complete when the call returns
  // (null stream).
  void get(void* dst, const Window& win, int target, std::size_t src_offset, std::size_t bytes,
           Stream stream = nullptr);
  // put, then update `target`'s signal word `index`: whoever sees the signal sees the data.
  void put_signal(const Window& win, int target, std::size_t dst_offset, const void* src,
                  std::size_t bytes, const Signals& sig, std::size_t index, std::uint64_t value,
                  SignalOp op, Stream stream = nullptr);
  // Updates `target`'s signal word `index`, ordered after this rank's earlier puts to target.
  void signal(const Signals& sig, int target, std::size_t index, std::uint64_t value, SignalOp op,
              Stream stream = nullptr);
  // Blocks until this rank's word `index` compares true against `value`. Host-blocking with
  // a null stream; times out after MESHMEM_TIMEOUT. On a stream the wait itself times out
  // on the GPU after MESHMEM_TIMEOUT (the stream moves on; the next call on this Comm raises
  // Error(Timeout) naming the signal), except with MESHMEM_STREAM_WAIT=memop (the auto
  // choice where this rank shares its GPU with another rank).
  void wait_until(const Signals& sig, std::size_t index, Cmp cmp, std::uint64_t value,
                  Stream stream = nullptr);
  // wait_until for each of the words first .. first+count-1 at once (one launch on a
  // stream): a halo's two or four neighbours' signals, say.
  void wait_until_all(const Signals& sig, std::size_t first, std::size_t count, Cmp cmp, std::uint64_t value,
                      Stream stream = nullptr);
  // wait_until_all, then sets each of those words to `then`, in one operation on a stream:
  // the reset of a halo's signal words before their next use, without a signal() per word.
  // A peer's signal to one of these words must not arrive before this reset has run (use
  // two sets of words, by iteration parity, as examples/03_jacobi does).
  void wait_until_all_then_set(const Signals& sig, std::size_t first, std::size_t count, Cmp cmp,
                               std::uint64_t value, std::uint64_t then, Stream stream = nullptr);
  // Every put and signal issued by this rank (on `stream`, for device windows) is complete
  // at its target.
  void quiet(Stream stream = nullptr);
  // Stream-ordered barrier: once `stream` passes it, every rank's stream has reached its
  // barrier and their earlier puts are complete. The host does not wait (MESHMEM_BARRIER
  // auto or kernel: a one-block kernel whose barrier count lives on the GPU, so it is
  // capturable into a CUDA graph and right on every replay; its waits time out after
  // MESHMEM_TIMEOUT). MESHMEM_BARRIER=meeting meets the node's ranks on the host first and
  // enqueues nothing when every stream was idle (auto does so where ranks share a GPU);
  // flag and event are not capturable. The
  // k-th barrier(stream) of a rank is met with the k-th of every other rank, whatever
  // streams they run on: a barrier waits for the same rank's previous barrier(stream)
  // (on another stream too). Across nodes a proxy thread meets the ranks once the stream
  // reached the barrier. Where no GPU part runs (host windows only), the same as barrier().
  void barrier(Stream stream);
  // Host barrier: quiet + every rank has arrived; the host waits. Device puts issued on
  // streams are not covered (synchronise the stream first, or use barrier(stream)).
  void barrier();

  // Collective: a persistent halo exchange of `win` (meshmem/halo.hpp). Checked on every
  // rank against every rank's declaration: regions out of bounds, destinations that
  // overlap, and a neighbour that does not list this rank back are errors naming both.
  HaloExchange make_halo(const Window& win, const std::vector<HaloRegion>& sends);

  // Which path reaches `rank` for windows of kind `memory` (None: no transport does).
  TransportKind transport(int rank, Memory memory) const;
  // Why no transport reaches `rank` for windows of kind `memory`, each transport's reason
  // ("ipc: ...; shm: ...; mpi: ..."); empty where one does.
  std::string unreachable_reason(int rank, Memory memory) const;
  // Why the transports for windows of `memory` tried before the one that reaches `rank` did
  // not ("ipc: ...; staged: ..."): empty where none was passed over; unreachable_reason()
  // where none reaches it. meshmem-info --job prints it beside every pair's transport.
  std::string skipped_reason(int rank, Memory memory) const;
  // How descriptors are passed between ranks of this node.
  FdPassing fd_passing() const;
  // This rank's device and the barrier / stream-wait variants chosen for it, the GPU queues
  // and the module loading mode of the process and where they come from (docs/semantics.md, "GPU
  // queues", "Module loading"), and what the transports in use hold (the staged transport's
  // pinned pool, and the latest report of one of its streams held back in a GPU queue), or
  // why device windows are unavailable.
  std::string device_info() const;

 private:
  std::unique_ptr<detail::CommImpl> impl_;
};

// The memory kind a program should use by default: Device where this build has the GPU part
// and a CUDA device is visible, Host otherwise.
Memory default_memory();

// Whether this build has the GPU part and a CUDA device is visible; `why` says why not.
bool gpu_available(std::string* why = nullptr);

// Makes GPU (node-local rank of this process in `comm`) modulo (visible GPUs) the current
// device, the usual one-GPU-per-rank placement, and returns it; -1 where there is no GPU.
// Call it before constructing a Comm: a Comm uses the device current at construction.
// Collective over `comm` (it finds the node-local rank).
int select_local_device(MPI_Comm comm);

// This rank's place among the ranks of `comm` on its machine, which share its GPUs: ranks
// with its host name and kernel boot id (not MPI_COMM_TYPE_SHARED, which some Open MPI 4.1
// builds get wrong). A Comm's nodes also split ranks by network and pid namespace (docs/running.md,
// "Separate hosts on one machine"); GPUs are shared across those. Collective over `comm`; raises Error(Mpi)
// naming the call that failed.
int node_local_rank(MPI_Comm comm);

}  // namespace meshmem
