// The meshmem Python module (meshmem._meshmem): Comm, Window, Signals, HaloExchange and the
// data operations over the public C++ API. Blocking calls release the GIL; C++ errors become
// meshmem.Error with their code and message.
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <thread>

#include "binding.hpp"

namespace meshmem::python {

namespace {

PyObject* g_error = nullptr;

std::string cat(const char* a, const std::string& b) { return std::string(a) + b; }

// Gathers one number from every rank over the binding's own communicator, bounded by the
// Comm's timeout (the ranks' other waits are meshmem's and bounded the same way).
std::vector<long> gather_counts(const CommHolder& c, long mine, const char* call) {
  int size = 0;
  MPI_Comm_size(c.agree, &size);
  std::vector<long> all(static_cast<std::size_t>(size));
  MPI_Request req = MPI_REQUEST_NULL;
  int rc = MPI_Iallgather(&mine, 1, MPI_LONG, all.data(), 1, MPI_LONG, c.agree, &req);
  if (rc != MPI_SUCCESS) throw Error(ErrorCode::Mpi, cat(call, ": MPI_Iallgather failed (" + std::to_string(rc) + ")"));
  const auto timeout = c.comm->options().timeout;
  const auto start = std::chrono::steady_clock::now();
  py::gil_scoped_release release;
  for (int done = 0;;) {
    rc = MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) throw Error(ErrorCode::Mpi, cat(call, ": MPI_Test failed (" + std::to_string(rc) + ")"));
    if (done) break;
    if (timeout.count() > 0 && std::chrono::steady_clock::now() - start > timeout)
      throw Error(ErrorCode::Timeout, cat(call, ": not every rank came within MESHMEM_TIMEOUT (a collective "
                                                "call made on some ranks only)"));
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return all;
}

// Every rank raises the same error where any rank still holds arrays of what is freed.
void agree_no_live_arrays(const CommHolder& c, const std::function<long()>& count, const char* call,
                          const char* what) {
  long mine = count();
  if (mine > 0) {  // arrays only in reference cycles are not live: collect them first
    py::module_::import("gc").attr("collect")();
    mine = count();
  }
  const std::vector<long> all = gather_counts(c, mine, call);
  for (std::size_t r = 0; r < all.size(); ++r)
    if (all[r] > 0)
      throw Error(ErrorCode::InvalidArgument,
                  cat(call, ": rank " + std::to_string(r) + " still holds " + std::to_string(all[r]) +
                                " array(s) of " + what + " (their memory would go away under them); "
                                "delete them first; nothing was freed"));
}

void translate(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const Error& e) {
    set_python_error(e);
  }
}

}  // namespace

void invalid(const std::string& message) { throw Error(ErrorCode::InvalidArgument, message); }

void set_python_error(const Error& e) {
  py::object code = py::cast(e.code());
  py::object exc = py::reinterpret_steal<py::object>(PyObject_CallFunction(g_error, "s", e.what()));
  if (!exc) return;  // the call's own Python error stands
  PyObject_SetAttrString(exc.ptr(), "code", code.ptr());
  PyErr_SetObject(g_error, exc.ptr());
}

Comm& CommHolder::get(const char* call) const {
  if (!comm) throw Error(ErrorCode::InvalidArgument, cat(call, ": the Comm was closed"));
  return *comm;
}

void CommHolder::close() {
  if (!comm) return;
  agree_no_live_arrays(
      *this,
      [this] {
        long n = 0;
        for (const auto& weak : windows)
          if (auto w = weak.lock()) n += w->exports.load();
        return n;
      },
      "Comm.close", "its windows");
  {
    py::gil_scoped_release release;
    comm.reset();  // collective: frees every live window
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && agree != MPI_COMM_NULL) MPI_Comm_free(&agree);
  agree = MPI_COMM_NULL;
}

CommHolder::~CommHolder() {
  if (comm && Py_IsInitialized() && PyGILState_Check()) {
    py::gil_scoped_release release;  // collective
    comm.reset();
  } else {
    comm.reset();
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && agree != MPI_COMM_NULL) MPI_Comm_free(&agree);
}

void WindowHolder::check(const char* call) const {
  owner->get(call);
  if (!words().valid())
    throw Error(ErrorCode::InvalidArgument, cat(call, is_signals ? ": the signals were freed" : ": the window was freed"));
}

void WindowHolder::free(const char* call) {
  check(call);
  agree_no_live_arrays(*owner, [this] { return exports.load(); }, call, is_signals ? "these signals" : "this window");
  py::gil_scoped_release release;
  if (is_signals)
    sig.free();
  else
    win.free();
}

WindowHolder::~WindowHolder() {
  if (!words().valid()) return;
  if (Py_IsInitialized() && PyGILState_Check()) {
    py::gil_scoped_release release;  // collective
    win = Window();
    sig = Signals();
  }
}

namespace {

// MPI initialised by the binding (no mpi4py) is finalised when the interpreter exits.
void finalise_mpi_at_exit() {
  py::module_::import("atexit").attr("register")(py::cpp_function([] {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }));
}

std::shared_ptr<CommHolder> make_comm(py::handle mpi_comm, py::handle options) {
  auto c = std::make_shared<CommHolder>();
  const MPI_Comm base = mpi_comm_of(mpi_comm, &c->initialised_mpi);
  if (c->initialised_mpi) finalise_mpi_at_exit();
  std::unique_ptr<Options> opts;
  if (!options.is_none()) {
    opts = std::make_unique<Options>(Options::from_environment());
    for (auto item : options.cast<py::dict>())
      opts->set(py::str(item.first).cast<std::string>(), py::str(item.second).cast<std::string>());
  }
  {
    py::gil_scoped_release release;
    const int rc = MPI_Comm_dup(base, &c->agree);
    if (rc != MPI_SUCCESS) throw Error(ErrorCode::Mpi, "meshmem.Comm: MPI_Comm_dup failed (" + std::to_string(rc) + ")");
    c->comm = opts ? std::make_unique<Comm>(base, *opts) : std::make_unique<Comm>(base);
  }
  c->device = current_device();
  return c;
}

template <class H>
std::shared_ptr<H> alloc_window(const std::shared_ptr<CommHolder>& c, std::size_t n, py::handle memory, bool signals) {
  const char* call = signals ? "Comm.alloc_signals" : "Comm.alloc";
  const Memory mem = memory_of(memory, call);
  Comm& comm = c->get(call);
  auto w = std::make_shared<H>();
  w->owner = c;
  w->memory = mem;
  w->is_signals = signals;
  {
    py::gil_scoped_release release;
    if (signals)
      w->sig = comm.alloc_signals(n, mem);
    else
      w->win = comm.alloc(n, mem);
  }
  w->bytes = w->words().size();
  auto& ws = c->windows;
  ws.erase(std::remove_if(ws.begin(), ws.end(), [](const auto& weak) { return weak.expired(); }), ws.end());
  ws.push_back(w);
  return w;
}

template <class Cls>
void bind_window_common(Cls& cls, const char* name) {
  using H = typename Cls::type;
  cls.def_property_readonly("memory", [](const H& w) { return w.memory == Memory::Device ? "device" : "host"; })
      .def_property_readonly("valid", [](const H& w) { return w.valid(); })
      .def_property_readonly("live_arrays", [](const H& w) { return w.exports.load(); },
                             "arrays of it still alive on this rank (free() is refused while any rank has some)")
      .def("free", [name](H& w) { w.free((std::string(name) + ".free").c_str()); },
           "Collective: frees it on every rank; refused on every rank while any rank holds arrays of it")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [name](H& w, py::handle, py::handle, py::handle) {
        if (w.valid()) w.free((std::string(name) + ".free").c_str());
        return false;
      });
}

}  // namespace

}  // namespace meshmem::python

PYBIND11_MODULE(_meshmem, m) {
  using namespace meshmem;
  using namespace meshmem::python;
  m.doc() = "meshmem: one-sided put / get / signal / barrier over symmetric windows (C++ binding)";

  py::enum_<ErrorCode>(m, "ErrorCode")
      .value("InvalidArgument", ErrorCode::InvalidArgument)
      .value("Cuda", ErrorCode::Cuda)
      .value("Mpi", ErrorCode::Mpi)
      .value("System", ErrorCode::System)
      .value("Timeout", ErrorCode::Timeout)
      .value("Unsupported", ErrorCode::Unsupported)
      .value("Internal", ErrorCode::Internal);
  g_error = PyErr_NewExceptionWithDoc("meshmem.Error",
                                      "meshmem's error: .code is a meshmem.ErrorCode, str() the C++ message",
                                      PyExc_RuntimeError, nullptr);
  m.attr("Error") = py::handle(g_error);
  py::register_exception_translator(&translate);

  py::enum_<Memory>(m, "Memory").value("Device", Memory::Device).value("Host", Memory::Host);
  py::enum_<SignalOp>(m, "SignalOp").value("Set", SignalOp::Set).value("Add", SignalOp::Add);
  py::enum_<Cmp>(m, "Cmp")
      .value("EQ", Cmp::EQ).value("NE", Cmp::NE).value("GT", Cmp::GT)
      .value("GE", Cmp::GE).value("LT", Cmp::LT).value("LE", Cmp::LE);

  bind_arrays(m);
  bind_world(m);

  py::class_<PyWindow, std::shared_ptr<PyWindow>> window(m, "Window", "A symmetric window (Comm.alloc)");
  bind_window_common(window, "Window");
  window.def_property_readonly("nbytes", [](const PyWindow& w) { return w.bytes; })
      .def("local",
           [](const std::shared_ptr<PyWindow>& w, py::handle dtype, py::handle shape, std::size_t offset) {
             return window_array(w, -1, dtype, shape, offset, "Window.local");
           },
           py::arg("dtype") = "uint8", py::arg("shape") = py::none(), py::arg("offset") = 0,
           "This rank's part as an array (numpy.ndarray for host windows, meshmem.WindowArray for device "
           "windows) of `dtype` and `shape` (default: as many items as fit), from byte `offset`")
      .def("peer",
           [](const std::shared_ptr<PyWindow>& w, int rank, py::handle dtype, py::handle shape, std::size_t offset) {
             w->check("Window.peer");
             if (rank < 0 || rank >= w->owner->comm->size())
               invalid("Window.peer: rank " + std::to_string(rank) + " is out of range (the Comm has " +
                       std::to_string(w->owner->comm->size()) + " ranks)");
             return window_array(w, rank, dtype, shape, offset, "Window.peer");
           },
           py::arg("rank"), py::arg("dtype") = "uint8", py::arg("shape") = py::none(), py::arg("offset") = 0,
           "rank's part mapped here as an array (as local()), or None where it is not mapped");

  py::class_<PySignals, std::shared_ptr<PySignals>> signals(m, "Signals", "Symmetric 64-bit signal words (Comm.alloc_signals)");
  bind_window_common(signals, "Signals");
  signals.def_property_readonly("count", [](const PySignals& s) { return s.bytes / sizeof(std::uint64_t); })
      .def("__len__", [](const PySignals& s) { return s.bytes / sizeof(std::uint64_t); })
      .def("read",
           [](const PySignals& s, std::size_t index) {
             s.check("Signals.read");
             if (index >= s.bytes / sizeof(std::uint64_t))
               invalid("Signals.read: index " + std::to_string(index) + " is out of range (" +
                       std::to_string(s.bytes / sizeof(std::uint64_t)) + " signals)");
             return s.sig.read(index);
           },
           "This rank's word `index` now (acquire ordering)")
      .def("local",
           [](const std::shared_ptr<PySignals>& s) { return window_array(s, -1, py::str("uint64"), py::none(), 0, "Signals.local"); },
           "This rank's words as a uint64 array (host signals: numpy; read them with read() for ordering)");

  py::class_<HaloRegion>(m, "HaloRegion", "A region sent to a neighbour (meshmem/halo.hpp): bytes, rows and pitches")
      .def(py::init([](int peer, std::size_t src_offset, std::size_t dst_offset, std::size_t width, std::size_t height,
                       std::size_t src_pitch, std::size_t dst_pitch) {
             return HaloRegion{peer, src_offset, dst_offset, width, height, src_pitch, dst_pitch};
           }),
           py::arg("peer"), py::arg("src_offset"), py::arg("dst_offset"), py::arg("width"), py::arg("height") = 1,
           py::arg("src_pitch") = 0, py::arg("dst_pitch") = 0)
      .def_readwrite("peer", &HaloRegion::peer)
      .def_readwrite("src_offset", &HaloRegion::src_offset)
      .def_readwrite("dst_offset", &HaloRegion::dst_offset)
      .def_readwrite("width", &HaloRegion::width)
      .def_readwrite("height", &HaloRegion::height)
      .def_readwrite("src_pitch", &HaloRegion::src_pitch)
      .def_readwrite("dst_pitch", &HaloRegion::dst_pitch);

  struct PyHalo {
    std::shared_ptr<PyWindow> window;
    HaloExchange halo;
    bool open = true;
    void check(const char* call) const {
      if (!open) throw Error(ErrorCode::InvalidArgument, std::string(call) + ": the halo exchange was closed");
      window->check(call);
    }
    void close() {
      if (!open) return;
      open = false;
      py::gil_scoped_release release;
      halo = HaloExchange();  // collective
    }
    ~PyHalo() {
      if (open && Py_IsInitialized() && PyGILState_Check()) {
        py::gil_scoped_release release;
        halo = HaloExchange();
      }
    }
  };
  py::class_<PyHalo, std::shared_ptr<PyHalo>>(m, "HaloExchange", "A persistent halo exchange (Comm.make_halo)")
      .def("exchange",
           [](PyHalo& h, py::handle stream) {
             h.check("HaloExchange.exchange");
             const Stream s = stream_of(stream, "HaloExchange.exchange");
             py::gil_scoped_release release;
             h.halo.exchange(s);
           },
           py::arg("stream") = py::none())
      .def("complete",
           [](PyHalo& h, py::handle stream) {
             h.check("HaloExchange.complete");
             const Stream s = stream_of(stream, "HaloExchange.complete");
             py::gil_scoped_release release;
             h.halo.complete(s);
           },
           py::arg("stream") = py::none())
      .def_property_readonly("exchanges", [](const PyHalo& h) { return h.halo.exchanges(); })
      .def_property_readonly("neighbours", [](const PyHalo& h) { return h.halo.neighbours(); })
      .def("close", &PyHalo::close, "Collective")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyHalo& h, py::handle, py::handle, py::handle) {
        h.close();
        return false;
      });

  py::class_<CommHolder, std::shared_ptr<CommHolder>>(m, "Comm",
      "meshmem.Comm(comm=None, options=None): collective over an mpi4py communicator (None: "
      "MPI.COMM_WORLD; without mpi4py, MPI_COMM_WORLD with MPI initialised by meshmem). options: "
      "{'MESHMEM_TIMEOUT': '30', ...} over the environment's MESHMEM_* settings")
      .def(py::init(&make_comm), py::arg("comm") = py::none(), py::arg("options") = py::none())
      .def_property_readonly("rank", [](const CommHolder& c) { return c.get("Comm.rank").rank(); })
      .def_property_readonly("size", [](const CommHolder& c) { return c.get("Comm.size").size(); })
      .def_property_readonly("node", [](const CommHolder& c) { return c.get("Comm.node").node(); })
      .def_property_readonly("node_count", [](const CommHolder& c) { return c.get("Comm.node_count").node_count(); })
      .def_property_readonly("device", [](const CommHolder& c) { return c.device; },
                             "the CUDA device of this rank's device windows (-1: none)")
      .def_property_readonly("closed", [](const CommHolder& c) { return !c.comm; })
      .def("node_of", [](const CommHolder& c, int r) { return c.get("Comm.node_of").node_of(r); })
      .def("transport",
           [](const CommHolder& c, int r, py::handle memory) {
             return std::string(to_string(c.get("Comm.transport").transport(r, memory_of(memory, "Comm.transport"))));
           },
           py::arg("rank"), py::arg("memory") = "device", "The path to rank: ipc, staged, shm, mpi, nccl, mpi-device or none")
      .def("unreachable_reason",
           [](const CommHolder& c, int r, py::handle memory) {
             return c.get("Comm.unreachable_reason").unreachable_reason(r, memory_of(memory, "Comm.unreachable_reason"));
           },
           py::arg("rank"), py::arg("memory") = "device")
      .def("skipped_reason",
           [](const CommHolder& c, int r, py::handle memory) {
             return c.get("Comm.skipped_reason").skipped_reason(r, memory_of(memory, "Comm.skipped_reason"));
           },
           py::arg("rank"), py::arg("memory") = "device")
      .def("device_info", [](const CommHolder& c) { return c.get("Comm.device_info").device_info(); })
      .def("alloc",
           [](const std::shared_ptr<CommHolder>& c, std::size_t n, py::handle memory) {
             return alloc_window<PyWindow>(c, n, memory, false);
           },
           py::arg("nbytes"), py::arg("memory") = "device",
           "Collective: a window of nbytes on every rank (memory: \"device\" or \"host\")")
      .def("alloc_signals",
           [](const std::shared_ptr<CommHolder>& c, std::size_t n, py::handle memory) {
             return alloc_window<PySignals>(c, n, memory, true);
           },
           py::arg("count"), py::arg("memory") = "device",
           "Collective: count 64-bit signal words, zero, on every rank")
      .def("wait_until_all",
           [](CommHolder& c, PySignals& sig, std::size_t first, std::size_t count, py::handle cmp, std::uint64_t value,
              py::handle stream) {
             const char* call = "comm.wait_until_all";
             sig.check(call);
             const Cmp k = cmp_of(cmp, call);
             const Stream st = stream_of(stream, call);
             Comm& comm = c.get(call);
             py::gil_scoped_release release;
             comm.wait_until_all(sig.sig, first, count, k, value, st);
           },
           py::arg("sig"), py::arg("first"), py::arg("count"), py::arg("cmp"), py::arg("value"),
           py::arg("stream") = py::none())
      .def("quiet",
           [](CommHolder& c, py::handle stream) {
             const Stream st = stream_of(stream, "comm.quiet");
             Comm& comm = c.get("comm.quiet");
             py::gil_scoped_release release;
             comm.quiet(st);
           },
           py::arg("stream") = py::none())
      .def("barrier",
           [](CommHolder& c, py::handle stream) {
             const bool on_stream = !stream.is_none();
             const Stream st = stream_of(stream, "comm.barrier");
             Comm& comm = c.get("comm.barrier");
             py::gil_scoped_release release;
             if (on_stream)
               comm.barrier(st);
             else
               comm.barrier();
           },
           py::arg("stream") = py::none(),
           "Without a stream: quiet + every rank arrived, the host waits. With one: stream-ordered")
      .def("make_halo",
           [](const std::shared_ptr<CommHolder>& c, const std::shared_ptr<PyWindow>& w,
              const std::vector<HaloRegion>& sends) {
             w->check("Comm.make_halo");
             Comm& comm = c->get("Comm.make_halo");
             auto h = std::make_shared<PyHalo>();
             h->window = w;
             py::gil_scoped_release release;
             h->halo = comm.make_halo(w->win, sends);
             return h;
           },
           py::arg("win"), py::arg("sends"), "Collective: a persistent halo exchange of win (list of HaloRegion)")
      .def("close", &CommHolder::close,
           "Collective: frees the Comm and its windows; refused on every rank while any rank holds arrays of them")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](CommHolder& c, py::handle, py::handle, py::handle) {
        c.close();
        return false;
      });

  bind_fast_calls(m.attr("Comm"));  // put, get, put_signal, signal, wait_until

  m.def("gpu_available", [] {
    std::string why;
    const bool yes = gpu_available(&why);
    return py::make_tuple(yes, why);
  }, "(available, why not): this build has the GPU part and a CUDA device is visible");
  m.def("default_memory", [] { return default_memory() == Memory::Device ? "device" : "host"; });
  m.def("select_local_device", [](py::handle comm) {
    bool here = false;
    const MPI_Comm c = mpi_comm_of(comm, &here);
    if (here) finalise_mpi_at_exit();
    py::gil_scoped_release release;
    return select_local_device(c);
  }, py::arg("comm") = py::none(), "Collective: the usual one-GPU-per-rank device made current (before Comm); -1: no GPU");
  m.def("mpi_library_version", &mpi_library_version, "The MPI library meshmem was built with");
#if MESHMEM_PYTHON_HAVE_CUDA
  m.attr("has_gpu_part") = true;
#else
  m.attr("has_gpu_part") = false;
#endif
}
