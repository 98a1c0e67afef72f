//! Evidence with holes is never called complete: data files that no longer
//! match their digests, trace.json rows the files do not hold, import lines
//! skipped under a manifest that says complete, and data files deleted from
//! disk. scope, inspect, audit and lookup (through scope's summary) all
//! judge completeness by scope's one coverage rule; each case runs the real
//! binary on a simulated trace damaged the way a responder could find it.

use std::path::{Path, PathBuf};

use kvtrail::schema::{KvEvent, Op};
use kvtrail::trace::Trace;
use kvtrail::trace::write::{kv_batch, write_single_file};

use crate::support::cli::{kvtrail, s, simulate};

/// The repros' clean trace: steady traffic, pools at 2x the context.
fn steady(dir: &Path, name: &str) -> PathBuf {
    simulate(
        &dir.join(name),
        &[
            "--scenario",
            "steady",
            "--requests",
            "10",
            "--set",
            "prefill.capacity_tokens=32768",
            "--set",
            "decode.capacity_tokens=65536",
        ],
    )
}

fn scope_json(t: &Path) -> serde_json::Value {
    let r = kvtrail(["scope", s(t), "--json"]).run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    serde_json::from_str(&r.stdout).unwrap()
}

fn edit_manifest(t: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = t.join("trace.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    f(&mut m);
    std::fs::write(&p, serde_json::to_vec(&m).unwrap()).unwrap();
}

/// Rewrites every kv file with each `read` turned into an `alloc` (seqs
/// unchanged): the trace still reads cleanly, its digests no longer match.
fn reads_to_allocs(t: &Path) {
    let trace = Trace::open(t).unwrap();
    for f in &trace.kv_files {
        let mut events: Vec<KvEvent> = Vec::new();
        for c in trace.kv_file(f).unwrap() {
            events.extend(c.unwrap().events);
        }
        for e in &mut events {
            if e.op == Op::Read {
                e.op = Op::Alloc;
                e.token_pos = None;
            }
        }
        write_single_file(f, &[kv_batch(&events)]).unwrap();
    }
}

fn assert_incomplete(v: &serde_json::Value, why: &str) {
    let c = &v["coverage"];
    assert_eq!(c["complete"], false, "{why}: {c:#}");
    let verdict = v["verdict"].as_str().unwrap();
    assert!(
        verdict.contains("INCOMPLETE") && !verdict.contains("evidence is complete"),
        "{why}: {verdict}"
    );
    let notes: Vec<&str> = c["notes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    assert!(notes.iter().any(|n| n.contains(why)), "{why}: {notes:#?}");
}

fn inspect_says_complete(t: &Path) -> bool {
    let r = kvtrail(["inspect", s(t)]).run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    r.stdout.contains("evidence    complete")
}

fn audit_warnings(t: &Path) -> (i32, Vec<String>) {
    let r = kvtrail(["audit", s(t), "--json"]).run();
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap_or_else(|e| {
        panic!("{e}: {}{}", r.stdout, r.stderr);
    });
    let kinds = v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["severity"] == "warning")
        .map(|f| f["kind"].as_str().unwrap().to_string())
        .collect();
    (r.code, kinds)
}

#[test]
fn data_files_that_fail_their_digests_are_not_complete_evidence() {
    let dir = tempfile::tempdir().unwrap();
    let t = simulate(
        &dir.path().join("t"),
        &["--scenario", "incident", "--requests", "30"],
    );
    let before = dir.path().join("before");
    let r = kvtrail(["scope", s(&t), "--out", s(&before), "--json"]).run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(v["coverage"]["complete"], true, "{:#}", v["coverage"]);
    let affected = v["affected_responses"][0]["external_id"]
        .as_str()
        .expect("the incident affects a response")
        .to_string();

    reads_to_allocs(&t);
    assert_eq!(kvtrail(["verify", s(&t)]).run().code, 1);
    let after = dir.path().join("after");
    let r = kvtrail(["scope", s(&t), "--out", s(&after), "--json"]).run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_incomplete(&v, "do not match their blake3 digest");
    let modified = v["coverage"]["files_modified"].as_array().unwrap();
    assert!(!modified.is_empty());
    assert!(
        modified
            .iter()
            .all(|p| p.as_str().unwrap().starts_with("kv/")),
        "{modified:?}"
    );
    // The human verdict says so too.
    let r = kvtrail(["scope", s(&t)]).run();
    assert!(r.stdout.contains("INCOMPLETE"), "{}", r.stdout);
    assert!(r.stdout.contains("blake3 digest"), "{}", r.stdout);

    // inspect checks the digests before it calls the evidence complete.
    assert!(!inspect_says_complete(&t));
    let r = kvtrail(["inspect", s(&t), "--json"]).run();
    let iv: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert!(
        iv["evidence_warnings"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w.as_str().unwrap().contains("blake3 digest")),
        "{:#}",
        iv["evidence_warnings"]
    );

    // A response the original evidence shows affected is never "not
    // affected" on complete evidence.
    let r = kvtrail(["lookup", s(&after), "--external-id", &affected, "--json"]).run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    let a: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(a["status"], "not_affected_incomplete_evidence", "{a:#}");

    // Notification packs get the note worded without file paths.
    let packs = dir.path().join("packs");
    let r = kvtrail(["notify", s(&after), "--out", s(&packs)]).run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    let summary: kvtrail::scope::ScopeReport =
        kvtrail::scope::ScopeReport::from_json(&std::fs::read(after.join("summary.json")).unwrap())
            .unwrap();
    for n in kvtrail::scope::customer_notes(&summary.coverage) {
        assert!(!n.contains("kv/") && !n.contains(".parquet"), "{n}");
    }
}

#[test]
fn manifest_rows_the_files_do_not_hold_are_not_complete_evidence() {
    let dir = tempfile::tempdir().unwrap();
    let t = steady(dir.path(), "rows");
    let mut listed = String::new();
    edit_manifest(&t, |m| {
        let f = &mut m["files"][0];
        listed = f["path"].as_str().unwrap().to_string();
        f["rows"] = (f["rows"].as_u64().unwrap() + 1000).into();
    });
    assert_eq!(kvtrail(["verify", s(&t)]).run().code, 1);
    let v = scope_json(&t);
    assert_incomplete(&v, "another number of rows than trace.json lists");
    let d = &v["coverage"]["files_rows_differ"][0];
    assert_eq!(d["path"], listed.as_str());
    assert_eq!(
        d["listed_rows"].as_u64().unwrap(),
        d["file_rows"].as_u64().unwrap() + 1000
    );
    assert!(!inspect_says_complete(&t));
    let (code, warnings) = audit_warnings(&t);
    assert_eq!(code, 1);
    assert!(warnings.contains(&"evidence_incomplete".to_string()));
}

#[test]
fn skipped_import_lines_under_complete_true_are_not_complete_evidence() {
    let dir = tempfile::tempdir().unwrap();
    let t = steady(dir.path(), "skipped");
    edit_manifest(&t, |m| {
        m["capture"]["skipped_lines"] = 3.into();
        m["capture"]["complete"] = true.into();
    });
    assert_eq!(kvtrail(["verify", s(&t)]).run().code, 1);
    let v = scope_json(&t);
    assert_incomplete(&v, "3 malformed input lines were skipped");
    assert_eq!(v["coverage"]["skipped_lines"], 3);
    assert!(!inspect_says_complete(&t));
    let (code, warnings) = audit_warnings(&t);
    assert_eq!(code, 1);
    assert!(warnings.contains(&"evidence_incomplete".to_string()));
}

#[test]
fn audit_with_a_pool_s_kv_files_deleted_is_not_a_pass() {
    let dir = tempfile::tempdir().unwrap();
    let t = steady(dir.path(), "t");
    let (code, warnings) = audit_warnings(&t);
    assert_eq!((code, warnings), (0, vec![]), "the clean trace passes");
    std::fs::remove_dir_all(t.join("kv/pool=1")).unwrap();
    let (code, warnings) = audit_warnings(&t);
    assert_eq!(code, 1);
    assert_eq!(warnings, ["evidence_incomplete"]);
    let r = kvtrail(["audit", s(&t)]).run();
    assert!(
        r.stdout
            .contains("1 file listed in trace.json is missing on disk"),
        "{}",
        r.stdout
    );
    assert!(!r.stdout.contains("pass:"), "{}", r.stdout);
    // scope and inspect say the same.
    assert_incomplete(&scope_json(&t), "missing on disk");
    assert!(!inspect_says_complete(&t));
}

#[test]
fn a_clean_trace_is_still_complete_everywhere() {
    let dir = tempfile::tempdir().unwrap();
    let t = steady(dir.path(), "clean");
    let v = scope_json(&t);
    assert_eq!(v["coverage"]["complete"], true, "{:#}", v["coverage"]);
    let c = v["coverage"].as_object().unwrap();
    for k in ["files_modified", "files_rows_differ", "skipped_lines"] {
        assert!(!c.contains_key(k), "{k} is left out when empty");
    }
    assert!(inspect_says_complete(&t));
    assert_eq!(audit_warnings(&t), (0, vec![]));
}

#[test]
fn a_file_listed_twice_is_verified_and_counted_once() {
    let dir = tempfile::tempdir().unwrap();
    let t = steady(dir.path(), "dup");
    let once = kvtrail(["verify", s(&t), "--json"]).run();
    assert_eq!(once.code, 0, "{}", once.stdout);
    let once: serde_json::Value = serde_json::from_str(&once.stdout).unwrap();
    edit_manifest(&t, |m| {
        let first = m["files"][0].clone();
        m["files"].as_array_mut().unwrap().push(first);
    });
    let twice = kvtrail(["verify", s(&t), "--json"]).run();
    assert_eq!(twice.code, 0, "{}", twice.stdout);
    let twice: serde_json::Value = serde_json::from_str(&twice.stdout).unwrap();
    for k in ["files_checked", "bytes_hashed", "rows_checked"] {
        assert_eq!(twice[k], once[k], "{k}");
    }
    // The same entry twice says nothing new: the evidence stays complete.
    assert_eq!(scope_json(&t)["coverage"]["complete"], true);
    // Two different entries for one path: one of them is wrong.
    edit_manifest(&t, |m| {
        let n = m["files"].as_array().unwrap().len();
        let r = m["files"][n - 1]["rows"].as_u64().unwrap();
        m["files"][n - 1]["rows"] = (r + 1).into();
    });
    assert_eq!(kvtrail(["verify", s(&t)]).run().code, 1);
    assert_incomplete(&scope_json(&t), "another number of rows");
}

#[test]
fn inspect_with_files_missing_or_left_open_does_not_say_complete() {
    let dir = tempfile::tempdir().unwrap();
    let missing = steady(dir.path(), "missing");
    assert!(inspect_says_complete(&missing), "the clean trace");
    std::fs::remove_dir_all(missing.join("kv/pool=1")).unwrap();
    assert!(!inspect_says_complete(&missing));

    let open = steady(dir.path(), "open");
    let part = Trace::open(&open).unwrap().kv_files[0].clone();
    std::fs::copy(&part, part.with_extension("parquet.inprogress")).unwrap();
    assert!(!inspect_says_complete(&open));
    let r = kvtrail(["inspect", s(&open)]).run();
    assert!(
        r.stdout.contains("may hold rows that were not read"),
        "{}",
        r.stdout
    );
}
