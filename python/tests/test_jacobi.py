"""examples/python/jacobi.py on 2 and 4 ranks, both halo exchanges, bitwise equal to its
one-rank run (skipped without a GPU or CuPy)."""

import importlib.util
import os
import sys

import pytest

import meshmem

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "examples", "python"))

GPU, WHY = meshmem.gpu_available()


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py is not installed")
@pytest.mark.skipif(not GPU, reason=f"no GPU: {WHY}")
@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="cupy is not installed")
@pytest.mark.parametrize("halo", ["meshmem", "mpi"])
def test_jacobi_matches_one_rank(mpi, halo):
    import jacobi
    assert jacobi.main(["--n", "258", "--iters", "60", "--halo", halo, "--check"], mpi) == 0
