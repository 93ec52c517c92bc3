// Windows' parts as arrays: NumPy arrays (host) or objects with __cuda_array_interface__ and
// __dlpack__ (device), and the dtypes that view them. A call's arguments (the caller's arrays,
// streams, names): arguments.cpp.
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

}  // namespace

Part::Part(std::shared_ptr<WindowHolder> w, void* p, std::size_t n, py::dtype d, std::vector<py::ssize_t> s, int r)
    : window(std::move(w)), ptr(p), nbytes(n), dtype(std::move(d)), shape(std::move(s)), owner_rank(r) {
  ++window->exports;
}
Part::~Part() { --window->exports; }

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
