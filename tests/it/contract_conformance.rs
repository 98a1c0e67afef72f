//! Conformance to the trace contract (docs/trace-format.md)
//! on traces kvtrail did not write: tests/conformance/make_traces.py writes
//! every case with pyarrow (and DuckDB) into a temporary folder, straight
//! from the contract's sentences, together with an `expected.json` whose
//! expectations come from the contract too (each case quotes the sentence
//! it checks in `why`). This test runs the real binary (`verify`,
//! `inspect`, `scope --json`) on each case and compares: exit codes, the
//! exact set of affected responses with their confidence, foreign and
//! unknown tokens, per-source counts and cross-tenant flags, coverage,
//! blank reads, anomalies, and for bad input the file/row/column named in
//! the error.
//!
//! The Python side is the notebooks venv built by
//! .ci/setup.d/60-notebooks.sh (pyarrow + DuckDB). Without it the test
//! FAILS when `CI` is set and says it skips otherwise.
//!
//! Cases marked `refused_by` are also run through the other commands that
//! replay a trace (audit, diff), which must refuse them as
//! scope does.
//!
//! `KVTRAIL_CONFORMANCE_CASE=substring` runs only the matching cases;
//! `KVTRAIL_CONFORMANCE_REV2_SCOPE=1` adds the cases that wait for scope's
//! revision-2 output (see the end of make_traces.py);
//! `KVTRAIL_CONFORMANCE_BIN=path` checks another kvtrail build.
//!
//! Index:
//! - `contract_conformance`: every case of make_traces.py, all failures
//!   reported together.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::support::cli::{self, Ran};
use crate::support::venv;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `kvtrail ARGS`; KVTRAIL_CONFORMANCE_BIN checks another build (an older
/// release).
fn kvtrail(args: &[&str]) -> Ran {
    cli::kvtrail(args)
        .bin_from_env("KVTRAIL_CONFORMANCE_BIN")
        .run()
}

/// Replaces the manifest's "__BLAKE3__" placeholders with the real digest
/// of each listed file (Python has no blake3 in the venv).
fn fill_digests(trace: &Path) {
    let path = trace.join("trace.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return;
    };
    if !text.contains("__BLAKE3__") {
        return;
    }
    // Keep a byte-order mark where the case wrote one (manifest_utf8_bom).
    let (bom, body) = match text.strip_prefix('\u{feff}') {
        Some(rest) => ("\u{feff}", rest),
        None => ("", text.as_str()),
    };
    let mut m: Value = serde_json::from_str(body).unwrap();
    for f in m["files"].as_array_mut().unwrap() {
        if f["blake3"] == "__BLAKE3__" {
            let rel = f["path"].as_str().unwrap().replace('\\', "/");
            let bytes = std::fs::read(trace.join(rel)).unwrap();
            f["blake3"] = Value::String(blake3::hash(&bytes).to_hex().to_string());
        }
    }
    let body = serde_json::to_string_pretty(&m).unwrap();
    std::fs::write(&path, format!("{bom}{body}")).unwrap();
}

/// Checks one case; returns the list of mismatches.
fn check(case_dir: &Path) -> Vec<String> {
    let exp: Value =
        serde_json::from_slice(&std::fs::read(case_dir.join("expected.json")).unwrap()).unwrap();
    let trace = case_dir.join("trace");
    fill_digests(&trace);
    let t = trace.to_str().unwrap();
    let mut bad = Vec::new();
    let mut fail = |what: String| bad.push(what);

    for cmd in ["verify", "inspect"] {
        if let Some(code) = exp[cmd].as_i64() {
            let r = kvtrail(&[cmd, t]);
            if r.code as i64 != code || r.stderr.contains("panicked") {
                fail(format!(
                    "{cmd}: exit {} (expected {code})\n{}{}",
                    r.code, r.stdout, r.stderr
                ));
            }
        }
    }
    // Other commands that replay the trace and must refuse it too (exit 2,
    // with the scope error's fragments): `{trace}` in an argument is the
    // case's trace.
    for args in exp["refused_by"].as_array().into_iter().flatten() {
        let args: Vec<String> = args
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().replace("{trace}", t))
            .collect();
        let mut argv: Vec<&str> = args.iter().map(String::as_str).collect();
        if !args.iter().any(|a| a == t) {
            argv.push(t);
        }
        let r = kvtrail(&argv);
        if r.code != 2 || r.stderr.contains("panicked") {
            fail(format!(
                "{}: exit {} (expected 2)\n{}{}",
                argv.join(" "),
                r.code,
                r.stdout,
                r.stderr
            ));
        }
        for frag in exp["scope"]["stderr"].as_array().into_iter().flatten() {
            let frag = frag.as_str().unwrap();
            if !r.stderr.contains(frag) {
                fail(format!("{}: error lacks {frag:?}: {}", argv[0], r.stderr));
            }
        }
    }
    let Some(sc) = exp.get("scope") else {
        return bad;
    };
    let r = kvtrail(&["scope", "--json", "--backend", "cpu", t]);
    let code = sc["exit"].as_i64().unwrap_or(0);
    if r.code as i64 != code || r.stderr.contains("panicked") {
        fail(format!(
            "scope: exit {} (expected {code})\nstderr: {}",
            r.code, r.stderr
        ));
        return bad;
    }
    for frag in sc["stderr"].as_array().into_iter().flatten() {
        let frag = frag.as_str().unwrap();
        if !r.stderr.contains(frag) {
            fail(format!("scope: error lacks {frag:?}: {}", r.stderr));
        }
    }
    if code != 0 {
        return bad;
    }
    let rep: Value = match serde_json::from_str(&r.stdout) {
        Ok(v) => v,
        Err(e) => {
            fail(format!("scope --json is not JSON: {e}"));
            return bad;
        }
    };
    if let Some(want) = sc.get("affected").and_then(Value::as_object) {
        let got: Vec<&Value> = rep["affected_responses"]
            .as_array()
            .unwrap()
            .iter()
            .collect();
        let mut got_ids: Vec<String> = got.iter().map(|a| a["request_id"].to_string()).collect();
        let mut want_ids: Vec<String> = want.keys().cloned().collect();
        got_ids.sort();
        want_ids.sort();
        if got_ids != want_ids {
            fail(format!(
                "affected responses {got_ids:?}, expected {want_ids:?}\n{}",
                rep["affected_responses"]
            ));
        }
        for a in &got {
            let Some(w) = want.get(&a["request_id"].to_string()) else {
                continue;
            };
            let rid = &a["request_id"];
            for (key, field) in [
                ("confidence", "confidence"),
                ("foreign", "foreign_tokens"),
                ("unknown", "unknown_tokens"),
                ("cross_tenant", "cross_tenant"),
                ("arrival_ns", "arrival_ns"),
            ] {
                if let Some(v) = w.get(key)
                    && &a[field] != v
                {
                    fail(format!(
                        "response {rid}: {field} = {}, expected {v}",
                        a[field]
                    ));
                }
            }
            if let Some(srcs) = w.get("sources").and_then(Value::as_object) {
                let got_srcs: std::collections::BTreeMap<String, Value> = a["sources"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|s| (s["request_id"].to_string(), s["tokens"].clone()))
                    .collect();
                let want_srcs: std::collections::BTreeMap<String, Value> =
                    srcs.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
                if got_srcs != want_srcs {
                    fail(format!(
                        "response {rid}: sources {got_srcs:?}, expected {want_srcs:?}"
                    ));
                }
            }
        }
    }
    if let Some(want) = sc.get("cross_tenant_shared").and_then(Value::as_object) {
        check_cross_tenant_shared(&rep, want, &mut fail);
    }
    if let Some(breach) = sc.get("prefix_cache_breach").and_then(Value::as_bool) {
        let verdict = rep["verdict"].as_str().unwrap_or("").to_lowercase();
        if verdict.contains("prefix-cache") != breach {
            fail(format!(
                "verdict {verdict:?}: a prefix-cache isolation breach expected: {breach}"
            ));
        }
    }
    if let Some(v) = sc.get("coverage_complete")
        && &rep["coverage"]["complete"] != v
    {
        fail(format!(
            "coverage.complete = {}, expected {v}; notes {}",
            rep["coverage"]["complete"], rep["coverage"]["notes"]
        ));
    }
    let notes = rep["coverage"]["notes"].to_string();
    for frag in sc["notes"].as_array().into_iter().flatten() {
        if !notes.contains(frag.as_str().unwrap()) {
            fail(format!("coverage.notes lack {frag}: {notes}"));
        }
    }
    if let Some(v) = sc.get("requests_missing")
        && &rep["coverage"]["requests_missing"] != v
    {
        fail(format!(
            "coverage.requests_missing = {}, expected {v}",
            rep["coverage"]["requests_missing"]
        ));
    }
    if let Some(v) = sc.get("blank_reads").and_then(Value::as_bool) {
        let n = rep["blank_reads"].as_u64().unwrap_or(0);
        if (n > 0) != v {
            fail(format!("blank_reads = {n}, expected some: {v}"));
        }
    }
    for kind in sc["anomalies"].as_array().into_iter().flatten() {
        if !rep["anomalies"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| &a["kind"] == kind)
        {
            fail(format!("anomaly {kind} not reported: {}", rep["anomalies"]));
        }
    }
    bad
}

/// `cross_tenant_shared` of `scope --json`: the responses whose shared
/// reads hit another tenant's KV, each with its tokens and the tokens per
/// source request, exactly as `want` (request id -> {tokens, sources}).
fn check_cross_tenant_shared(
    rep: &Value,
    want: &serde_json::Map<String, Value>,
    fail: &mut impl FnMut(String),
) {
    // Absent when there are none (so reports of traces without such hits
    // keep their bytes); present, it is a list.
    let none = Vec::new();
    let got = match &rep["cross_tenant_shared"] {
        Value::Null => &none,
        Value::Array(a) => a,
        other => {
            fail(format!(
                "scope --json: cross_tenant_shared is not a list: {other}"
            ));
            return;
        }
    };
    let mut got_ids: Vec<String> = got.iter().map(|a| a["request_id"].to_string()).collect();
    let mut want_ids: Vec<String> = want.keys().cloned().collect();
    got_ids.sort();
    want_ids.sort();
    if got_ids != want_ids {
        fail(format!(
            "cross_tenant_shared {got_ids:?}, expected {want_ids:?}"
        ));
    }
    for a in got {
        let rid = a["request_id"].to_string();
        let Some(w) = want.get(&rid) else {
            continue;
        };
        if let Some(v) = w.get("tokens")
            && &a["tokens"] != v
        {
            fail(format!(
                "cross_tenant_shared {rid}: tokens = {}, expected {v}",
                a["tokens"]
            ));
        }
        if let Some(srcs) = w.get("sources").and_then(Value::as_object) {
            let got_srcs: std::collections::BTreeMap<String, Value> = a["sources"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|s| (s["request_id"].to_string(), s["tokens"].clone()))
                .collect();
            let want_srcs: std::collections::BTreeMap<String, Value> =
                srcs.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            if got_srcs != want_srcs {
                fail(format!(
                    "cross_tenant_shared {rid}: sources {got_srcs:?}, expected {want_srcs:?}"
                ));
            }
        }
    }
}

#[test]
fn contract_conformance() {
    let Some(py) = venv::NOTEBOOKS.python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(&py)
        .arg(repo().join("tests/conformance/make_traces.py"))
        .arg(dir.path())
        .output()
        .expect("run make_traces.py");
    assert!(
        out.status.success(),
        "make_traces.py failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let names: Vec<String> =
        serde_json::from_slice(&std::fs::read(dir.path().join("cases.json")).unwrap()).unwrap();
    assert!(names.len() >= 50, "only {} cases", names.len());
    let only = std::env::var("KVTRAIL_CONFORMANCE_CASE").ok();
    let names: Vec<&String> = names
        .iter()
        .filter(|n| only.as_deref().is_none_or(|o| n.contains(o)))
        .collect();
    // Two workers: the machine is shared.
    let failures: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|w| {
                let names = &names;
                let root = dir.path();
                s.spawn(move || {
                    names
                        .iter()
                        .skip(w)
                        .step_by(2)
                        .flat_map(|n| {
                            check(&root.join(n))
                                .into_iter()
                                .map(move |m| format!("[{n}] {m}"))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    assert!(
        failures.is_empty(),
        "{} mismatches with the contract:\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}
