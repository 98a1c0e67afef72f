//! `scope --pools LIST` shards and `kvtrail merge`: for every split of the
//! pools into shards, the merged --out folder must equal a single run's,
//! byte for byte (summary.json, responses.csv, tenants.csv,
//! findings.parquet, findings.ocsf.jsonl, timeline.jsonl) when the shards
//! are signed and authenticated (`merge --allowed-signers`). Traces: copies of copies over four pools with a hole
//! and blank reads, and the committed incident-mini trace.

use std::path::Path;

use kvtrail::trace::Role;

use crate::support::cli::{Ran, kvtrail, s};
use crate::support::reseal::reseal_evidence;
use crate::support::trace_builder::{TraceBuilder, pool};

const FILES: &[&str] = &[
    "requests.csv",
    "timeline.json",
    "summary.json",
    "responses.csv",
    "tenants.csv",
    "findings.parquet",
    "findings.ocsf.jsonl",
    "timeline.jsonl",
];

/// Runs each shard (signed), merges them (authenticated: `merge
/// --allowed-signers`), and compares with the single run.
fn check(trace: &Path, shards: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let (key, allowed) = crate::statements::keygen(dir.path(), "key");
    let single = dir.path().join("single");
    kvtrail(["scope", s(trace), "--out", s(&single)]).run().ok();
    let mut parts = Vec::new();
    for (i, pools) in shards.iter().enumerate() {
        let out = dir.path().join(format!("shard-{i}"));
        kvtrail([
            "scope",
            s(trace),
            "--pools",
            pools,
            "--out",
            s(&out),
            "--signing-key",
            s(&key),
        ])
        .run()
        .ok();
        assert!(out.join("shard.json").is_file());
        parts.push(out);
    }
    let merged = dir.path().join("merged");
    let mut args = vec!["merge".to_string()];
    args.extend(parts.iter().map(|p| s(p).to_string()));
    args.extend(["--out".to_string(), s(&merged).to_string()]);
    args.extend(["--allowed-signers".to_string(), s(&allowed).to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    kvtrail(&args).run().ok();
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
        kvtrail(["scope", s(&t), "--pools", pools, "--out", s(&out)])
            .run()
            .ok();
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
        let o = kvtrail(&args).run();
        assert_eq!(o.code, 2);
        let err = o.stderr.as_str();
        assert!(err.contains(msg), "{err}");
    }
    let o = kvtrail(["scope", s(&t), "--pools", "9"]).run();
    assert_eq!(o.code, 2);
    assert!(
        o.stderr
            .as_str()
            .contains("pool 9 is not in the deployment")
    );
}

fn merge_args(parts: &[&Path], out: &Path) -> Ran {
    let mut args = vec!["merge".to_string()];
    args.extend(parts.iter().map(|p| s(p).to_string()));
    args.extend(["--out".to_string(), s(out).to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    kvtrail(&args).run()
}

fn json(p: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

fn put_json(p: &Path, v: &serde_json::Value) {
    std::fs::write(p, serde_json::to_string_pretty(v).unwrap()).unwrap();
}

/// Tenant a writes pool 1 (decode); tenant b reads it: all the exposure is
/// in pool 1, none in pool 0.
fn decode_leak() -> TraceBuilder {
    let mut tb = TraceBuilder::pd();
    tb.req(1, "acme");
    tb.req(2, "globex");
    tb.write(0, 1, 0, 4);
    tb.read(0, 1, 0, 4);
    tb.write(1, 1, 0, 4);
    tb.read(1, 2, 0, 4);
    tb
}

fn shard(t: &Path, pools: &str, out: &Path) -> std::path::PathBuf {
    kvtrail(["scope", s(t), "--pools", pools, "--out", s(out)])
        .run()
        .ok();
    out.to_path_buf()
}

#[test]
fn shard_folder_never_claims_no_exposure_with_complete_evidence() {
    let dir = tempfile::tempdir().unwrap();
    let t = decode_leak().record(&dir.path().join("t"));
    let o = kvtrail([
        "scope",
        s(&t),
        "--pools",
        "0",
        "--out",
        s(&dir.path().join("s0")),
    ])
    .run();
    o.ok();
    let stdout = o.stdout.as_str();
    assert!(!stdout.contains("evidence is complete"), "{stdout}");
    let sum = json(&dir.path().join("s0/summary.json"));
    assert_eq!(sum["coverage"]["complete"], false, "{sum}");
    let verdict = sum["verdict"].as_str().unwrap();
    assert!(
        verdict.contains("shard")
            && verdict.contains("pools [1]")
            && !verdict.contains("evidence is complete"),
        "{verdict}"
    );
    assert_eq!(sum["coverage"]["shard_pools"], serde_json::json!([0]));
    // A single run over every pool is still complete.
    let full = kvtrail(["scope", s(&t)]).run();
    assert!(full.stdout.as_str().contains("the evidence is complete"));
}

#[test]
fn lookup_and_notify_refuse_a_shard_folder() {
    let dir = tempfile::tempdir().unwrap();
    let t = decode_leak().record(&dir.path().join("t"));
    let s0 = shard(&t, "0", &dir.path().join("s0"));
    // With its shard.json, and without it (the folder then no longer
    // matches its evidence.json, but its summary still says shard).
    for round in 0..2 {
        let err = kvtrail(["lookup", s(&s0), "--external-id", "ext-2"])
            .run()
            .refused("shard");
        assert!(err.contains("kvtrail merge"), "{err}");
        kvtrail([
            "notify",
            s(&s0),
            "--out",
            s(&dir.path().join(format!("p{round}"))),
        ])
        .run()
        .refused("shard");
        let o = kvtrail(["lookup", s(&s0), "--external-id", "ext-2"]).run();
        assert!(!o.stdout.as_str().contains("NOT AFFECTED"));
        if round == 0 {
            std::fs::remove_file(s0.join("shard.json")).unwrap();
        }
    }
}

#[test]
fn merge_refuses_a_shard_whose_summary_was_edited() {
    let dir = tempfile::tempdir().unwrap();
    let t = decode_leak().record(&dir.path().join("t"));
    let s0 = shard(&t, "0", &dir.path().join("s0"));
    let s1 = shard(&t, "1", &dir.path().join("s1"));
    let p = s1.join("summary.json");
    let mut sum = json(&p);
    sum["affected_responses"] = serde_json::json!([]);
    sum["recipients"] = serde_json::json!([]);
    sum["sources"] = serde_json::json!([]);
    put_json(&p, &sum);
    let err = merge_args(&[&s0, &s1], &dir.path().join("m")).refused("evidence.json");
    assert!(err.contains("summary.json"), "{err}");
    assert!(!dir.path().join("m/summary.json").exists());
}

#[test]
fn merge_refuses_a_shard_whose_shard_json_claims_pools_it_did_not_replay() {
    let dir = tempfile::tempdir().unwrap();
    let t = decode_leak().record(&dir.path().join("t"));
    let s1 = shard(&t, "1", &dir.path().join("s1"));
    let p = s1.join("shard.json");
    let mut sh = json(&p);
    sh["pools"] = serde_json::json!([0, 1]);
    put_json(&p, &sh);
    let err = merge_args(&[&s1], &dir.path().join("m")).refused("evidence.json");
    assert!(err.contains("shard.json"), "{err}");
    // Resealed, the claim still contradicts the shard's own summary.
    reseal_evidence(&s1);
    merge_args(&[&s1], &dir.path().join("m")).refused("pools");
}

#[test]
fn merge_of_counts_near_u64_max_saturates_instead_of_wrapping() {
    let dir = tempfile::tempdir().unwrap();
    let t = decode_leak().record(&dir.path().join("t"));
    let s0 = shard(&t, "0", &dir.path().join("s0"));
    let s1 = shard(&t, "1", &dir.path().join("s1"));
    for sh in [&s0, &s1] {
        let p = sh.join("summary.json");
        let mut sum = json(&p);
        sum["counts"]["kv_events"] = u64::MAX.into();
        sum["counts"]["slot_touches"] = u64::MAX.into();
        put_json(&p, &sum);
        reseal_evidence(sh);
    }
    let m = dir.path().join("m");
    merge_args(&[&s0, &s1], &m).ok();
    let sum = json(&m.join("summary.json"));
    assert_eq!(sum["counts"]["kv_events"], u64::MAX, "{sum}");
    assert_eq!(sum["counts"]["slot_touches"], u64::MAX, "{sum}");
}

#[test]
fn merge_refuses_reader_windows_whose_first_is_after_last() {
    let dir = tempfile::tempdir().unwrap();
    let t = decode_leak().record(&dir.path().join("t"));
    let s0 = shard(&t, "0", &dir.path().join("s0"));
    let s1 = shard(&t, "1", &dir.path().join("s1"));
    let p = s1.join("shard.json");
    let mut sh = json(&p);
    sh["readers"]["2"] = serde_json::json!([5000, 10]);
    put_json(&p, &sh);
    reseal_evidence(&s1);
    let err = merge_args(&[&s0, &s1], &dir.path().join("m")).refused("readers.2");
    assert!(err.contains("shard.json"), "{err}");
}

#[test]
fn merge_refuses_shards_of_different_traces() {
    let dir = tempfile::tempdir().unwrap();
    let t0 = decode_leak().record(&dir.path().join("t0"));
    // Same deployment and requests; pool 1 without the foreign read.
    let mut other = TraceBuilder::pd();
    other.req(1, "acme");
    other.req(2, "globex");
    other.write(0, 1, 0, 4);
    other.read(0, 1, 0, 4);
    other.write(1, 1, 0, 4);
    other.read(1, 1, 0, 4);
    let t1 = other.record(&dir.path().join("t1"));
    let s0 = shard(&t0, "0", &dir.path().join("s0"));
    let s1 = shard(&t1, "1", &dir.path().join("s1"));
    let err = merge_args(&[&s0, &s1], &dir.path().join("m")).refused("trace");
    assert!(err.contains("evidence.json"), "{err}");
    assert!(!dir.path().join("m/summary.json").exists());
}

#[test]
fn merged_folder_keeps_the_chain_of_custody() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let t = decode_leak().record(&root.join("t"));
    let single = root.join("single");
    kvtrail(["scope", s(&t), "--out", s(&single)]).run().ok();
    let s0 = shard(&t, "0", &root.join("s0"));
    let s1 = shard(&t, "1", &root.join("s1"));
    // An untouched shard verifies (shard.json is in its evidence.json).
    kvtrail(["verify", s(&s1)]).run().ok();
    let m = root.join("m");
    merge_args(&[&s0, &s1], &m).ok();
    for f in [
        "evidence.json",
        "requests.csv",
        "timeline.json",
        "report.html",
    ] {
        assert!(m.join(f).is_file(), "merged folder has no {f}");
    }
    // The merged folder verifies, and cites both shards' evidence digests.
    let v = kvtrail(["verify", s(&m)]).run();
    v.ok();
    let ev = json(&m.join("evidence.json"));
    for sh in [&s0, &s1] {
        let digest = blake3::hash(&std::fs::read(sh.join("evidence.json")).unwrap())
            .to_hex()
            .to_string();
        assert!(
            ev["inputs"]
                .as_array()
                .unwrap()
                .iter()
                .any(|i| i["kind"] == "scope"
                    && i["files"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|f| f["path"] == "evidence.json" && f["blake3"] == digest.as_str())),
            "{ev}"
        );
    }
    // A shard edited after the merge breaks the merged folder's verify.
    let mut sum = json(&s1.join("summary.json"));
    sum["verdict"] = "edited".into();
    put_json(&s1.join("summary.json"), &sum);
    assert_eq!(kvtrail(["verify", s(&m)]).run().code, 1);
    // lookup and notify accept it and answer as on the single run.
    for id in ["ext-2", "ext-1"] {
        let a = kvtrail(["lookup", s(&m), "--json", "--external-id", id]).run();
        let b = kvtrail(["lookup", s(&single), "--json", "--external-id", id]).run();
        b.ok();
        let (a, b) = (json_of(&a.stdout_bytes), json_of(&b.stdout_bytes));
        assert_eq!(a["status"], b["status"]);
        assert_eq!(a["matches"], b["matches"]);
        assert_eq!(a["status"], "affected", "{a}");
    }
    kvtrail(["notify", s(&single), "--out", s(&root.join("p1"))])
        .run()
        .ok();
    let o = kvtrail(["notify", s(&m), "--out", s(&root.join("p2"))]).run();
    o.ok();
    let packs = |d: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(d.join("customers"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    assert_eq!(packs(&root.join("p1")), packs(&root.join("p2")));
}

fn json_of(b: &[u8]) -> serde_json::Value {
    serde_json::from_slice(b).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(b)))
}

#[test]
fn merge_of_response_token_counts_near_u64_max_saturates_per_tenant() {
    // Two responses of one tenant, each (forged) with u64::MAX foreign
    // tokens from one source tenant: the per-tenant and total sums wrapped
    // (or panicked) before.
    let dir = tempfile::tempdir().unwrap();
    let mut tb = decode_leak();
    tb.req(3, "globex");
    tb.read(1, 3, 0, 4);
    let t = tb.record(&dir.path().join("t"));
    let s0 = shard(&t, "0", &dir.path().join("s0"));
    let s1 = shard(&t, "1", &dir.path().join("s1"));
    let p = s1.join("summary.json");
    let mut sum = json(&p);
    let affected = sum["affected_responses"].as_array_mut().unwrap();
    assert_eq!(affected.len(), 2, "{affected:?}");
    for a in affected {
        a["foreign_tokens"] = u64::MAX.into();
        for s in a["sources"].as_array_mut().unwrap() {
            s["tokens"] = u64::MAX.into();
        }
    }
    put_json(&p, &sum);
    reseal_evidence(&s1);
    let m = dir.path().join("m");
    merge_args(&[&s0, &s1], &m).ok();
    let sum = json(&m.join("summary.json"));
    assert_eq!(sum["counts"]["foreign_tokens"], u64::MAX, "{sum}");
    let globex = sum["recipients"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["tenant"] == "globex")
        .unwrap();
    assert_eq!(globex["foreign_tokens"], u64::MAX, "{sum}");
    let acme = sum["sources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["tenant"] == "acme")
        .unwrap();
    assert_eq!(acme["tokens"], u64::MAX, "{sum}");
}
