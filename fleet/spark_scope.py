"""kvtrail's native shards on Spark: the PySpark job `kvtrail fleet spark`
writes and submits (it is built into the binary; this is its source).

Usage (what `kvtrail fleet spark` runs):
  spark-submit [--master URL] [--conf K=V ...] --files KVTRAIL_BINARY \
      spark_scope.py PLAN.json RESULT.json

PLAN.json (written by `kvtrail fleet spark` from `kvtrail fleet plan`):
  {"format": "kvtrail-fleet-spark-plan", "trace": TRACE, "binary": NAME,
   "backend": "auto"|"cpu"|"cuda", "direct": BOOL, "staging": DIR,
   "shards": [{"index": I, "pools": [P, ...]}, ...]}

One Spark task per shard: the kvtrail binary (shipped to the executors with
--files, found through SparkFiles) runs `kvtrail scope TRACE --pools P,...
--out DIR` on the executor, reading the trace where it lives (an object
store URL, or a path every executor sees). With "direct" (a local trace,
so a file system the executors share) the shard is written straight into
STAGING/shard-I; otherwise into the executor's temporary folder, from
where its files travel back to the driver as the task's result (persisted
on the executors' disks, then fetched one shard at a time, so the driver
holds one chunk at a time) and are written into STAGING/shard-I.

A shard whose kvtrail exits non-zero is not retried (its errors are bad
input, the same on every attempt): its exit code and stderr are reported.
RESULT.json, written last (atomically), says what happened:
  {"format": "kvtrail-fleet-spark-result", "secs": S (the job, from its
   SparkContext up to the last shard written),
   "shards": [{"index": I, "pools": [...], "dir": "shard-I"}, ...],
   "errors": [{"index": I, "pools": [...], "exit": N|null, "stderr": S}]}
The merge of the shards is kvtrail's, on the driver, after this job.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

CHUNK = 4 << 20
PLAN_FORMAT = "kvtrail-fleet-spark-plan"
RESULT_FORMAT = "kvtrail-fleet-spark-result"


def shard_name(index):
    return "shard-%04d" % index


def executable(name, tmp):
    """The shipped binary, made executable (a copy when the shipped file
    is not)."""
    from pyspark import SparkFiles

    exe = SparkFiles.get(name)
    if os.access(exe, os.X_OK):
        return exe
    local = os.path.join(tmp, name)
    shutil.copyfile(exe, local)
    os.chmod(local, 0o700)
    return local


def shard_files(out):
    """(relative path, absolute path) of every file of a shard folder, sorted."""
    found = []
    for root, dirs, files in os.walk(out):
        dirs.sort()
        for f in sorted(files):
            full = os.path.join(root, f)
            found.append((os.path.relpath(full, out), full))
    return found


def task(plan):
    trace, binary, backend = plan["trace"], plan["binary"], plan["backend"]
    direct, staging = plan["direct"], plan["staging"]

    def run(items):
        for index, pools in items:
            tmp = tempfile.mkdtemp(prefix="kvtrail-shard-")
            try:
                exe = executable(binary, tmp)
                name = shard_name(index)
                out = os.path.join(staging if direct else tmp, name)
                cmd = [exe, "scope", trace, "--pools", ",".join(str(p) for p in pools),
                       "--backend", backend, "--out", out]
                env = dict(os.environ, KVTRAIL_NO_PROGRESS="1")
                p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, env=env)
                if p.returncode != 0:
                    yield ("error", index, pools, p.returncode, p.stderr.decode(errors="replace")[-8000:])
                    continue
                if not direct:
                    for rel, full in shard_files(out):
                        with open(full, "rb") as fh:
                            n = 0
                            while True:
                                b = fh.read(CHUNK)
                                yield ("chunk", index, rel, n, b)
                                n += 1
                                if len(b) < CHUNK:
                                    break
                yield ("done", index, pools, name)
            except Exception as e:  # the task's own failure, reported like a shard's
                yield ("error", index, pools, None, "%s: %s" % (type(e).__name__, e))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)

    return run


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


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: spark_scope.py PLAN.json RESULT.json")
    plan = json.load(open(sys.argv[1]))
    if plan.get("format") != PLAN_FORMAT:
        sys.exit("%s: not a %s file" % (sys.argv[1], PLAN_FORMAT))
    from pyspark import SparkContext, StorageLevel

    sc = SparkContext(appName="kvtrail fleet spark")
    sc.setLogLevel("ERROR")
    started = time.time()
    shards = [(s["index"], s["pools"]) for s in plan["shards"]]
    rdd = sc.parallelize(shards, len(shards)).mapPartitions(task(plan))
    if plan["direct"]:
        records = rdd.collect()
    else:
        # Every shard runs at once; their files are then fetched one shard
        # (partition) at a time from the executors' disks.
        rdd.persist(StorageLevel.DISK_ONLY)
        rdd.count()
        records = rdd.toLocalIterator()
    done, errors = [], []
    for rec in records:
        if rec[0] == "chunk":
            write_chunk(plan["staging"], *rec[1:])
        elif rec[0] == "done":
            done.append({"index": rec[1], "pools": rec[2], "dir": rec[3]})
        else:
            errors.append({"index": rec[1], "pools": rec[2], "exit": rec[3], "stderr": rec[4]})
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
