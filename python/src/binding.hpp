// The Python binding's shared declarations: the owners of a Comm, a window and signals as
// Python sees them, the arrays exported from windows, and the argument converters.
#pragma once

#include <mpi.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "meshmem/meshmem.hpp"

namespace py = pybind11;

namespace meshmem::python {

// Raises meshmem.Error(InvalidArgument): bad input found by the binding, before anything ran.
[[noreturn]] void invalid(const std::string& message);
void set_python_error(const Error& e);  // as meshmem.Error, its .code set

struct WindowHolder;

// A Comm and what the binding keeps beside it. Windows hold it (shared_ptr), so it outlives them.
struct CommHolder {
  std::unique_ptr<Comm> comm;
  MPI_Comm agree = MPI_COMM_NULL;  // the binding's own duplicate, for its agreements (free with arrays alive)
  int device = -1;                 // the CUDA device current when the Comm was made
  bool initialised_mpi = false;    // MPI_Init_thread was called by the binding for this Comm
  std::vector<std::weak_ptr<WindowHolder>> windows;

  Comm& get(const char* call) const;  // raises meshmem.Error once closed
  // Collective: any rank with live arrays of any window makes every rank raise; else frees.
  void close();
  ~CommHolder();
};

// A window or signals: the C++ object, its Comm, and how many arrays of it are alive.
struct WindowHolder {
  std::shared_ptr<CommHolder> owner;
  Window win;  // empty for signals
  Signals sig; // empty for windows
  bool is_signals = false;
  Memory memory = Memory::Host;
  std::size_t bytes = 0;
  std::atomic<long> exports{0};

  const Window& words() const { return is_signals ? sig.words() : win; }
  bool valid() const { return owner->comm && words().valid(); }
  void check(const char* call) const;  // raises meshmem.Error once freed
  // Collective: refused on every rank (meshmem.Error) while any rank holds arrays of it.
  void free(const char* call);
  virtual ~WindowHolder();
};
struct PyWindow : WindowHolder {};
struct PySignals : WindowHolder {};

// An array over part of a window (this rank's or a mapped peer's): NumPy's base for host
// windows; for device windows the object CuPy and PyTorch take (__cuda_array_interface__,
// __dlpack__). It keeps its window alive and counts as one of its live arrays.
struct Part {
  std::shared_ptr<WindowHolder> window;
  void* ptr = nullptr;
  std::size_t nbytes = 0;
  py::dtype dtype;
  std::vector<py::ssize_t> shape;
  int owner_rank = -1;  // whose part of the window
  Part(std::shared_ptr<WindowHolder> w, void* p, std::size_t n, py::dtype d, std::vector<py::ssize_t> s, int r);
  Part(const Part&) = delete;
  Part& operator=(const Part&) = delete;
  ~Part();
  bool device() const { return window->memory == Memory::Device; }
};

// Memory that a put reads or a get writes, taken from any array object for the call's length.
struct Span {
  void* ptr = nullptr;
  std::size_t nbytes = 0;
  std::size_t itemsize = 1;
  bool device = false;
  Py_buffer view{};
  bool has_view = false;
  Span() = default;
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;
  ~Span();  // releases the buffer; destroyed with the GIL held
};
// `what` of `call` ("comm.put: src"): buffer protocol (C-contiguous, not object dtype),
// torch tensors, __cuda_array_interface__; `writable` for destinations.
void span_of(Span& out, py::handle obj, bool writable, const std::string& call, const char* what);

Stream stream_of(py::handle stream, const char* call);
Memory memory_of(py::handle memory, const char* call);
Cmp cmp_of(py::handle cmp, const char* call);
SignalOp op_of(py::handle op, const char* call);
py::dtype dtype_of(py::handle dtype, const char* call);

// The communicator of an mpi4py object (None: MPI_COMM_WORLD, MPI initialised here where
// mpi4py is absent), after checking that mpi4py runs on the MPI library meshmem was built with.
MPI_Comm mpi_comm_of(py::handle comm, bool* initialised_here);
std::string mpi_library_version();

// The arrays of a window: numpy.ndarray for host windows, Part for device windows.
py::object window_array(const std::shared_ptr<WindowHolder>& w, int rank, py::handle dtype, py::handle shape,
                        std::size_t offset, const char* call);

void bind_arrays(py::module_& m);
void bind_fast_calls(py::handle comm_type);  // Comm's inner-loop calls (fast_calls.cpp)
void bind_world(py::module_& m);  // the tests' MPI_COMM_WORLD without mpi4py
int current_device();  // -1 without the GPU part or a device

}  // namespace meshmem::python
