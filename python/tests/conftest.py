"""Shared fixtures of the meshmem Python tests, which run on every rank of an mpirun job.

Every rank runs the same tests in the same order; a check that fails on some ranks is agreed
across ranks (agree()) before the next collective, so a failure fails every rank instead of
leaving the others waiting. A run where every test skipped exits 77, which CTest reports as
skipped (SKIP_RETURN_CODE), never as passed.
"""

import importlib.util
import os
import pickle
import sys
import time

import numpy as np
import pytest

import meshmem


class _World:
    """MPI_COMM_WORLD through the binding's own helpers where mpi4py is absent (a GPU machine's
    virtual environment, say): what the tests use of mpi4py's communicator. meshmem.Comm takes
    it as the world."""

    _meshmem_world = True

    def __init__(self):
        import atexit
        from meshmem import _meshmem as m
        self._m = m
        if m._world_init():
            atexit.register(m._world_finalize)
        self.rank, self.size = m._world_rank(), m._world_size()

    def allgather(self, obj):
        return [pickle.loads(b) for b in self._m._world_allgather(pickle.dumps(obj))]

    def bcast(self, obj, root=0):
        return pickle.loads(self._m._world_bcast(pickle.dumps(obj), root))

    def Barrier(self):
        self._m._world_barrier()


_world = None
HAVE_MPI4PY = importlib.util.find_spec("mpi4py") is not None
if os.environ.get("MESHMEM_TEST_NO_MPI4PY"):  # as where it is not installed, for the binding too
    sys.modules["mpi4py"] = sys.modules["mpi4py.MPI"] = None
    HAVE_MPI4PY = False


def world():
    """MPI.COMM_WORLD (MPI initialised with MPI_THREAD_MULTIPLE on first use, so that the tests
    of the tools, test_info.py, which launch MPI jobs themselves, are no MPI processes), or
    _World where mpi4py is absent."""
    global _world
    if _world is None:
        if HAVE_MPI4PY:
            from mpi4py import MPI
            _world = MPI.COMM_WORLD
        else:
            _world = _World()
    return _world


needs_mpi4py = pytest.mark.skipif(not HAVE_MPI4PY, reason="mpi4py is not installed")


def agree(ok, what=""):
    """Fails the test on every rank where it failed on any, naming the ranks and their reasons."""
    reasons = world().allgather(None if ok else (what or "check failed"))
    bad = [(r, why) for r, why in enumerate(reasons) if why is not None]
    if bad:
        pytest.fail("; ".join(f"rank {r}: {why}" for r, why in bad), pytrace=False)


def raises(fn, code=meshmem.ErrorCode.InvalidArgument, contains=None):
    """Runs fn; returns None where it raised meshmem.Error with `code` (and `contains` in its
    message), else what happened instead, for agree()."""
    try:
        fn()
    except meshmem.Error as e:
        if e.code != code:
            return f"raised {e.code} instead of {code}: {e}"
        if contains is not None and contains not in str(e):
            return f"message lacks {contains!r}: {e}"
        return None
    except Exception as e:  # noqa: BLE001 - any other exception is the finding
        return f"raised {type(e).__name__} instead of meshmem.Error: {e}"
    return "did not raise"


def fresh_seed():
    """A new seed for every test, from rank 0's clock, printed so that a failure can be replayed."""
    seed = world().bcast(int(os.environ.get("MESHMEM_TEST_SEED", time.time_ns() % (1 << 32))), root=0)
    print(f"seed {seed} (MESHMEM_TEST_SEED replays it)")
    return seed


def data(seed, *key, nbytes):
    """Bytes that only (seed, key) produce: what a rank sent is recomputed by its receiver."""
    rng = np.random.default_rng([seed, *key])
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


@pytest.fixture(scope="session")
def mpi():
    return world()


@pytest.fixture(scope="session")
def comm():
    if meshmem.gpu_available()[0]:
        meshmem.select_local_device(world())  # before the Comm: it uses the current device
    c = meshmem.Comm(world())
    yield c
    c.close()


_outcomes = {"passed": 0, "failed": 0, "skipped": 0}


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        _outcomes[report.outcome] = _outcomes.get(report.outcome, 0) + 1


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == 0 and _outcomes["skipped"] > 0 and _outcomes["passed"] == 0 and _outcomes["failed"] == 0:
        print("meshmem: every test skipped")
        session.exitstatus = 77
