// The calls of a program's inner loop (Comm.put, get, put_signal, signal, wait_until) as
// METH_FASTCALL methods of meshmem.Comm. CPython passes their arguments as an array, and the
// keywords' names as a tuple of interned strings matched here by address. pybind11's own
// dispatch builds a dictionary for the keywords and looks every parameter not given by position
// up by a string made for the lookup, which doubled the cost of `op=` and `stream=`.
// Argument errors raise TypeError as pybind11's would; the rest is the binding's usual checks.
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

#include "binding.hpp"

namespace meshmem::python {

namespace {

constexpr std::size_t kMaxParams = 10;

// A call's parameters: the first `positional` may come by position, the rest by keyword only;
// the first `required` must be given. The text signature makes help() and inspect show them.
struct Signature {
  const char* call;  // "comm.put_signal", for messages
  std::vector<PyObject*> names;
  Py_ssize_t positional;
  Py_ssize_t required;
  Signature(const char* c, std::initializer_list<const char*> params, Py_ssize_t pos, Py_ssize_t req)
      : call(c), positional(pos), required(req) {
    for (const char* p : params) names.push_back(PyUnicode_InternFromString(p));
    if (names.size() > kMaxParams) throw std::logic_error(std::string(c) + ": more parameters than kMaxParams");
  }
};

std::string name_of(const Signature& sig, Py_ssize_t i) { return PyUnicode_AsUTF8(sig.names[i]); }

[[noreturn]] void type_error(const Signature& sig, const std::string& what) {
  throw py::type_error(std::string(sig.call) + "(): " + what);
}

// out[i]: parameter i's argument, null where not given.
void parse(const Signature& sig, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames, PyObject** out) {
  const auto n = static_cast<Py_ssize_t>(sig.names.size());
  for (Py_ssize_t i = 0; i < n; ++i) out[i] = nullptr;
  if (nargs > sig.positional)
    type_error(sig, "takes at most " + std::to_string(sig.positional) + " positional arguments (" +
                        std::to_string(nargs) + " given)");
  for (Py_ssize_t i = 0; i < nargs; ++i) out[i] = args[i];
  const Py_ssize_t nkw = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
  for (Py_ssize_t k = 0; k < nkw; ++k) {
    PyObject* key = PyTuple_GET_ITEM(kwnames, k);
    Py_ssize_t at = -1;
    for (Py_ssize_t i = 0; i < n && at < 0; ++i)
      if (sig.names[i] == key) at = i;
    for (Py_ssize_t i = 0; i < n && at < 0; ++i)  // a name made at run time, not interned
      if (PyUnicode_Compare(sig.names[i], key) == 0) at = i;
    if (PyErr_Occurred()) PyErr_Clear();
    if (at < 0) type_error(sig, "got an unexpected keyword argument " + py::repr(key).cast<std::string>());
    if (out[at] != nullptr) type_error(sig, "got multiple values for argument " + py::repr(key).cast<std::string>());
    out[at] = args[nargs + k];
  }
  for (Py_ssize_t i = 0; i < sig.required; ++i)
    if (out[i] == nullptr)
      type_error(sig, "missing required argument '" + name_of(sig, i) + "'");
}

template <class T>
T& object_arg(const Signature& sig, PyObject* const* a, int i, const char* type) {
  try {
    return py::handle(a[i]).cast<T&>();
  } catch (const py::cast_error&) {
  } catch (const py::reference_cast_error&) {  // None
  }
  type_error(sig, name_of(sig, i) + " must be a " + type + ", not " + Py_TYPE(a[i])->tp_name);
}

[[noreturn]] void not_an_integer(const Signature& sig, int i, PyObject* v, const char* what) {
  type_error(sig, name_of(sig, i) + " must be " + what + ", not " + py::repr(v).cast<std::string>());
}

// An integer argument (int, or an object with __index__ such as numpy.int64) in [lo, hi].
template <class T>
T integer_arg(const Signature& sig, PyObject* const* a, int i, long long lo, unsigned long long hi) {
  PyObject* v = a[i];
  if (PyFloat_Check(v) || !PyIndex_Check(v)) not_an_integer(sig, i, v, "an integer");
  py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(v));
  if (!index) throw py::error_already_set();
  int overflow = 0;
  const long long n = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (n == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (overflow > 0) {  // above LLONG_MAX
    const unsigned long long u = PyLong_AsUnsignedLongLong(index.ptr());
    if (PyErr_Occurred()) PyErr_Clear();
    else if (u <= hi) return static_cast<T>(u);
  } else if (overflow == 0 && n >= lo && (n < 0 || static_cast<unsigned long long>(n) <= hi)) {
    return static_cast<T>(n);
  }
  not_an_integer(sig, i, v, "an integer in range");
}

int rank_arg(const Signature& sig, PyObject* const* a, int i) {
  return integer_arg<int>(sig, a, i, INT32_MIN, INT32_MAX);
}
std::size_t index_arg(const Signature& sig, PyObject* const* a, int i) {
  return integer_arg<std::size_t>(sig, a, i, 0, SIZE_MAX);
}
std::uint64_t value_arg(const Signature& sig, PyObject* const* a, int i) {
  return integer_arg<std::uint64_t>(sig, a, i, 0, UINT64_MAX);
}

py::handle or_default(PyObject* given, py::handle fallback) { return given != nullptr ? py::handle(given) : fallback; }
py::handle zero() {
  static PyObject* const z = PyLong_FromLong(0);
  return z;
}
py::handle set_name() {
  static PyObject* const s = PyUnicode_InternFromString("set");
  return s;
}

std::size_t byte_offset(py::handle offset, py::handle elem_offset, const Span& s, const char* call) {
  const auto off = offset.cast<long long>();
  if (!elem_offset.is_none()) {
    if (off != 0) invalid(std::string(call) + ": give offset (bytes) or elem_offset (elements), not both");
    const auto e = elem_offset.cast<long long>();
    if (e < 0) invalid(std::string(call) + ": elem_offset " + std::to_string(e) + " is negative");
    return static_cast<std::size_t>(e) * s.itemsize;
  }
  if (off < 0) invalid(std::string(call) + ": offset " + std::to_string(off) + " is negative");
  return static_cast<std::size_t>(off);
}

void check_side(const WindowHolder& w, const Span& s, const char* call, const char* what) {
  if (w.memory == Memory::Host && s.device)
    invalid(std::string(call) + ": " + what +
            " is GPU memory, but the window is a host window (host windows take host arrays: NumPy)");
}

// The body's exceptions as Python's, as pybind11 sets them for the binding's other calls.
template <class Body>
PyObject* guarded(Body&& body) {
  try {
    body();
    Py_RETURN_NONE;
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const Error& e) {
    set_python_error(e);
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

// put(win, target, src, ...) and get(dst, win, target, ...): the same checks, the array on
// the other side of the window.
enum class Direction { Put, Get };

template <Direction D>
PyObject* transfer_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return guarded([&] {
    constexpr bool get = D == Direction::Get;
    static const Signature sig =
        get ? Signature("comm.get", {"dst", "win", "target", "offset", "stream", "elem_offset"}, 5, 3)
            : Signature("comm.put", {"win", "target", "src", "offset", "stream", "elem_offset"}, 5, 3);
    constexpr int array_at = get ? 0 : 2, win_at = get ? 1 : 0, target_at = get ? 2 : 1;
    const char* array_name = get ? "dst" : "src";
    PyObject* a[kMaxParams];
    parse(sig, args, nargs, kwnames, a);
    CommHolder& c = py::handle(self).cast<CommHolder&>();
    PyWindow& w = object_arg<PyWindow>(sig, a, win_at, "meshmem.Window");
    const int target = rank_arg(sig, a, target_at);
    Span s;
    span_of(s, a[array_at], get, sig.call, array_name);
    w.check(sig.call);
    check_side(w, s, sig.call, array_name);
    const std::size_t off = byte_offset(or_default(a[3], zero()), or_default(a[5], Py_None), s, sig.call);
    const Stream st = stream_of(or_default(a[4], Py_None), sig.call);
    Comm& comm = c.get(sig.call);
    py::gil_scoped_release release;
    if (get)
      comm.get(s.ptr, w.win, target, off, s.nbytes, st);
    else
      comm.put(w.win, target, off, s.ptr, s.nbytes, st);
  });
}

PyObject* put_signal_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return guarded([&] {
    static const Signature sig(
        "comm.put_signal",
        {"win", "target", "src", "sig", "index", "value", "offset", "op", "stream", "elem_offset"}, 9, 6);
    PyObject* a[kMaxParams];
    parse(sig, args, nargs, kwnames, a);
    CommHolder& c = py::handle(self).cast<CommHolder&>();
    PyWindow& w = object_arg<PyWindow>(sig, a, 0, "meshmem.Window");
    const int target = rank_arg(sig, a, 1);
    PySignals& words = object_arg<PySignals>(sig, a, 3, "meshmem.Signals");
    const std::size_t index = index_arg(sig, a, 4);
    const std::uint64_t value = value_arg(sig, a, 5);
    Span s;
    span_of(s, a[2], false, sig.call, "src");
    w.check(sig.call);
    words.check(sig.call);
    check_side(w, s, sig.call, "src");
    const std::size_t off = byte_offset(or_default(a[6], zero()), or_default(a[9], Py_None), s, sig.call);
    const SignalOp o = op_of(or_default(a[7], set_name()), sig.call);
    const Stream st = stream_of(or_default(a[8], Py_None), sig.call);
    Comm& comm = c.get(sig.call);
    py::gil_scoped_release release;
    comm.put_signal(w.win, target, off, s.ptr, s.nbytes, words.sig, index, value, o, st);
  });
}

PyObject* signal_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return guarded([&] {
    static const Signature sig("comm.signal", {"sig", "target", "index", "value", "op", "stream"}, 6, 4);
    PyObject* a[kMaxParams];
    parse(sig, args, nargs, kwnames, a);
    CommHolder& c = py::handle(self).cast<CommHolder&>();
    PySignals& words = object_arg<PySignals>(sig, a, 0, "meshmem.Signals");
    const int target = rank_arg(sig, a, 1);
    const std::size_t index = index_arg(sig, a, 2);
    const std::uint64_t value = value_arg(sig, a, 3);
    words.check(sig.call);
    const SignalOp o = op_of(or_default(a[4], set_name()), sig.call);
    const Stream st = stream_of(or_default(a[5], Py_None), sig.call);
    Comm& comm = c.get(sig.call);
    py::gil_scoped_release release;
    comm.signal(words.sig, target, index, value, o, st);
  });
}

PyObject* wait_until_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return guarded([&] {
    static const Signature sig("comm.wait_until", {"sig", "index", "cmp", "value", "stream"}, 5, 4);
    PyObject* a[kMaxParams];
    parse(sig, args, nargs, kwnames, a);
    CommHolder& c = py::handle(self).cast<CommHolder&>();
    PySignals& words = object_arg<PySignals>(sig, a, 0, "meshmem.Signals");
    const std::size_t index = index_arg(sig, a, 1);
    const std::uint64_t value = value_arg(sig, a, 3);
    words.check(sig.call);
    const Cmp k = cmp_of(a[2], sig.call);
    const Stream st = stream_of(or_default(a[4], Py_None), sig.call);
    Comm& comm = c.get(sig.call);
    py::gil_scoped_release release;
    comm.wait_until(words.sig, index, k, value, st);
  });
}

template <PyObject* (*F)(PyObject*, PyObject* const*, Py_ssize_t, PyObject*)>
PyCFunction as_cfunction() {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(F));
}

// Static: CPython's method descriptors point at these for the life of the type.
PyMethodDef fast_methods[] = {
    {"put", as_cfunction<transfer_call<Direction::Put>>(), METH_FASTCALL | METH_KEYWORDS,
     "put($self, /, win, target, src, offset=0, stream=None, *, elem_offset=None)\n--\n\n"
     "Copies all of src (a contiguous array) into target's part of win at byte offset (or elem_offset "
     "items of src's dtype)"},
    {"get", as_cfunction<transfer_call<Direction::Get>>(), METH_FASTCALL | METH_KEYWORDS,
     "get($self, /, dst, win, target, offset=0, stream=None, *, elem_offset=None)\n--\n\n"
     "Fills all of dst from target's part of win at byte offset (or elem_offset items of dst's dtype)"},
    {"put_signal", as_cfunction<put_signal_call>(), METH_FASTCALL | METH_KEYWORDS,
     "put_signal($self, /, win, target, src, sig, index, value, offset=0, op='set', stream=None, *, "
     "elem_offset=None)\n--\n\n"
     "put, then target's signal word index is set to (op=\"add\": increased by) value; whoever sees "
     "the signal sees the data"},
    {"signal", as_cfunction<signal_call>(), METH_FASTCALL | METH_KEYWORDS,
     "signal($self, /, sig, target, index, value, op='set', stream=None)\n--\n\n"
     "Sets target's signal word index to value (op=\"add\": increases it by value)"},
    {"wait_until", as_cfunction<wait_until_call>(), METH_FASTCALL | METH_KEYWORDS,
     "wait_until($self, /, sig, index, cmp, value, stream=None)\n--\n\n"
     "Until this rank's word index compares true (cmp: \">=\", meshmem.Cmp.GE, ...): the host waits "
     "(GIL released) without a stream, the stream waits with one"},
};

}  // namespace

void bind_fast_calls(py::handle comm_type) {
  auto* type = reinterpret_cast<PyTypeObject*>(comm_type.ptr());
  for (PyMethodDef& def : fast_methods) {
    py::object method = py::reinterpret_steal<py::object>(PyDescr_NewMethod(type, &def));
    if (!method) throw py::error_already_set();
    comm_type.attr(def.ml_name) = method;
  }
}

}  // namespace meshmem::python
