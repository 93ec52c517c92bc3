#!/usr/bin/env python3
"""meshmem-info as users and scripts call it, checked on what they rely on.

  check_info.py MESHMEM_INFO MPIEXEC CASE

CASE: node (text: the user settings, --all the others; --help, a bad argument), node_json
(--json parsed, fields present and typed, settings as objects with their source), job:N
(mpirun -np N --job --json: a row per rank, a route per pair, each rank's device reason its
own, exit 0; the text form names every rank), knob_warnings (2 ranks: a misspelt MESHMEM_*
name on rank 1 alone is one warning on rank 0 naming the nearest setting and the rank; an old
name works and warns once; a bad value of a GPU setting is refused in every build), unreachable (ranks split into simulated nodes with only shm allowed:
exit 3, the pair's transport none and every reason), simulated (4 ranks on 2 simulated nodes:
mpi across, shm within, shm named as passed over), two_hosts (2 hosts x 2 ranks made by
launch/meshmem-hosts, its path the 4th argument; exit 77 where hosts cannot be made).
"""
import json
import os
import subprocess
import sys

info, mpiexec, case = sys.argv[1], sys.argv[2], sys.argv[3]
env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def run(args, extra_env=None, ranks=None):
    cmd = ([mpiexec, "-np", str(ranks), "--oversubscribe", "--bind-to", "none"] +
           [x for k in (extra_env or {}) for x in ("-x", k)] if ranks else []) + [info] + args
    p = subprocess.run(cmd, env=dict(env, **(extra_env or {})), capture_output=True, text=True, timeout=240)
    return p.returncode, p.stdout, p.stderr


def check(cond, what, out=""):
    if not cond:
        print("FAILED: " + what)
        if out:
            print(out[-4000:])
        sys.exit(1)
    print("ok: " + what)


def parse(out):
    try:
        return json.loads(out)
    except json.JSONDecodeError as e:
        check(False, "--json output parses (%s)" % e, out)


def check_node(node):
    for key, typ in (("hostname", str), ("cpus", int), ("gpu", dict), ("descriptor_passing", dict), ("mpi", dict),
                     ("nccl", str), ("problems", list)):
        check(isinstance(node.get(key), typ), "node field %s is a %s" % (key, typ.__name__))
    gpu = node["gpu"]
    check(isinstance(gpu["usable"], bool) and isinstance(gpu["devices"], list) and isinstance(gpu["pairs"], list),
          "gpu: usable, devices, pairs")
    if not gpu["usable"]:
        check(gpu["why"] != "", "a machine without a usable GPU says why: " + gpu["why"])
    for d in gpu["devices"]:
        check(d["pci_bus_id"] != "" and isinstance(d["vmm"], bool), "GPU %d: PCI bus id and VMM" % d["ordinal"])
    n = len(gpu["devices"])
    check(len(gpu["pairs"]) == n * (n - 1), "every ordered pair of %d GPUs reported" % n)
    for p in gpu["pairs"]:
        check(p["works"] or p.get("reason"), "GPU pair %d -> %d works or says why" % (p["from"], p["to"]))
    check(isinstance(node["descriptor_passing"]["pidfd_getfd"], bool), "pidfd_getfd is a boolean")
    check(node["mpi"]["cuda_aware"] != "", "MPI CUDA awareness: " + node["mpi"]["cuda_aware"])


if case == "node":
    rc, out, err = run([])
    check(rc == 0, "meshmem-info exits 0", out + err)
    for piece in ("node ", "GPUs", "descriptor passing: pidfd_getfd", "MPI: ", "NCCL: ", "--job", "user settings:",
                  "  MESHMEM_TIMEOUT=", "meshmem-info --all"):
        check(piece in out, "the report names " + piece.strip(), out)
    check("MESHMEM_FAULT=" not in out and "tuning settings:" not in out, "only the user settings without --all", out)
    rc, out, err = run(["--all"], {"MESHMEM_BARRIER": "kernel"})
    check(rc == 0 and "tuning settings:" in out and "testing settings:" in out and "  MESHMEM_FAULT=" in out,
          "--all lists the tuning and testing settings", out + err)
    check("  MESHMEM_BARRIER=kernel  [env]" in out, "a setting from the environment says so", out)
    rc, out, _ = run(["--help"])
    check(rc == 0 and "usage: meshmem-info" in out and "--json" in out and "--bandwidth" in out, "--help", out)
    rc, _, err = run(["--no-such-flag"])
    check(rc == 2 and "unknown argument --no-such-flag" in err, "a bad argument: exit 2 and says which", err)
elif case == "node_json":
    rc, out, err = run(["--json"])
    check(rc == 0, "meshmem-info --json exits 0", out + err)
    doc = parse(out)
    check(doc["ranks"] == 1 and len(doc["nodes"]) == 1 and "pairs" not in doc, "one node, no job part")
    settings = doc["settings"]
    check(isinstance(settings, dict) and len(settings) >= 25, "settings: an object of every setting")
    for name, st in settings.items():
        check(all(isinstance(st.get(k), str) for k in ("value", "default", "tier", "source")) and
              isinstance(st.get("used"), bool) and st["tier"] in ("user", "tuning", "testing"),
              "%s: value, default, tier, source, used" % name)
    t = settings["MESHMEM_TIMEOUT"]
    check(t["tier"] == "user" and t["source"] == "default" and t["value"] == t["default"], "MESHMEM_TIMEOUT: default")
    check(settings["MESHMEM_FAULT"]["tier"] == "testing", "MESHMEM_FAULT is a testing setting")
    check(isinstance(doc["notices"], list), "notices listed")
    rc, out, err = run(["--json"], {"MESHMEM_TIMEOUT": "7"})
    t = parse(out)["settings"]["MESHMEM_TIMEOUT"]
    check(rc == 0 and t["value"] == "7000ms" and t["source"] == "env" and t["default"] == "300000ms",
          "MESHMEM_TIMEOUT=7: value 7000ms from env: %s" % t, out + err)
    check_node(doc["nodes"][0])
    check(doc["unreachable_pairs"] is False and doc["broken_gpu_pairs"] == 0, "nothing unreachable or broken")
elif case.startswith("job:"):
    n = int(case.split(":")[1])
    rc, out, err = run(["--job", "--json"], ranks=n)
    check(rc == 0, "mpirun -np %d meshmem-info --job --json exits 0" % n, out + err)
    doc = parse(out)
    check(doc["ranks"] == n and len(doc["pairs"]) == n, "a row per rank")
    check(len(doc["nodes"]) == doc["node_count"] == 1, "one node report per node")
    check_node(doc["nodes"][0])
    for row in doc["pairs"]:
        check(len(row["host"]) == n and all(p["transport"] == "shm" for p in row["host"]),
              "rank %d: shm to every rank for host windows" % row["rank"])
        check(all(p["why"] for p in row["host"]), "rank %d: every route says why" % row["rank"])
        # Without device windows, each rank's own reason (a rank with a GPU in a job where
        # another has none names that rank: not here).
        info_text = row["device_info"]
        others = [r for r in range(n) if r != row["rank"] and ("rank %d:" % r) in info_text and
                  "not every rank" not in info_text]
        check(not others, "rank %d's device reason is its own (names no other rank): %s" % (row["rank"], info_text))
        check(isinstance(row["hostname"], str) and row["hostname"], "rank %d: hostname" % row["rank"])
    rc, out, err = run(["--job"], ranks=n)
    check(rc == 0 and all("rank %d (" % r in out for r in range(n)), "the text form has every rank", out + err)
    for r in range(1, n):
        line = [l for l in out.splitlines() if l.startswith("rank %d (" % r)][0]
        check("none: rank 0:" not in line, "rank %d's text row does not give rank 0's reason: %s" % (r, line))
elif case == "knob_warnings":
    def mpmd(env0, env1, args):
        pre = [mpiexec, "--oversubscribe", "--bind-to", "none"]
        ctx = lambda e: ["-np", "1", "env"] + ["%s=%s" % kv for kv in e.items()] + [info] + args
        p = subprocess.run(pre + ctx(env0) + [":"] + ctx(env1), env=env, capture_output=True, text=True, timeout=240)
        return p.returncode, p.stdout, p.stderr
    rc, out, err = mpmd({}, {"MESHMEM_TIMOUT": "5"}, ["--job"])
    check(rc == 0, "a misspelt name on rank 1: the job runs", out + err)
    lines = [l for l in err.splitlines() if "MESHMEM_TIMOUT" in l]
    check(len(lines) == 1, "one warning for MESHMEM_TIMOUT in the job (got %d)" % len(lines), err)
    check(lines[0].startswith("[meshmem rank 0] warn: MESHMEM_TIMOUT is not a meshmem setting and is ignored") and
          "did you mean MESHMEM_TIMEOUT?" in lines[0] and lines[0].endswith("; on rank 1"),
          "printed by rank 0, naming MESHMEM_TIMEOUT and rank 1: " + lines[0])
    old = {"MESHMEM_STAGING_CHUNK": "8192"}
    rc, out, err = mpmd(old, old, ["--job", "--json"])
    check(rc == 0, "an old name on both ranks: the job runs", out + err)
    lines = [l for l in err.splitlines() if "MESHMEM_STAGING_CHUNK" in l]
    check(len(lines) == 1 and lines[0].startswith("[meshmem rank 0] warn: MESHMEM_STAGING_CHUNK is the old name of "
                                                  "MESHMEM_STAGED_CHUNK") and lines[0].endswith("; on every rank"),
          "one warning naming the new name, on every rank", err)
    st = parse(out)["settings"]["MESHMEM_STAGED_CHUNK"]
    check(st["value"] == "8192" and st["source"] == "env (old name MESHMEM_STAGING_CHUNK)",
          "the old name's value is the new setting's: %s" % st)
    unused = [l for l in err.splitlines() if "MESHMEM_STAGED_CHUNK=8192 has no effect" in l]
    check(len(unused) == (0 if st["used"] else 1), "reported unused exactly where the GPU part is absent", err)
    rc, out, err = run(["--job"], {"MESHMEM_BARRIER": "foo"}, ranks=2)
    check(rc != 0 and "MESHMEM_BARRIER='foo' is not valid" in err, "MESHMEM_BARRIER=foo refused in every build", err)
elif case == "unreachable":
    rc, out, err = run(["--job", "--json"], {"MESHMEM_TRANSPORTS": "shm", "MESHMEM_SIMULATE_NODES": "2"}, ranks=2)
    check(rc == 3, "a pair without a transport: exit 3 (got %d)" % rc, out + err)
    doc = parse(out)
    check(doc["unreachable_pairs"] is True, "unreachable_pairs is true")
    route = doc["pairs"][0]["host"][1]
    check(route["transport"] == "none", "rank 0 -> rank 1: none")
    check("shm: rank 1 is on node 1" in route["reasons"] and "mpi: not in MESHMEM_TRANSPORTS" in route["reasons"],
          "every transport's reason: " + route["reasons"])
elif case == "simulated":
    rc, out, err = run(["--job", "--json"], {"MESHMEM_SIMULATE_NODES": "2"}, ranks=4)
    check(rc == 0, "4 ranks on 2 simulated nodes: exit 0", out + err)
    doc = parse(out)
    check(doc["node_count"] == 2, "2 nodes")
    host = doc["pairs"][0]["host"]
    check([p["transport"] for p in host] == ["shm", "shm", "mpi", "mpi"], "rank 0: shm within, mpi across")
    check("shm: " in host[2]["passed_over"], "rank 0 -> 2 names shm as passed over: " + host[2]["passed_over"])
    check("passed_over" not in host[1], "rank 0 -> 1: nothing passed over")
elif case == "two_hosts":
    hosts_tool = sys.argv[4]
    cmd = [hosts_tool, "--hosts", "2", "--ranks-per-host", "2", "--timeout", "150", "--unavailable-exit", "77", "--",
           "--oversubscribe", "--bind-to", "none", info, "--job", "--json"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)
    if p.returncode == 77:
        print("skipped: " + p.stderr.strip())
        sys.exit(77)
    check(p.returncode == 0, "meshmem-info --job across 2 hosts exits 0", p.stdout + p.stderr)
    doc = parse(p.stdout)
    check(doc["node_count"] == 2 and len(doc["nodes"]) == 2, "2 nodes, a report from each")
    check(doc["nodes"][0]["hostname"] != doc["nodes"][1]["hostname"], "the reports come from two hostnames")
    host = doc["pairs"][0]["host"]
    check([r["transport"] for r in host] == ["shm", "shm", "mpi", "mpi"], "rank 0: shm on its host, mpi to the other")
    check(doc["pairs"][2]["host"] != doc["pairs"][0]["host"] and doc["pairs"][2]["host"][3]["transport"] == "shm",
          "rank 2: shm to rank 3 on its own host")
else:
    check(False, "unknown case " + case)
