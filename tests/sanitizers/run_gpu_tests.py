#!/usr/bin/env python3
"""Runs the `gpu` CTest entries under compute-sanitizer (or plainly) within a time budget.

  tests/sanitizers/run_gpu_tests.py BUILD_DIR OUT_DIR [--tool memcheck|racecheck|none]
      [--budget SECONDS] [--per-test SECONDS] [--jobs N] [--only REGEX] [--skip REGEX]
      [--exclude GTEST_PATTERNS] [--env K=V ...] [--state FILE]

Each entry's command, environment and pass/skip rules come from `ctest --show-only=json-v1`;
with a tool, `compute-sanitizer --tool T --error-exitcode 86` goes in front of the test
program, one log per rank (OUT_DIR/<entry>.<pid>.san). --exclude adds negative gtest patterns
to every entry (e.g. '*TenThousand*:*Baseline*' for cases that only repeat or measure memory).
--state keeps the names of finished entries so that a later call, on a machine that kept the
build, goes on where this one stopped. Entries that need the machine alone (separate hosts,
a suspended job, a killed peer) run one at a time after the others.

--jobs above 1 runs entries side by side on the same GPUs: fine under a sanitizer, but tests
that compare GPU memory before and after (`*Baseline*`) or spin waiting for peers then see
the other jobs and fail or slow down, so plain runs should keep --jobs 1.

Prints one line per entry: verdict, seconds, gtest cases passed and skipped, and with a tool
the number of sanitizer summaries found and the errors or hazards they count. Exit status 1
if any entry failed or a sanitizer reported anything, else 0.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ap = argparse.ArgumentParser()
ap.add_argument("build")
ap.add_argument("out")
ap.add_argument("--tool", default="memcheck", choices=["memcheck", "racecheck", "synccheck", "initcheck", "none"])
ap.add_argument("--budget", type=float, default=540)
ap.add_argument("--per-test", type=float, default=240)
ap.add_argument("--jobs", type=int, default=1)
ap.add_argument("--only")
ap.add_argument("--skip")
ap.add_argument("--exclude")
ap.add_argument("--env", action="append", default=[])
ap.add_argument("--state")
a = ap.parse_args()

t0 = time.time()
os.makedirs(a.out, exist_ok=True)
listing = subprocess.run(["ctest", "--test-dir", a.build, "--show-only=json-v1", "-L", "gpu"],
                         check=True, stdout=subprocess.PIPE).stdout
tests = json.loads(listing)["tests"]
done = set()
if a.state and os.path.exists(a.state):
    done = {line.strip() for line in open(a.state) if line.strip()}
chosen = [t for t in tests
          if (not a.only or re.search(a.only, t["name"])) and not (a.skip and re.search(a.skip, t["name"]))
          and t["name"] not in done]
chosen.sort(key=lambda t: 0 if t["name"].endswith(".np2") else 1)  # the cheaper half first
alone = re.compile(r"two_hosts|suspend|killed_|sticky_error")
lock = threading.Lock()
SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: (\d+) hazard")


def prop(t, key, default=None):
    return next((p["value"] for p in t.get("properties", []) if p["name"] == key), default)


def with_exclusions(cmd):
    i = next((i for i, c in enumerate(cmd) if c.startswith("--gtest_filter=")), None)
    if i is None:
        return cmd + ["--gtest_filter=-" + a.exclude]
    f = cmd[i][len("--gtest_filter="):]
    cmd[i] = "--gtest_filter=" + (f + ":" + a.exclude if "-" in f else f + "-" + a.exclude)
    return cmd


def run(t):
    name = t["name"]
    left = a.budget - (time.time() - t0)
    if left < 20:
        return name, "not-run"
    cmd = list(t["command"])
    env = dict(os.environ)
    for kv in prop(t, "ENVIRONMENT", []) + a.env:
        k, v = kv.split("=", 1)
        env[k] = v
    if a.tool != "none":
        program = next(i for i, c in enumerate(cmd)
                       if re.search(r"/(tests|examples)/", c) and not c.endswith(".sh") and os.path.isfile(c)
                       and os.access(c, os.X_OK))  # the test binary, not the entries' launcher (needs_gpu.sh)
        cmd[program:program] = ["compute-sanitizer", "--tool", a.tool, "--error-exitcode", "86", "--print-limit",
                                "30", "--log-file", os.path.join(a.out, name + ".%p.san")]
    if a.exclude:
        cmd = with_exclusions(cmd)
    start = time.time()
    p = subprocess.Popen(cmd, env=env, cwd=prop(t, "WORKING_DIRECTORY"), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = p.communicate(timeout=min(a.per_test, left - 5))
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)  # mpirun and its ranks, this entry's only
        output, _ = p.communicate()
        rc = None
    text = (output or b"").decode(errors="replace")
    with open(os.path.join(a.out, name + ".log"), "w") as f:
        f.write(" ".join(cmd) + "\n" + text)
    passes, skips = prop(t, "PASS_REGULAR_EXPRESSION"), prop(t, "SKIP_REGULAR_EXPRESSION")
    fails = prop(t, "FAIL_REGULAR_EXPRESSION")
    # As CTest's: `.` matches a newline too (a pattern may span several ranks' lines).
    if rc is None:
        verdict = "TIMEOUT"
    elif (skips and any(re.search(r, text, re.S) for r in skips)) or rc == prop(t, "SKIP_RETURN_CODE", 77):
        verdict = "skipped"
    elif fails and any(re.search(r, text, re.S) for r in fails):
        verdict = f"FAIL(rc={rc}, failure pattern)"
    elif passes:
        verdict = "pass" if any(re.search(r, text, re.S) for r in passes) else f"FAIL(rc={rc})"
    else:
        verdict = "pass" if rc == 0 else f"FAIL(rc={rc})"
    findings = ""
    if a.tool != "none":
        counts = []
        for f in os.listdir(a.out):
            if f.startswith(name + ".") and f.endswith(".san"):
                counts += [int(x or y) for x, y in SUMMARY.findall(open(os.path.join(a.out, f), errors="replace").read())]
        findings = f" summaries={len(counts)} findings={sum(counts)}"
        if sum(counts) and verdict == "pass":
            verdict = "FINDINGS"
    ok = len(re.findall(r"\[       OK \]", text))
    skipped = len(set(re.findall(r"\[  SKIPPED \] (\S+)", text)))
    line = f"{name}: {verdict} {time.time() - start:.1f}s cases-ok={ok} cases-skipped={skipped}{findings}"
    with lock:
        print(line, flush=True)
        if a.state and verdict not in ("TIMEOUT", "not-run"):
            with open(a.state, "a") as f:
                f.write(name + "\n")
    return name, verdict


together = [t for t in chosen if not alone.search(t["name"])]
with ThreadPoolExecutor(max_workers=a.jobs) as pool:
    results = list(pool.map(run, together))
results += [run(t) for t in chosen if alone.search(t["name"])]
missed = [n for n, v in results if v == "not-run"]
bad = [n for n, v in results if v not in ("pass", "skipped", "not-run")]
print(f"# {a.tool}: {len(results) - len(missed)} run, {len(bad)} not passed {' '.join(bad)}; "
      f"{len(missed)} not reached {' '.join(missed)}; {time.time() - t0:.0f} s")
sys.exit(1 if bad else 0)
