#!/usr/bin/env python3
"""The fast GPU tier fits its budget: the `est` column of tests/gpu/entries.txt, summed over the
rows of tier gpu and gpu+long (one entry per rank count), plus the EST of the Python tests of
the fast tier (meshmem_add_python_test calls with LABELS gpu in PYTHON_CMAKE, EST seconds per
rank count), is at most BUDGET seconds (480: eight minutes on 1 x H200 with ranks sharing the
GPU). Estimates are replaced by the figures of the run files in tests/gpu/runs/ as runs come in.

  check_tier_budget.py ENTRIES_TXT [BUDGET] [PYTHON_CMAKE]
"""
import re
import sys

table, budget = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 480.0
total, rows = 0.0, 0
python_total, python_rows = 0.0, 0
if len(sys.argv) > 3:
    text = open(sys.argv[3]).read()
    for call in re.findall(r"^meshmem_add_python_test\((.*?)\)", text, re.S | re.M):
        words = call.split()
        def values(key):
            if key not in words:
                return []
            out = []
            for w in words[words.index(key) + 1:]:
                if w.isupper() and not w[0].isdigit():
                    break
                out.append(w)
            return out
        name = values("NAME")[0]
        if values("LABELS") != ["gpu"]:
            continue
        est = values("EST")
        if not est:
            sys.exit(f"{sys.argv[3]}: {name} is in the fast tier (LABELS gpu) without an EST")
        counts = len(values("RANKS"))
        python_total += float(est[0]) * counts
        python_rows += counts
for line in open(table):
    if not line.strip() or line.lstrip().startswith(("#", "@")):
        continue
    cols = [c.strip() for c in line.split("|")]
    if len(cols) != 9:
        sys.exit(f"{table}: a row needs 9 columns: {line.strip()}")
    entry, tier, ranks, est = cols[0], cols[1], cols[3], cols[8]
    if tier not in ("gpu", "gpu+long"):
        continue
    counts = 1 if ranks.startswith("hosts:") else len(ranks.split())
    total += float(est.split("/")[0]) * counts  # a gpu+long row's FAST/FULL: the fast entry's
    rows += counts
total += python_total
rows += python_rows
print(f"fast tier: {rows} entries ({python_rows} of them Python), {total:.0f} s estimated, budget {budget:.0f} s")
sys.exit(0 if total <= budget else 1)
