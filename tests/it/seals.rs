//! Seals: captures sealed while they are written (`record --signing-key`,
//! `ingest`/`simulate --signing-key`), checked by stock OpenSSH
//! (`ssh-keygen -Y verify`) and by `kvtrail verify --allowed-signers`, and
//! every forgery refused: a seal deleted, two reordered, one copied from
//! another capture, one altered, the final one removed, a data file edited
//! with trace.json recomputed, a data file added, a truncated signature, a
//! signature in another namespace, an unknown signer. Keys that ssh would
//! refuse are refused too.
//!
//! Index:
//! - record_seals_each_interval_and_openssh_accepts_every_seal
//! - record_cli_seals_and_verify_prints_the_signer
//! - ingest_and_simulate_seal_the_finished_trace
//! - forged_seals_fail_naming_the_seal
//! - edited_or_added_data_files_fail_though_trace_json_was_recomputed
//! - signatures_that_cannot_be_checked_exit_2
//! - unknown_signer_fails / unsigned_trace_with_require_signature_fails
//! - unsafe_keys_are_refused_before_anything_is_written

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use kvtrail::custody::keys::SigningKey;
use kvtrail::record::SealConfig;

use crate::support::cli::{kvtrail, s};
use crate::support::record::*;
use crate::support::reseal::{reseal_trace, reseal_trace_digests};

const ID: &str = "capture@example";

/// A stock ssh-keygen ed25519 key and an allowed_signers file naming it
/// as [`ID`].
fn keygen(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    crate::support::keys::keygen(dir, name, ID)
}

/// `ssh-keygen -Y verify` of one seal by [`ID`].
fn openssh_verify(allowed: &Path, seal: &Path) -> (bool, String) {
    crate::support::keys::openssh_verify(allowed, ID, seal)
}

fn seal_files(trace: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(trace.join("seals"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    v.sort();
    v
}

fn seal_json(p: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

/// A capture through the sidecar, sealed every 150 ms, with small part
/// files (some completed, some open across seals) and quiet intervals.
fn sealed_capture(dir: &Path, key: &Path) -> PathBuf {
    let key = Arc::new(SigningKey::load(key).unwrap());
    let rig = start(|c| {
        c.seal = Some(SealConfig {
            key,
            every: Duration::from_millis(150),
        });
        c.recorder.row_group_rows = 50;
        c.recorder.part.rotate_bytes = 6_000;
    });
    {
        let mut a = rig.connect(&[2]);
        let mut b = rig.connect(&[3]);
        for burst in 0..4u32 {
            for i in 0..200u32 {
                writeln!(a, "{}", kv(2, 1 + burst as u64, "write", (i * 7) % 4000, 1)).unwrap();
                writeln!(b, "{}", kv(3, 1 + burst as u64, "write", (i * 3) % 4000, 2)).unwrap();
            }
            a.flush().unwrap();
            b.flush().unwrap();
            // Longer than an interval: some seals cover an empty window.
            std::thread::sleep(Duration::from_millis(400));
        }
    }
    let (sum, _t, d, out) = rig.stop();
    assert!(sum.seals >= 4, "{sum:?}");
    let dest = dir.join(out.file_name().unwrap());
    copy_dir(&out, &dest);
    drop(d);
    dest
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        let q = to.join(p.file_name().unwrap());
        if p.is_dir() {
            copy_dir(&p, &q);
        } else {
            std::fs::copy(&p, &q).unwrap();
        }
    }
}

fn verify(trace: &Path, extra: &[&str]) -> (i32, String, String) {
    let mut args = vec!["verify", s(trace)];
    args.extend(extra);
    kvtrail(args).run().into_parts()
}

#[test]
fn record_seals_each_interval_and_openssh_accepts_every_seal() {
    let d = tempfile::tempdir().unwrap();
    let (key, allowed) = keygen(d.path(), "key");
    let t = sealed_capture(d.path(), &key);
    let seals = seal_files(&t);
    assert!(seals.len() >= 4, "{seals:?}");
    let (mut open_parts, mut completed, mut empty) = (0, 0, 0);
    let mut ids = std::collections::BTreeSet::new();
    for (i, p) in seals.iter().enumerate() {
        let (ok, out) = openssh_verify(&allowed, p);
        assert!(ok, "ssh-keygen refused {}: {out}", p.display());
        let v = seal_json(p);
        assert_eq!(v["index"], i as u64);
        assert_eq!(v["final"], i + 1 == seals.len(), "{v}");
        assert_eq!(v["previous_sha256"].is_null(), i == 0);
        ids.insert(v["capture_id"].as_str().unwrap().to_string());
        open_parts += v["open_parts"].as_array().unwrap().len();
        completed += v["files"].as_array().unwrap().len();
        let new_events: u64 = v["pools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["events_in_window"].as_u64().unwrap())
            .sum();
        if new_events == 0 && !v["final"].as_bool().unwrap() {
            empty += 1;
        }
        assert!(v["connections"]["total"].as_u64().unwrap() >= 2, "{v}");
        for p in v["pools"].as_array().unwrap() {
            assert!(p["seq_to"].as_u64() >= p["seq_from"].as_u64(), "{v}");
        }
    }
    assert_eq!(ids.len(), 1, "one capture id: {ids:?}");
    assert!(open_parts > 0, "row groups of open parts were sealed");
    assert!(completed > 0, "completed files were sealed");
    assert!(empty > 0, "quiet intervals are sealed too");
    // The chain: each seal names the previous one's sha256.
    for w in seals.windows(2) {
        use sha2::Digest;
        let prev = std::fs::read(&w[0]).unwrap();
        let want: String = sha2::Sha256::digest(&prev)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(seal_json(&w[1])["previous_sha256"], want);
    }
    let (code, out, err) = verify(&t, &["--allowed-signers", s(&allowed)]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(&format!("SEALED: {} seals", seals.len())),
        "{out}"
    );
    assert!(out.contains(ID), "the signer is named: {out}");
    // Without allowed signers: never more than the evidence supports.
    let (code, out, err) = verify(&t, &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("sealed, signatures not checked"), "{out}");
    assert!(!out.contains("SEALED") && !out.contains("intact"), "{out}");
}

#[test]
fn record_cli_seals_and_verify_prints_the_signer() {
    let d = tempfile::tempdir().unwrap();
    let (key, allowed) = keygen(d.path(), "key");
    let (child, sock, out) = spawn_record(
        d.path(),
        &["--signing-key", s(&key), "--seal-every", "200ms"],
    );
    let mut c = hello(&sock, 2);
    for i in 0..100 {
        writeln!(c, "{}", kv(2, 1, "write", i, 1)).unwrap();
    }
    c.flush().unwrap();
    std::thread::sleep(Duration::from_millis(700));
    writeln!(c, r#"{{"type":"bye","enqueued":0,"sent":0,"dropped":0}}"#).unwrap();
    drop(c);
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let o = wait_bounded(child, Duration::from_secs(60));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(stdout.contains("sealed: "), "{stdout}");
    let seals = seal_files(&out);
    assert!(seals.len() >= 3, "{seals:?}");
    // The summary counts what is on disk and says what sealing cost.
    assert!(
        stdout.contains(&format!("sealed: {} seals in seals/", seals.len())),
        "{stdout}"
    );
    assert!(stdout.contains("sealing used "), "{stdout}");
    for p in &seals {
        let (ok, msg) = openssh_verify(&allowed, p);
        assert!(ok, "{}: {msg}", p.display());
    }
    let (code, o, e) = verify(&out, &["--allowed-signers", s(&allowed), "--json"]);
    assert_eq!(code, 0, "{o}{e}");
    let v: serde_json::Value = serde_json::from_str(&o).unwrap();
    assert_eq!(v["seals"]["ok"], true);
    assert_eq!(v["all_ok"], true, "{o}");
    assert_eq!(v["seals"]["final_seal"], true);
    assert!(v["seals"]["signers"][0].as_str().unwrap().starts_with(ID));
}

#[test]
fn ingest_and_simulate_seal_the_finished_trace() {
    let d = tempfile::tempdir().unwrap();
    let (key, allowed) = keygen(d.path(), "key");
    let sim = d.path().join("sim");
    kvtrail([
        "simulate",
        "--scenario",
        "incident",
        "--requests",
        "300",
        "--out",
        s(&sim),
        "--signing-key",
        s(&key),
    ])
    .expect(&[0])
    .run();
    let dep = write_deployment(d.path());
    let lines = d.path().join("in.jsonl");
    let body: String = (0..50).map(|i| kv(2, 1, "write", i, 1) + "\n").collect();
    std::fs::write(&lines, body).unwrap();
    let ing = d.path().join("ing");
    kvtrail([
        "ingest",
        s(&lines),
        "--deployment",
        s(&dep),
        "--out",
        s(&ing),
        "--signing-key",
        s(&key),
    ])
    .expect(&[0])
    .run();
    for t in [&sim, &ing] {
        let seals = seal_files(t);
        assert_eq!(seals.len(), 1, "{seals:?}");
        assert_eq!(seal_json(&seals[0])["final"], true);
        let (ok, msg) = openssh_verify(&allowed, &seals[0]);
        assert!(ok, "{msg}");
        let (code, out, err) = verify(t, &["--allowed-signers", s(&allowed)]);
        assert_eq!(code, 0, "{out}{err}");
        assert!(out.contains("SEALED: 1 seal of"), "{out}");
    }
}

fn rename_seal(t: &Path, from: u64, to: u64) {
    for ext in ["json", "json.sig"] {
        std::fs::rename(
            t.join(format!("seals/{from:06}.{ext}")),
            t.join(format!("seals/{to:06}.{ext}")),
        )
        .unwrap();
    }
}

/// verify with the allowed signers must exit 1 and name `at` with `what`.
fn fails(t: &Path, allowed: &Path, at: &str, what: &str) {
    let (code, out, err) = verify(t, &["--allowed-signers", s(allowed)]);
    assert_eq!(code, 1, "{out}{err}");
    let line = out
        .lines()
        .find(|l| l.contains(at) && l.contains(what))
        .unwrap_or_else(|| panic!("no FAIL naming {at} with {what:?}:\n{out}"));
    assert!(line.starts_with("FAIL"), "{line}");
    assert!(out.contains("SEALS FAILED"), "{out}");
    // The last line is the one verdict: never "OK" while the seals fail,
    // though the trace's own checks pass; the JSON says the same.
    let last = out.lines().last().unwrap_or_default();
    assert!(last.starts_with("FAILED"), "{out}");
    let (code, json, err) = verify(t, &["--allowed-signers", s(allowed), "--json"]);
    assert_eq!(code, 1, "{json}{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["all_ok"], false, "{json}");
    assert_eq!(v["seals"]["ok"], false, "{json}");
}

#[test]
fn forged_seals_fail_naming_the_seal() {
    let d = tempfile::tempdir().unwrap();
    let (key, allowed) = keygen(d.path(), "key");
    let a = sealed_capture(&d.path().join("a"), &key);
    let b = sealed_capture(&d.path().join("b"), &key);
    let fresh = |name: &str| {
        let t = d.path().join(name);
        copy_dir(&a, &t);
        t
    };
    // Deleted.
    let t = fresh("deleted");
    std::fs::remove_file(t.join("seals/000001.json")).unwrap();
    std::fs::remove_file(t.join("seals/000001.json.sig")).unwrap();
    fails(&t, &allowed, "seals/000001.json", "missing");
    // Reordered.
    let t = fresh("reordered");
    rename_seal(&t, 1, 99);
    rename_seal(&t, 2, 1);
    rename_seal(&t, 99, 2);
    fails(&t, &allowed, "seals/000001.json", "reordered");
    // Replayed from another capture (signed by the same key).
    let t = fresh("replayed");
    for ext in ["json", "json.sig"] {
        std::fs::copy(
            b.join(format!("seals/000002.{ext}")),
            t.join(format!("seals/000002.{ext}")),
        )
        .unwrap();
    }
    fails(&t, &allowed, "seals/000002.json", "another capture");
    // Altered after signing.
    let t = fresh("altered");
    let p = t.join("seals/000001.json");
    let text = std::fs::read_to_string(&p).unwrap();
    std::fs::write(&p, text.replacen("\"index\": 1", "\"index\": 1 ", 1)).unwrap();
    fails(&t, &allowed, "seals/000001.json", "altered");
    // The final seal (and the tail) removed.
    let t = fresh("cut");
    let last = seal_files(&t).len() as u64 - 1;
    std::fs::remove_file(t.join(format!("seals/{last:06}.json"))).unwrap();
    std::fs::remove_file(t.join(format!("seals/{last:06}.json.sig"))).unwrap();
    fails(&t, &allowed, "seals", "no final seal");
    // A seal without its signature.
    let t = fresh("unsigned");
    std::fs::remove_file(t.join("seals/000000.json.sig")).unwrap();
    fails(&t, &allowed, "seals/000000.json", "unsigned");
    // Without allowed signers the chain is still checked.
    let t = fresh("deleted-unchecked");
    std::fs::remove_file(t.join("seals/000002.json")).unwrap();
    std::fs::remove_file(t.join("seals/000002.json.sig")).unwrap();
    let (code, out, _) = verify(&t, &[]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("seals/000002.json: missing"), "{out}");
}

#[test]
fn edited_or_added_data_files_fail_though_trace_json_was_recomputed() {
    let d = tempfile::tempdir().unwrap();
    let (key, allowed) = keygen(d.path(), "key");
    let t = sealed_capture(d.path(), &key);
    // A completed file: drop its last row group's bytes... simplest, flip
    // one byte inside the data, then recompute trace.json.
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(t.join("trace.json")).unwrap()).unwrap();
    let victim = m["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap().to_string())
        .find(|p| p.starts_with("kv/"))
        .unwrap();
    let mut bytes = std::fs::read(t.join(&victim)).unwrap();
    bytes[10] ^= 0x01;
    std::fs::write(t.join(&victim), &bytes).unwrap();
    crate::support::reseal::reseal_trace_digests(&t);
    // trace.json now agrees with the edited file ...
    let plain = kvtrail(["verify", s(&t)]).run();
    assert!(!plain.stdout.contains(&format!("FAIL modified    {victim}")));
    // ... but the seals do not, nor does trace.json match the final seal.
    fails(&t, &allowed, &victim, "changed after sealing");
    fails(
        &t,
        &allowed,
        "trace.json",
        "changed after the capture closed",
    );

    // A data file added after the final seal.
    let t2 = d.path().join("added");
    copy_dir(&sealed_capture(&d.path().join("x"), &key), &t2);
    let src = t2.join(&victim);
    let extra = src.with_file_name("part-09999.parquet");
    std::fs::copy(&src, &extra).unwrap();
    std::fs::create_dir_all(t2.join("requests")).unwrap();
    reseal_trace(&t2);
    let rel = format!(
        "{}/part-09999.parquet",
        Path::new(&victim).parent().unwrap().display()
    );
    fails(&t2, &allowed, &rel, "not sealed");
}

#[test]
fn signatures_that_cannot_be_checked_exit_2() {
    let d = tempfile::tempdir().unwrap();
    let (key, allowed) = keygen(d.path(), "key");
    let a = sealed_capture(d.path(), &key);
    // Truncated.
    let t = d.path().join("truncated");
    copy_dir(&a, &t);
    let p = t.join("seals/000001.json.sig");
    let sig = std::fs::read(&p).unwrap();
    std::fs::write(&p, &sig[..sig.len() / 2]).unwrap();
    let (code, _, err) = verify(&t, &["--allowed-signers", s(&allowed)]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("000001.json.sig") && err.contains("truncated"),
        "{err}"
    );
    // Signed in another namespace, by the right key, with stock ssh-keygen.
    let t = d.path().join("namespace");
    copy_dir(&a, &t);
    let seal = t.join("seals/000001.json");
    std::fs::remove_file(t.join("seals/000001.json.sig")).unwrap();
    let st = Command::new("ssh-keygen")
        .args(["-q", "-Y", "sign", "-n", "file", "-f"])
        .arg(&key)
        .arg(&seal)
        .status()
        .unwrap();
    assert!(st.success());
    let (code, _, err) = verify(&t, &["--allowed-signers", s(&allowed)]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("namespace") && err.contains("\"file\""),
        "{err}"
    );
    // A malformed allowed_signers file.
    let bad = d.path().join("bad.allowed");
    std::fs::write(&bad, "someone ssh-ed25519\n").unwrap();
    let (code, _, err) = verify(&a, &["--allowed-signers", s(&bad)]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("line 1"), "{err}");
}

#[test]
fn unknown_signer_fails() {
    let d = tempfile::tempdir().unwrap();
    let (key, _) = keygen(d.path(), "key");
    let (_, other) = keygen(d.path(), "other");
    let t = sealed_capture(d.path(), &key);
    fails(&t, &other, "seals/000000.json", "do not name");
    // Named, but only for another namespace.
    let line = std::fs::read_to_string(d.path().join("key.allowed")).unwrap();
    let scoped = d.path().join("scoped.allowed");
    std::fs::write(&scoped, line.replacen(' ', " namespaces=\"git\" ", 1)).unwrap();
    fails(&t, &scoped, "seals/000000.json", "do not name");
}

#[test]
fn unsigned_trace_with_require_signature_fails() {
    let d = tempfile::tempdir().unwrap();
    let (_, allowed) = keygen(d.path(), "key");
    let t = crate::support::cli::simulate(
        &d.path().join("plain"),
        &["--scenario", "incident", "--requests", "100"],
    );
    let (code, out, _) = verify(&t, &[]);
    assert_eq!(code, 0, "{out}");
    assert!(
        !out.contains("seal"),
        "an unsealed trace reads as before: {out}"
    );
    let (code, out, _) = verify(
        &t,
        &["--allowed-signers", s(&allowed), "--require-signature"],
    );
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("not signed"), "{out}");
}

#[test]
fn unsafe_keys_are_refused_before_anything_is_written() {
    let d = tempfile::tempdir().unwrap();
    let (key, _) = keygen(d.path(), "key");
    let secret = std::fs::read_to_string(&key).unwrap();
    let body: String = secret
        .lines()
        .filter(|l| !l.starts_with("-----"))
        .collect::<Vec<_>>()
        .join("");
    let run = |k: &Path, want: &str| {
        let out = d.path().join("out");
        let ran = kvtrail([
            "simulate",
            "--scenario",
            "incident",
            "--requests",
            "50",
            "--out",
            s(&out),
            "--signing-key",
            s(k),
        ])
        .run();
        let err = ran.refused(want);
        assert!(!out.exists(), "nothing is written with a refused key");
        assert!(!err.contains(&body[20..60]), "key material never printed");
    };
    // Readable by the group.
    let open = d.path().join("open");
    std::fs::copy(&key, &open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o640)).unwrap();
    run(&open, "readable by others");
    // Encrypted with a passphrase.
    let enc = d.path().join("enc");
    let st = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "passphrase", "-f"])
        .arg(&enc)
        .status()
        .unwrap();
    assert!(st.success());
    run(&enc, "encrypted");
    // Not ed25519.
    let ec = d.path().join("ecdsa");
    let st = Command::new("ssh-keygen")
        .args(["-q", "-t", "ecdsa", "-N", "", "-f"])
        .arg(&ec)
        .status()
        .unwrap();
    assert!(st.success());
    run(&ec, "ed25519 only");
    // Not a key at all.
    let junk = d.path().join("junk");
    std::fs::write(&junk, "hello").unwrap();
    std::fs::set_permissions(&junk, std::fs::Permissions::from_mode(0o600)).unwrap();
    run(&junk, "not an OpenSSH private key");
}

/// Two requests under one id found at close: the requests file already
/// sealed while open is rewritten without them, and the final seal lists
/// the rewritten file (`rewritten`), so the chain still holds and stock
/// OpenSSH accepts every seal.
#[test]
fn a_requests_file_rewritten_at_close_is_sealed_again() {
    let d = tempfile::tempdir().unwrap();
    let (key, allowed) = keygen(d.path(), "key");
    let signing = Arc::new(SigningKey::load(&key).unwrap());
    let rig = start(|c| {
        c.seal = Some(SealConfig {
            key: signing,
            every: Duration::from_millis(150),
        });
        c.recorder.row_group_rows = 20;
        c.recorder.part.rotate_bytes = 4_000;
    });
    let req = |rid: u64, tenant: &str| {
        serde_json::json!({"type": "request", "request_id": rid, "external_id": format!("x{rid}"),
            "tenant": tenant, "arrival_ns": 1, "finish_ns": 2, "prompt_tokens": 8,
            "prefilled_tokens": 8, "output_tokens": 1, "http_status": 200, "finish_reason": "stop",
            "prefill_pool": 2, "decode_pool": 2})
        .to_string()
    };
    {
        let mut c = rig.connect(&[2]);
        writeln!(c, "{}", kv(2, 7, "write", 0, 4)).unwrap();
        writeln!(c, "{}", req(7, "acme")).unwrap();
        for rid in 100..260u64 {
            writeln!(c, "{}", kv(2, rid, "write", 8 + rid as u32, 1)).unwrap();
            writeln!(c, "{}", req(rid, "initech")).unwrap();
        }
        c.flush().unwrap();
        // Wait until a seal covers the requests written so far (a file
        // completed or a part still open), whenever the sealer gets to it.
        let t = std::time::Instant::now();
        while !rig.out.join("seals").is_dir()
            || !seal_files(&rig.out)
                .iter()
                .any(|p| std::fs::read_to_string(p).is_ok_and(|s| s.contains("\"requests/")))
        {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "no seal covers the requests"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        writeln!(c, "{}", req(7, "globex")).unwrap();
        c.flush().unwrap();
    }
    let (sum, _t, dir, out) = rig.stop();
    assert_eq!(sum.stats.request_conflicts, 1, "{sum:?}");
    assert!(!sum.complete);
    let dest = d.path().join("trace");
    copy_dir(&out, &dest);
    drop(dir);
    let seals = seal_files(&dest);
    let last = seal_json(seals.last().unwrap());
    assert_eq!(last["final"], true);
    let rewritten: Vec<&serde_json::Value> = last["files"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["rewritten"] == true)
        .collect();
    assert!(
        rewritten
            .iter()
            .any(|f| f["path"].as_str().unwrap().starts_with("requests/")),
        "the rewritten requests file is sealed again: {last}"
    );
    for p in &seals {
        let (ok, msg) = openssh_verify(&allowed, p);
        assert!(ok, "{}: {msg}", p.display());
    }
    let (code, o, e) = verify(&dest, &["--allowed-signers", s(&allowed), "--json"]);
    let v: serde_json::Value = serde_json::from_str(&o).unwrap_or_else(|_| panic!("{o}{e}"));
    assert_eq!(v["seals"]["ok"], true, "{v}");
    assert_eq!(v["seals"]["final_seal"], true, "{v}");
    // The capture itself is incomplete (the conflict), and says so.
    assert_eq!(v["complete"], false, "{v}");
    assert_eq!(v["all_ok"], false, "{v}");
    assert_eq!(code, 1, "{o}{e}");
    // The rewritten file edited after the final seal still fails.
    let req_file = crate::support::files::paths(&dest.join("requests"))
        .into_iter()
        .next()
        .unwrap();
    let mut bytes = std::fs::read(&req_file).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    std::fs::write(&req_file, bytes).unwrap();
    reseal_trace_digests(&dest);
    let (code, o, e) = verify(&dest, &["--allowed-signers", s(&allowed)]);
    assert_eq!(code, 1, "{o}{e}");
    assert!(o.contains("FAIL seal"), "{o}");
}

/// The sealing thread failing mid-capture (its folder replaced by a
/// file) never passes silently: record keeps capturing, logs it, and
/// exits 2 at shutdown naming the failure; the trace's seals then fail
/// verify (no final seal), never "SEALED".
#[test]
fn a_sealing_failure_ends_record_with_exit_2() {
    let d = tempfile::tempdir().unwrap();
    let (key, allowed) = keygen(d.path(), "key");
    let (child, sock, out) = spawn_record(
        d.path(),
        &["--signing-key", s(&key), "--seal-every", "200ms"],
    );
    let mut c = hello(&sock, 2);
    for i in 0..50 {
        writeln!(c, "{}", kv(2, 1, "write", i, 1)).unwrap();
    }
    c.flush().unwrap();
    let t = std::time::Instant::now();
    while seal_files(&out).is_empty() {
        assert!(t.elapsed() < Duration::from_secs(20), "no first seal");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The seals folder becomes a file: the next seal cannot be written.
    std::fs::remove_dir_all(out.join("seals")).unwrap();
    std::fs::write(out.join("seals"), "not a folder").unwrap();
    for i in 50..100 {
        writeln!(c, "{}", kv(2, 1, "write", i, 1)).unwrap();
    }
    c.flush().unwrap();
    // No wait: whichever seal comes next, an interval's or the final one
    // at close, cannot be written, and either must end record with exit 2.
    writeln!(c, r#"{{"type":"bye","enqueued":0,"sent":0,"dropped":0}}"#).unwrap();
    drop(c);
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let o = wait_bounded(child, Duration::from_secs(60));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("seal"), "{stderr}");
    // The events were captured all the same.
    let trace = kvtrail::trace::Trace::open(&out).unwrap();
    assert_eq!(seqs(&trace, 2).len(), 100);
    let (code, v, e) = verify(&out, &["--allowed-signers", s(&allowed)]);
    assert_ne!(code, 0, "{v}{e}");
    assert!(!v.contains("SEALED:"), "{v}");
}
