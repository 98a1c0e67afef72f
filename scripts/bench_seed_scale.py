#!/usr/bin/env python3
"""Seed-scale run: a simulated incident at the disclosed deployment's
parameters (context window 1,048,576 tokens, prefill pool 681,280 tokens,
decode pool 2,097,152 tokens: more than twice the prefill pool), end to
end through the release binary: simulate, verify, scope --out, notify.
For each step: wall time, CPU time (user + system) and peak RSS of the
kvtrail process (from wait4), and the trace's KV event count.

Run it at two sizes to show memory flat in the trace's length (the pools,
not the events, bound what kvtrail holds):

    cargo build --release
    python3 scripts/bench_seed_scale.py --requests 40000 --dir /tmp/seed-1e7
    python3 scripts/bench_seed_scale.py --requests 400000 --dir /tmp/seed-1e8

Each run prints one table, and with --json the same as JSON on stdout.
--reuse-trace keeps a trace an earlier run simulated in the same --dir.
Plain Python 3 (no packages); Linux (wait4 rusage).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEPLOYMENT = [
    "--set", "context_window=1048576",
    "--set", "prefill.capacity_tokens=681280",
    "--set", "decode.capacity_tokens=2097152",
]

NOTIFY_TOML = """operator_name = "Example Inference GmbH"
dpo_contact = "dpo@example-inference.eu"
incident_id = "INC-SEED-SCALE"
became_aware = "2026-09-10 08:00 UTC"
"""


def run(argv, ok=(0,)):
    """Runs argv; returns (exit code, wall s, cpu s, peak RSS MiB)."""
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.monotonic() - t0
    code = os.waitstatus_to_exitcode(status)
    if code not in ok:
        sys.stderr.write(err.decode(errors="replace"))
        raise SystemExit(f"{' '.join(argv)}: exit {code}")
    return code, wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024


def kv_events(trace):
    with open(os.path.join(trace, "trace.json")) as f:
        m = json.load(f)
    return sum(f.get("rows", 0) for f in m.get("files", []) if f["path"].startswith("kv/"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40_000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--dir", required=True, help="work folder (emptied first)")
    ap.add_argument("--bin", default=os.path.join(ROOT, "target/release/kvtrail"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--reuse-trace", action="store_true",
                    help="keep DIR/trace when an earlier run simulated it (no simulate row)")
    a = ap.parse_args()
    trace = os.path.join(a.dir, "trace")
    reuse = a.reuse_trace and os.path.exists(os.path.join(trace, "trace.json"))
    if reuse:
        for name in ("scope", "packs", "notify.toml"):
            p = os.path.join(a.dir, name)
            if os.path.isdir(p):
                shutil.rmtree(p)
            elif os.path.exists(p):
                os.remove(p)
    else:
        if os.path.exists(a.dir):
            shutil.rmtree(a.dir)
        os.makedirs(a.dir)
    scope = os.path.join(a.dir, "scope")
    packs = os.path.join(a.dir, "packs")
    toml = os.path.join(a.dir, "notify.toml")
    with open(toml, "w") as f:
        f.write(NOTIFY_TOML)
    steps = [
        ("simulate", [a.bin, "simulate", "--scenario", "incident", "--requests", str(a.requests),
                      "--seed", str(a.seed), *DEPLOYMENT, "--out", trace], (0,)),
        ("verify", [a.bin, "verify", trace], (0,)),
        # scope exits 1 when it finds affected responses (the incident does).
        ("scope", [a.bin, "scope", trace, "--out", scope], (0, 1)),
        ("notify", [a.bin, "notify", scope, "--out", packs, "--config", toml], (0,)),
    ]
    rows = []
    events = kv_events(trace) if reuse else None
    for name, argv, ok in steps:
        if reuse and name == "simulate":
            continue
        code, wall, cpu, rss = run(argv, ok)
        if name == "simulate":
            events = kv_events(trace)
        rows.append({"step": name, "exit": code, "wall_s": round(wall, 2),
                     "cpu_s": round(cpu, 2), "peak_rss_mib": round(rss, 1)})
    with open(os.path.join(scope, "summary.json")) as f:
        s = json.load(f)
    load = os.getloadavg()[0]
    out = {"requests": a.requests, "kv_events": events, "affected_responses":
           len(s["affected_responses"]), "load_avg_1m": round(load, 1), "steps": rows}
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{a.requests} requests, {events} KV events, "
          f"{out['affected_responses']} affected responses (load {load:.1f})")
    print(f"{'step':10} {'wall s':>9} {'cpu s':>9} {'peak RSS MiB':>13}")
    for r in rows:
        print(f"{r['step']:10} {r['wall_s']:9.2f} {r['cpu_s']:9.2f} {r['peak_rss_mib']:13.1f}")


if __name__ == "__main__":
    main()
