"""Host windows with NumPy on every rank: puts, gets, signals, peers' arrays, halo exchange,
freeing, and the GIL released while the host waits. Run under mpirun at 2 and 4 ranks, on
one node and on simulated nodes (MESHMEM_SIMULATE_NODES=2); every byte is checked."""

import os
import threading
import time

import numpy as np
import pytest

import meshmem
from conftest import agree, data, fresh_seed, needs_mpi4py, raises

POISON = 0xA5


def test_comm_matches_mpi(comm, mpi):
    agree(comm.rank == mpi.rank and comm.size == mpi.size, f"rank/size {comm.rank}/{comm.size}")
    nodes = int(os.environ.get("MESHMEM_SIMULATE_NODES", "1"))
    expect = int(os.environ.get("MESHMEM_TEST_EXPECT_NODES", min(nodes, comm.size)))  # real hosts: set by CTest
    agree(comm.node_count == expect, f"node_count {comm.node_count}, expected {expect}")
    problems = []
    for r in range(comm.size):
        t = comm.transport(r, "host")
        same_node = comm.node_of(r) == comm.node
        forced = os.environ.get("MESHMEM_TRANSPORTS")
        want = "mpi" if forced == "mpi" or not same_node else "shm"
        if r != comm.rank and t != want:
            problems.append(f"transport({r}) {t}, expected {want}")
    agree(not problems, "; ".join(problems))
    agree(mpi.allgather(comm.node) == [comm.node_of(r) for r in range(comm.size)], "node_of differs from node")


@pytest.mark.parametrize("chunk,dtype", [(1003, np.uint8), (4096, np.float64), (24, np.int32)])
def test_put_to_every_rank_every_byte(comm, mpi, chunk, dtype):
    seed = fresh_seed()
    itemsize = np.dtype(dtype).itemsize
    nbytes = chunk * itemsize
    with comm.alloc(comm.size * nbytes, memory="host") as win:
        mine = win.local()
        mine[:] = POISON
        comm.barrier()
        for target in range(comm.size):
            if target != comm.rank:
                src = data(seed, comm.rank, target, nbytes=nbytes).view(dtype)
                comm.put(win, target, src, elem_offset=comm.rank * chunk)
        comm.barrier()
        bad = []
        for r in range(comm.size):
            region = mine[r * nbytes:(r + 1) * nbytes]
            want = np.full(nbytes, POISON, np.uint8) if r == comm.rank else data(seed, r, comm.rank, nbytes=nbytes)
            if not np.array_equal(region, want):
                bad.append(f"bytes from rank {r}: {np.count_nonzero(region != want)} differ")
        del mine, region
        agree(not bad, "; ".join(bad))


def test_get_from_every_rank(comm, mpi):
    seed = fresh_seed()
    n = 5000
    with comm.alloc(n, memory="host") as win:
        win.local()[:] = data(seed, comm.rank, nbytes=n)
        comm.barrier()
        rng = np.random.default_rng([seed, 99, comm.rank])
        bad = []
        for r in range(comm.size):
            off = int(rng.integers(0, n // 2))
            length = int(rng.integers(1, n - off))
            dst = np.full(length + 20, POISON, np.uint8)
            comm.get(dst[10:10 + length], win, r, off)
            want = np.concatenate([np.full(10, POISON, np.uint8), data(seed, r, nbytes=n)[off:off + length],
                                   np.full(10, POISON, np.uint8)])
            if not np.array_equal(dst, want):
                bad.append(f"get from rank {r} at {off}+{length}: {np.count_nonzero(dst != want)} bytes differ")
        agree(not bad, "; ".join(bad))
        comm.barrier()


def test_put_signal_ring(comm, mpi):
    seed = fresh_seed()
    n = 777
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    with comm.alloc(n, memory="host") as win, comm.alloc_signals(2, memory="host") as sig:
        bad = []
        for k in range(1, 21):
            comm.put_signal(win, right, data(seed, k, comm.rank, nbytes=n), sig, 0, k)
            comm.wait_until(sig, 0, ">=", k)
            got = win.local().copy()
            if not np.array_equal(got, data(seed, k, left, nbytes=n)):
                bad.append(f"round {k}: data from rank {left} differ")
            comm.barrier()  # the left neighbour's next put lands after this check
        agree(not bad, "; ".join(bad))
        agree(sig.read(0) == 20 and sig.read(1) == 0, f"signals {sig.read(0)}, {sig.read(1)}")


def test_signal_add_and_wait_forms(comm, mpi):
    with comm.alloc_signals(3, memory="host") as sig:
        for target in range(comm.size):
            comm.signal(sig, target, 1, 1, "add")
            comm.signal(sig, target, 2, 5, meshmem.SignalOp.Add)
        comm.wait_until(sig, 1, meshmem.Cmp.EQ, comm.size)
        comm.wait_until_all(sig, 1, 1, "==", comm.size)
        comm.barrier()
        words = sig.local()
        agree(list(words) == [0, comm.size, 5 * comm.size], f"words {list(words)}")
        del words
        comm.barrier()


def test_peer_arrays_where_mapped(comm, mpi):
    seed = fresh_seed()
    n = 4096
    with comm.alloc(n, memory="host") as win:
        win.local()[:] = data(seed, comm.rank, nbytes=n)
        comm.barrier()
        bad = []
        for r in range(comm.size):
            if r == comm.rank:
                continue
            peer = win.peer(r, np.uint8)
            mapped = comm.transport(r, "host") == "shm"
            if (peer is not None) != mapped:
                bad.append(f"peer({r}) {'mapped' if peer is not None else 'None'} with transport {comm.transport(r, 'host')}")
            elif peer is not None and not np.array_equal(peer, data(seed, r, nbytes=n)):
                bad.append(f"peer({r}) differs from rank {r}'s data")
        agree(not bad, "; ".join(bad))
        comm.barrier()
        right = (comm.rank + 1) % comm.size
        peer = win.peer(right, np.uint32, shape=(4,), offset=8)
        if peer is not None:
            peer[:] = [comm.rank, 1, 2, 3]
        del peer
        comm.barrier()
        left = (comm.rank - 1) % comm.size
        words = win.local(np.uint32)[2:6]
        mapped = comm.transport(left, "host") == "shm"
        agree(not mapped or list(words) == [left, 1, 2, 3], f"words written through rank {left}'s peer array: {list(words)}")
        del words
        comm.barrier()


def test_local_array_dtype_shape_offset(comm, mpi):
    with comm.alloc(64, memory="host") as win:
        a = win.local("float64", (2, 3), offset=8)
        b = win.local(np.uint8)
        a[:] = np.arange(6).reshape(2, 3)
        ok = a.shape == (2, 3) and a.dtype == np.float64 and np.array_equal(b[8:56].view(np.float64), np.arange(6.0))
        ok = ok and win.local(np.int16).shape == (32,) and win.local(np.uint8, 10).shape == (10,)
        del a, b
        agree(ok, "local() views disagree")


def test_arrays_keep_their_window_alive(comm, mpi):
    win = comm.alloc(128, memory="host")
    a = win.local(np.int64)
    del win  # the array holds it: nothing is freed yet
    a[:] = np.arange(16) * (comm.rank + 1)
    comm.barrier()
    agree(np.array_equal(a, np.arange(16) * (comm.rank + 1)), "array of a dropped window changed")
    base = a.base
    agree(isinstance(base, meshmem.WindowArray) and base.rank == comm.rank, f"base {base!r}")
    del a, base  # the last reference: freed here, collectively, on every rank
    comm.barrier()


def test_free_refused_while_arrays_live_then_use_after_free(comm, mpi):
    win = comm.alloc(256, memory="host")
    kept = win.local() if comm.rank == 0 else None
    agree(raises(win.free, contains="rank 0 still holds 1 array") is None, "free with rank 0's array alive")
    agree(win.valid, "the window was freed although free() was refused")
    del kept
    win.free()
    src = np.zeros(8, np.uint8)
    problems = [p for p in (
        raises(lambda: win.local(), contains="freed"),
        raises(lambda: win.peer(0), contains="freed"),
        raises(lambda: comm.put(win, 0, src), contains="freed"),
        raises(lambda: comm.get(src, win, 0), contains="freed"),
        raises(win.free, contains="freed"),
    ) if p]
    agree(not problems, "; ".join(problems))
    agree(not win.valid and win.live_arrays == 0, "freed window still valid")


def test_context_managers_free(comm, mpi):
    with comm.alloc(64, memory="host") as win, comm.alloc_signals(4, memory="host") as sig:
        agree(win.valid and sig.valid and len(sig) == 4 and win.nbytes == 64, "fresh objects")
    agree(not win.valid and not sig.valid, "still valid after the with block")
    agree(raises(lambda: sig.read(0), contains="freed") is None, "read of freed signals")


def test_gil_released_while_waiting(comm, mpi):
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    with comm.alloc_signals(2, memory="host") as sig:
        comm.barrier()
        if comm.rank == 0:
            counts = [0]
            stop = threading.Event()

            def spin():
                while not stop.is_set():
                    counts[0] += 1

            t = threading.Thread(target=spin)
            t.start()
            time.sleep(0.1)  # the spinning thread's pace on this machine now, the GIL free
            before = counts[0]
            time.sleep(0.1)
            pace = (counts[0] - before) / 0.1
            comm.signal(sig, 1, 1, 1)  # rank 1 signals back half a second after this
            start, before = time.monotonic(), counts[0]
            comm.wait_until(sig, 0, ">=", 1)
            waited, during = time.monotonic() - start, counts[0] - before
            stop.set()
            t.join()
            # Held by the waiter, the GIL would let the other thread run about one switch
            # interval (5 ms; seen: 16 ms worth); released, it runs through the wait, slowed
            # only by the other ranks on the same cores. 50 ms worth tells them apart.
            ok = waited > 0.2 and during > pace * 0.05
            why = f"waited {waited:.3f} s; the other thread counted {during} meanwhile, {pace:.0f}/s before"
        else:
            ok, why = True, ""
            if comm.rank == 1:
                comm.wait_until(sig, 1, ">=", 1)
                time.sleep(0.5)
                comm.signal(sig, 0, 0, 1)
        agree(ok, why)
        comm.barrier()


@needs_mpi4py
def test_comm_of_a_split_communicator(comm, mpi):
    sub = mpi.Split(mpi.rank % 2, mpi.rank)
    with meshmem.Comm(sub) as c:
        agree(c.rank == sub.rank and c.size == sub.size, f"{c.rank}/{c.size} vs {sub.rank}/{sub.size}")
        with c.alloc(16, memory="host") as win:
            comm_right = (c.rank + 1) % c.size
            comm.barrier()
            c.put(win, comm_right, np.full(16, mpi.rank, np.uint8))
            c.barrier()
            expect = sub.allgather(mpi.rank)[(c.rank - 1) % c.size]
            agree(np.all(win.local() == expect), f"expected {expect}")
    sub.Free()


def test_halo_exchange_rows(comm, mpi):
    """A ring of row blocks of a 2-D float64 grid: each rank's first and last interior rows go to
    its neighbours' halo rows (HaloRegion with pitches over a window viewed as 2-D)."""
    rows, cols = 6, 10
    row = cols * 8
    up, down = (comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size
    seed = fresh_seed()
    with comm.alloc((rows + 2) * row, memory="host") as win:
        grid = win.local(np.float64, (rows + 2, cols))
        grid[:] = -1.0
        grid[1:-1] = np.random.default_rng([seed, comm.rank]).random((rows, cols))
        sends = [meshmem.HaloRegion(peer=up, src_offset=1 * row, dst_offset=(rows + 1) * row, width=row),
                 meshmem.HaloRegion(peer=down, src_offset=rows * row, dst_offset=0, width=row)]
        if comm.size == 2:  # up == down: one region each way still, to distinct halo rows
            pass
        with comm.make_halo(win, sends) as halo:
            halo.exchange()
            comm.barrier()
            up_grid = np.random.default_rng([seed, up]).random((rows, cols))
            down_grid = np.random.default_rng([seed, down]).random((rows, cols))
            ok = np.array_equal(grid[0], up_grid[-1]) and np.array_equal(grid[-1], down_grid[0])
            agree(ok and halo.exchanges == 1, f"halo rows differ (exchanges {halo.exchanges})")
        del grid
