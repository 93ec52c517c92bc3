"""Plot the Jacobi benchmark CSV: time per iteration and parallel efficiency by GPUs."""
import csv
import sys
from collections import defaultdict

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

rows = list(csv.DictReader(open(sys.argv[1])))
single = {r["size_bytes"]: float(r["latency_us"]) for r in rows if r["variant"] == "single-gpu"}
series = defaultdict(dict)  # (size, variant) -> {ranks: us}
for r in rows:
    if r["variant"] == "single-gpu":
        continue
    series[(r["size_bytes"], r["variant"])][int(r["ranks"])] = float(r["latency_us"])
sizes = sorted({k[0] for k in series}, key=int)
fig, axes = plt.subplots(2, len(sizes), figsize=(6 * len(sizes), 8), squeeze=False)
print("size variant ranks us_per_iter efficiency")
for col, size in enumerate(sizes):
    t1 = single.get(size)
    for (s, variant), pts in sorted(series.items()):
        if s != size:
            continue
        ranks = sorted(pts)
        xs = [1] + ranks if t1 else ranks
        ys = ([t1] if t1 else []) + [pts[n] for n in ranks]
        axes[0][col].plot(xs, ys, marker="o", label=variant)
        if t1:
            eff = [t1 / (n * pts[n]) for n in ranks]
            axes[1][col].plot(ranks, eff, marker="o", label=variant)
            for n, e in zip(ranks, eff):
                print(size, variant, n, pts[n], round(e, 3))
    axes[0][col].set_title(f"Jacobi {size}^2: time per iteration")
    axes[0][col].set_xlabel("GPUs")
    axes[0][col].set_ylabel("us per iteration")
    axes[0][col].set_yscale("log")
    axes[0][col].legend(fontsize=7)
    axes[1][col].set_title(f"Jacobi {size}^2: parallel efficiency vs single GPU")
    axes[1][col].set_xlabel("GPUs")
    axes[1][col].set_ylabel("T1 / (N * TN)")
    axes[1][col].axhline(0.95, color="grey", linestyle=":")
    axes[1][col].legend(fontsize=7)
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)
