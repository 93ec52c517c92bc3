"""python -m meshmem.info [meshmem-info's arguments]: runs the meshmem-info tool of this
build (or the one on PATH), so that `mpirun -np 4 python -m meshmem.info --job` prints what
`mpirun -np 4 meshmem-info --job` does. The process becomes meshmem-info (exec), which
initialises MPI itself: nothing of the Python package runs first.
"""

import os
import shutil
import sys


def find_tool():
    """The meshmem-info binary: MESHMEM_INFO, this build's, or the first on PATH."""
    env = os.environ.get("MESHMEM_INFO")
    if env:
        return env
    try:
        from . import _build  # written by CMake in the build tree
        if os.access(_build.MESHMEM_INFO, os.X_OK):
            return _build.MESHMEM_INFO
    except ImportError:
        pass
    here = os.path.dirname(os.path.abspath(__file__))
    for rel in ("../../bin/meshmem-info", "../../../../bin/meshmem-info"):  # installed beside the package
        p = os.path.normpath(os.path.join(here, rel))
        if os.access(p, os.X_OK):
            return p
    return shutil.which("meshmem-info")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    tool = find_tool()
    if tool is None:
        sys.stderr.write("meshmem.info: meshmem-info not found (set MESHMEM_INFO, or put it on PATH)\n")
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(tool, [tool] + list(argv))


if __name__ == "__main__":
    sys.exit(main())
