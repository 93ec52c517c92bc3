// Arrays in and out of the binding: windows' parts as NumPy arrays (host) or as objects with
// __cuda_array_interface__ and __dlpack__ (device); any caller's array as the memory of a put
// or a get; streams, memory kinds, comparisons and operations from Python values.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>

#include "binding.hpp"

#if MESHMEM_PYTHON_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace meshmem::python {

namespace {

// DLPack's C ABI (the unversioned DLManagedTensor of the DLPack specification, which every
// framework accepts), written here so that no dlpack header is needed to build.
struct DLDevice {
  std::int32_t device_type;  // kDLCPU 1, kDLCUDA 2
  std::int32_t device_id;
};
struct DLDataType {
  std::uint8_t code;  // kDLInt 0, kDLUInt 1, kDLFloat 2, kDLComplex 5, kDLBool 6
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;  // null: C-contiguous
  std::uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};
constexpr std::int32_t kDLCPU = 1;
constexpr std::int32_t kDLCUDA = 2;

struct Exported {
  DLManagedTensor tensor{};
  std::vector<std::int64_t> shape;
  PyObject* part = nullptr;  // a reference: the window stays alive while the consumer holds it
};

// Called by the consumer, from any thread, with or without the GIL.
void delete_exported(DLManagedTensor* t) {
  auto* e = static_cast<Exported*>(t->manager_ctx);
  if (Py_IsInitialized()) {
    PyGILState_STATE g = PyGILState_Ensure();
    Py_XDECREF(e->part);
    PyGILState_Release(g);
  }
  delete e;
}

// A capsule no consumer took: its tensor is still ours to delete.
void delete_capsule(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, "dltensor")) return;  // consumed: renamed "used_dltensor"
  auto* t = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  if (t != nullptr && t->deleter != nullptr) t->deleter(t);
}

DLDataType dl_dtype(const py::dtype& d) {
  DLDataType t{0, static_cast<std::uint8_t>(d.itemsize() * 8), 1};
  switch (d.kind()) {
    case 'i': t.code = 0; break;
    case 'u': t.code = 1; break;
    case 'f': t.code = 2; break;
    case 'c': t.code = 5; break;
    case 'b': t.code = 6; break;
    default: invalid(std::string("__dlpack__: dtype ") + d.attr("name").cast<std::string>() + " has no DLPack type");
  }
  return t;
}

py::object dlpack(py::object self, py::kwargs kwargs) {
  Part& p = self.cast<Part&>();
  if (kwargs.contains("copy") && !kwargs["copy"].is_none() && kwargs["copy"].cast<bool>())
    throw py::buffer_error("meshmem: __dlpack__(copy=True): a window's array is exported without a copy only");
  auto e = std::make_unique<Exported>();
  e->shape.assign(p.shape.begin(), p.shape.end());
  DLTensor& t = e->tensor.dl_tensor;
  t.data = p.ptr;
  t.device = p.device() ? DLDevice{kDLCUDA, p.window->owner->device} : DLDevice{kDLCPU, 0};
  t.ndim = static_cast<std::int32_t>(e->shape.size());
  t.dtype = dl_dtype(p.dtype);
  t.shape = e->shape.data();
  t.strides = nullptr;
  t.byte_offset = 0;
  e->tensor.manager_ctx = e.get();
  e->tensor.deleter = delete_exported;
  e->part = self.release().ptr();
  Exported* raw = e.release();
  PyObject* capsule = PyCapsule_New(&raw->tensor, "dltensor", delete_capsule);
  if (capsule == nullptr) {
    delete_exported(&raw->tensor);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(capsule);
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

}  // namespace

Part::Part(std::shared_ptr<WindowHolder> w, void* p, std::size_t n, py::dtype d, std::vector<py::ssize_t> s, int r)
    : window(std::move(w)), ptr(p), nbytes(n), dtype(std::move(d)), shape(std::move(s)), owner_rank(r) {
  ++window->exports;
}
Part::~Part() { --window->exports; }

Span::~Span() {
  if (has_view) PyBuffer_Release(&view);
}

namespace {
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

// Whether `obj` has attribute `name` (interned): where the type's generic lookup answers (CuPy,
// PyTorch and Numba define __cuda_array_interface__ and their streams' handles on the type; a
// NumPy array has no instance attributes), without making the attribute's value.
bool has_attribute(py::handle obj, PyObject* name) {
  PyTypeObject* type = Py_TYPE(obj.ptr());
  if (type->tp_getattro == PyObject_GenericGetAttr) {
    if (_PyType_Lookup(type, name) != nullptr) return true;
    if (type->tp_dictoffset == 0) return false;
  }
  return static_cast<bool>(attribute_or_null(obj, name));
}

bool has_cuda_array_interface(py::handle obj) {
  static PyObject* const name = PyUnicode_InternFromString("__cuda_array_interface__");
  return has_attribute(obj, name);
}
}  // namespace

void span_of(Span& out, py::handle obj, bool writable, const std::string& call, const char* what) {
  // The message prefix is built only where a message is: this runs on every put and get.
  const auto at = [&] { return call + ": " + what; };
  if (py::isinstance<Part>(obj)) {
    const Part& p = obj.cast<const Part&>();
    out.ptr = p.ptr;
    out.nbytes = p.nbytes;
    out.itemsize = static_cast<std::size_t>(p.dtype.itemsize());
    out.device = p.device();
    return;
  }
  // Host arrays through the buffer protocol; GPU arrays first, as CuPy's ndarray offers a buffer
  // too (one that refuses: its memory is not host memory).
  if (PyObject_CheckBuffer(obj.ptr()) && !has_cuda_array_interface(obj)) {
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
  // PyTorch: the tensor's own accessors (its __cuda_array_interface__ is slow and CPU tensors have none).
  static PyObject* const data_ptr = PyUnicode_InternFromString("data_ptr");
  static PyObject* const element_size = PyUnicode_InternFromString("element_size");
  static PyObject* const is_contiguous = PyUnicode_InternFromString("is_contiguous");
  if (has_attribute(obj, data_ptr) && has_attribute(obj, element_size) && has_attribute(obj, is_contiguous)) {
    if (!obj.attr("is_contiguous")().cast<bool>())
      invalid(at() + " (a torch tensor) is not contiguous; pass tensor.contiguous(); nothing was written");
    out.ptr = reinterpret_cast<void*>(obj.attr("data_ptr")().cast<std::uintptr_t>());
    out.itemsize = obj.attr("element_size")().cast<std::size_t>();
    out.nbytes = obj.attr("numel")().cast<std::size_t>() * out.itemsize;
    out.device = obj.attr("is_cuda").cast<bool>();
    return;
  }
  py::object cai = py::getattr(obj, "__cuda_array_interface__", py::none());
  if (!cai.is_none()) {
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
        invalid(at() + " (" + type_name(obj) + ") is not C-contiguous; pass a contiguous array "
                     "(cupy.ascontiguousarray); nothing was written");
    }
    out.ptr = reinterpret_cast<void*>(data[0].cast<std::uintptr_t>());
    out.nbytes = n;
    out.device = true;
    return;
  }
  invalid(at() + ": " + type_name(obj) + " is not an array (neither the buffer protocol, "
               "__cuda_array_interface__ nor a torch tensor)");
}

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
  if (PyLong_Check(s.ptr())) return from_int(s);
  // Looked up without raising for the names a stream lacks: this runs on every stream call.
  static PyObject* const protocol = PyUnicode_InternFromString("__cuda_stream__");
  static PyObject* const torch_handle = PyUnicode_InternFromString("cuda_stream");
  static PyObject* const cupy_handle = PyUnicode_InternFromString("ptr");
  if (py::object f = attribute_or_null(s, protocol)) {
    py::tuple t = f().cast<py::tuple>();
    return from_int(t[1]);
  }
  if (py::object h = attribute_or_null(s, torch_handle)) return from_int(h);  // torch.cuda.Stream
  if (py::object h = attribute_or_null(s, cupy_handle)) return from_int(h);   // cupy.cuda.Stream
  invalid(std::string(call) + ": stream must be None, an integer handle, a cupy.cuda.Stream or a "
                              "torch.cuda.Stream; got " + type_name(s));
}

namespace {
std::string lower_str(py::handle v) {
  std::string s = py::str(v).cast<std::string>();
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}
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

namespace {
bool is(py::handle s, const char* text) { return PyUnicode_CompareWithASCIIString(s.ptr(), text) == 0; }
}  // namespace

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

py::dtype dtype_of(py::handle d, const char* call) {
  py::object spec = py::reinterpret_borrow<py::object>(d);
  // torch.float32 and the like: the NumPy dtype of the same name.
  const std::string text = py::str(py::handle(d)).cast<std::string>();
  if (text.rfind("torch.", 0) == 0) spec = py::str(text.substr(6));
  py::dtype out;
  try {
    out = py::reinterpret_steal<py::dtype>(py::module_::import("numpy").attr("dtype")(spec).release());
  } catch (py::error_already_set& e) {
    invalid(std::string(call) + ": dtype " + py::repr(d).cast<std::string>() + " is not a dtype (" + e.what() + ")");
  }
  if (out.kind() == 'O' || out.kind() == 'V' || out.kind() == 'U' || out.kind() == 'S' || out.itemsize() == 0)
    invalid(std::string(call) + ": dtype " + out.attr("name").cast<std::string>() +
            " is not a numeric dtype (object, void and string dtypes cannot view a window)");
  return out;
}

py::object window_array(const std::shared_ptr<WindowHolder>& w, int rank, py::handle dtype, py::handle shape,
                        std::size_t offset, const char* call) {
  w->check(call);
  const std::string at = call;
  py::dtype dt = dtype_of(dtype, call);
  const auto item = static_cast<std::size_t>(dt.itemsize());
  void* base = rank < 0 ? w->words().local() : w->words().peer(rank);
  if (base == nullptr) return py::none();  // not mapped here (another node, or the mpi transport)
  if (offset > w->bytes)
    invalid(at + ": offset " + std::to_string(offset) + " is past the end of the window (" + std::to_string(w->bytes) + " bytes)");
  std::vector<py::ssize_t> dims;
  if (shape.is_none()) {
    dims.push_back(static_cast<py::ssize_t>((w->bytes - offset) / item));
  } else if (PyLong_Check(shape.ptr())) {
    dims.push_back(shape.cast<py::ssize_t>());
  } else {
    dims = shape.cast<std::vector<py::ssize_t>>();
  }
  std::size_t n = item;
  for (py::ssize_t s : dims) {
    if (s < 0) invalid(at + ": a negative dimension in shape");
    n *= static_cast<std::size_t>(s);
  }
  if (n > w->bytes - offset)
    invalid(at + ": shape and dtype need " + std::to_string(n) + " bytes from offset " + std::to_string(offset) +
            ", past the end of the window (" + std::to_string(w->bytes) + " bytes)");
  if (offset % item != 0)
    invalid(at + ": offset " + std::to_string(offset) + " is not a multiple of the item size " + std::to_string(item));
  void* ptr = static_cast<char*>(base) + offset;
  const int owner_rank = rank < 0 ? w->owner->comm->rank() : rank;
  py::object part = py::cast(new Part(w, ptr, n, dt, dims, owner_rank), py::return_value_policy::take_ownership);
  if (w->memory == Memory::Device) return part;
  return py::array(dt, dims, {}, ptr, part);  // base = part: the window stays alive
}

int current_device() {
#if MESHMEM_PYTHON_HAVE_CUDA
  if (!gpu_available()) return -1;
  int d = -1;
  if (cudaGetDevice(&d) != cudaSuccess) return -1;
  return d;
#else
  return -1;
#endif
}

void bind_arrays(py::module_& m) {
  py::class_<Part>(m, "WindowArray",
                   "Part of a window as an array without a copy: host windows give numpy.ndarray over it; "
                   "device windows give this object, which cupy.asarray, torch.as_tensor and "
                   "torch.from_dlpack take. It keeps its window alive.")
      .def_property_readonly("ptr", [](const Part& p) { return reinterpret_cast<std::uintptr_t>(p.ptr); })
      .def_property_readonly("nbytes", [](const Part& p) { return p.nbytes; })
      .def_property_readonly("shape", [](const Part& p) { return py::tuple(py::cast(p.shape)); })
      .def_property_readonly("dtype", [](const Part& p) { return p.dtype; })
      .def_property_readonly("rank", [](const Part& p) { return p.owner_rank; }, "whose part of the window")
      .def_property_readonly("memory", [](const Part& p) { return p.device() ? "device" : "host"; })
      .def_property_readonly("__cuda_array_interface__",
                             [](const Part& p) -> py::dict {
                               if (!p.device()) throw py::attribute_error("a host window's array has no __cuda_array_interface__");
                               py::dict d;
                               d["shape"] = py::tuple(py::cast(p.shape));
                               d["typestr"] = p.dtype.attr("str");
                               d["data"] = py::make_tuple(reinterpret_cast<std::uintptr_t>(p.ptr), false);
                               d["strides"] = py::none();
                               d["version"] = 3;
                               return d;
                             })
      .def("__dlpack__", &dlpack,
           "DLPack capsule of the array (the consumer's stream is not waited for: order the window's "
           "writes before it yourself)")
      .def("__dlpack_device__",
           [](const Part& p) {
             if (p.device()) return py::tuple(py::make_tuple(kDLCUDA, p.window->owner->device));
             return py::tuple(py::make_tuple(kDLCPU, 0));
           })
      .def("__repr__", [](const Part& p) {
        return "<meshmem.WindowArray rank " + std::to_string(p.owner_rank) + " " + (p.device() ? "device" : "host") +
               " " + p.dtype.attr("name").cast<std::string>() + " " + py::str(py::tuple(py::cast(p.shape))).cast<std::string>() + ">";
      });
}

}  // namespace meshmem::python
