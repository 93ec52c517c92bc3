#!/usr/bin/env python3
"""Jacobi iterations on an N x N grid (CuPy), its rows split across the ranks, with the halo
exchange done either by MPI through host memory (the usual mpi4py code: device -> host ->
Sendrecv -> host -> device) or by meshmem (puts into the neighbours' device windows and
signals, ordered on the CuPy stream; the host does not wait).

    mpirun -np 4 python examples/python/jacobi.py --n 4096 --iters 200 --halo meshmem
    mpirun -np 4 python examples/python/jacobi.py --n 4096 --iters 200 --halo mpi
    mpirun -np 2 python examples/python/jacobi.py --n 512 --iters 100 --check

--array numpy runs the same program on the CPU (NumPy, host windows). --check compares the result with the same iterations run on rank 0 alone (bitwise: every
point is computed by the same expression). The top edge is held at 1, the others at 0.
"""

import argparse
import sys
import time

import numpy as np


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1024, help="grid points per side")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--halo", choices=("meshmem", "mpi"), default="meshmem")
    p.add_argument("--check", action="store_true", help="compare with a one-rank run on rank 0")
    p.add_argument("--array", choices=("cupy", "numpy"), default="cupy",
                   help="numpy: the same program on the CPU with host windows (no GPU needed)")
    p.add_argument("--csv", help="append a row in bench/results' format (variant python-<halo>, size_bytes = n, "
                                 "latency_us = time per iteration), as examples/03_jacobi --csv does")
    p.add_argument("--machine", default="unknown")
    p.add_argument("--commit", default="unknown")
    return p.parse_args(argv)


def rows_of(n, size, rank):
    """The interior rows (1 .. n-2) this rank updates: [first, first + count)."""
    interior = n - 2
    count = interior // size + (1 if rank < interior % size else 0)
    first = 1 + rank * (interior // size) + min(rank, interior % size)
    return first, count


def initial(cp, n, first, count):
    """This rank's rows first-1 .. first+count (its halos included) of the initial grid."""
    g = cp.zeros((count + 2, n), dtype=cp.float64)
    if first == 1:
        g[0, :] = 1.0  # the top edge
    return g


_fused_step = None  # CuPy's kernel for step(), made at its first use


def step(src, dst):
    """One sweep of src's interior into dst's. CuPy arrays: one fused kernel over the four
    shifted views (the sum of slices would launch a kernel and make a grid-sized temporary
    for each operation: about three times the memory traffic of the C++ example's kernel);
    NumPy arrays: the same sum on the host. Both add in the same order, so they agree bit
    for bit."""
    global _fused_step
    if hasattr(src, "__cuda_array_interface__"):
        if _fused_step is None:
            import cupy
            _fused_step = cupy.ElementwiseKernel(
                "float64 up, float64 down, float64 left, float64 right", "float64 out",
                "out = 0.25 * (up + down + left + right)", "meshmem_jacobi_step")
        _fused_step(src[:-2, 1:-1], src[2:, 1:-1], src[1:-1, :-2], src[1:-1, 2:], dst[1:-1, 1:-1])
        return
    dst[1:-1, 1:-1] = 0.25 * (src[:-2, 1:-1] + src[2:, 1:-1] + src[1:-1, :-2] + src[1:-1, 2:])


def reference(cp, n, iters):
    a, b = initial(cp, n, 1, n - 2), initial(cp, n, 1, n - 2)
    for _ in range(iters):
        step(a, b)
        a, b = b, a
    return cp.asnumpy(a)


def run_mpi(cp, mpi, n, iters, first, count):
    from mpi4py import MPI
    up = mpi.rank - 1 if mpi.rank > 0 else MPI.PROC_NULL
    down = mpi.rank + 1 if mpi.rank < mpi.size - 1 else MPI.PROC_NULL
    a, b = initial(cp, n, first, count), initial(cp, n, first, count)
    step(a, b)  # the sweep's kernel is compiled at its first call: before the clock starts
    b = initial(cp, n, first, count)
    send, recv = np.empty(n), np.empty(n)
    cp.cuda.Device().synchronize()
    mpi.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        step(a, b)
        # B's first interior row up, B's last one down; halos from the neighbours.
        send[:] = cp.asnumpy(b[1])
        mpi.Sendrecv(send, dest=up, recvbuf=recv, source=down)
        if down != MPI.PROC_NULL:
            b[-1] = cp.asarray(recv)
        send[:] = cp.asnumpy(b[-2])
        mpi.Sendrecv(send, dest=down, recvbuf=recv, source=up)
        if up != MPI.PROC_NULL:
            b[0] = cp.asarray(recv)
        a, b = b, a
    cp.cuda.Device().synchronize()
    return a, time.perf_counter() - start


class NumpyAsCupy:
    """What this program uses of CuPy, done by NumPy on the host (--array numpy)."""

    float64 = np.float64
    zeros = staticmethod(np.zeros)
    asarray = staticmethod(np.asarray)
    asnumpy = staticmethod(np.asarray)

    class cuda:  # noqa: N801 - CuPy's name
        class Stream:
            def __init__(self, non_blocking=False):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def synchronize(self):
                pass

        class Device:
            def __init__(self, device=None):
                pass

            def synchronize(self):
                pass

            def use(self):
                pass


def run_meshmem(cp, mpi, n, iters, first, count):
    import meshmem
    on_host = cp is NumpyAsCupy  # host windows, the host form of the exchange
    stream = cp.cuda.Stream(non_blocking=True)
    row = n * 8
    sends = []
    if mpi.rank > 0:  # the first interior row to the upper neighbour's bottom halo
        sends.append(meshmem.HaloRegion(peer=mpi.rank - 1, src_offset=row,
                                        dst_offset=(rows_of(n, mpi.size, mpi.rank - 1)[1] + 1) * row, width=row))
    if mpi.rank < mpi.size - 1:  # the last interior row to the lower neighbour's top halo
        sends.append(meshmem.HaloRegion(peer=mpi.rank + 1, src_offset=count * row, dst_offset=0, width=row))
    with meshmem.Comm(mpi) as comm:
        # Two windows in alternation: iteration k reads one while the halos of the other land.
        # Windows are symmetric: every rank allocates for the largest band (rank 0's).
        most = rows_of(n, mpi.size, 0)[1]
        wins = [comm.alloc((most + 2) * row, memory="host" if on_host else "device") for _ in range(2)]
        grids = [cp.asarray(w.local(np.float64, (count + 2, n))) for w in wins]
        halos = [comm.make_halo(w, sends) for w in wins]
        with stream:
            step(grids[0], grids[1])  # the sweep's kernel is compiled at its first call: before the clock starts
            for i in range(2):
                grids[i][:] = initial(cp, n, first, count)
        stream.synchronize()
        comm.barrier()
        start = time.perf_counter()
        for k in range(iters):
            src, dst = k % 2, (k + 1) % 2
            with stream:
                step(grids[src], grids[dst])
            halos[dst].exchange(stream=None if on_host else stream)
        stream.synchronize()
        elapsed = time.perf_counter() - start
        result = grids[iters % 2].copy()
        del grids  # the windows' arrays: free() is refused while they live
        for h in halos:
            h.close()
        for w in wins:
            w.free()
    return result, elapsed


def main(argv=None, mpi=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.array == "numpy":
        cp = NumpyAsCupy
    else:
        try:
            import cupy as cp
        except ImportError:
            print("jacobi.py: cupy is not installed (--array numpy runs on the CPU)")
            return 77
    if mpi is None:
        from mpi4py import MPI
        mpi = MPI.COMM_WORLD
    import meshmem
    if args.array == "cupy" and meshmem.gpu_available()[0]:
        cp.cuda.Device(meshmem.select_local_device(mpi)).use()
    first, count = rows_of(args.n, mpi.size, mpi.rank)
    run = run_meshmem if args.halo == "meshmem" else run_mpi
    grid, elapsed = run(cp, mpi, args.n, args.iters, first, count)
    interior = cp.asnumpy(grid[1:-1])
    worst = mpi.allreduce(elapsed, op=__import__("mpi4py").MPI.MAX)
    if mpi.rank == 0:
        print(f"jacobi {args.n}x{args.n}, {args.iters} iterations, {mpi.size} ranks, halo {args.halo}: "
              f"{worst / args.iters * 1e6:.1f} us per iteration")
        if args.csv:
            import datetime
            import os
            new = not os.path.exists(args.csv) or os.path.getsize(args.csv) == 0
            with open(args.csv, "a") as f:
                if new:
                    f.write("date,commit,machine,benchmark,variant,ranks,size_bytes,latency_us,bandwidth_gbps\n")
                date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
                f.write(f"{date},{args.commit},{args.machine},jacobi,python-{args.halo},{mpi.size},{args.n},"
                        f"{worst / args.iters * 1e6:.4f},\n")
    error = 0.0
    if args.check:
        parts = mpi.gather(interior, root=0)
        if mpi.rank == 0:
            whole = reference(cp, args.n, args.iters)[1:-1]
            error = float(np.max(np.abs(np.concatenate(parts) - whole)))
            print(f"largest difference from the one-rank run: {error}")
        error = mpi.bcast(error, root=0)
    return 0 if error == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())
