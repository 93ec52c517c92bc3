// A call's Python arguments as the C++ API's: any caller's array as the memory of a put or a
// get, streams, memory kinds, comparisons and operations. These run on every put, get,
// put_signal and wait: what an argument's type is (a window's array, a buffer, a torch tensor,
// a CuPy array, a __cuda_array_interface__ object; which kind of stream) is found once per type
// and kept, and each call reads only the attributes that kind needs.
#include <pybind11/stl.h>

#include <cctype>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "binding.hpp"

namespace meshmem::python {

namespace {

PyObject* interned(const char* name) { return PyUnicode_InternFromString(name); }

// obj.name, or a null object where it has none, in one lookup (not hasattr, then getattr) and
// without raising and clearing an AttributeError: for types with the generic lookup Python
// then skips making the exception. An unset __slots__ member reads as none too.
py::object attribute_or_null(py::handle obj, PyObject* name) {
  PyObject* value = nullptr;
#if PY_VERSION_HEX >= 0x030D0000
  const int found = PyObject_GetOptionalAttr(obj.ptr(), name, &value);
#else
  const int found = _PyObject_LookupAttr(obj.ptr(), name, &value);
#endif
  if (found < 0) throw py::error_already_set();
  return found > 0 ? py::reinterpret_steal<py::object>(value) : py::object();
}

// Whether the type itself (its MRO) defines `name`: then every object of it has the attribute.
bool type_defines(PyTypeObject* type, PyObject* name) { return _PyType_Lookup(type, name) != nullptr; }

// Whether the objects of `type` can have attributes that their type does not define (an
// instance __dict__, or a lookup of their own): then only the object itself answers "has no".
bool instances_may_add(PyTypeObject* type) {
  return type->tp_dictoffset != 0 || type->tp_getattro != PyObject_GenericGetAttr;
}

// Whether `obj` has attribute `name` (interned), without making its value where the type answers.
bool has_attribute(py::handle obj, PyObject* name) {
  PyTypeObject* type = Py_TYPE(obj.ptr());
  if (type_defines(type, name)) return true;
  if (!instances_may_add(type)) return false;
  return static_cast<bool>(attribute_or_null(obj, name));
}

bool module_starts_with(PyTypeObject* type, const char* prefix) {
  static PyObject* const module = interned("__module__");
  py::object m = attribute_or_null(py::handle(reinterpret_cast<PyObject*>(type)), module);
  if (!m || !PyUnicode_Check(m.ptr())) return false;
  const char* text = PyUnicode_AsUTF8(m.ptr());
  if (text == nullptr) {
    PyErr_Clear();
    return false;
  }
  return std::strncmp(text, prefix, std::strlen(prefix)) == 0;
}

// What a type's objects are, as the memory of a call, or as a stream: found once per type and
// kept with a reference to the type (so that its address is never taken by another type).
// Answers that an object could change (an attribute its type does not define) are not kept.
template <class Kind>
class KindsByType {
 public:
  bool find(PyTypeObject* type, Kind& out) const {
    for (const Known& k : known_)
      if (k.type == type) {
        out = k.kind;
        return true;
      }
    return false;
  }
  void keep(PyTypeObject* type, Kind kind) {
    Py_INCREF(reinterpret_cast<PyObject*>(type));
    known_.push_back(Known{type, kind});
  }

 private:
  struct Known {
    PyTypeObject* type;
    Kind kind;
  };
  std::vector<Known> known_;  // a handful of types per program; read and written with the GIL held
};

// Never destroyed: the references they hold are the interpreter's to drop at its exit.
template <class Kind>
KindsByType<Kind>& kinds_by_type() {
  static auto* kinds = new KindsByType<Kind>;
  return *kinds;
}

// ---- arrays ----

enum class ArrayKind { WindowPart, Buffer, Torch, Cupy, CudaArrayInterface, NotAnArray };

PyObject* const& name_cuda_array_interface() {
  static PyObject* const name = interned("__cuda_array_interface__");
  return name;
}

// The kind of `obj`; `keep`: whether every object of its type is of that kind.
ArrayKind classify_array(py::handle obj, bool& keep) {
  PyTypeObject* type = Py_TYPE(obj.ptr());
  static PyTypeObject* const part = reinterpret_cast<PyTypeObject*>(py::type::of<Part>().ptr());
  keep = true;
  if (PyType_IsSubtype(type, part)) return ArrayKind::WindowPart;
  const bool cai_on_type = type_defines(type, name_cuda_array_interface());
  const bool cai = cai_on_type || (instances_may_add(type) && attribute_or_null(obj, name_cuda_array_interface()));
  keep = cai_on_type || !instances_may_add(type);
  // Host arrays through the buffer protocol; GPU arrays first, as CuPy's ndarray offers a buffer
  // too (one that refuses: its memory is not host memory).
  if (PyObject_CheckBuffer(obj.ptr()) && !cai) return ArrayKind::Buffer;
  // PyTorch: the tensor's own accessors (its __cuda_array_interface__ is slow and CPU tensors have none).
  static PyObject* const data_ptr = interned("data_ptr");
  static PyObject* const element_size = interned("element_size");
  static PyObject* const is_contiguous = interned("is_contiguous");
  if (type_defines(type, data_ptr) && type_defines(type, element_size) && type_defines(type, is_contiguous)) {
    keep = true;
    return ArrayKind::Torch;
  }
  if (has_attribute(obj, data_ptr) && has_attribute(obj, element_size) && has_attribute(obj, is_contiguous)) {
    keep = false;
    return ArrayKind::Torch;
  }
  if (!cai) return ArrayKind::NotAnArray;
  // CuPy: the attributes its ndarray keeps (pointer, size, contiguity, dtype) instead of the
  // interface's dictionary, which it builds on each request.
  static PyObject* const c_contiguous = interned("_c_contiguous");
  static PyObject* const data = interned("data");
  static PyObject* const size = interned("size");
  static PyObject* const dtype = interned("dtype");
  if (cai_on_type && type_defines(type, c_contiguous) && type_defines(type, data) && type_defines(type, size) &&
      type_defines(type, dtype) && module_starts_with(type, "cupy"))
    return ArrayKind::Cupy;
  return ArrayKind::CudaArrayInterface;
}

ArrayKind array_kind(py::handle obj) {
  PyTypeObject* type = Py_TYPE(obj.ptr());
  ArrayKind kind;
  if (kinds_by_type<ArrayKind>().find(type, kind)) return kind;
  bool keep = false;
  kind = classify_array(obj, keep);
  if (keep) kinds_by_type<ArrayKind>().keep(type, kind);
  return kind;
}

// A small integer of a typestr ("<f8"), the item size.
std::size_t itemsize_of_typestr(const std::string& typestr) {
  if (typestr.size() < 3) return 1;
  return static_cast<std::size_t>(std::stoul(typestr.substr(2)));
}

bool c_contiguous(const std::vector<py::ssize_t>& shape, const std::vector<py::ssize_t>& strides, std::size_t itemsize) {
  py::ssize_t expect = static_cast<py::ssize_t>(itemsize);
  for (std::size_t i = shape.size(); i-- > 0;) {
    if (shape[i] != 1 && strides[i] != expect) return false;
    expect *= shape[i];
  }
  return true;
}

std::string type_name(py::handle obj) { return py::str(py::type::handle_of(obj).attr("__name__")).cast<std::string>(); }

// obj.name as a new reference; null with the error cleared where it fails.
PyObject* read_or_clear(PyObject* obj, PyObject* name) {
  PyObject* v = PyObject_GetAttr(obj, name);
  if (v == nullptr) PyErr_Clear();
  return v;
}

// A CuPy ndarray's memory from its own attributes; false (nothing raised) where one of them is
// not what CuPy's ndarray has, and the interface's dictionary is asked instead.
bool cupy_span(Span& out, py::handle obj, bool& contiguous) {
  static PyObject* const c_name = interned("_c_contiguous");
  static PyObject* const data_name = interned("data");
  static PyObject* const ptr_name = interned("ptr");
  static PyObject* const size_name = interned("size");
  static PyObject* const dtype_name = interned("dtype");
  static PyObject* const itemsize_name = interned("itemsize");
  py::object c = py::reinterpret_steal<py::object>(read_or_clear(obj.ptr(), c_name));
  py::object data = py::reinterpret_steal<py::object>(read_or_clear(obj.ptr(), data_name));
  py::object size = py::reinterpret_steal<py::object>(read_or_clear(obj.ptr(), size_name));
  py::object dtype = py::reinterpret_steal<py::object>(read_or_clear(obj.ptr(), dtype_name));
  if (!c || !data || !size || !dtype || !PyBool_Check(c.ptr()) || !PyLong_Check(size.ptr())) return false;
  py::object ptr = py::reinterpret_steal<py::object>(read_or_clear(data.ptr(), ptr_name));
  py::object itemsize = py::reinterpret_steal<py::object>(read_or_clear(dtype.ptr(), itemsize_name));
  if (!ptr || !itemsize || !PyLong_Check(ptr.ptr()) || !PyLong_Check(itemsize.ptr())) return false;
  const unsigned long long p = PyLong_AsUnsignedLongLong(ptr.ptr());
  const Py_ssize_t n = PyLong_AsSsize_t(size.ptr());
  const Py_ssize_t item = PyLong_AsSsize_t(itemsize.ptr());
  if (PyErr_Occurred() || n < 0 || item <= 0) {
    PyErr_Clear();
    return false;
  }
  contiguous = c.ptr() == Py_True;
  out.ptr = reinterpret_cast<void*>(static_cast<std::uintptr_t>(p));
  out.itemsize = static_cast<std::size_t>(item);
  out.nbytes = static_cast<std::size_t>(n) * out.itemsize;
  out.device = true;
  return true;
}

// obj.name, raising what the lookup raised.
py::object attribute(py::handle obj, PyObject* name) {
  PyObject* v = PyObject_GetAttr(obj.ptr(), name);
  if (v == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(v);
}

py::object call_method(py::handle obj, PyObject* name) {
  PyObject* v = PyObject_CallMethodNoArgs(obj.ptr(), name);
  if (v == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(v);
}

}  // namespace

Span::~Span() {
  if (has_view) PyBuffer_Release(&view);
}

void span_of(Span& out, py::handle obj, bool writable, const std::string& call, const char* what) {
  // The message prefix is built only where a message is: this runs on every put and get.
  const auto at = [&] { return call + ": " + what; };
  const auto not_contiguous = [&](const char* fix) {
    invalid(at() + " (" + type_name(obj) + ") is not C-contiguous; pass a contiguous array (" + fix +
            "); nothing was written");
  };
  switch (array_kind(obj)) {
    case ArrayKind::WindowPart: {
      const Part& p = obj.cast<const Part&>();
      out.ptr = p.ptr;
      out.nbytes = p.nbytes;
      out.itemsize = static_cast<std::size_t>(p.dtype.itemsize());
      out.device = p.device();
      return;
    }
    case ArrayKind::Buffer: {
      if (PyObject_GetBuffer(obj.ptr(), &out.view, PyBUF_RECORDS_RO) != 0) {
        py::error_already_set e;
        invalid(at() + " (" + type_name(obj) + ") refused its buffer: " + e.what());
      }
      out.has_view = true;
      if (writable && out.view.readonly) invalid(at() + " (" + type_name(obj) + ") is read-only; nothing was written");
      if (!PyBuffer_IsContiguous(&out.view, 'C'))
        invalid(at() + " (" + type_name(obj) + ") is not C-contiguous; pass a contiguous array "
                       "(numpy.ascontiguousarray) or a contiguous slice; nothing was written");
      if (out.view.format != nullptr && std::strchr(out.view.format, 'O') != nullptr)
        invalid(at() + " has dtype object (Python references, not data); nothing was written");
      out.ptr = out.view.buf;
      out.nbytes = static_cast<std::size_t>(out.view.len);
      out.itemsize = static_cast<std::size_t>(out.view.itemsize);
      return;
    }
    case ArrayKind::Torch: {
      static PyObject* const is_contiguous = interned("is_contiguous");
      static PyObject* const data_ptr = interned("data_ptr");
      static PyObject* const element_size = interned("element_size");
      static PyObject* const numel = interned("numel");
      static PyObject* const is_cuda = interned("is_cuda");
      if (!PyObject_IsTrue(call_method(obj, is_contiguous).ptr()))
        invalid(at() + " (a torch tensor) is not contiguous; pass tensor.contiguous(); nothing was written");
      out.ptr = reinterpret_cast<void*>(call_method(obj, data_ptr).cast<std::uintptr_t>());
      out.itemsize = call_method(obj, element_size).cast<std::size_t>();
      out.nbytes = call_method(obj, numel).cast<std::size_t>() * out.itemsize;
      out.device = attribute(obj, is_cuda).cast<bool>();
      return;
    }
    case ArrayKind::Cupy: {
      bool contiguous = false;
      if (cupy_span(out, obj, contiguous)) {
        if (!contiguous) not_contiguous("cupy.ascontiguousarray");
        return;
      }
      break;  // not the attributes of CuPy's ndarray: its interface below
    }
    case ArrayKind::CudaArrayInterface:
      break;
    case ArrayKind::NotAnArray:
      invalid(at() + ": " + type_name(obj) + " is not an array (neither the buffer protocol, "
                   "__cuda_array_interface__ nor a torch tensor)");
  }
  py::object cai = attribute_or_null(obj, name_cuda_array_interface());
  if (!cai || cai.is_none())
    invalid(at() + ": " + type_name(obj) + " is not an array (neither the buffer protocol, "
                 "__cuda_array_interface__ nor a torch tensor)");
  py::dict d = cai.cast<py::dict>();
  py::tuple data = d["data"].cast<py::tuple>();
  if (writable && data[1].cast<bool>()) invalid(at() + " (" + type_name(obj) + ") is read-only; nothing was written");
  if (d.contains("mask") && !d["mask"].is_none()) invalid(at() + " has a mask; masked arrays are not supported");
  const std::string typestr = d["typestr"].cast<std::string>();
  out.itemsize = itemsize_of_typestr(typestr);
  if (typestr.size() > 1 && typestr[1] == 'O') invalid(at() + " has dtype object; nothing was written");
  std::vector<py::ssize_t> shape = d["shape"].cast<std::vector<py::ssize_t>>();
  std::size_t n = out.itemsize;
  for (py::ssize_t s : shape) n *= static_cast<std::size_t>(s);
  if (d.contains("strides") && !d["strides"].is_none()) {
    if (!c_contiguous(shape, d["strides"].cast<std::vector<py::ssize_t>>(), out.itemsize))
      not_contiguous("cupy.ascontiguousarray");
  }
  out.ptr = reinterpret_cast<void*>(data[0].cast<std::uintptr_t>());
  out.nbytes = n;
  out.device = true;
}

// ---- streams ----

namespace {

PyObject* const& name_protocol() {
  static PyObject* const name = interned("__cuda_stream__");
  return name;
}
PyObject* const& name_torch_handle() {
  static PyObject* const name = interned("cuda_stream");
  return name;
}
PyObject* const& name_cupy_handle() {
  static PyObject* const name = interned("ptr");
  return name;
}

// torch.cuda.Stream's cuda_stream and cupy.cuda.Stream's ptr are the handle that their
// __cuda_stream__ returns, read without a call; a type that defines the protocol is asked
// through it. Those are kept per type; any other object is asked each time (NotKnown), as its
// own attributes may answer (an instance attribute, __getattr__, an unset __slots__ member).
enum class StreamKind { TorchHandle, CupyPtr, Protocol, NotKnown };

StreamKind classify_stream(PyTypeObject* type) {
  if (type_defines(type, name_torch_handle()) && module_starts_with(type, "torch")) return StreamKind::TorchHandle;
  if (type_defines(type, name_cupy_handle()) && module_starts_with(type, "cupy")) return StreamKind::CupyPtr;
  if (type_defines(type, name_protocol()) && !instances_may_add(type)) return StreamKind::Protocol;
  return StreamKind::NotKnown;
}
}  // namespace

Stream stream_of(py::handle s, const char* call) {
  if (s.is_none()) return nullptr;
  auto from_int = [&](py::handle v) {
    if (!PyLong_Check(v.ptr())) invalid(std::string(call) + ": the stream handle is not an integer");
    const unsigned long long h = PyLong_AsUnsignedLongLong(v.ptr());
    if (PyErr_Occurred()) {
      PyErr_Clear();
      invalid(std::string(call) + ": the stream handle is negative or too large");
    }
    return reinterpret_cast<Stream>(static_cast<std::uintptr_t>(h));
  };
  auto from_protocol = [&](py::handle f) {
    py::object t = py::reinterpret_borrow<py::object>(f)();
    if (!PyTuple_Check(t.ptr()) || PyTuple_GET_SIZE(t.ptr()) != 2)
      invalid(std::string(call) + ": __cuda_stream__() did not return a (version, handle) tuple");
    return from_int(PyTuple_GET_ITEM(t.ptr(), 1));
  };
  if (PyLong_Check(s.ptr())) return from_int(s);
  PyTypeObject* type = Py_TYPE(s.ptr());
  StreamKind kind;
  if (!kinds_by_type<StreamKind>().find(type, kind)) {
    kind = classify_stream(type);
    kinds_by_type<StreamKind>().keep(type, kind);  // a type's answer: NotKnown too (asked each time)
  }
  switch (kind) {
    case StreamKind::TorchHandle: return from_int(attribute(s, name_torch_handle()));
    case StreamKind::CupyPtr: return from_int(attribute(s, name_cupy_handle()));
    case StreamKind::Protocol: return from_protocol(attribute(s, name_protocol()));
    case StreamKind::NotKnown: break;
  }
  // Looked up without raising for the names a stream lacks.
  if (py::object f = attribute_or_null(s, name_protocol())) return from_protocol(f);
  if (py::object h = attribute_or_null(s, name_torch_handle())) return from_int(h);  // torch.cuda.Stream
  if (py::object h = attribute_or_null(s, name_cupy_handle())) return from_int(h);   // cupy.cuda.Stream
  invalid(std::string(call) + ": stream must be None, an integer handle, a cupy.cuda.Stream or a "
                              "torch.cuda.Stream; got " + type_name(s));
}

// ---- names and enums ----

namespace {
std::string lower_str(py::handle v) {
  std::string s = py::str(v).cast<std::string>();
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}
bool is(py::handle s, const char* text) { return PyUnicode_CompareWithASCIIString(s.ptr(), text) == 0; }
}  // namespace

Memory memory_of(py::handle m, const char* call) {
  if (py::isinstance<Memory>(m)) return m.cast<Memory>();
  if (py::isinstance<py::str>(m)) {
    const std::string s = lower_str(m);
    if (s == "device") return Memory::Device;
    if (s == "host") return Memory::Host;
  }
  invalid(std::string(call) + ": memory must be \"device\" or \"host\", not " + py::repr(m).cast<std::string>());
}

Cmp cmp_of(py::handle c, const char* call) {
  if (PyUnicode_Check(c.ptr())) {  // the common spellings without building strings
    if (is(c, ">=")) return Cmp::GE;
    if (is(c, "==")) return Cmp::EQ;
  }
  if (py::isinstance<Cmp>(c)) return c.cast<Cmp>();
  if (py::isinstance<py::str>(c)) {
    const std::string s = lower_str(c);
    if (s == "==" || s == "eq") return Cmp::EQ;
    if (s == "!=" || s == "ne") return Cmp::NE;
    if (s == ">" || s == "gt") return Cmp::GT;
    if (s == ">=" || s == "ge") return Cmp::GE;
    if (s == "<" || s == "lt") return Cmp::LT;
    if (s == "<=" || s == "le") return Cmp::LE;
  }
  invalid(std::string(call) + ": cmp must be a meshmem.Cmp or one of == != > >= < <=, not " +
          py::repr(c).cast<std::string>());
}

SignalOp op_of(py::handle o, const char* call) {
  if (PyUnicode_Check(o.ptr())) {
    if (is(o, "set")) return SignalOp::Set;
    if (is(o, "add")) return SignalOp::Add;
  }
  if (py::isinstance<SignalOp>(o)) return o.cast<SignalOp>();
  if (py::isinstance<py::str>(o)) {
    const std::string s = lower_str(o);
    if (s == "set") return SignalOp::Set;
    if (s == "add") return SignalOp::Add;
  }
  invalid(std::string(call) + ": op must be \"set\", \"add\" or a meshmem.SignalOp, not " +
          py::repr(o).cast<std::string>());
}

}  // namespace meshmem::python
