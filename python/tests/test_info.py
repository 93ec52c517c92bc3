"""python -m meshmem.info runs this build's meshmem-info: the same JSON on this node, and the
same job report (a route for every pair) under mpirun. Not an MPI process itself: it launches
the jobs (conftest's MPI is imported lazily and never here)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from meshmem import info

ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1")


def run(cmd, ranks=None):
    if ranks:
        mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
        cmd = [mpirun, "-np", str(ranks), "--oversubscribe", "--bind-to", "none"] + cmd
    p = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=240)
    return p.returncode, p.stdout, p.stderr


def stable(doc):
    """The report less what changes from one run to the next (pids, times, tokens)."""
    text = json.dumps(doc, sort_keys=True)
    return sorted(doc.keys()), doc.get("ranks"), len(doc.get("nodes", [])), len(doc.get("pairs", [])), len(text) > 0


def test_finds_this_builds_tool():
    tool = info.find_tool()
    assert tool and os.access(tool, os.X_OK), f"meshmem-info not found: {tool}"


def test_node_report_matches_the_tool():
    rc1, out1, err1 = run([sys.executable, "-m", "meshmem.info", "--json"])
    rc2, out2, err2 = run([info.find_tool(), "--json"])
    assert rc1 == rc2 == 0, err1 + err2
    a, b = json.loads(out1), json.loads(out2)
    assert stable(a) == stable(b)
    assert a["settings"] == b["settings"] and a["meshmem"] == b["meshmem"]


@pytest.mark.parametrize("ranks", [2])
def test_job_report_under_mpirun(ranks):
    rc, out, err = run([sys.executable, "-m", "meshmem.info", "--job", "--json"], ranks=ranks)
    assert rc == 0, out + err
    doc = json.loads(out)
    assert doc["ranks"] == ranks and "pairs" in doc, out


def test_bad_arguments_exit_2_like_the_tool():
    rc, _, _ = run([sys.executable, "-m", "meshmem.info", "--no-such-option"])
    assert rc == 2
