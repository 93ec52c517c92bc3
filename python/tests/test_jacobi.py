"""examples/python/jacobi.py on 2 and 4 ranks, both halo exchanges, bitwise equal to its
one-rank run: with CuPy on the GPU (skipped without a GPU or CuPy), and with NumPy and host
windows (--array numpy, run by the CPU suite)."""

import importlib.util
import os
import sys

import pytest

# Iterations exceed every rank's band of rows, so that values cross the halos: a wrong or
# missing exchange changes the result.

import meshmem

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "examples", "python"))

GPU, WHY = meshmem.gpu_available()


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py is not installed")
@pytest.mark.skipif(not GPU, reason=f"no GPU: {WHY}")
@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="cupy is not installed")
@pytest.mark.parametrize("halo", ["meshmem", "mpi"])
def test_jacobi_with_cupy_matches_one_rank(mpi, halo):
    import jacobi
    assert jacobi.main(["--n", "130", "--iters", "150", "--halo", halo, "--check"], mpi) == 0


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py is not installed")
@pytest.mark.parametrize("halo", ["meshmem", "mpi"])
def test_jacobi_on_the_cpu_matches_one_rank(mpi, halo):
    import jacobi
    assert jacobi.main(["--n", "66", "--iters", "100", "--halo", halo, "--check", "--array", "numpy"], mpi) == 0
