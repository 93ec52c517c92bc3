"""Device windows with CuPy and PyTorch: zero-copy views (__cuda_array_interface__ and DLPack),
stream-ordered put_signal / wait_until / get / barrier on the framework's own stream, peers'
views where mapped, and a halo exchange. CTest runs it on one node and with each route forced
(ipc, staged, nccl between simulated nodes). Skipped without a GPU, and per framework where
CuPy or PyTorch is not installed; every byte is checked."""

import importlib.util

import numpy as np
import pytest

import meshmem
from conftest import agree, data, fresh_seed, raises

GPU, WHY = meshmem.gpu_available()
pytestmark = pytest.mark.skipif(not GPU, reason=f"no GPU: {WHY}")
POISON = 0x3C


class Cupy:
    def __init__(self, device):
        import cupy
        self.cp = cupy
        cupy.cuda.Device(device).use()

    def stream(self):
        return self.cp.cuda.Stream(non_blocking=True)

    def wrap(self, part):
        return self.cp.asarray(part)

    def from_dlpack(self, part):
        return self.cp.from_dlpack(part)

    def ptr(self, a):
        return a.data.ptr

    def fill(self, a, value, s):
        with s:
            a.fill(value)

    def to_device(self, host, s):
        with s:
            a = self.cp.asarray(host)
        s.synchronize()  # usable on any stream from here on
        return a

    def to_host(self, a, s):
        with s:
            h = self.cp.asnumpy(a, stream=s)
        s.synchronize()
        return h

    def sync_all(self):
        self.cp.cuda.Device().synchronize()


class Torch:
    def __init__(self, device):
        import torch
        self.torch = torch
        torch.cuda.set_device(device)
        self.dev = torch.device("cuda", device)

    def stream(self):
        return self.torch.cuda.Stream(device=self.dev)

    def wrap(self, part):
        return self.torch.as_tensor(part, device=self.dev)

    def from_dlpack(self, part):
        return self.torch.from_dlpack(part)

    def ptr(self, a):
        return a.data_ptr()

    def fill(self, a, value, s):
        with self.torch.cuda.stream(s):
            a.fill_(value)

    def to_device(self, host, s):
        with self.torch.cuda.stream(s):
            a = self.torch.from_numpy(host).to(self.dev)
        s.synchronize()  # usable on any stream from here on
        return a

    def to_host(self, a, s):
        s.synchronize()
        return a.cpu().numpy()

    def sync_all(self):
        self.torch.cuda.synchronize()


def have(module):
    return importlib.util.find_spec(module) is not None


@pytest.fixture(params=[pytest.param(Cupy, marks=pytest.mark.skipif(not have("cupy"), reason="cupy is not installed"),
                                     id="cupy"),
                        pytest.param(Torch, marks=pytest.mark.skipif(not have("torch"), reason="torch is not installed"),
                                     id="torch")])
def fw(request, comm):
    return request.param(comm.device)


def test_zero_copy_views(comm, fw):
    with comm.alloc(4096, memory="device") as win:
        part = win.local(np.float32, (32, 32))
        a = fw.wrap(part)
        b = fw.from_dlpack(win.local(np.float32, (32, 32)))
        ok = fw.ptr(a) == part.ptr == fw.ptr(b) and tuple(a.shape) == (32, 32) and tuple(b.shape) == (32, 32)
        ok = ok and part.__dlpack_device__() == (2, comm.device)
        del a, b, part
        comm.barrier()
        agree(ok, "views are not the window's memory")


def test_put_signal_wait_until_on_the_framework_stream(comm, fw):
    seed = fresh_seed()
    n = 3 * 4096 + 5
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    s = fw.stream()
    with comm.alloc(n, memory="device") as win, comm.alloc_signals(1, memory="device") as sig:
        mine = fw.wrap(win.local())
        fw.fill(mine, POISON, s)
        s.synchronize()
        comm.barrier()
        bad = []
        for k in range(1, 4):
            src = fw.to_device(data(seed, k, comm.rank, nbytes=n), s)
            comm.put_signal(win, right, src, sig, 0, k, stream=s)
            comm.wait_until(sig, 0, ">=", k, stream=s)
            got = fw.to_host(mine, s)
            if not np.array_equal(got, data(seed, k, left, nbytes=n)):
                bad.append(f"round {k}: {np.count_nonzero(got != data(seed, k, left, nbytes=n))} bytes from rank {left} differ")
            comm.barrier(stream=s)  # the left neighbour's next put lands after this check
            s.synchronize()
        del mine
        agree(not bad, "; ".join(bad))
        comm.quiet(stream=s)
        s.synchronize()
        comm.barrier()


def test_slices_offsets_and_strided_views(comm, fw):
    """A slice of a framework's array (its memory starts past its allocation's) with an offset in
    items of its dtype puts exactly its bytes; a get fills a slice; a strided view, as source or
    destination, raises and nothing is written (the binding reads each framework's array
    through its own attributes: this checks what they give)."""
    seed = fresh_seed()
    items, first, count, at = 64, 5, 40, 3  # float64 items
    nbytes = items * 8
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    s = fw.stream()
    with comm.alloc(nbytes, memory="device") as win:
        mine = fw.wrap(win.local())
        fw.fill(mine, POISON, s)
        s.synchronize()
        comm.barrier()
        full = fw.to_device(data(seed, comm.rank, nbytes=nbytes).view(np.float64), s)
        comm.put(win, right, full[first:first + count], stream=s, elem_offset=at)
        comm.quiet(stream=s)
        s.synchronize()
        comm.barrier()
        want = np.full(nbytes, POISON, np.uint8)
        want[at * 8:(at + count) * 8] = data(seed, left, nbytes=nbytes)[first * 8:(first + count) * 8]
        got = fw.to_host(mine, s)
        bad = [] if np.array_equal(got, want) else [f"put of a slice: {np.count_nonzero(got != want)} bytes differ"]
        comm.barrier()
        strided = full[::2]
        for what, call in [("strided src", lambda: comm.put(win, right, strided, stream=s)),
                           ("strided dst", lambda: comm.get(strided, win, right, stream=s))]:
            why = raises(call, contains="contiguous")
            if why is not None:
                bad.append(f"{what}: {why}")
        s.synchronize()
        comm.barrier()
        got = fw.to_host(mine, s)
        if not np.array_equal(got, want):
            bad.append(f"after the refused calls: {np.count_nonzero(got != want)} bytes differ")
        # A get into a slice of a poisoned array: only the slice changes.
        dst = fw.to_device(np.full(items, -1.0), s)
        comm.get(dst[first:first + count], win, right, stream=s, elem_offset=at)
        host_dst = fw.to_host(dst, s).view(np.uint8)
        expect = np.full(items, -1.0).view(np.uint8).copy()
        # right's window holds, from item `at` on, what this rank put there (its items from `first` on).
        expect[first * 8:(first + count) * 8] = data(seed, comm.rank, nbytes=nbytes)[first * 8:(first + count) * 8]
        if not np.array_equal(host_dst, expect):
            bad.append(f"get into a slice: {np.count_nonzero(host_dst != expect)} bytes differ")
        del mine
        agree(not bad, "; ".join(bad))
        comm.barrier()


def test_get_on_the_framework_stream(comm, fw):
    seed = fresh_seed()
    n = 10000
    s = fw.stream()
    right = (comm.rank + 1) % comm.size
    with comm.alloc(n, memory="device") as win:
        mine = fw.wrap(win.local())
        mine[:] = fw.to_device(data(seed, comm.rank, nbytes=n), s)  # on the framework's current stream
        fw.sync_all()
        comm.barrier()
        dst = fw.to_device(np.full(n - 100, POISON, np.uint8), s)
        comm.get(dst, win, right, 100, stream=s)
        got = fw.to_host(dst, s)
        del mine
        agree(np.array_equal(got, data(seed, right, nbytes=n)[100:]), f"get from rank {right} differs")
        comm.barrier()


def test_peer_views_where_mapped(comm, fw):
    seed = fresh_seed()
    n = 8192
    s = fw.stream()
    with comm.alloc(n, memory="device") as win:
        mine = fw.wrap(win.local())
        mine[:] = fw.to_device(data(seed, comm.rank, nbytes=n), s)  # on the framework's current stream
        fw.sync_all()
        comm.barrier()
        bad = []
        for r in range(comm.size):
            if r == comm.rank:
                continue
            part = win.peer(r)
            route = comm.transport(r, "device")
            if (part is not None) != (route == "ipc"):
                bad.append(f"peer({r}) {'mapped' if part is not None else 'None'} with transport {route}")
            elif part is not None:
                got = fw.to_host(fw.wrap(part), s)
                if not np.array_equal(got, data(seed, r, nbytes=n)):
                    bad.append(f"rank {r}'s part seen here differs")
            del part
        del mine
        agree(not bad, "; ".join(bad))
        comm.barrier()


def test_halo_exchange_on_a_stream(comm, fw):
    rows, cols = 8, 16
    row = cols * 8
    up, down = (comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size
    seed = fresh_seed()
    s = fw.stream()
    with comm.alloc((rows + 2) * row, memory="device") as win:
        grid = fw.wrap(win.local(np.float64, (rows + 2, cols)))
        host = np.full((rows + 2, cols), -1.0)
        host[1:-1] = np.random.default_rng([seed, comm.rank]).random((rows, cols))
        grid[:] = fw.to_device(host, s)
        fw.sync_all()
        comm.barrier()
        sends = [meshmem.HaloRegion(peer=up, src_offset=row, dst_offset=(rows + 1) * row, width=row),
                 meshmem.HaloRegion(peer=down, src_offset=rows * row, dst_offset=0, width=row)]
        with comm.make_halo(win, sends) as halo:
            halo.exchange(stream=s)
            got = fw.to_host(grid, s)
            up_grid = np.random.default_rng([seed, up]).random((rows, cols))
            down_grid = np.random.default_rng([seed, down]).random((rows, cols))
            ok = np.array_equal(got[0], up_grid[-1]) and np.array_equal(got[-1], down_grid[0])
            ok = ok and np.array_equal(got[1:-1], host[1:-1])
            del grid
            agree(ok, "halo rows differ")
            comm.barrier(stream=s)
            s.synchronize()
