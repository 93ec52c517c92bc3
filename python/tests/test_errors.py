"""Bad input from Python: wrong dtypes, out-of-range offsets and ranks, freed windows,
non-contiguous and read-only arrays, GPU memory for a host window, bad names. Each raises
meshmem.Error (with its code) on the rank that made it, and nothing is written: every rank's
window is checked, every byte, after every case."""

import numpy as np
import pytest

import meshmem
from conftest import agree, raises

POISON = 0x5A
N = 256


class FakeDeviceArray:
    """Looks like GPU memory (__cuda_array_interface__) at an address nothing may touch."""

    __cuda_array_interface__ = {"shape": (8,), "typestr": "<u1", "data": (16, False), "version": 3, "strides": None}


@pytest.fixture(scope="module")
def target(comm):
    with comm.alloc(N, memory="host") as win, comm.alloc_signals(2, memory="host") as sig:
        yield win, sig


def check_untouched(comm, win, sig, case):
    comm.barrier()
    mine = win.local()
    differ = int(np.count_nonzero(mine != POISON))
    words = [sig.read(0), sig.read(1)]
    del mine
    agree(differ == 0 and words == [0, 0], f"{case}: {differ} bytes written, signals {words}")


def src8():
    return np.arange(8, dtype=np.uint8)


class CupyLikeStream:
    ptr = 12345  # cupy.cuda.Stream: the handle as `ptr`


class TorchLikeStream:
    cuda_stream = 12345  # torch.cuda.Stream


class ProtocolStream:
    def __cuda_stream__(self):  # the CUDA stream protocol: (version, handle)
        return (0, 12345)


class InstanceHandleStream:
    def __init__(self):
        self.ptr = 12345


def without_ptr():
    s = InstanceHandleStream()
    del s.ptr
    return s


class InstanceDeviceArray:
    """A __cuda_array_interface__ of its own (not its class's); InstanceDeviceArray(False) has none."""

    def __init__(self, interface=True):
        if interface:
            self.__cuda_array_interface__ = FakeDeviceArray.__cuda_array_interface__


class GetattrStream:
    __slots__ = ()

    def __getattr__(self, name):
        if name == "ptr":
            return 12345
        raise AttributeError(name)


class UnsetSlotStream:
    __slots__ = ("ptr",)  # never set: found on the type, absent on the object


def bad_cases(comm, win, sig):
    """(name, call, code, words the message must contain) for a put to the right neighbour."""
    right = (comm.rank + 1) % comm.size
    ro = np.zeros(8, np.uint8)
    ro.setflags(write=False)
    inv, uns = meshmem.ErrorCode.InvalidArgument, meshmem.ErrorCode.Unsupported
    return [
        ("object dtype src", lambda: comm.put(win, right, np.array([1, None, 3], dtype=object)), inv, "dtype object"),
        ("non-contiguous src", lambda: comm.put(win, right, np.arange(32, dtype=np.uint8)[::2]), inv, "not C-contiguous"),
        ("2-D column src", lambda: comm.put(win, right, np.zeros((8, 8), np.uint8)[:, 1]), inv, "not C-contiguous"),
        ("src not an array", lambda: comm.put(win, right, [1, 2, 3]), inv, "is not an array"),
        ("an object without the __cuda_array_interface__ of others of its class",
         lambda: comm.put(win, right, InstanceDeviceArray(False)), inv, "is not an array"),
        ("GPU memory in an instance attribute", lambda: comm.put(win, right, InstanceDeviceArray()), inv, "GPU memory"),
        ("GPU memory into a host window", lambda: comm.put(win, right, FakeDeviceArray()), inv, "GPU memory"),
        ("offset past the end", lambda: comm.put(win, right, src8(), N - 4), inv, "past the end"),
        ("elem_offset past the end", lambda: comm.put(win, right, np.zeros(4, np.float64), elem_offset=N // 8 - 3), inv,
         "past the end"),
        ("negative offset", lambda: comm.put(win, right, src8(), -8), inv, "negative"),
        ("offset and elem_offset", lambda: comm.put(win, right, src8(), 8, elem_offset=1), inv, "not both"),
        ("target out of range", lambda: comm.put(win, comm.size, src8()), inv, "out of range"),
        ("negative target", lambda: comm.put(win, -1, src8()), inv, "out of range"),
        ("put_signal past the end", lambda: comm.put_signal(win, right, np.zeros(N + 1, np.uint8), sig, 0, 1), inv,
         "past the end"),
        ("put_signal signal index out of range", lambda: comm.put_signal(win, right, src8(), sig, 2, 1), inv,
         "out of range"),
        ("put_signal bad op", lambda: comm.put_signal(win, right, src8(), sig, 0, 1, op="mul"), inv, "op must be"),
        ("signal index out of range", lambda: comm.signal(sig, right, 5, 1), inv, "out of range"),
        ("stream on a host window", lambda: comm.put(win, right, src8(), stream=12345), uns, "host windows"),
        ("bad stream object", lambda: comm.put(win, right, src8(), stream="s"), inv, "stream must be"),
        # Each way a framework's stream names its handle is read as a stream (and refused here).
        ("cupy-style stream on a host window", lambda: comm.put(win, right, src8(), stream=CupyLikeStream()), uns,
         "host windows"),
        ("torch-style stream on a host window", lambda: comm.put(win, right, src8(), stream=TorchLikeStream()), uns,
         "host windows"),
        ("__cuda_stream__ stream on a host window",
         lambda: comm.put(win, right, src8(), stream=ProtocolStream()), uns, "host windows"),
        ("stream handle in an instance attribute",
         lambda: comm.put(win, right, src8(), stream=InstanceHandleStream()), uns, "host windows"),
        # The binding keeps what it learnt of a type, never what one object of it had.
        ("an object of that class without the handle", lambda: comm.put(win, right, src8(), stream=without_ptr()),
         inv, "stream must be"),
        ("object without a stream handle", lambda: comm.put(win, right, src8(), stream=object()), inv,
         "stream must be"),
        ("stream handle from __getattr__", lambda: comm.put(win, right, src8(), stream=GetattrStream()), uns,
         "host windows"),
        ("unset __slots__ handle", lambda: comm.put(win, right, src8(), stream=UnsetSlotStream()), inv,
         "stream must be"),
        ("get into a read-only array", lambda: comm.get(ro, win, right), inv, "read-only"),
        ("get into a non-contiguous array", lambda: comm.get(np.zeros(16, np.uint8)[::2], win, right), inv,
         "not C-contiguous"),
        ("get into an object array", lambda: comm.get(np.empty(4, dtype=object), win, right), inv, "dtype object"),
        ("get past the end", lambda: comm.get(np.zeros(16, np.uint8), win, right, N - 8), inv, "past the end"),
        ("wait_until bad cmp", lambda: comm.wait_until(sig, 0, "=>", 1), inv, "cmp must be"),
        ("wait_until index out of range", lambda: comm.wait_until(sig, 9, ">=", 0), inv, "out of range"),
        ("local dtype object", lambda: win.local(object), inv, "not a numeric dtype"),
        ("local dtype not a dtype", lambda: win.local("no_such_dtype"), inv, "is not a dtype"),
        ("local shape too large", lambda: win.local(np.float64, (N // 8 + 1,)), inv, "past the end"),
        ("local offset not aligned to the dtype", lambda: win.local(np.float64, 2, offset=4), inv, "multiple"),
        ("peer rank out of range", lambda: win.peer(comm.size), inv, "out of range"),
        ("memory kind", lambda: comm.alloc(8, memory="gpu"), inv, "memory must be"),
    ]


def test_bad_input_raises_and_writes_nothing(comm, target):
    win, sig = target
    mine = win.local()
    mine[:] = POISON
    del mine
    for name, call, code, words in bad_cases(comm, win, sig):
        got = raises(call, code, words)
        agree(got is None, f"{name}: {got}")
        check_untouched(comm, win, sig, name)


def type_error_cases(comm, win, sig):
    """Arguments that do not fit a call's parameters: TypeError naming the call, as Python's own."""
    right = (comm.rank + 1) % comm.size
    return [
        ("unexpected keyword", lambda: comm.put(win, right, src8(), strem=None), "unexpected keyword argument 'strem'"),
        ("a value given twice", lambda: comm.put(win, right, src8(), target=right),
         "multiple values for argument 'target'"),
        ("missing argument", lambda: comm.put_signal(win, right, src8(), sig, 0), "missing required argument 'value'"),
        ("too many by position", lambda: comm.wait_until(sig, 0, ">=", 0, None, 1), "at most 5 positional"),
        ("elem_offset by position", lambda: comm.put(win, right, src8(), 0, None, 1), "at most 5 positional"),
        ("a window that is not one", lambda: comm.put(sig, right, src8()), "win must be a meshmem.Window"),
        ("signals that are not", lambda: comm.put_signal(win, right, src8(), win, 0, 1),
         "sig must be a meshmem.Signals"),
        ("None for the window", lambda: comm.get(np.zeros(8, np.uint8), None, right), "win must be a meshmem.Window"),
        ("a float rank", lambda: comm.put(win, 1.0, src8()), "target must be an integer"),
        ("a string index", lambda: comm.signal(sig, right, "0", 1), "index must be an integer"),
        ("a negative index", lambda: comm.wait_until(sig, -1, ">=", 0), "index must be an integer in range"),
        ("a negative value", lambda: comm.signal(sig, right, 0, -1), "value must be an integer in range"),
        ("a value past 64 bits", lambda: comm.signal(sig, right, 0, 1 << 64), "value must be an integer in range"),
        ("a rank past int", lambda: comm.put(win, 1 << 40, src8()), "target must be an integer in range"),
    ]


def test_bad_arguments_raise_type_error_and_write_nothing(comm, target):
    win, sig = target
    mine = win.local()
    mine[:] = POISON
    del mine
    for name, call, words in type_error_cases(comm, win, sig):
        try:
            call()
            got = "did not raise"
        except TypeError as e:
            got = None if words in str(e) and "comm." in str(e) else f"message {e}"
        except Exception as e:  # noqa: BLE001 - any other exception is the finding
            got = f"raised {type(e).__name__}: {e}"
        agree(got is None, f"{name}: {got}")
        check_untouched(comm, win, sig, name)


def test_keywords_positions_and_index_objects_agree(comm):
    """The same put_signal by position, by keyword (names made at run time too), with NumPy
    integers for rank, index and value: every byte and the signal arrive each time."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    name = "".join(["str", "eam"])  # not interned
    forms = [
        lambda w, s, src: comm.put_signal(w, right, src, s, 0, 1, 8, "add", None),
        lambda w, s, src: comm.put_signal(w, right, src, s, 0, 1, op="add", offset=8, **{name: None}),
        lambda w, s, src: comm.put_signal(sig=s, value=np.uint64(1), index=np.int64(0), src=src, target=np.int32(right),
                                          win=w, op=meshmem.SignalOp.Add, elem_offset=8),
    ]
    bad = []
    for i, form in enumerate(forms):
        with comm.alloc(64, memory="host") as win, comm.alloc_signals(1, memory="host") as sig:
            mine = win.local()
            mine[:] = POISON
            comm.barrier()
            src = np.arange(8, dtype=np.uint8) + 10 * comm.rank + i
            form(win, sig, src)
            comm.wait_until(sig, 0, ">=", 1)
            want = np.full(64, POISON, np.uint8)
            want[8:16] = np.arange(8, dtype=np.uint8) + 10 * left + i
            if not np.array_equal(mine, want) or sig.read(0) != 1:
                bad.append(f"form {i}: {np.count_nonzero(mine != want)} bytes differ, signal {sig.read(0)}")
            del mine
            comm.barrier()
    agree(not bad, "; ".join(bad))


def test_error_carries_code_and_message(comm, target):
    win, _ = target
    try:
        comm.put(win, comm.size + 3, np.zeros(1, np.uint8))
        got = None
    except meshmem.Error as e:
        got = e
    ok = (isinstance(got, RuntimeError) and got.code == meshmem.ErrorCode.InvalidArgument
          and "comm.put" in str(got) and str(comm.size + 3) in str(got))
    agree(ok, f"error {got!r}")


def test_freed_and_closed_objects_raise(mpi):
    c = meshmem.Comm(mpi)
    win = c.alloc(64, memory="host")
    sig = c.alloc_signals(1, memory="host")
    win.free()
    sig.free()
    right = (c.rank + 1) % c.size
    cases = [
        ("put into a freed window", lambda: c.put(win, right, src8()), "freed"),
        ("put_signal with freed signals", lambda: c.put_signal(win, right, src8(), sig, 0, 1), "freed"),
        ("wait on freed signals", lambda: c.wait_until(sig, 0, ">=", 0), "freed"),
        ("signal freed signals", lambda: c.signal(sig, right, 0, 1), "freed"),
    ]
    problems = [f"{n}: {g}" for n, f, w in cases if (g := raises(f, contains=w))]
    agree(not problems, "; ".join(problems))
    win2 = c.alloc(64, memory="host")
    c.close()
    after = [
        ("alloc on a closed Comm", lambda: c.alloc(8, memory="host"), "closed"),
        ("put on a closed Comm", lambda: c.put(win2, right, src8()), "closed"),
        ("rank of a closed Comm", lambda: c.rank, "closed"),
        ("barrier on a closed Comm", lambda: c.barrier(), "closed"),
        ("local() of a window of a closed Comm", lambda: win2.local(), "closed"),
    ]
    problems = [f"{n}: {g}" for n, f, w in after if (g := raises(f, contains=w))]
    agree(not problems and c.closed and not win2.valid, "; ".join(problems))


def test_close_refused_while_arrays_live(mpi):
    c = meshmem.Comm(mpi)
    win = c.alloc(64, memory="host")
    kept = win.local() if c.rank == c.size - 1 else None
    got = raises(c.close, contains=f"rank {c.size - 1} still holds 1 array")
    agree(got is None and not c.closed, f"close with arrays alive: {got}")
    del kept
    c.close()
    agree(c.closed, "not closed")
