//! `lookup` through the scope folder's look-up index
//! (requests.index.parquet) gives the same answers as the scan of
//! requests.csv that a folder without a usable index gets: on a simulated
//! incident, for every affected response's external id and output hash,
//! for bystanders, every tenant, ids and hashes not in the trace; with the
//! index missing (an older kvtrail's folder) and with the index edited
//! (the folder no longer matches its evidence.json).

use std::path::Path;

use crate::support::cli::{kvtrail, s, simulate};

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn answer(dir: &Path, q: &[&str]) -> serde_json::Value {
    let r = kvtrail(["lookup", s(dir), "--json"])
        .args(q.iter().copied())
        .expect(&[0, 1])
        .run();
    serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("{q:?}: {e}: {}", r.stderr))
}

/// The answer without what differs by folder on purpose: the evidence
/// check and the note saying how the rows were found.
fn comparable(mut v: serde_json::Value) -> serde_json::Value {
    let o = v.as_object_mut().unwrap();
    for k in ["evidence_intact", "evidence_problems", "notes"] {
        o.remove(k);
    }
    v
}

#[test]
fn lookup_answers_are_the_same_with_and_without_the_index() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let t = simulate(
        &root.join("trace"),
        &["--scenario", "incident", "--requests", "400"],
    );
    let indexed = root.join("scope");
    kvtrail(["scope", s(&t), "--out", s(&indexed)])
        .expect(&[0, 1])
        .run();
    assert!(indexed.join("requests.index.parquet").is_file());
    let missing = root.join("older");
    copy_dir(&indexed, &missing);
    std::fs::remove_file(missing.join("requests.index.parquet")).unwrap();
    let edited = root.join("edited");
    copy_dir(&indexed, &edited);
    let p = edited.join("requests.index.parquet");
    let mut bytes = std::fs::read(&p).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x55;
    std::fs::write(&p, bytes).unwrap();

    // Queries: every affected response's id and hash, bystanders, tenants.
    let mut rd = csv::Reader::from_path(indexed.join("requests.csv")).unwrap();
    let rows: Vec<csv::StringRecord> = rd.records().map(|r| r.unwrap()).collect();
    assert_eq!(rows.len(), 400);
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(indexed.join("summary.json")).unwrap()).unwrap();
    let affected: Vec<u64> = summary["affected_responses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["request_id"].as_u64().unwrap())
        .collect();
    assert!(!affected.is_empty(), "the incident has affected responses");
    let mut queries: Vec<Vec<String>> = Vec::new();
    let mut tenants = std::collections::BTreeSet::new();
    for (i, r) in rows.iter().enumerate() {
        let id: u64 = r[0].parse().unwrap();
        tenants.insert(r[2].to_string());
        if affected.contains(&id) || i % 50 == 0 {
            if !r[1].is_empty() {
                queries.push(vec!["--external-id".into(), r[1].into()]);
                queries.push(vec![
                    "--external-id".into(),
                    r[1].into(),
                    "--tenant".into(),
                    r[2].into(),
                ]);
            }
            if !r[9].is_empty() {
                queries.push(vec!["--output-hash".into(), r[9].to_uppercase()]);
            }
        }
    }
    for t in &tenants {
        queries.push(vec!["--tenant".into(), t.clone()]);
    }
    queries.push(vec!["--tenant".into(), "no-such-customer".into()]);
    queries.push(vec!["--external-id".into(), "chatcmpl-not-in-trace".into()]);
    queries.push(vec!["--output-hash".into(), "ab".repeat(32)]);
    let mut statuses = std::collections::BTreeSet::new();
    for q in &queries {
        let q: Vec<&str> = q.iter().map(String::as_str).collect();
        let a = answer(&indexed, &q);
        assert!(a.get("notes").is_none(), "{q:?}: {a}");
        assert_eq!(a["evidence_intact"], true);
        let b = answer(&missing, &q);
        assert!(
            b["notes"][0].as_str().unwrap().contains("no look-up index"),
            "{q:?}: {b}"
        );
        let c = answer(&edited, &q);
        assert!(
            c["notes"][0]
                .as_str()
                .unwrap()
                .contains("does not match its evidence.json"),
            "{q:?}: {c}"
        );
        statuses.insert(a["status"].as_str().unwrap().to_string());
        let a = comparable(a);
        assert_eq!(a, comparable(b), "{q:?}: index vs no index");
        assert_eq!(a, comparable(c), "{q:?}: index vs edited index");
    }
    assert!(statuses.contains("affected") && statuses.contains("not_found"));
    assert!(statuses.iter().any(|s| s.starts_with("not_affected")));
    // The human answer says how it was found.
    let text = kvtrail(["lookup", s(&missing), "--tenant", "no-such-customer"])
        .expect(&[1])
        .run()
        .stdout;
    assert!(
        text.contains("note: this scope folder has no look-up index"),
        "{text}"
    );
}
