#!/usr/bin/env python3
"""The fast GPU tier fits its budget: the `est` column of tests/gpu/entries.txt, summed over the
rows of tier gpu and gpu+long (one entry per rank count), is at most BUDGET seconds (480: eight
minutes on 1 x H200 with ranks sharing the GPU). Estimates are replaced by the figures of the
run files in tests/gpu/runs/ as runs come in.

  check_tier_budget.py ENTRIES_TXT [BUDGET]
"""
import sys

table, budget = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 480.0
total, rows = 0.0, 0
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
    total += float(est) * counts
    rows += counts
print(f"fast tier: {rows} entries, {total:.0f} s estimated, budget {budget:.0f} s")
sys.exit(0 if total <= budget else 1)
