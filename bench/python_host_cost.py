#!/usr/bin/env python3
"""The per-call host cost of put_signal and wait_until from Python, beside the same calls from
C++ (python_host_cost_cpp, built with the Python package). Python is timed twice: arguments by position and with
op= / stream= by keyword (the binding's inner-loop calls read keywords without a dictionary;
under pybind11's dispatch they cost about a microsecond more). Each rank issues `calls`
put_signal of 8 bytes (a NumPy array, or a CuPy/PyTorch one for device windows) to its right
neighbour, then `calls` wait_until on a word already satisfied; rank 0's mean per call.

    mpirun -np 2 python bench/python_host_cost.py [--memory host|device] [--calls N]
             [--cpp-results CPP_OUTPUT] [--csv out.csv --machine NAME --commit C]
(bench/python_host_cost.sh runs both and writes the results file.)

Device windows: the stream forms on a CuPy stream (torch where CuPy is absent), and once more
with the stream given as its integer handle (python-handle: what the stream object's lookup costs).
"""

import argparse
import datetime
import sys
import time

import numpy as np

import meshmem

try:
    from mpi4py import MPI
    WORLD = MPI.COMM_WORLD
except ImportError:  # meshmem.Comm() is then MPI_COMM_WORLD, MPI initialised by meshmem
    WORLD = None


def measure(memory, calls):
    mpi = WORLD
    stream, handle, src = None, None, np.ones(8, np.uint8)
    if memory == "device":
        meshmem.select_local_device(mpi)
        try:
            import cupy as cp
            stream = cp.cuda.Stream(non_blocking=True)
            handle = stream.ptr
            src = cp.ones(8, cp.uint8)
            sync = stream.synchronize
        except ImportError:
            import torch
            stream = torch.cuda.Stream()
            handle = stream.cuda_stream
            src = torch.ones(8, dtype=torch.uint8, device="cuda")
            sync = stream.synchronize
    with meshmem.Comm(mpi) as comm:
        with comm.alloc(4096, memory=memory) as win, comm.alloc_signals(2, memory=memory) as sig:
            right = (comm.rank + 1) % comm.size
            put_signal, wait_until = comm.put_signal, comm.wait_until

            def timed(put_call, wait_call):
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    put_call()
                t1 = time.perf_counter()
                if stream is not None:
                    sync()
                comm.barrier()
                t2 = time.perf_counter()
                for _ in range(calls):
                    wait_call()
                t3 = time.perf_counter()
                if stream is not None:
                    sync()
                comm.barrier()
                return (t1 - t0) / calls * 1e6, (t3 - t2) / calls * 1e6

            # Arguments by position (the hot-loop form), then op= and stream= by keyword.
            positional = timed(lambda: put_signal(win, right, src, sig, 0, 1, 0, "add", stream),
                               lambda: wait_until(sig, 1, ">=", 0, stream))
            keywords = timed(lambda: put_signal(win, right, src, sig, 0, 1, op="add", stream=stream),
                             lambda: wait_until(sig, 1, ">=", 0, stream=stream))
            by_handle = None
            if handle is not None:
                by_handle = timed(lambda: put_signal(win, right, src, sig, 0, 1, 0, "add", handle),
                                  lambda: wait_until(sig, 1, ">=", 0, handle))
        rank, size = comm.rank, comm.size
    return positional, keywords, by_handle, rank, size


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memory", choices=("host", "device"), default="host")
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--csv", help="append rows in bench/results' format")
    p.add_argument("--machine", default="unknown")
    p.add_argument("--commit", default="")
    p.add_argument("--cpp-results", help="the C++ baseline's output (python_host_cost_cpp), to put beside")
    a = p.parse_args()
    positional, keywords, by_handle, rank, size = measure(a.memory, a.calls)
    if rank != 0:
        return 0
    rows = [("python", "put_signal", positional[0]), ("python", "wait_until", positional[1]),
            ("python-keywords", "put_signal", keywords[0]), ("python-keywords", "wait_until", keywords[1])]
    if by_handle is not None:
        rows += [("python-handle", "put_signal", by_handle[0]), ("python-handle", "wait_until", by_handle[1])]
    if a.cpp_results:
        for line in open(a.cpp_results):
            f = line.split()
            if len(f) == 5 and f[0] == "c++":
                rows.append(("c++", f[1], float(f[4])))
    print("# language  call  memory  calls  per_call_us")
    for lang, call, us in rows:
        print(f"{lang}  {call}  {a.memory}  {a.calls}  {us:.3f}")
    cpp = {call: us for lang, call, us in rows if lang == "c++"}
    for lang, call, us in rows:
        if lang != "c++" and call in cpp:
            print(f"# {call} ({lang}): {us - cpp[call]:+.3f} us per call more than C++")
    if a.csv:
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        with open(a.csv, "a") as f:
            if f.tell() == 0:
                f.write("date,commit,machine,benchmark,variant,ranks,size_bytes,latency_us,bandwidth_gbps\n")
            for lang, call, us in rows:
                f.write(f"{date},{a.commit},{a.machine},python_host_cost_{call},{lang}-{a.memory},{size},8,{us:.4f},\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
