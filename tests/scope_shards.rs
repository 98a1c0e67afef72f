//! `scope --pools LIST` shards and `kvtrail merge`: for every split of the
//! pools into shards, the merged --out folder must equal a single run's,
//! byte for byte (summary.json, responses.csv, tenants.csv,
//! findings.parquet). Traces: copies of copies over four pools with a hole
//! and blank reads, and the committed incident-mini trace.

#[path = "scope_common/mod.rs"]
mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{TraceBuilder, pool};
use kvtrail::trace::Role;

fn kvtrail(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvtrail"))
        .args(args)
        .env("KVTRAIL_NO_PROGRESS", "1")
        .output()
        .unwrap()
}

fn ok(o: &Output) {
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

const FILES: &[&str] = &[
    "summary.json",
    "responses.csv",
    "tenants.csv",
    "findings.parquet",
];

/// Runs each shard, merges them, and compares with the single run.
fn check(trace: &Path, shards: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let single = dir.path().join("single");
    ok(&kvtrail(&["scope", s(trace), "--out", s(&single)]));
    let mut parts = Vec::new();
    for (i, pools) in shards.iter().enumerate() {
        let out = dir.path().join(format!("shard-{i}"));
        ok(&kvtrail(&[
            "scope",
            s(trace),
            "--pools",
            pools,
            "--out",
            s(&out),
        ]));
        assert!(out.join("shard.json").is_file());
        parts.push(out);
    }
    let merged = dir.path().join("merged");
    let mut args = vec!["merge".to_string()];
    args.extend(parts.iter().map(|p| s(p).to_string()));
    args.extend(["--out".to_string(), s(&merged).to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    ok(&kvtrail(&args));
    for f in FILES {
        let a = std::fs::read(single.join(f)).unwrap();
        let b = std::fs::read(merged.join(f)).unwrap();
        assert!(
            a == b,
            "{f} differs for shards {shards:?}:\n--- single\n{}\n--- merged\n{}",
            String::from_utf8_lossy(&a),
            String::from_utf8_lossy(&b)
        );
    }
}

fn four_pools() -> TraceBuilder {
    let mut tb = TraceBuilder::with_pools(vec![
        pool(0, Role::Prefill, 32),
        pool(1, Role::Mixed, 32),
        pool(2, Role::Mixed, 32),
        pool(3, Role::Decode, 32),
    ]);
    tb.req(1, "acme");
    tb.req(2, "initech");
    tb.req(3, "umbrella");
    let s0 = tb.write(0, 1, 0, 6);
    tb.read(0, 2, 0, 8); // foreign and blank in pool 0
    let s1 = tb.copy(1, 1, 0, 6, 0, 0, s0);
    tb.write(1, 3, 0, 1);
    tb.lose(1, 2);
    let s1b = tb.write(1, 3, 20, 1);
    tb.read(1, 2, 0, 3);
    let s2 = tb.copy(2, 2, 10, 6, 1, 0, s1);
    let s2b = tb.copy(2, 3, 0, 2, 1, 0, s1b);
    tb.copy(3, 2, 5, 6, 2, 10, s2);
    tb.copy(3, 3, 20, 2, 2, 0, s2b);
    tb.read(3, 2, 5, 6);
    tb.read(3, 3, 20, 4); // blank tail
    tb.read(2, 2, 10, 6);
    tb
}

#[test]
fn merged_shards_equal_a_single_run_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let t = four_pools().record(&dir.path().join("t"));
    for shards in [
        &["0,1,2,3"][..],
        &["0", "1", "2", "3"],
        &["3", "0,1", "2"],
        &["1,3", "0,2"],
    ] {
        check(&t, shards);
    }
}

#[test]
fn merged_shards_equal_a_single_run_on_incident_mini() {
    let t = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/incident-mini");
    check(&t, &["1", "0"]);
}

#[test]
fn merge_rejects_overlapping_or_missing_pools() {
    let dir = tempfile::tempdir().unwrap();
    let t = four_pools().record(&dir.path().join("t"));
    let run = |name: &str, pools: &str| {
        let out = dir.path().join(name);
        ok(&kvtrail(&[
            "scope",
            s(&t),
            "--pools",
            pools,
            "--out",
            s(&out),
        ]));
        out
    };
    let a = run("a", "0,1");
    let b = run("b", "1,2");
    let c = run("c", "3");
    for (parts, msg) in [
        (vec![&a, &b, &c], "reported by shards"),
        (vec![&a, &c], "no shard reports pools [2]"),
    ] {
        let mut args = vec!["merge".to_string()];
        args.extend(parts.iter().map(|p| s(p).to_string()));
        args.extend(["--out".into(), s(&dir.path().join("m")).to_string()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = kvtrail(&args);
        assert_eq!(o.status.code(), Some(2));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(msg), "{err}");
    }
    let o = kvtrail(&["scope", s(&t), "--pools", "9"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("pool 9 is not in the deployment"));
}
