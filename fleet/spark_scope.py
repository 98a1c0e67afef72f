"""kvtrail's native shards on Spark: the PySpark job `kvtrail fleet spark`
writes and submits (it is built into the binary; this is its source).

Usage (what `kvtrail fleet spark` runs):
  spark-submit [--master URL] [--conf K=V ...] --files KVTRAIL_BINARY \
      spark_scope.py PLAN.json RESULT.json

PLAN.json (written by `kvtrail fleet spark` from `kvtrail fleet plan`):
  {"format": "kvtrail-fleet-spark-plan", "trace": TRACE, "binary": NAME,
   "backend": "auto"|"cpu"|"cuda", "direct": BOOL, "staging": DIR,
   "shards": [{"index": I, "pools": [P, ...]}, ...]}

One Spark task per shard, run in the executor's JVM without Python: the
job pipes the shard's "INDEX POOLS" line (JavaRDD.pipe) through the kvtrail
binary (shipped to the executors with --files; a small sh wrapper finds it
in the driver's SparkFiles folder in local mode, else in the executor's
working folder, where Spark puts shipped files), whose hidden `kvtrail fleet
task` runs `kvtrail scope TRACE --pools P,... --out DIR`, reading the trace
where it lives (an object store URL, or a path every executor sees), and
prints one JSON line per event. With "direct" (a local trace, so a file
system the executors share) the shard is written straight into
STAGING/shard-I; otherwise into the executor's temporary folder, from where
its files travel back to the driver as base64 lines (persisted on the
executors' disks, then fetched one shard at a time, so the driver holds one
shard's lines at a time) and are written into STAGING/shard-I.

A shard whose kvtrail exits non-zero is not retried (its errors are bad
input, the same on every attempt): its exit code and stderr are reported.
RESULT.json, written last (atomically), says what happened:
  {"format": "kvtrail-fleet-spark-result", "secs": S (the job, from its
   SparkContext up to the last shard written),
   "shards": [{"index": I, "pools": [...], "dir": "shard-I"}, ...],
   "errors": [{"index": I, "pools": [...], "exit": N|null, "stderr": S,
               "error": E|null}]}
where E is the shard's kvtrail error as it wrote it, a JSON error line
({"type": "error", "message": M, "hint": H|null, "location": L|null}),
so that kvtrail reports it without reading it out of S.
The merge of the shards is kvtrail's, on the driver, after this job.
"""
import base64
import json
import os
import sys
import time

PLAN_FORMAT = "kvtrail-fleet-spark-plan"
RESULT_FORMAT = "kvtrail-fleet-spark-result"

# Runs on the executor: finds the shipped binary ($1) in the driver's
# SparkFiles folder ($2: local mode) or the working folder (executors),
# copies it where it may run when the shipped file is not executable, and
# runs `kvtrail fleet task` with the remaining arguments.
WRAPPER = r"""
name=$1; root=$2; shift 2
exe=
for e in "$root/$name" "./$name"; do
    if [ -f "$e" ]; then exe=$e; break; fi
done
if [ -z "$exe" ]; then
    echo "kvtrail fleet spark: the shipped binary $name is in neither $root nor $(pwd)" >&2
    exit 127
fi
tmp=
if [ ! -x "$exe" ]; then
    tmp=$(mktemp -d) || exit 1
    if ! { cp "$exe" "$tmp/$name" && chmod 700 "$tmp/$name"; }; then rm -rf "$tmp"; exit 1; fi
    exe=$tmp/$name
fi
"$exe" fleet task "$@"
rc=$?
if [ -n "$tmp" ]; then rm -rf "$tmp"; fi
exit $rc
"""


def shard_name(index):
    return "shard-%04d" % index


def safe_rel(rel):
    """A shard file's relative path, refused if it could leave the folder."""
    parts = rel.split("/")
    if os.path.isabs(rel) or any(p in ("", ".", "..") for p in parts):
        raise ValueError("shard file path %r is not a plain relative path" % rel)
    return os.path.join(*parts)


def write_chunk(staging, index, rel, n, data):
    d = os.path.join(staging, shard_name(index))
    path = os.path.join(d, safe_rel(rel))
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if n == 0 else os.O_APPEND)
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def java_list(sc, items):
    out = sc._jvm.java.util.ArrayList()
    for i in items:
        out.add(i)
    return out


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: spark_scope.py PLAN.json RESULT.json")
    plan = json.load(open(sys.argv[1]))
    if plan.get("format") != PLAN_FORMAT:
        sys.exit("%s: not a %s file" % (sys.argv[1], PLAN_FORMAT))
    from pyspark import SparkContext, SparkFiles, StorageLevel

    sc = SparkContext(appName="kvtrail fleet spark")
    sc.setLogLevel("ERROR")
    started = time.time()
    shards = plan["shards"]
    lines = ["%d %s" % (s["index"], ",".join(str(p) for p in s["pools"])) for s in shards]
    cmd = ["sh", "-c", WRAPPER, "kvtrail-fleet-task", plan["binary"], SparkFiles.getRootDirectory(),
           "--trace", plan["trace"], "--backend", plan["backend"]]
    if plan["direct"]:
        cmd += ["--staging", plan["staging"]]
    rdd = sc._jsc.parallelize(java_list(sc, lines), len(lines)).pipe(java_list(sc, cmd))
    if plan["direct"]:
        records = rdd.collect()
    else:
        # Every shard runs at once; their files are then fetched one shard
        # (partition) at a time from the executors' disks.
        rdd.persist(sc._getJavaStorageLevel(StorageLevel.DISK_ONLY))
        rdd.count()
        records = rdd.toLocalIterator()
    done, errors = [], []
    for line in records:
        rec = json.loads(line)
        kind = rec["kind"]
        if kind == "chunk":
            write_chunk(plan["staging"], rec["index"], rec["rel"], rec["n"], base64.b64decode(rec["data"]))
        elif kind == "done":
            done.append({"index": rec["index"], "pools": rec["pools"], "dir": rec["dir"]})
        else:
            errors.append({"index": rec["index"], "pools": rec["pools"], "exit": rec["exit"],
                           "stderr": rec["stderr"], "error": rec.get("error")})
    secs = time.time() - started
    sc.stop()
    result = {"format": RESULT_FORMAT, "secs": secs, "shards": sorted(done, key=lambda s: s["index"]),
              "errors": sorted(errors, key=lambda e: e["index"])}
    tmp = sys.argv[2] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, sys.argv[2])


if __name__ == "__main__":
    main()
