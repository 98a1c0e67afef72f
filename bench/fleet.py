"""Fleet figures on one simulated trace, in one run: native `kvtrail scope`
(single process, and sharded by pool + merge) vs the DuckDB dialect vs the
Spark dialect on local Spark (local[2]); wall time and peak memory
(max RSS of the process tree, from wait4 rusage), with ratios against the
native single run. Every engine must find the same affected responses.

Usage (after .ci/setup.d/50-sql.sh and `cargo build --release`):
  ~/.cache/kvtrail/venv-sql/bin/python bench/fleet.py [TRACE] [--kvtrail BIN] [--no-spark]
Default TRACE: traces/incident-mini (3000 requests, 161k kv events).
"""
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd):
    """Runs cmd; returns (seconds, peak RSS MB of the child tree)."""
    t = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(p.pid, 0)
    secs = time.time() - t
    err = p.stderr.read().decode()
    if status != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{err[-2000:]}")
    return secs, ru.ru_maxrss / 1024


def main():
    args = sys.argv[1:]
    trace = os.path.join(ROOT, "traces/incident-mini")
    kvt = os.path.join(ROOT, "target/release/kvtrail")
    spark = True
    i = 0
    while i < len(args):
        if args[i] == "--kvtrail":
            kvt = args[i + 1]
            i += 2
        elif args[i] == "--no-spark":
            spark = False
            i += 1
        else:
            trace = args[i]
            i += 1
    if not os.path.exists(kvt):
        kvt = os.path.join(ROOT, "target/debug/kvtrail")
    py = sys.executable
    runner = os.path.join(ROOT, "tests/sql/run_sql.py")
    manifest = json.load(open(os.path.join(trace, "trace.json")))
    pools = sorted(p["id"] for p in manifest["deployment"]["pools"])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        s, m = run([kvt, "scope", trace, "--out", f"{tmp}/single"])
        native = json.load(open(f"{tmp}/single/summary.json"))
        want = sorted((a["request_id"], a["foreign_tokens"]) for a in native["affected_responses"])
        rows.append(("native scope (1 process)", s, m, len(want)))

        t0 = time.time()
        peak = 0.0
        for p in pools:
            _, mm = run([kvt, "scope", trace, "--pools", str(p), "--out", f"{tmp}/shard-{p}"])
            peak = max(peak, mm)
        run([kvt, "merge", *[f"{tmp}/shard-{p}" for p in pools], "--out", f"{tmp}/merged"])
        merged = open(f"{tmp}/merged/summary.json").read()
        same = merged == open(f"{tmp}/single/summary.json").read()
        rows.append((f"native sharded ({len(pools)} shards, sequential) + merge", time.time() - t0, peak,
                     len(want) if same else "MISMATCH"))

        for engine in ["duckdb"] + (["spark"] if spark else []):
            sql = f"{tmp}/{engine}.sql"
            run([kvt, "sql", "--dialect", engine, "--trace-path", trace, "--out", sql])
            jobs = f"{tmp}/{engine}-jobs.json"
            json.dump([{"name": "t", "sql": sql}], open(jobs, "w"))
            s, m = run([py, runner, engine, jobs, f"{tmp}/{engine}-out.json"])
            res = json.load(open(f"{tmp}/{engine}-out.json"))["t"]
            got = sorted((a["request_id"], a["foreign_tokens"]) for a in res["kvtrail_affected_responses"])
            rows.append((f"{engine} dialect", s, m, len(got) if got == want else f"MISMATCH {got}"))

    base_s, base_m = rows[0][1], rows[0][2]
    ev = sum(f.get("rows", 0) for f in manifest.get("files", []) if f["path"].startswith("kv/"))
    print(f"trace {trace}: {ev} kv events, pools {pools}, {native['counts']['slot_touches']} slot touches")
    print(f"{'engine':<48} {'secs':>9} {'x native':>9} {'peak MB':>9} {'x native':>9}  affected")
    for name, s, m, n in rows:
        print(f"{name:<48} {s:>9.2f} {s / base_s:>9.1f} {m:>9.0f} {m / base_m:>9.1f}  {n}")


if __name__ == "__main__":
    main()
