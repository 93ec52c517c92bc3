// From an mpi4py communicator to the MPI_Comm meshmem takes, checking first that mpi4py runs
// on the MPI library this module was built with (two MPI libraries in one process cannot share
// a communicator: the handle would be read as something else).
#include <string>

#include "binding.hpp"

namespace meshmem::python {

std::string mpi_library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  MPI_Get_library_version(text, &len);  // allowed before MPI_Init
  std::string s(text, static_cast<std::size_t>(len > 0 ? len : 0));
  while (!s.empty() && (s.back() == '\n' || s.back() == '\0' || s.back() == ' ')) s.pop_back();
  return s;
}

namespace {

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

void init_mpi_here(bool* initialised_here) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) throw Error(ErrorCode::InvalidArgument, "meshmem.Comm: MPI was finalised already");
  if (initialized) return;
  int provided = 0;
  const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
  if (rc != MPI_SUCCESS) throw Error(ErrorCode::Mpi, "meshmem.Comm: MPI_Init_thread failed (" + std::to_string(rc) + ")");
  *initialised_here = true;
}

}  // namespace

MPI_Comm mpi_comm_of(py::handle comm, bool* initialised_here) {
  *initialised_here = false;
  if (!comm.is_none() && py::hasattr(comm, "_meshmem_world")) {  // the tests' world without mpi4py
    init_mpi_here(initialised_here);
    return MPI_COMM_WORLD;
  }
  py::object mpi;
  try {
    mpi = py::module_::import("mpi4py.MPI");
  } catch (py::error_already_set& e) {
    if (!comm.is_none())
      invalid(std::string("meshmem.Comm(comm): comm must be an mpi4py communicator, but mpi4py cannot be imported (") +
              e.what() + ")");
    // No mpi4py: the job's world, MPI initialised here (and finalised at exit, see module.cpp).
    init_mpi_here(initialised_here);
    return MPI_COMM_WORLD;
  }
  const std::string ours = mpi_library_version();
  const std::string theirs = mpi.attr("Get_library_version")().cast<std::string>();
  auto trimmed = [](std::string s) {
    while (!s.empty() && (s.back() == '\n' || s.back() == '\0' || s.back() == ' ')) s.pop_back();
    return s;
  };
  if (trimmed(theirs) != ours)
    throw Error(ErrorCode::Unsupported,
                "meshmem.Comm: mpi4py runs on another MPI library (\"" + first_line(theirs) +
                    "\") than meshmem was built with (\"" + first_line(ours) +
                    "\"); build mpi4py against meshmem's MPI (pip install --no-binary mpi4py mpi4py, with "
                    "that MPI's mpicc first on PATH) or build meshmem against mpi4py's");
  if (mpi.attr("_sizeof")(mpi.attr("Comm")).cast<std::size_t>() != sizeof(MPI_Comm))
    throw Error(ErrorCode::Unsupported, "meshmem.Comm: mpi4py's MPI_Comm has another size than meshmem's");
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized)
    throw Error(ErrorCode::InvalidArgument,
                "meshmem.Comm: MPI is not initialised (mpi4py.rc.initialize is False; call MPI.Init_thread() first)");
  py::object obj = comm.is_none() ? mpi.attr("COMM_WORLD") : py::reinterpret_borrow<py::object>(comm);
  if (!py::isinstance(obj, mpi.attr("Comm")))
    invalid("meshmem.Comm(comm): comm must be an mpi4py communicator (mpi4py.MPI.Comm), not " +
            py::str(py::type::handle_of(obj).attr("__name__")).cast<std::string>());
  const auto address = mpi.attr("_addressof")(obj).cast<std::uintptr_t>();
  const MPI_Comm c = *reinterpret_cast<const MPI_Comm*>(address);
  if (c == MPI_COMM_NULL) invalid("meshmem.Comm(comm): comm is MPI.COMM_NULL");
  return c;
}

// MPI_COMM_WORLD for the tests where mpi4py is absent (python/tests/conftest.py): rank, size,
// barrier, allgather and broadcast of bytes. Not part of the package's API.
void bind_world(py::module_& m) {
  auto check = [](int rc, const char* call) {
    if (rc != MPI_SUCCESS) throw Error(ErrorCode::Mpi, std::string("meshmem._world: ") + call + " failed (" + std::to_string(rc) + ")");
  };
  m.def("_world_init", [] {
    bool here = false;
    init_mpi_here(&here);
    return here;
  });
  m.def("_world_finalize", [] {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  });
  m.def("_world_rank", [check] {
    int r = 0;
    check(MPI_Comm_rank(MPI_COMM_WORLD, &r), "MPI_Comm_rank");
    return r;
  });
  m.def("_world_size", [check] {
    int n = 0;
    check(MPI_Comm_size(MPI_COMM_WORLD, &n), "MPI_Comm_size");
    return n;
  });
  m.def("_world_barrier", [check] {
    py::gil_scoped_release release;
    check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  });
  m.def("_world_allgather", [check](const py::bytes& mine) {
    const std::string data = mine;
    int size = 0;
    check(MPI_Comm_size(MPI_COMM_WORLD, &size), "MPI_Comm_size");
    int len = static_cast<int>(data.size());
    std::vector<int> lens(static_cast<std::size_t>(size)), offsets(static_cast<std::size_t>(size));
    std::string all;
    {
      py::gil_scoped_release release;
      check(MPI_Allgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, MPI_COMM_WORLD), "MPI_Allgather");
      int total = 0;
      for (int r = 0; r < size; ++r) {
        offsets[r] = total;
        total += lens[r];
      }
      all.resize(static_cast<std::size_t>(total));
      check(MPI_Allgatherv(data.data(), len, MPI_BYTE, all.data(), lens.data(), offsets.data(), MPI_BYTE, MPI_COMM_WORLD),
            "MPI_Allgatherv");
    }
    py::list out;
    for (int r = 0; r < size; ++r) out.append(py::bytes(all.data() + offsets[r], static_cast<std::size_t>(lens[r])));
    return out;
  });
  m.def("_world_bcast", [check](const py::bytes& mine, int root) {
    std::string data = mine;
    {
      py::gil_scoped_release release;
      long long len = static_cast<long long>(data.size());
      check(MPI_Bcast(&len, 1, MPI_LONG_LONG, root, MPI_COMM_WORLD), "MPI_Bcast");
      data.resize(static_cast<std::size_t>(len));
      check(MPI_Bcast(data.data(), static_cast<int>(len), MPI_BYTE, root, MPI_COMM_WORLD), "MPI_Bcast");
    }
    return py::bytes(data);
  });
}

}  // namespace meshmem::python
