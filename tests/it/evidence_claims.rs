//! Never "complete" when it isn't: files the readers skip, manifest keys
//! written as `null`, traces without KV events, and scope folders that
//! claim less than the trace holds (issue 32, defects 3, 8 and 13, and
//! "verify re-derives what it cheaply can").
//!
//! Index:
//! - files no reader reads: `defect3_*`
//! - `null` where the contract allows none: `defect8_*`
//! - no KV events, no evidence: `defect13_*`
//! - scope folders checked against their trace: `folder_rederives_*`

use std::path::{Path, PathBuf};
use std::time::Duration;

use kvtrail::capture::{Recorder, RecorderOptions};
use kvtrail::trace::write::PartOptions;
use serde_json::Value;

use crate::support::cli::{Ran, kvtrail, s};
use crate::support::small_trace::{deployment, events, requests, write_batches, write_trace};

const POOL1: &str = "kv/pool=1/part-00000.parquet";

fn run(args: &[&str]) -> Ran {
    // KVTRAIL_TEST_BIN=path runs the cases against another build (an
    // older release, to see a case fail there).
    let r = kvtrail(args)
        .bin_from_env("KVTRAIL_TEST_BIN")
        .timeout(Duration::from_secs(60))
        .run();
    assert!(!r.timed_out, "kvtrail {args:?} did not finish");
    assert!(
        !r.stderr.contains("panicked"),
        "kvtrail {args:?} panicked:\n{}",
        r.stderr
    );
    r
}

fn fresh() -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let t = write_trace(d.path());
    (d, t)
}

fn manifest(t: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(t.join("trace.json")).unwrap()).unwrap()
}

fn store(t: &Path, m: &Value) {
    std::fs::write(t.join("trace.json"), serde_json::to_vec_pretty(m).unwrap()).unwrap();
}

/// Moves listed file `from` to `to` (relative to the trace) and changes
/// its path in trace.json, as a hand that renames a file would.
fn rename_listed(t: &Path, from: &str, to: &str) {
    let dst = t.join(to);
    std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
    std::fs::rename(t.join(from), &dst).unwrap();
    let mut m = manifest(t);
    for f in m["files"].as_array_mut().unwrap() {
        if f["path"] == from {
            f["path"] = Value::String(to.into());
        }
    }
    store(t, &m);
}

/// `scope --json`: exit code and the report.
fn scope_json(t: &Path) -> (i32, Value) {
    let r = run(&["scope", "--backend", "cpu", "--json", s(t)]);
    let v = serde_json::from_str(&r.stdout).unwrap_or(Value::Null);
    (r.code, v)
}

fn verify_json(t: &Path) -> (i32, Value) {
    let r = run(&["verify", "--json", s(t)]);
    (
        r.code,
        serde_json::from_str(&r.stdout).unwrap_or_else(|_| panic!("verify: {}", r.stderr)),
    )
}

/// Pool 1 split into two files, the second holding a seq hole: the trace
/// as the Recorder would list it (digests and rows in trace.json).
fn trace_with_hole_in_second_file(d: &Path) -> PathBuf {
    let t = write_trace(d);
    let p1: Vec<_> = events().into_iter().filter(|e| e.pool == 1).collect();
    let (a, b) = p1.split_at(8);
    // seq 9 lost: a hole the second file holds.
    let b: Vec<_> = b.iter().filter(|e| e.seq != 9).cloned().collect();
    std::fs::remove_file(t.join(POOL1)).unwrap();
    let fa = "kv/pool=1/part-00000.parquet";
    let fb = "kv/pool=1/part-00001.parquet";
    let comp = parquet::basic::Compression::SNAPPY;
    write_batches(
        &t.join(fa),
        &[kvtrail::trace::write::kv_batch(a)],
        comp,
        1024,
    );
    write_batches(
        &t.join(fb),
        &[kvtrail::trace::write::kv_batch(&b)],
        comp,
        1024,
    );
    let mut m = manifest(&t);
    let files = m["files"].as_array_mut().unwrap();
    files.retain(|f| f["path"] != POOL1);
    for (rel, rows) in [(fa, a.len()), (fb, b.len())] {
        let (h, _) = kvtrail::custody::hash_file(&t.join(rel)).unwrap();
        files.push(serde_json::json!({"path": rel, "rows": rows, "blake3": h}));
    }
    store(&t, &m);
    t
}

// ---------------------------------------------------------------------------
// Defect 3: a listed file no reader reads

#[test]
fn defect3_verify_refuses_unread_suffix() {
    for suffix in [
        ".PARQUET",
        ".Parquet",
        ".parquet.bak",
        ".parquet ",
        ".parquet.inprogress",
    ] {
        let d = tempfile::tempdir().unwrap();
        let t = trace_with_hole_in_second_file(d.path());
        // Untouched, the hole is seen.
        let (_, v) = verify_json(&t);
        assert_eq!(v["seq_holes"], 1, "{v}");
        assert_eq!(v["complete"], false, "{v}");
        let to = format!("kv/pool=1/part-00001{suffix}");
        rename_listed(&t, "kv/pool=1/part-00001.parquet", &to);
        let (code, v) = verify_json(&t);
        assert_eq!(
            code, 1,
            "{suffix:?}: verify passed a file no reader reads: {v}"
        );
        assert_eq!(v["complete"], false, "{suffix:?}: {v}");
        let named = v["problems"].as_array().unwrap().iter().any(|p| {
            p["path"] == to.as_str() && p["detail"].as_str().unwrap().contains("no reader reads it")
        });
        assert!(named, "{suffix:?}: the file is not named as unread: {v}");
        let human = run(&["verify", s(&t)]);
        assert!(
            human.stdout.contains("INCOMPLETE") && !human.stdout.contains("capture complete"),
            "{suffix:?}: {}",
            human.stdout
        );
        // scope: the evidence is incomplete, the file named as unread.
        let (code, v) = scope_json(&t);
        assert_eq!(code, 0, "{v}");
        assert_eq!(v["coverage"]["complete"], false, "{suffix:?}: {v}");
        let unread = v["coverage"]["files_unread"].as_array().unwrap();
        assert!(unread.iter().any(|p| p == to.as_str()), "{suffix:?}: {v}");
        assert!(
            v["coverage"]["files_missing"]
                .as_array()
                .unwrap()
                .is_empty(),
            "{v}"
        );
        // inspect warns about it.
        let r = run(&["inspect", s(&t)]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        assert!(r.stdout.contains(to.as_str()), "{suffix:?}: {}", r.stdout);
    }
}

#[test]
fn defect3_listed_file_outside_requests_and_kv_is_unread() {
    for to in ["pool1.parquet", "extra/part-00001.parquet", "kv"] {
        let d = tempfile::tempdir().unwrap();
        let t = trace_with_hole_in_second_file(d.path());
        if to == "kv" {
            // `kv` itself is a folder: listing it is no data file either.
            let mut m = manifest(&t);
            for f in m["files"].as_array_mut().unwrap() {
                if f["path"] == "kv/pool=1/part-00001.parquet" {
                    f["path"] = Value::String("kv".into());
                }
            }
            store(&t, &m);
            std::fs::remove_file(t.join("kv/pool=1/part-00001.parquet")).unwrap();
        } else {
            rename_listed(&t, "kv/pool=1/part-00001.parquet", to);
        }
        let (code, v) = verify_json(&t);
        assert_eq!(code, 1, "{to}: {v}");
        assert_eq!(v["complete"], false, "{to}: {v}");
        assert!(
            v["problems"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["path"] == to),
            "{to}: {v}"
        );
        let (_, v) = scope_json(&t);
        assert_eq!(v["coverage"]["complete"], false, "{to}: {v}");
    }
}

#[test]
fn defect3_unlisted_near_miss_names_are_unread() {
    // A file named like a data file but not `*.parquet` exactly, and not
    // listed: the readers skip it, so rows may vanish unseen.
    for name in ["part-00001.PARQUET", "part-00001.parquet "] {
        let d = tempfile::tempdir().unwrap();
        let t = trace_with_hole_in_second_file(d.path());
        let to = format!("kv/pool=1/{name}");
        rename_listed(&t, "kv/pool=1/part-00001.parquet", &to);
        let mut m = manifest(&t);
        m["files"]
            .as_array_mut()
            .unwrap()
            .retain(|f| f["path"] != to.as_str());
        store(&t, &m);
        let (code, v) = verify_json(&t);
        assert_eq!(code, 1, "{name:?}: {v}");
        assert_eq!(v["complete"], false, "{name:?}: {v}");
        assert!(
            v["problems"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["path"] == to.as_str() && p["kind"] == "unread"),
            "{name:?}: {v}"
        );
        let (_, v) = scope_json(&t);
        assert_eq!(v["coverage"]["complete"], false, "{name:?}: {v}");
    }
}

#[test]
fn defect3_one_rule_decides_what_the_readers_read() {
    use kvtrail::trace::files::{TableFile, reader_skips, table_file};
    for (below, want) in [
        ("pool=0/part-0.parquet", TableFile::Data),
        ("part-0.parquet", TableFile::Data),
        ("pool=0/_temporary/part-0.parquet", TableFile::Hidden),
        ("pool=0/.part-0.parquet", TableFile::Hidden),
        ("pool=0/part-0.parquet.inprogress", TableFile::InProgress),
        ("pool=0/part-0.PARQUET", TableFile::NearMiss),
        ("pool=0/part-0.Parquet", TableFile::NearMiss),
        ("pool=0/part-0.parquet ", TableFile::NearMiss),
        ("pool=0/part-0.parquet.bak", TableFile::Other),
        ("pool=0/_SUCCESS", TableFile::Other),
    ] {
        assert_eq!(table_file(below), want, "{below:?}");
    }
    assert_eq!(reader_skips("kv/pool=0/part-0.parquet"), None);
    assert_eq!(reader_skips("requests/part-0.parquet"), None);
    for rel in [
        "kv/pool=0/part-0.PARQUET",
        "kv/pool=0/part-0.parquet.bak",
        "kv/_x/part-0.parquet",
        "part-0.parquet",
        "other/part-0.parquet",
        "kv",
        "requestsx/part-0.parquet",
    ] {
        assert!(reader_skips(rel).is_some(), "{rel:?}");
    }
}

// ---------------------------------------------------------------------------
// Defect 8: `null` where the contract allows none

#[test]
fn defect8_null_prefix_cache_scope_is_refused() {
    type Edit = fn(&mut Value);
    let cases: Vec<(&str, Edit)> = vec![
        ("prefix_cache_scope", |m| {
            m["deployment"]["prefix_cache_scope"] = Value::Null
        }),
        ("capture.from_engine_start", |m| {
            m["capture"]["from_engine_start"] = Value::Null
        }),
        ("files", |m| m["files"] = Value::Null),
        ("capture", |m| m["capture"] = Value::Null),
        ("deployment.context_window", |m| {
            m["deployment"]["context_window"] = Value::Null
        }),
        ("deployment.pools[1].page_size", |m| {
            m["deployment"]["pools"][1]["page_size"] = Value::Null
        }),
        ("deployment.pools[0].capacity_tokens", |m| {
            m["deployment"]["pools"][0]["capacity_tokens"] = Value::Null
        }),
        ("files[0].rows", |m| m["files"][0]["rows"] = Value::Null),
        ("capture.skipped_lines", |m| {
            m["capture"]["skipped_lines"] = Value::Null
        }),
        ("capture.skipped_lines", |m| {
            m["capture"]["skipped_lines"] = Value::String("3".into())
        }),
    ];
    for (key, edit) in cases {
        let (_d, t) = fresh();
        let mut m = manifest(&t);
        edit(&mut m);
        store(&t, &m);
        for cmd in ["verify", "inspect", "scope"] {
            let r = run(&[cmd, s(&t)]);
            assert_eq!(
                r.code, 2,
                "{cmd} with {key} edited: {}{}",
                r.stdout, r.stderr
            );
            assert!(
                r.stderr.contains(key) && r.stderr.contains("trace.json"),
                "{cmd} does not name {key}: {}",
                r.stderr
            );
        }
    }
    // The keys the contract lets be null still read as absent.
    let (_d, t) = fresh();
    let mut m = manifest(&t);
    m["deployment"]["name"] = Value::Null;
    m["deployment"]["engine"] = Value::Null;
    m["deployment"]["pools"][0]["name"] = Value::Null;
    m["capture"]["writer"] = Value::Null;
    m["capture"]["ended_ns"] = Value::Null;
    store(&t, &m);
    for cmd in ["verify", "inspect", "scope"] {
        let r = run(&[cmd, s(&t)]);
        assert_eq!(r.code, 0, "{cmd}: {}{}", r.stdout, r.stderr);
    }
}

#[test]
fn defect8_null_in_a_deployment_file_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let dep = d.path().join("dep.json");
    std::fs::write(
        &dep,
        r#"{"name":"x","engine":"e","context_window":4096,"prefix_cache_scope":null,"pools":[{"id":0,"name":"p","role":"mixed","capacity_tokens":64,"page_size":4}]}"#,
    )
    .unwrap();
    let input = d.path().join("in.jsonl");
    std::fs::write(
        &input,
        "{\"type\":\"kv\",\"pool\":0,\"ts_ns\":1,\"request_id\":1,\"op\":\"write\",\"slot_start\":0,\"slot_count\":4,\"token_pos\":0}\n",
    )
    .unwrap();
    let t = d.path().join("t");
    let r = run(&["ingest", s(&input), "--deployment", s(&dep), "--out", s(&t)]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("prefix_cache_scope"), "{}", r.stderr);
}

// ---------------------------------------------------------------------------
// Defect 13: no KV events, no evidence

fn assert_no_evidence(t: &Path) {
    let (code, v) = verify_json(t);
    assert_eq!(code, 1, "verify passed a trace without KV events: {v}");
    assert_eq!(v["complete"], false, "{v}");
    assert!(
        v["problems"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["kind"] == "empty"),
        "{v}"
    );
    let r = run(&["verify", s(t)]);
    assert!(r.stdout.contains("INCOMPLETE"), "{}", r.stdout);
    let r = run(&["scope", "--backend", "cpu", s(t)]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        !r.stdout.contains("the evidence is complete") && !r.stdout.contains("no exposure found"),
        "scope calls a trace without KV events clean:\n{}",
        r.stdout
    );
    assert!(r.stdout.contains("no KV evidence"), "{}", r.stdout);
    let (_, v) = scope_json(t);
    assert_eq!(v["coverage"]["complete"], false, "{v}");
    assert_eq!(v["coverage"]["no_kv_events"], true, "{v}");
    let r = run(&["scope", "--backend", "cpu", "--fail-on-exposure", s(t)]);
    assert_eq!(
        r.code, 1,
        "the gate passed a trace without KV events: {}",
        r.stderr
    );
    let r = run(&["inspect", s(t)]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout.contains("no KV events") && !r.stdout.contains("evidence    complete"),
        "{}",
        r.stdout
    );
}

#[test]
fn defect13_empty_capture_is_not_complete() {
    for (name, text) in [("empty", ""), ("blank", "\n  \n\t\n\n")] {
        let d = tempfile::tempdir().unwrap();
        let dep = d.path().join("dep.json");
        std::fs::write(&dep, serde_json::to_vec(&deployment()).unwrap()).unwrap();
        let input = d.path().join("in.jsonl");
        std::fs::write(&input, text).unwrap();
        let t = d.path().join("t");
        let r = run(&["ingest", s(&input), "--deployment", s(&dep), "--out", s(&t)]);
        assert_eq!(r.code, 0, "{name}: {}", r.stderr);
        assert!(
            r.stderr.contains("no KV events"),
            "{name}: no warning: {}",
            r.stderr
        );
        let m = manifest(&t);
        assert_eq!(m["capture"]["complete"], false, "{name}: {m}");
        assert_eq!(m["capture"]["no_kv_events"], true, "{name}: {m}");
        assert_no_evidence(&t);
    }
}

#[test]
fn defect13_requests_without_kv_events_are_no_evidence() {
    // Written by the Recorder and closed cleanly: complete in trace.json,
    // but nothing of what any request read was recorded.
    let d = tempfile::tempdir().unwrap();
    let t = d.path().join("t");
    let opts = RecorderOptions {
        started_ns: Some(1_000),
        part: PartOptions::default(),
        ..Default::default()
    };
    let mut rec = Recorder::create(&t, deployment(), opts).unwrap();
    for r in requests() {
        rec.request(r).unwrap();
    }
    rec.close().unwrap();
    assert_eq!(manifest(&t)["capture"]["complete"], true);
    assert_no_evidence(&t);

    // The same through ingest: requests only.
    let dep = d.path().join("dep.json");
    std::fs::write(&dep, serde_json::to_vec(&deployment()).unwrap()).unwrap();
    let input = d.path().join("in.jsonl");
    std::fs::write(
        &input,
        "{\"type\":\"request\",\"request_id\":1,\"tenant\":\"a\",\"arrival_ns\":1,\"prompt_tokens\":1,\"output_tokens\":1,\"http_status\":200,\"prefill_pool\":0}\n",
    )
    .unwrap();
    let t2 = d.path().join("t2");
    let r = run(&[
        "ingest",
        s(&input),
        "--deployment",
        s(&dep),
        "--out",
        s(&t2),
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(manifest(&t2)["capture"]["complete"], false);
    assert_no_evidence(&t2);
}

// ---------------------------------------------------------------------------
// verify re-derives what it cheaply can: a scope folder's claims against
// its evidence

/// Rewrites `coverage` of a folder's summary.json with `edit`, and
/// evidence.json over it, as a forger who re-hashes would.
fn forge_summary(folder: &Path, edit: impl Fn(&mut Value)) {
    let p = folder.join("summary.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    edit(&mut v["coverage"]);
    let bytes = serde_json::to_vec_pretty(&v).unwrap();
    std::fs::write(&p, &bytes).unwrap();
    let (h, n) = kvtrail::custody::hash_file(&p).unwrap();
    let ep = folder.join("evidence.json");
    let mut ev: Value = serde_json::from_slice(&std::fs::read(&ep).unwrap()).unwrap();
    for f in ev["outputs"].as_array_mut().unwrap() {
        if f["path"] == "summary.json" {
            f["blake3"] = Value::String(h.clone());
            f["bytes"] = n.into();
            assert!(f.get("chunks").is_none(), "summary.json has chunks");
        }
    }
    std::fs::write(&ep, serde_json::to_vec_pretty(&ev).unwrap()).unwrap();
}

fn hide_holes(c: &mut Value) {
    c["gaps"] = Value::Array(vec![]);
    c["lost_events"] = 0.into();
    c["complete"] = true.into();
    c["notes"] = Value::Array(vec![]);
}

fn verify_folder_code(f: &Path) -> Ran {
    run(&["verify", s(f)])
}

#[test]
fn folder_rederives_seq_holes_and_unread_files() {
    let d = tempfile::tempdir().unwrap();
    let t = trace_with_hole_in_second_file(d.path());
    let out = d.path().join("scoped");
    let r = run(&["scope", "--backend", "cpu", s(&t), "--out", s(&out)]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let r = verify_folder_code(&out);
    assert_eq!(
        r.code, 0,
        "an honest folder fails: {}{}",
        r.stdout, r.stderr
    );
    // A folder that hides its hole.
    forge_summary(&out, hide_holes);
    let r = verify_folder_code(&out);
    assert_eq!(r.code, 1, "a folder hiding its hole passes: {}", r.stdout);
    assert!(
        r.stdout.contains("contradicts") && r.stdout.contains("pool 1"),
        "{}",
        r.stdout
    );

    // A folder that hides a file the readers skip.
    let d = tempfile::tempdir().unwrap();
    let t = write_trace(d.path());
    std::fs::copy(t.join(POOL1), t.join("kv/pool=1/part-00009.PARQUET")).unwrap();
    let out = d.path().join("scoped");
    let r = run(&["scope", "--backend", "cpu", s(&t), "--out", s(&out)]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(verify_folder_code(&out).code, 0);
    forge_summary(&out, |c| {
        c["files_unread"] = Value::Array(vec![]);
        c["complete"] = true.into();
    });
    let r = verify_folder_code(&out);
    assert_eq!(
        r.code, 1,
        "a folder hiding an unread file passes: {}",
        r.stdout
    );
    assert!(r.stdout.contains("part-00009.PARQUET"), "{}", r.stdout);
}

#[test]
fn folder_rederives_a_shards_holes_and_a_merge_of_them() {
    let d = tempfile::tempdir().unwrap();
    let t = trace_with_hole_in_second_file(d.path());
    let mut shards = Vec::new();
    for pools in ["0", "1"] {
        let out = d.path().join(format!("shard{pools}"));
        let r = run(&[
            "scope",
            "--backend",
            "cpu",
            "--pools",
            pools,
            s(&t),
            "--out",
            s(&out),
        ]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        assert_eq!(
            verify_folder_code(&out).code,
            0,
            "honest shard {pools} fails"
        );
        shards.push(out);
    }
    let merged = d.path().join("merged");
    let r = run(&["merge", s(&shards[0]), s(&shards[1]), "--out", s(&merged)]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let r = verify_folder_code(&merged);
    assert_eq!(r.code, 0, "honest merge fails: {}", r.stdout);
    // The merged folder hides the hole its shard reports.
    forge_summary(&merged, hide_holes);
    let r = verify_folder_code(&merged);
    assert_eq!(
        r.code, 1,
        "a merge hiding a shard's hole passes: {}",
        r.stdout
    );
    assert!(r.stdout.contains("contradicts"), "{}", r.stdout);
    // The shard that holds the hole hides it.
    forge_summary(&shards[1], hide_holes);
    let r = verify_folder_code(&shards[1]);
    assert_eq!(r.code, 1, "a shard hiding its hole passes: {}", r.stdout);
    assert!(r.stdout.contains("pool 1"), "{}", r.stdout);
}
