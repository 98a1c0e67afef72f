"""Fleet figures: native `kvtrail scope` (one process, and sharded by pool +
`kvtrail merge`), native shards on Spark (`kvtrail fleet spark`, local[2])
vs the DuckDB dialect vs the Spark dialect on local Spark (local[2]), on
the same simulated traces, in one run. For each engine: wall
time (and, for the SQL engines, the query time without the engine's start),
peak memory of the whole process tree (the JVM included: /proc is sampled
every 20 ms, and wait4's max RSS is taken when larger), and ratios against
the native single run on the same trace. Every engine must find the same
affected responses with the same foreign tokens (and the merged folders of
the shards the same summary.json as the single run), or the row says
MISMATCH and the script exits 1. For `fleet spark`, "query s" is the Spark
job (tasks and the shards' return, from the job's SparkContext up) plus the
merge, without spark-submit's JVM and Python start. Beside it, "Spark
floor" is a fresh spark-submit running a job of the same shape (one
JavaRDD.pipe task per shard, `cat` in kvtrail's place), timed the same way:
what any job of this shape costs on this machine. The last line of each
trace compares the job and the floor with the Spark dialect's query, all
measured here.

Rows are printed as each engine finishes (a slow engine does not hide the
others' figures).

Usage (after .ci/setup.d/50-sql.sh and `cargo build --release`):
  ~/.cache/kvtrail/venv-sql/bin/python bench/fleet.py [options] [TRACE ...]

  TRACE              existing trace folders (default: simulate the incident
                     at --requests sizes, seed 1)
  --requests N,M     incident sizes to simulate (default 1000,3000; 3000 is
                     the size of the committed traces/incident-mini)
  --engines LIST     any of native,sharded,fleet-spark,duckdb,spark (default: all)
  --kvtrail BIN      the kvtrail binary (default target/release/kvtrail)
"""
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tree_rss_kb(root_pid):
    """Sum of VmRSS (kB) of root_pid and every descendant still running."""
    children = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    total, todo = 0, [root_pid]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            pass
    return total


def run(cmd, env=None, want_stderr=False):
    """Runs cmd; returns (wall seconds, peak RSS MB of the process tree),
    and its stderr with want_stderr."""
    t = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         env=None if env is None else {**os.environ, **env})
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss_kb(p.pid))
            done.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    err = []
    reader = threading.Thread(target=lambda: err.append(p.stderr.read()), daemon=True)
    reader.start()
    _, status, ru = os.wait4(p.pid, 0)
    secs = time.time() - t
    done.set()
    sampler.join()
    reader.join()
    if status != 0:
        msg = (err[0] if err else b"").decode(errors="replace")
        sys.exit(f"failed: {' '.join(cmd)}\n{msg[-3000:]}")
    mb = max(peak[0], ru.ru_maxrss) / 1024
    if want_stderr:
        return secs, mb, (err[0] if err else b"").decode(errors="replace")
    return secs, mb


# Spark's floor for a job of fleet spark's shape: the same SparkContext
# start, then one pipe task per shard line (JavaRDD.pipe, as the job), with
# `cat` in kvtrail's place, timed as the job times itself.
FLOOR_JOB = r"""
import json, sys, time
from pyspark import SparkContext
sc = SparkContext(appName="kvtrail fleet bench floor")
sc.setLogLevel("ERROR")
started = time.time()
def jl(items):
    out = sc._jvm.java.util.ArrayList()
    for i in items:
        out.add(i)
    return out
n = int(sys.argv[2])
lines = ["%d 0" % i for i in range(n)]
got = list(sc._jsc.parallelize(jl(lines), n).pipe(jl(["sh", "-c", "cat"])).collect())
secs = time.time() - started
sc.stop()
assert sorted(got) == sorted(lines), got
json.dump({"secs": secs}, open(sys.argv[1], "w"))
"""


def spark_floor(py, tmp, shards):
    """Seconds of a no-op Spark job of fleet spark's shape (`cat` in
    kvtrail's place) in a fresh spark-submit, local[2]."""
    job, out = os.path.join(tmp, "floor_job.py"), os.path.join(tmp, "floor.json")
    with open(job, "w") as f:
        f.write(FLOOR_JOB)
    submit = os.path.join(os.path.dirname(py), "spark-submit")
    run([submit, "--master", "local[2]", "--conf", "spark.ui.enabled=false", "--conf", "spark.driver.memory=2g",
         job, out, str(shards)], env={"PYSPARK_PYTHON": py, "PYSPARK_DRIVER_PYTHON": py})
    return json.load(open(out))["secs"]


def affected(rows):
    return sorted((a["request_id"], a["foreign_tokens"]) for a in rows)


def bench_trace(trace, kvt, engines, tmp, py):
    runner = os.path.join(ROOT, "tests/sql/run_sql.py")
    manifest = json.load(open(os.path.join(trace, "trace.json")))
    pools = sorted(p["id"] for p in manifest["deployment"]["pools"])
    name = os.path.basename(trace.rstrip("/"))
    work = os.path.join(tmp, "out", name)
    os.makedirs(work, exist_ok=True)

    s, m = run([kvt, "scope", trace, "--out", f"{work}/single"])
    native = json.load(open(f"{work}/single/summary.json"))
    want = affected(native["affected_responses"])
    c = native["counts"]
    print(f"\n== {trace}: {c['requests']} requests, {c['kv_events']} kv events, "
          f"{c['slot_touches']} slot touches, pools {pools}; "
          f"{len(want)} affected responses, {c['foreign_tokens']} foreign tokens", flush=True)
    print(f"{'engine':<34} {'wall s':>8} {'query s':>8} {'x native':>9} {'peak MB':>8} {'x native':>9}  result",
          flush=True)
    base_s, base_m = s, m
    ok = True

    def row(label, secs, query, mb, result):
        q = f"{query:8.2f}" if query is not None else f"{'':>8}"
        print(f"{label:<34} {secs:8.2f} {q} {secs / base_s:9.1f} {mb:8.0f} {mb / base_m:9.1f}  {result}",
              flush=True)

    if "native" in engines:
        row("native scope (1 process)", s, None, m, f"{len(want)} affected")
    if "sharded" in engines:
        t0 = time.time()
        peak = 0.0
        for p in pools:
            _, mm = run([kvt, "scope", trace, "--pools", str(p), "--out", f"{work}/shard-{p}"])
            peak = max(peak, mm)
        _, mm = run([kvt, "merge", *[f"{work}/shard-{p}" for p in pools], "--out", f"{work}/merged"])
        peak = max(peak, mm)
        same = open(f"{work}/merged/summary.json").read() == open(f"{work}/single/summary.json").read()
        ok &= same
        row(f"native, {len(pools)} pool shards + merge", time.time() - t0, None, peak,
            "identical summary.json" if same else "MISMATCH")
    fleet_query, fleet_wall, floor = None, [None], None
    if "fleet-spark" in engines:
        submit = os.path.join(os.path.dirname(py), "spark-submit")
        secs, mb, err = run([kvt, "fleet", "spark", trace, "--out", f"{work}/fleet", "--master", "local[2]",
                             "--spark-submit", submit, "--backend", "cpu",
                             "--conf", "spark.ui.enabled=false", "--conf", "spark.driver.memory=2g"],
                            env={"PYSPARK_PYTHON": py, "PYSPARK_DRIVER_PYTHON": py}, want_stderr=True)
        job = [ln for ln in err.splitlines() if ln.startswith("kvtrail: fleet spark: job ")]
        # "kvtrail: fleet spark: job J s (N shards), merge M s"
        words = job[-1].split() if job else []
        fleet_query = float(words[4]) + float(words[-2]) if job else None
        shards = words[6].lstrip("(") if job else "?"
        same = open(f"{work}/fleet/summary.json").read() == open(f"{work}/single/summary.json").read()
        ok &= same
        fleet_wall[0] = secs
        row(f"fleet spark, {shards} shard(s), local[2]", secs, fleet_query, mb,
            "identical summary.json" if same else "MISMATCH")
        floor = spark_floor(py, tmp, int(shards))
        print(f"{'  Spark floor: same job, cat':<34} {'':>8} {floor:8.2f}   (fleet spark's job above it: "
              f"{fleet_query - floor:.2f} s)", flush=True)
    for engine in ("duckdb", "spark"):
        if engine not in engines:
            continue
        sql = f"{work}/{engine}.sql"
        run([kvt, "sql", "--dialect", engine, "--trace-path", trace, "--out", sql])
        jobs = f"{work}/{engine}-jobs.json"
        json.dump([{"name": "t", "sql": sql}], open(jobs, "w"))
        secs, mb = run([py, runner, engine, jobs, f"{work}/{engine}-out.json"])
        res = json.load(open(f"{work}/{engine}-out.json"))["t"]
        got = affected(res["kvtrail_affected_responses"])
        ok &= got == want
        row(f"{engine} dialect ({'local[2]' if engine == 'spark' else '2 threads'})", secs, res["_secs"], mb,
            f"{len(got)} affected, same" if got == want else f"MISMATCH {got}")
        if engine == "spark" and fleet_query and floor:
            print(f"fleet spark vs Spark dialect on local[2]: query {res['_secs'] / fleet_query:.0f}x faster, "
                  f"wall {secs / fleet_wall[0]:.0f}x faster; the Spark floor's job is "
                  f"{res['_secs'] / floor:.0f}x faster than the dialect (the most a Spark job of this shape "
                  f"can reach here)", flush=True)
    return ok


def main():
    args = sys.argv[1:]
    kvt = os.path.join(ROOT, "target/release/kvtrail")
    engines = {"native", "sharded", "fleet-spark", "duckdb", "spark"}
    sizes = [1000, 3000]
    traces = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--kvtrail":
            kvt = args[i + 1]
            i += 2
        elif a == "--engines":
            engines = set(args[i + 1].split(","))
            i += 2
        elif a == "--requests":
            sizes = [int(x) for x in args[i + 1].split(",")]
            i += 2
        elif a in ("-h", "--help"):
            print(__doc__)
            return 0
        else:
            traces.append(a)
            i += 1
    if not os.path.exists(kvt):
        sys.exit(f"no kvtrail binary at {kvt}: run `cargo build --release` (or pass --kvtrail)")
    py = sys.executable
    print(f"fleet bench: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; engines {sorted(engines)}",
          flush=True)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        if not traces:
            for n in sizes:
                t = f"{tmp}/incident-{n}"
                run([kvt, "simulate", "--scenario", "incident", "--requests", str(n), "--seed", "1", "--out", t])
                traces.append(t)
        for t in traces:
            ok &= bench_trace(t, kvt, engines, tmp, py)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
