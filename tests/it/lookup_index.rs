//! `lookup` through the scope folder's look-up index
//! (requests.index.parquet) gives the same answers as the scan of
//! requests.csv that a folder without a usable index gets: on a simulated
//! incident, for every affected response's external id and output hash,
//! for bystanders, every tenant, ids and hashes not in the trace; with the
//! index missing (an older kvtrail's folder) and with the index edited
//! (the folder no longer matches its evidence.json).

use std::path::Path;

use crate::support::cli::{kvtrail, s, simulate};
use crate::support::files::copy_dir;

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

/// A scope folder whose requests.csv is large enough for chunk digests
/// (about 6 MB: six 1 MiB chunks): the golden v1 trace's findings and `n`
/// synthetic requests, with its look-up index and evidence.json, written
/// through the library as scope writes them.
fn large_folder(dir: &Path, n: u64) {
    use kvtrail::report::lookup_files::{self, REQUESTS_CSV, REQUESTS_HEADER};
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/golden-v1");
    let run = kvtrail::scope::run::ScopeRun::open(&golden, kvtrail::lineage::BackendChoice::Cpu)
        .unwrap()
        .run(None, &kvtrail::progress::NoReporter)
        .unwrap();
    kvtrail::report::write_out(&run.report, dir).unwrap();
    let cmd = ["kvtrail".to_string(), "scope".to_string()];
    kvtrail::report::bundle::write_scope_extras(&run.trace, &run.report, dir, &cmd).unwrap();
    std::fs::remove_file(dir.join(kvtrail::custody::EVIDENCE_JSON)).unwrap();
    let f = std::fs::File::create(dir.join(REQUESTS_CSV)).unwrap();
    let mut w = kvtrail::report::csv::writer(std::io::BufWriter::new(f));
    w.write_record(REQUESTS_HEADER.split(',')).unwrap();
    for i in 0..n {
        let arrival = 1_788_220_800_000_000_000i64 + i as i64 * 1_000_000;
        w.write_record([
            i.to_string(),
            large_ext(i),
            ["acme", "globex", "initech"][(i % 3) as usize].to_string(),
            arrival.to_string(),
            (arrival + 2_000_000_000).to_string(),
            "200".into(),
            "812".into(),
            "812".into(),
            "64".into(),
            blake3::hash(&i.to_le_bytes()).to_hex().to_string(),
        ])
        .unwrap();
    }
    w.flush().unwrap();
    drop(w);
    lookup_files::write_lookup_index(dir).unwrap();
    kvtrail::custody::write_evidence(dir, "scope", &cmd, Vec::new()).unwrap();
}

fn large_ext(i: u64) -> String {
    format!(
        "chatcmpl-{}",
        &blake3::hash(&(i + 1).to_be_bytes()).to_hex()[..24]
    )
}

/// The byte offset of request `id`'s row in requests.csv.
fn row_offset(dir: &Path, id: u64) -> usize {
    let text = std::fs::read_to_string(dir.join("requests.csv")).unwrap();
    text.find(&format!("\n{id},")).unwrap() + 1
}

fn flip(p: &Path, at: usize) {
    let mut b = std::fs::read(p).unwrap();
    // A digit for another digit: the file stays valid CSV of the same size.
    b[at] = if b[at] == b'1' { b'2' } else { b'1' };
    std::fs::write(p, b).unwrap();
}

fn edit_evidence(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("evidence.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

/// The chunk digests of requests.csv in evidence.json.
fn csv_chunks(v: &mut serde_json::Value) -> &mut serde_json::Value {
    let outs = v["outputs"].as_array_mut().unwrap();
    let f = outs
        .iter_mut()
        .find(|f| f["path"] == "requests.csv")
        .unwrap();
    &mut f["chunks"]
}

#[test]
fn a_lookup_in_a_large_folder_checks_the_bytes_it_reads_and_answers_a_changed_one_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let good = root.join("scope");
    large_folder(&good, 36_000);
    let ev: serde_json::Value =
        serde_json::from_slice(&std::fs::read(good.join("evidence.json")).unwrap()).unwrap();
    let csv = ev["outputs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["path"] == "requests.csv")
        .unwrap();
    assert_eq!(csv["chunks"]["chunk_bytes"], 1 << 20);
    let chunks = csv["chunks"]["blake3"].as_array().unwrap().len();
    assert!(chunks >= 5, "{chunks} chunks");
    // The small files have none.
    for f in ev["outputs"].as_array().unwrap() {
        assert_eq!(
            f.get("chunks").is_some(),
            f["bytes"].as_u64().unwrap() >= 4 << 20,
            "{f}"
        );
    }
    let id = 7u64;
    let q = ["--external-id", &large_ext(id)];
    let a = answer(&good, &q);
    assert_eq!(a["evidence_check"], "bytes_read", "{a}");
    assert_eq!(a["evidence_intact"], true, "{a}");
    assert!(a.get("notes").is_none(), "the index was used: {a}");
    assert_eq!(a["matches"][0]["request_id"], id);
    let whole = answer(&good, &[q[0], q[1], "--full-check"]);
    assert_eq!(whole["evidence_check"], "whole_folder");
    assert_eq!(whole["evidence_intact"], true);
    let strip = |mut v: serde_json::Value| {
        v.as_object_mut().unwrap().remove("evidence_check");
        v
    };
    assert_eq!(strip(a.clone()), strip(whole));
    let text = kvtrail(["lookup", s(&good), q[0], q[1]])
        .expect(&[0])
        .run()
        .stdout;
    assert!(
        text.contains(
            "every byte read matches evidence.json; `kvtrail verify` checks the whole folder"
        ),
        "{text}"
    );

    // A byte changed far from the row asked about: the look-up did not
    // read it and answers as before; the whole check and verify find it.
    let far = root.join("far");
    copy_dir(&good, &far);
    let end = std::fs::metadata(far.join("requests.csv")).unwrap().len() as usize;
    let at = row_offset(&far, 35_990);
    assert!(at > end - (1 << 20), "in the last chunk");
    flip(&far.join("requests.csv"), at);
    assert_eq!(strip(answer(&far, &q)), strip(a.clone()));
    let w = answer(&far, &[q[0], q[1], "--full-check"]);
    assert_eq!(w["evidence_intact"], false, "{w}");
    assert!(
        w["evidence_problems"][0]
            .as_str()
            .unwrap()
            .contains("modified requests.csv"),
        "{w}"
    );
    kvtrail(["verify", s(&far)]).expect(&[1]).run();

    // The row asked about changed (same size): the chunk read does not
    // match, and the look-up is answered after the whole check.
    let near = root.join("near");
    copy_dir(&good, &near);
    let text = std::fs::read_to_string(near.join("requests.csv")).unwrap();
    let row = row_offset(&near, id);
    let arrival = row + text[row..].find(",1788220800").unwrap() + 12;
    flip(&near.join("requests.csv"), arrival);
    let b = answer(&near, &q);
    assert_eq!(b["evidence_check"], "whole_folder", "{b}");
    assert_eq!(b["evidence_intact"], false, "{b}");
    assert!(
        b["evidence_problems"][0]
            .as_str()
            .unwrap()
            .contains("modified requests.csv"),
        "{b}"
    );
    assert!(
        b["notes"][0]
            .as_str()
            .unwrap()
            .contains("does not match its evidence.json"),
        "{b}"
    );
    kvtrail(["lookup", s(&near), q[0], q[1]]).expect(&[1]).run();

    // Grown by a byte: found by the size check before anything is read.
    let grown = root.join("grown");
    copy_dir(&good, &grown);
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(grown.join("requests.csv"))
        .unwrap();
    std::io::Write::write_all(&mut f, b"\n").unwrap();
    drop(f);
    let g = answer(&grown, &q);
    assert_eq!(
        (g["evidence_check"].as_str(), g["evidence_intact"].as_bool()),
        (Some("whole_folder"), Some(false)),
        "{g}"
    );

    // A chunk digest edited in the record (still hex): the chunk read
    // does not match it; the whole check names the edited record.
    let forged = root.join("forged");
    copy_dir(&good, &forged);
    edit_evidence(&forged, |v| {
        csv_chunks(v)["blake3"][0] = "ab".repeat(32).into()
    });
    let c = answer(&forged, &q);
    assert_eq!(c["evidence_intact"], false, "{c}");
    assert!(
        c["evidence_problems"][0]
            .as_str()
            .unwrap()
            .contains("chunk digests (chunk 0 differs): the record was edited"),
        "{c}"
    );

    // Records that are not kvtrail's: exit 2 naming the key.
    for (name, edit, key) in [
        (
            "chunk size",
            Box::new(|v: &mut serde_json::Value| csv_chunks(v)["chunk_bytes"] = 4096.into())
                as Box<dyn Fn(&mut serde_json::Value)>,
            "chunks.chunk_bytes",
        ),
        (
            "a digest too few",
            Box::new(|v: &mut serde_json::Value| {
                csv_chunks(v)["blake3"].as_array_mut().unwrap().pop();
            }),
            "chunks.blake3",
        ),
        (
            "not hex",
            Box::new(|v: &mut serde_json::Value| {
                csv_chunks(v)["blake3"][1] = "zz".repeat(32).into()
            }),
            "chunks.blake3[1]",
        ),
        (
            "chunks on a small file",
            Box::new(|v: &mut serde_json::Value| {
                let c = csv_chunks(v).clone();
                let outs = v["outputs"].as_array_mut().unwrap();
                let f = outs
                    .iter_mut()
                    .find(|f| f["path"] == "summary.json")
                    .unwrap();
                f["chunks"] = c;
            }),
            "chunks.chunk_bytes",
        ),
    ] {
        let d = root.join(name.replace(' ', "-"));
        copy_dir(&good, &d);
        edit_evidence(&d, edit);
        let r = kvtrail(["lookup", s(&d), q[0], q[1]]).expect(&[2]).run();
        assert!(
            r.stderr.contains(key) && r.stderr.contains("evidence.json"),
            "{name}: {}",
            r.stderr
        );
    }
}

/// A chunk's digest as an attacker would recompute it: plain blake3 (the
/// kind earlier records hold) or the chunk's chaining value in the file's
/// BLAKE3 tree (`blake3-subtree`).
fn chunk_digest(subtree: bool, offset: u64, bytes: &[u8]) -> String {
    use blake3::hazmat::HasherExt as _;
    if !subtree {
        return blake3::hash(bytes).to_hex().to_string();
    }
    let mut h = blake3::Hasher::new();
    h.set_input_offset(offset);
    h.update(bytes);
    blake3::Hash::from(h.finalize_non_root())
        .to_hex()
        .to_string()
}

#[test]
fn defect5_lookup_never_trusts_a_record_whose_chunks_contradict_its_digest() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let good = root.join("scope");
    large_folder(&good, 36_000);
    let id = 7u64;
    let q = ["--external-id", &large_ext(id)];
    let before = answer(&good, &q);
    assert_eq!(before["evidence_intact"], true, "{before}");
    // A record of an earlier version (plain chunk digests, no `digest`
    // key), unedited: still read, checked whole (its chunks are bound to
    // nothing), and intact.
    let old = root.join("older-record");
    copy_dir(&good, &old);
    let bytes = std::fs::read(old.join("requests.csv")).unwrap();
    edit_evidence(&old, |v| {
        let c = csv_chunks(v);
        c.as_object_mut().unwrap().remove("digest");
        for (j, piece) in bytes.chunks(1 << 20).enumerate() {
            c["blake3"][j] = chunk_digest(false, 0, piece).into();
        }
    });
    let a = answer(&old, &q);
    assert_eq!(
        (a["evidence_intact"].as_bool(), a["evidence_check"].as_str()),
        (Some(true), Some("whole_folder")),
        "{a}"
    );
    assert_eq!(a["matches"], before["matches"], "{a}");
    kvtrail(["verify", s(&old)]).expect(&[0]).run();
    // The row asked about is edited (same size) and only its chunk's
    // digest updated in evidence.json; the file's blake3 is left stale.
    // Variants: the digest kvtrail writes, a plain one with the record's
    // `digest` key kept, and a record of an earlier version's kind (no
    // `digest` key, every chunk's plain digest).
    for (name, subtree, drop_kind) in [
        ("plain", false, false),
        ("plain-legacy", false, true),
        ("subtree", true, false),
    ] {
        let d = root.join(name);
        copy_dir(&good, &d);
        let p = d.join("requests.csv");
        let text = std::fs::read_to_string(&p).unwrap();
        let row = row_offset(&d, id);
        let arrival = row + text[row..].find(",1788220800").unwrap() + 12;
        flip(&p, arrival);
        let bytes = std::fs::read(&p).unwrap();
        let chunk = 1usize << 20;
        let i = arrival / chunk;
        let piece = &bytes[i * chunk..((i + 1) * chunk).min(bytes.len())];
        let digest = chunk_digest(subtree, (i * chunk) as u64, piece);
        edit_evidence(&d, |v| {
            let c = csv_chunks(v);
            c["blake3"][i] = digest.clone().into();
            if drop_kind {
                // Every chunk's plain digest, as an earlier version wrote.
                c.as_object_mut().unwrap().remove("digest");
                for (j, piece) in bytes.chunks(chunk).enumerate() {
                    c["blake3"][j] = chunk_digest(false, 0, piece).into();
                }
            }
        });
        let r = kvtrail(["verify", s(&d)]).expect(&[1]).run();
        assert!(r.stdout.contains("requests.csv"), "{name}: {}", r.stdout);
        for full in [false, true] {
            let mut args = q.to_vec();
            if full {
                args.push("--full-check");
            }
            let a = answer(&d, &args);
            assert_eq!(a["evidence_intact"], false, "{name} full {full}: {a}");
            assert_eq!(a["evidence_check"], "whole_folder", "{name}: {a}");
            let problems = a["evidence_problems"].to_string();
            assert!(
                problems.contains("requests.csv") && problems.contains("contradicts itself"),
                "{name}: {problems}"
            );
            assert!(
                a["notes"][0]
                    .as_str()
                    .unwrap()
                    .contains("does not match its evidence.json"),
                "{name}: {a}"
            );
            kvtrail(["lookup", s(&d), q[0], q[1]]).expect(&[1]).run();
        }
    }
}
