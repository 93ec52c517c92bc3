#!/usr/bin/env bash
# Run on a Debian 12 machine (this project's CPU machines) before a GPU run: copies into the
# ignored folder python/third_party what a GPU machine's Python may lack and cannot download:
#   pylib/             Debian's pytest 7.2 and its pure-Python dependencies (checked to run on
#                      Python 3.12), used by CTest and run_gpu.sh only where `import pytest` fails
#   pybind11/include/  Debian's pybind11 2.10 headers, used only where neither the system nor
#                      the interpreter (pybind11, or the headers PyTorch ships) has any
# Then carry python/third_party to the GPU machine with the checkout.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dest=$root/python/third_party
dist=/usr/lib/python3/dist-packages
mkdir -p "$dest/pylib" "$dest/pybind11/include"
for p in _pytest pytest pluggy iniconfig packaging py.py attr attrs; do
  [ -e "$dist/$p" ] || { echo "carry_for_gpu.sh: $dist/$p missing (apt-get install python3-pytest)" >&2; exit 1; }
  rm -rf "${dest:?}/pylib/$p"
  cp -r "$dist/$p" "$dest/pylib/"
done
[ -d /usr/include/pybind11 ] || { echo "carry_for_gpu.sh: /usr/include/pybind11 missing (apt-get install pybind11-dev)" >&2; exit 1; }
rm -rf "$dest/pybind11/include/pybind11"
cp -r /usr/include/pybind11 "$dest/pybind11/include/"
find "$dest" -name __pycache__ -prune -exec rm -rf {} +
du -sh "$dest"
