"""Remote traces against local: `kvtrail verify` and `kvtrail scope --json`
on a simulated trace read from a local folder, from a static HTTP server
with Range (tests/objstore/server.py http) and from moto's S3 server
(tests/objstore/server.py s3), all on 127.0.0.1, in one run. For each:
wall time, the process's peak RSS (wait4), and ratios against the local
run; the remote outputs must equal the local ones (the trace's location
aside), or the row says MISMATCH and the script exits 1.

Usage (after .ci/setup.d/56-moto.sh and `cargo build --release`):
  ~/.cache/kvtrail/venv-moto/bin/python bench/object_store.py [--requests N,M] [--kvtrail BIN]
"""
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER = os.path.join(ROOT, "tests", "objstore", "server.py")


def peak(cmd, env=None):
    """Wall time, exit code, stdout and the peak RSS (MiB) of one process."""
    t0 = time.time()
    with tempfile.TemporaryFile() as o, tempfile.TemporaryFile() as e:
        p = subprocess.Popen(cmd, stdout=o, stderr=e, env=env)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.time() - t0
        o.seek(0)
        e.seek(0)
        code = os.waitstatus_to_exitcode(status)
        return code, o.read().decode(), e.read().decode(), wall, ru.ru_maxrss / 1024


def start(args):
    p = subprocess.Popen(
        [sys.executable, SERVER] + args, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    info = json.loads(p.stdout.readline())
    return p, info


def main():
    args = sys.argv[1:]
    sizes = [1000, 3000]
    kvt = os.path.join(ROOT, "target", "release", "kvtrail")
    while args:
        a = args.pop(0)
        if a == "--requests":
            sizes = [int(x) for x in args.pop(0).split(",")]
        elif a == "--kvtrail":
            kvt = args.pop(0)
        else:
            sys.exit(__doc__)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            t = os.path.join(tmp, "t%d" % n)
            subprocess.run(
                [kvt, "simulate", "--scenario", "incident", "--requests", str(n), "--seed", "1", "--out", t],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(t) for f in fs)
            spec = os.path.join(tmp, "spec%d.json" % n)
            json.dump({"bucket": "bench", "uploads": [{"dir": t, "prefix": "t"}]}, open(spec, "w"))
            http, hinfo = start(["http", tmp])
            s3, sinfo = start(["s3", spec])
            env = dict(os.environ)
            env.update(
                KVTRAIL_NO_PROGRESS="1",
                AWS_ENDPOINT=sinfo["endpoint"],
                AWS_ALLOW_HTTP="true",
                AWS_REGION="us-east-1",
                AWS_ACCESS_KEY_ID=sinfo["key_id"],
                AWS_SECRET_ACCESS_KEY=sinfo["secret"],
                AWS_METADATA_ENDPOINT="http://127.0.0.1:9",
            )
            where = [
                ("local", t),
                ("http", "%s/t%d" % (hinfo["endpoint"], n)),
                ("s3 (moto)", "s3://bench/t"),
            ]
            print("trace: %d requests, %.1f MiB" % (n, size / 2**20), flush=True)
            for cmd in (["verify", "--json"], ["scope", "--json"]):
                base = None
                for name, loc in where:
                    code, out, err, wall, rss = peak([kvt, cmd[0], loc] + cmd[1:], env)
                    out = out.replace(loc, t)
                    if base is None:
                        base = (out, wall, rss)
                        same = "baseline"
                    else:
                        same = "same" if out == base[0] else "MISMATCH"
                        failed |= out != base[0]
                    print(
                        "  %-7s %-10s exit %d  %7.2f s (x%.2f)  peak %6.1f MiB (x%.2f)  %s"
                        % (cmd[0], name, code, wall, wall / base[1], rss, rss / base[2], same),
                        flush=True,
                    )
                    if code not in (0, 1):
                        print(err)
                        failed = True
            for p in (http, s3):
                p.stdin.close()
                p.wait()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
