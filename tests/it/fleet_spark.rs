//! `kvtrail fleet plan` and `kvtrail fleet spark`: the shards follow copies
//! (a prefill pool rides with a decode pool that replays it, a device pool
//! and its cache tier travel together); on local Spark (`local[2]`, the
//! pyspark of .ci/setup.d/50-sql.sh) the shards of a trace in S3 (moto,
//! .ci/setup.d/56-moto.sh) and of a local trace merge into a folder equal
//! to a local `scope --out` byte for byte, as `merge` promises (every file
//! but report.html, which shows the command line, and evidence.json, which
//! cites the shard folders); `verify` accepts it. A shard failing on an
//! executor, an unreachable endpoint, a bucket without the trace and an
//! object replaced between listing and reading: exit 2, a message and a
//! hint, no folder left.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use kvtrail::trace::Role;

use crate::support::cli::{Kvtrail, Ran, kvtrail, s};
use crate::support::files::copy_dir;
use crate::support::objstore::{self, Server};
use crate::support::trace_builder::{TraceBuilder, pool};
use crate::support::venv;

const BUCKET: &str = "traces";

/// Five pools: prefill 0 feeding decode 1 and 2, decode 2 offloading to
/// its cache tier 3 and loading back, a mixed pool 4 without copies;
/// foreign and blank reads in every shard.
fn fleet_trace() -> TraceBuilder {
    let mut tb = TraceBuilder::with_pools(vec![
        pool(0, Role::Prefill, 32),
        pool(1, Role::Decode, 32),
        pool(2, Role::Decode, 32),
        pool(3, Role::Cache, 64),
        pool(4, Role::Mixed, 32),
    ]);
    for (id, t) in [(1, "acme"), (2, "initech"), (3, "umbrella"), (4, "hooli")] {
        tb.req(id, t);
    }
    let s0 = tb.write(0, 1, 0, 8);
    tb.copy(1, 1, 0, 8, 0, 0, s0);
    tb.read(1, 1, 0, 8);
    tb.read(1, 2, 0, 4); // foreign: request 1's KV
    let s0b = tb.write(0, 3, 8, 4);
    let c2 = tb.copy(2, 3, 0, 4, 0, 8, s0b);
    let off = tb.copy(3, 0, 10, 4, 2, 0, c2);
    tb.write(2, 2, 0, 4);
    tb.copy(2, 0, 4, 4, 3, 10, off);
    tb.read(2, 4, 4, 6); // foreign (request 3's, through the tier) and blank
    tb.write(4, 2, 0, 4);
    tb.read(4, 3, 0, 6); // foreign and blank
    tb.read(0, 4, 8, 2); // foreign in the prefill pool
    tb
}

/// The trace on disk once per run of the tests.
fn local() -> &'static (tempfile::TempDir, PathBuf, PathBuf) {
    static T: OnceLock<(tempfile::TempDir, PathBuf, PathBuf)> = OnceLock::new();
    T.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let t = fleet_trace().record(&dir.path().join("fleet"));
        // The same trace with request 2 listed twice: the plan (kv only)
        // passes, every shard's scope refuses the request index.
        let mut tb = fleet_trace();
        tb.req(2, "initech");
        let dup = tb.record(&dir.path().join("dup"));
        (dir, t, dup)
    })
}

/// One moto server: the trace under `fleet/`, again under `changing/`
/// (one kv object replaced right after it is listed), and an empty bucket.
fn s3() -> &'static Server {
    static S: OnceLock<Server> = OnceLock::new();
    S.get_or_init(|| {
        let (dir, t, _) = local();
        let changing = std::fs::read_dir(t.join("kv/pool=2"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".parquet"))
            .min()
            .expect("a kv file of pool 2");
        let spec = dir.path().join("spec.json");
        std::fs::write(
            &spec,
            serde_json::json!({
                "bucket": BUCKET,
                "empty_bucket": "empty",
                "uploads": [{"dir": t, "prefix": "fleet"}, {"dir": t, "prefix": "changing"}],
                "changing": format!("changing/kv/pool=2/{changing}"),
            })
            .to_string(),
        )
        .unwrap();
        objstore::start(&["s3", spec.to_str().unwrap()])
    })
}

/// spark-submit of the SQL venv, with PYSPARK_PYTHON its python; None
/// (after a SKIP line) outside CI when the venv is missing.
fn spark() -> Option<(PathBuf, PathBuf)> {
    let py = venv::SQL.python()?;
    let submit = py.parent().unwrap().join("spark-submit");
    assert!(
        submit.is_file(),
        "{} is missing: run .ci/setup.d/50-sql.sh",
        submit.display()
    );
    Some((submit, py))
}

/// `kvtrail fleet spark TRACE --out OUT` on local[2].
fn fleet_spark(trace: &str, out: &Path, submit: &Path, py: &Path) -> Kvtrail {
    kvtrail([
        "fleet",
        "spark",
        trace,
        "--out",
        s(out),
        "--master",
        "local[2]",
        "--spark-submit",
        s(submit),
        "--backend",
        "cpu",
        "--conf",
        "spark.ui.enabled=false",
    ])
    .env("PYSPARK_PYTHON", py)
    .env("PYSPARK_DRIVER_PYTHON", py)
    .timeout(Duration::from_secs(600))
}

/// What the parent folder holds (no temporary folder may stay).
fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// The lines a run printed on stdout, each a JSON value.
fn json_lines(r: &Ran) -> Vec<serde_json::Value> {
    r.ok()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The merged folder against a local single run: every file byte for byte
/// but report.html (the command line) and evidence.json (the shards as
/// inputs); both present, and the folder lists the same files.
fn same_as_local_scope(merged: &Path, single: &Path) {
    same_files(merged, single);
    let html = std::fs::read_to_string(merged.join("report.html")).unwrap();
    assert!(
        html.contains("fleet spark"),
        "report.html names the command"
    );
}

/// Two scope folders list the same files, equal byte for byte but
/// report.html and evidence.json (which name the command and inputs).
fn same_files(merged: &Path, single: &Path) {
    let names = entries(single);
    assert_eq!(entries(merged), names);
    assert!(names.len() >= 10, "{names:?}");
    for n in &names {
        if n == "report.html" || n == "evidence.json" {
            continue;
        }
        let a = std::fs::read(single.join(n)).unwrap();
        let b = std::fs::read(merged.join(n)).unwrap();
        assert!(
            a == b,
            "{n} differs from a local scope's:\n--- scope\n{}\n--- fleet spark\n{}",
            String::from_utf8_lossy(&a),
            String::from_utf8_lossy(&b)
        );
    }
}

#[test]
fn plan_follows_copies() {
    let (_, t, _) = local();
    let o = kvtrail(["fleet", "plan", s(t), "--json"]).run();
    let v: serde_json::Value = serde_json::from_str(&o.ok()).unwrap();
    let shards: Vec<(Vec<u64>, Vec<u64>)> = v["shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            let ids = |k: &str| {
                g[k].as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap())
                    .collect()
            };
            (ids("pools"), ids("replays"))
        })
        .collect();
    assert_eq!(
        shards,
        vec![
            (vec![0, 1], vec![0, 1]),
            (vec![2, 3], vec![0, 2, 3]),
            (vec![4], vec![4]),
        ]
    );
    let events: u64 = v["shards"][2]["events"].as_u64().unwrap();
    assert_eq!(events, 2);
    let o = kvtrail(["fleet", "plan", s(t), "--list"]).run();
    assert_eq!(o.ok(), "0,1\n2,3\n4\n");
    // The listed shards are what scope --pools and merge take.
    let o = kvtrail(["fleet", "plan", s(t)]).run();
    assert!(
        o.ok().contains("shard 1: --pools 2,3 (replays 0,2,3;"),
        "{}",
        o.stdout
    );
}

/// `fleet task`, the Spark task's side of the job's pipe, without Spark:
/// shards on stdin, JSON lines out. Without --staging a shard's files come
/// back as base64 chunks that rebuild the folder a `scope --pools` writes;
/// a shard that fails is a line with its exit code and stderr (the task
/// itself succeeds); a line that is no shard fails the task (exit 2).
#[test]
fn fleet_task_prints_shards_as_lines() {
    use base64::Engine;
    let (_, t, dup) = local();
    let tmp = tempfile::tempdir().unwrap();
    let o = kvtrail(["fleet", "task", "--trace", s(t), "--backend", "cpu"])
        .stdin("7 2,3\n\n")
        .run();
    let lines = json_lines(&o);
    let rebuilt = tmp.path().join("rebuilt");
    let mut chunks = 0;
    for l in &lines[..lines.len() - 1] {
        assert_eq!(l["kind"], "chunk", "{l}");
        assert_eq!(l["index"], 7);
        let rel = l["rel"].as_str().unwrap();
        assert!(!rel.contains("..") && !rel.starts_with('/'), "{rel}");
        let path = rebuilt.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let data = base64::engine::general_purpose::STANDARD
            .decode(l["data"].as_str().unwrap())
            .unwrap();
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap();
        std::io::Write::write_all(&mut f, &data).unwrap();
        chunks += 1;
    }
    assert!(chunks >= 10, "{chunks} chunks");
    let done = lines.last().unwrap();
    assert_eq!(done["kind"], "done");
    assert_eq!(done["index"], 7);
    assert_eq!(done["dir"], "shard-0007");
    assert_eq!(done["pools"], serde_json::json!([2, 3]));
    let single = tmp.path().join("single");
    kvtrail([
        "scope",
        s(t),
        "--pools",
        "2,3",
        "--backend",
        "cpu",
        "--out",
        s(&single),
    ])
    .expect(&[0, 1])
    .run();
    same_files(&rebuilt, &single);

    // A shard that fails: reported as a line, the task goes on.
    let staging = tmp.path().join("staging");
    std::fs::create_dir(&staging).unwrap();
    let o = kvtrail([
        "fleet",
        "task",
        "--trace",
        s(dup),
        "--backend",
        "cpu",
        "--staging",
        s(&staging),
    ])
    .stdin("0 0,1\n1 4\n")
    .run();
    let lines = json_lines(&o);
    assert_eq!(lines.len(), 2, "{lines:?}");
    for (l, pools) in lines
        .iter()
        .zip([serde_json::json!([0, 1]), serde_json::json!([4])])
    {
        assert_eq!(l["kind"], "error", "{l}");
        assert_eq!(l["exit"], 2);
        assert_eq!(l["pools"], pools);
        assert!(
            l["stderr"].as_str().unwrap().contains("request_id 2"),
            "{l}"
        );
    }
    assert!(entries(&staging).is_empty(), "{:?}", entries(&staging));

    // Not a shard line: the task fails (Spark then fails the job).
    // A line past the task's limit (1 MiB) is refused without being held.
    let long = format!("0 {}", "1,".repeat(600_000));
    for bad in ["x 1\n", "0\n", "0 1,,2\n", "0 70000\n", long.as_str()] {
        let r = kvtrail(["fleet", "task", "--trace", s(t), "--backend", "cpu"])
            .stdin(bad)
            .expect(&[2])
            .run();
        assert!(r.stderr.contains("INDEX POOLS"), "{bad:?}: {}", r.stderr);
    }
}

#[test]
fn spark_shards_equal_a_local_scope_for_s3_and_local_traces() {
    let Some((submit, py)) = spark() else { return };
    let (_, t, _) = local();
    let srv = s3();
    let tmp = tempfile::tempdir().unwrap();
    let single = tmp.path().join("single");
    kvtrail(["scope", s(t), "--out", s(&single)]).run().ok();

    // From S3: executors read the trace there, their shards come back
    // through Spark.
    let out = tmp.path().join("s3");
    let url = format!("s3://{BUCKET}/fleet");
    let r = objstore::on_s3(srv, fleet_spark(&url, &out, &submit, &py))
        .timeout(Duration::from_secs(600))
        .run();
    assert_eq!(r.code, 0, "stdout: {}\nstderr: {}", r.stdout, r.stderr);
    assert!(r.stderr.contains("3 shards"), "{}", r.stderr);
    same_as_local_scope(&out, &single);
    assert_eq!(
        entries(&tmp.path().join("s3.shards")),
        ["shard-0000", "shard-0001", "shard-0002"]
    );
    let v = objstore::on_s3(srv, kvtrail(["verify", s(&out)])).run();
    assert_eq!(v.code, 0, "verify: {}\n{}", v.stdout, v.stderr);

    // A local trace: the executors see the same path and write their
    // shards in place. --out is a link to an empty folder: written
    // through, as `scope --out` is, the shards beside the link's target.
    let out = tmp.path().join("local");
    std::fs::create_dir(tmp.path().join("real")).unwrap();
    std::os::unix::fs::symlink("real", &out).unwrap();
    let r = fleet_spark(s(t), &out, &submit, &py).run();
    assert_eq!(r.code, 0, "stdout: {}\nstderr: {}", r.stdout, r.stderr);
    same_as_local_scope(&out, &single);
    kvtrail(["verify", s(&out)]).expect(&[0]).run();
    assert_eq!(
        entries(tmp.path()),
        ["local", "real", "real.shards", "s3", "s3.shards", "single"]
    );
}

fn refused(r: &Ran, words: &[&str]) {
    assert_eq!(r.code, 2, "stdout: {}\nstderr: {}", r.stdout, r.stderr);
    assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    for w in words {
        assert!(r.stderr.contains(w), "stderr lacks {w:?}: {}", r.stderr);
    }
    assert!(r.stderr.contains("hint:"), "{}", r.stderr);
}

#[test]
fn a_shard_failing_on_an_executor_is_reported_and_nothing_is_left() {
    let Some((submit, py)) = spark() else { return };
    let (_, _, dup) = local();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let r = fleet_spark(s(dup), &out, &submit, &py).run();
    refused(
        &r,
        &[
            "3 of 3 shards failed",
            "--pools 0,1",
            "request_id 2",
            "exited 2",
        ],
    );
    assert!(entries(tmp.path()).is_empty(), "{:?}", entries(tmp.path()));
}

#[test]
fn bad_input_is_refused_before_spark_starts() {
    // Refused while planning: a spark-submit that does not exist is never
    // reached.
    let srv = s3();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let run = |url: &str| {
        objstore::on_s3(
            srv,
            kvtrail([
                "fleet",
                "spark",
                url,
                "--out",
                s(&out),
                "--spark-submit",
                "/nonexistent/spark-submit",
            ]),
        )
    };
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let u = format!("s3://{BUCKET}/fleet");
    let r = run(&u)
        .env("AWS_ENDPOINT", format!("http://127.0.0.1:{port}"))
        .env("KVTRAIL_OBJECT_STORE_RETRIES", "1")
        .env("KVTRAIL_OBJECT_STORE_CONNECT_TIMEOUT", "2")
        .run();
    refused(&r, &[&u, "did not answer"]);
    let r = run("s3://empty/fleet").run();
    refused(&r, &["s3://empty/fleet", "no trace under this prefix"]);
    let u = format!("s3://{BUCKET}/changing");
    let r = run(&u).run();
    refused(
        &r,
        &[&format!("{u}/kv/pool=2/"), "changed while kvtrail read it"],
    );
    let r = run(&format!("s3://{BUCKET}/fleet"))
        .args(["--conf", "spark.executor.memory"])
        .run();
    refused(&r, &["--conf spark.executor.memory: not KEY=VALUE"]);
    let r = objstore::on_s3(srv, kvtrail(["fleet", "plan", "s3://empty/fleet"])).run();
    refused(&r, &["no trace under this prefix"]);
    assert!(entries(tmp.path()).is_empty(), "{:?}", entries(tmp.path()));
}

/// The shards must have read the trace the driver planned from: a trace
/// changed after planning (here trace.json, rewritten by a spark-submit
/// wrapper just before the job starts: the same manifest with one more
/// space, another digest) is refused before anything is merged, and no
/// folder is left.
#[test]
fn shards_of_a_trace_changed_after_planning_are_refused() {
    let Some((submit, py)) = spark() else { return };
    let (_, t, _) = local();
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("trace");
    copy_dir(t, &trace);
    let wrapper = tmp.path().join("spark-submit");
    write_script(
        &wrapper,
        &format!(
            "printf ' ' >> '{}'\nexec '{}' \"$@\"",
            trace.join("trace.json").display(),
            submit.display()
        ),
    );
    let work = tmp.path().join("work");
    std::fs::create_dir(&work).unwrap();
    let out = work.join("out");
    let r = fleet_spark(s(&trace), &out, &wrapper, &py).run();
    refused(
        &r,
        &["the shards read other trace.json", "nothing was merged"],
    );
    assert!(entries(&work).is_empty(), "{:?}", entries(&work));
}

/// SIGTERM while the Spark job runs: spark-submit is stopped, exit 2, and
/// neither the folders next to --out nor the job's temporary folder stay.
/// (A stand-in spark-submit that waits: no Spark needed.)
#[test]
fn sigterm_during_the_job_leaves_nothing() {
    let (_, t, _) = local();
    let tmp = tempfile::tempdir().unwrap();
    let started = tmp.path().join("started");
    let submit = tmp.path().join("spark-submit");
    write_script(
        &submit,
        &format!("touch '{}'\nexec sleep 60", started.display()),
    );
    let work = tmp.path().join("work");
    let scratch = tmp.path().join("scratch");
    std::fs::create_dir(&work).unwrap();
    std::fs::create_dir(&scratch).unwrap();
    let child = std::process::Command::new(crate::support::cli::bin())
        .args(["fleet", "spark", s(t), "--out"])
        .arg(work.join("out"))
        .arg("--spark-submit")
        .arg(&submit)
        .env("TMPDIR", &scratch)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while !started.exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "spark-submit never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        !entries(&work).is_empty(),
        "no staging folder while the job runs"
    );
    let t1 = std::time::Instant::now();
    // SAFETY: kill(2) on our own child's pid.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    assert_eq!(rc, 0);
    let out = child.wait_with_output().unwrap();
    assert!(t1.elapsed() < Duration::from_secs(10), "{:?}", t1.elapsed());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");
    assert!(entries(&work).is_empty(), "{:?}", entries(&work));
    assert!(entries(&scratch).is_empty(), "{:?}", entries(&scratch));
}

/// An executable sh script at `path` (a stand-in or wrapper spark-submit).
fn write_script(path: &Path, body: &str) {
    std::fs::write(path, format!("#!/bin/sh\n{body}\n")).unwrap();
    let mut perm = std::fs::metadata(path).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    std::fs::set_permissions(path, perm).unwrap();
}
