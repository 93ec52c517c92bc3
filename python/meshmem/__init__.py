"""meshmem: one-sided put / get / signal / barrier over symmetric memory windows.

A binding of meshmem's C++ API for mpi4py programs::

    from mpi4py import MPI
    import numpy as np, meshmem

    with meshmem.Comm(MPI.COMM_WORLD) as comm:
        with comm.alloc(1024, memory="host") as win, comm.alloc_signals(1, memory="host") as sig:
            mine = win.local(np.float64)           # this rank's part, a NumPy array
            right = (comm.rank + 1) % comm.size
            comm.put_signal(win, right, np.full(8, comm.rank, np.float64), sig, 0, 1)
            comm.wait_until(sig, 0, ">=", 1)       # the left neighbour's data is here
            del mine                               # free() is refused while arrays of a window live

Device windows (memory="device") give meshmem.WindowArray objects that cupy.asarray,
torch.as_tensor(..., device="cuda") and torch.from_dlpack take without a copy; streams are
cupy.cuda.Stream, torch.cuda.Stream or a raw integer handle. Every error is meshmem.Error
(its .code a meshmem.ErrorCode). See docs/python.md.
"""

from ._meshmem import (  # noqa: F401
    Cmp,
    Comm,
    Error,
    ErrorCode,
    HaloExchange,
    HaloRegion,
    Memory,
    SignalOp,
    Signals,
    Window,
    WindowArray,
    default_memory,
    gpu_available,
    has_gpu_part,
    mpi_library_version,
    select_local_device,
)

__all__ = [
    "Cmp", "Comm", "Error", "ErrorCode", "HaloExchange", "HaloRegion", "Memory", "SignalOp",
    "Signals", "Window", "WindowArray", "default_memory", "gpu_available", "has_gpu_part",
    "mpi_library_version", "select_local_device",
]
