//! Signed findings: the in-toto statement in a DSSE envelope that scope,
//! merge, notify and export write with `--signing-key`, checked here by an
//! independent verifier written from the DSSE specification (the
//! pre-authentication encoding built by hand, the OpenSSH public key parsed
//! by hand, ed25519-dalek used directly: none of kvtrail's code), and by
//! `kvtrail verify`; every forgery fails: a file edited, a statement
//! edited, removed, replayed from another folder, re-signed by an unknown
//! key or stripped of its signature. Keys ssh would refuse are refused;
//! a forged shard is refused by `merge --allowed-signers`, and marked
//! "shards not authenticated" without it.
//!
//! Index:
//! - signed_scope_folder_passes_an_independent_dsse_check
//! - verify_prints_the_signer_and_fails_forged_statements
//! - statements_that_cannot_be_read_exit_2
//! - unsafe_or_non_ed25519_keys_are_refused_before_anything_is_written
//! - forged_shard_is_refused_with_allowed_signers_and_marked_without
//! - notify_cites_the_scope_statement_and_signs_its_packs
//! - export_signs_the_file_beside_it

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use base64::Engine;
use sha2::Digest;

use crate::support::cli::{kvtrail, s};
use crate::support::reseal::reseal_evidence;
use crate::support::trace_builder::TraceBuilder;

const ID: &str = "responder@example";
const STATEMENT: &str = "statement.intoto.jsonl";

/// A stock ssh-keygen ed25519 key and an allowed_signers file naming it
/// as [`ID`].
pub(crate) fn keygen(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    crate::support::keys::keygen(dir, name, ID)
}

/// Tenant acme writes pool 1 (decode); globex reads it.
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

fn b64() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::STANDARD
}

/// One SSH wire string off the front of `b`.
fn ssh_string<'a>(b: &mut &'a [u8]) -> &'a [u8] {
    let n = u32::from_be_bytes(b[..4].try_into().unwrap()) as usize;
    let s = &b[4..4 + n];
    *b = &b[4 + n..];
    s
}

/// The independent DSSE check: parses the envelope line, rebuilds the PAE
/// from the specification (`DSSEv1 SP len(type) SP type SP len(body) SP
/// body`), verifies the ed25519 signature with ed25519-dalek against the
/// raw key parsed from the OpenSSH `.pub` file, checks the keyid as
/// OpenSSH prints a fingerprint (`SHA256:` + unpadded base64 of the sha256
/// of the key blob), and every subject's sha256 against the folder, with
/// every file of the folder listed. Returns the statement.
fn independent_check(folder: &Path, public_file: &Path) -> serde_json::Value {
    let line = std::fs::read_to_string(folder.join(STATEMENT)).unwrap();
    assert_eq!(line.lines().count(), 1, "{line}");
    let env: serde_json::Value = serde_json::from_str(line.trim_end()).unwrap();
    let ptype = env["payloadType"].as_str().unwrap();
    assert_eq!(ptype, "application/vnd.in-toto+json");
    let body = b64().decode(env["payload"].as_str().unwrap()).unwrap();
    let mut pae = format!("DSSEv1 {} {} {} ", ptype.len(), ptype, body.len()).into_bytes();
    pae.extend_from_slice(&body);
    // The public key, from ssh-keygen's own .pub file.
    let public = std::fs::read_to_string(public_file).unwrap();
    let blob = b64()
        .decode(public.split_whitespace().nth(1).unwrap())
        .unwrap();
    let mut rest = blob.as_slice();
    assert_eq!(ssh_string(&mut rest), b"ssh-ed25519");
    let raw: [u8; 32] = ssh_string(&mut rest).try_into().unwrap();
    let vk = ed25519_dalek::VerifyingKey::from_bytes(&raw).unwrap();
    let fp = format!(
        "SHA256:{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(sha2::Sha256::digest(&blob))
    );
    let sigs = env["signatures"].as_array().unwrap();
    assert_eq!(sigs.len(), 1);
    assert_eq!(sigs[0]["keyid"].as_str().unwrap(), fp);
    let sig = b64().decode(sigs[0]["sig"].as_str().unwrap()).unwrap();
    let sig = ed25519_dalek::Signature::from_slice(&sig).unwrap();
    vk.verify_strict(&pae, &sig)
        .expect("the DSSE signature verifies independently");
    // Tampering with one byte of the payload breaks it.
    let mut bad = pae.clone();
    *bad.last_mut().unwrap() ^= 1;
    assert!(vk.verify_strict(&bad, &sig).is_err());
    let st: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(st["_type"], "https://in-toto.io/Statement/v1");
    assert!(st["predicateType"].as_str().unwrap().contains("kvtrail"));
    let mut listed: Vec<String> = Vec::new();
    for sub in st["subject"].as_array().unwrap() {
        let name = sub["name"].as_str().unwrap();
        let bytes = std::fs::read(folder.join(name)).unwrap();
        let want = format!("{:x}", sha2::Sha256::digest(&bytes));
        assert_eq!(sub["digest"]["sha256"].as_str().unwrap(), want, "{name}");
        listed.push(name.to_string());
    }
    let mut on_disk: Vec<String> = std::fs::read_dir(folder)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != STATEMENT)
        .collect();
    on_disk.sort();
    listed.sort();
    assert_eq!(listed, on_disk);
    st
}

/// A signed scope folder of `t` (with `pools` a shard).
fn signed_scope(t: &Path, out: &Path, key: &Path, pools: Option<&str>) -> PathBuf {
    let mut args = vec!["scope", s(t), "--out", s(out), "--signing-key", s(key)];
    if let Some(p) = pools {
        args.extend(["--pools", p]);
    }
    kvtrail(&args).run().ok();
    out.to_path_buf()
}

#[test]
fn signed_scope_folder_passes_an_independent_dsse_check() {
    let dir = tempfile::tempdir().unwrap();
    let (key, _) = keygen(dir.path(), "k");
    let t = decode_leak().record(&dir.path().join("t"));
    let out = signed_scope(&t, &dir.path().join("scope"), &key, None);
    let st = independent_check(&out, &key.with_extension("pub"));
    let p = &st["predicate"];
    assert_eq!(p["command"], "scope");
    assert_eq!(p["version"], env!("CARGO_PKG_VERSION"));
    assert!(
        p["argv"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "--signing-key")
    );
    assert_eq!(p["inputs"][0]["kind"], "trace");
    let tj = std::fs::read(t.join("trace.json")).unwrap();
    assert_eq!(
        p["inputs"][0]["digest"]["sha256"].as_str().unwrap(),
        format!("{:x}", sha2::Sha256::digest(&tj))
    );
    assert!(p["backend"].as_str().unwrap().contains("cpu"), "{p}");
    assert!(p["threads"].is_u64());
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    let verdict = p["verdict"].as_str().unwrap();
    assert!(!verdict.contains('\n'));
    assert_eq!(
        verdict,
        summary["verdict"]
            .as_str()
            .unwrap()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    );
    // The key is owner-only and never written into the folder.
    let secret = std::fs::read_to_string(&key).unwrap();
    let inner: String = secret.lines().filter(|l| !l.starts_with("-----")).collect();
    for e in std::fs::read_dir(&out).unwrap() {
        let text = String::from_utf8_lossy(&std::fs::read(e.unwrap().path()).unwrap()).into_owned();
        assert!(!text.contains(&inner[..40]));
    }
    // A sealed trace: the statement names its last seal.
    let sealed = dir.path().join("sealed");
    kvtrail([
        "simulate",
        "--scenario",
        "incident",
        "--out",
        s(&sealed),
        "--signing-key",
        s(&key),
    ])
    .run()
    .ok();
    assert!(sealed.join("seals").is_dir());
    {
        let o = signed_scope(&sealed, &dir.path().join("sealed-scope"), &key, None);
        let st = independent_check(&o, &key.with_extension("pub"));
        let seal = &st["predicate"]["inputs"][0]["last_seal"];
        let name = seal["name"].as_str().unwrap();
        let bytes = std::fs::read(sealed.join(name)).unwrap();
        assert_eq!(
            seal["sha256"].as_str().unwrap(),
            format!("{:x}", sha2::Sha256::digest(&bytes))
        );
    }
}

/// The one envelope of a folder's statement, decoded.
fn envelope(folder: &Path) -> (serde_json::Value, serde_json::Value) {
    let line = std::fs::read_to_string(folder.join(STATEMENT)).unwrap();
    let env: serde_json::Value = serde_json::from_str(line.trim_end()).unwrap();
    let body = b64().decode(env["payload"].as_str().unwrap()).unwrap();
    (env, serde_json::from_slice(&body).unwrap())
}

fn put_envelope(folder: &Path, env: &serde_json::Value) {
    let p = folder.join(STATEMENT);
    std::fs::write(&p, format!("{}\n", serde_json::to_string(env).unwrap())).unwrap();
}

/// A copy of a folder (files only, one level deep).
fn copy_folder(from: &Path, to: &Path) -> PathBuf {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    to.to_path_buf()
}

#[test]
fn verify_prints_the_signer_and_fails_forged_statements() {
    let dir = tempfile::tempdir().unwrap();
    let (key, allowed) = keygen(dir.path(), "k");
    let (other_key, other_allowed) = keygen(dir.path(), "other");
    let t = decode_leak().record(&dir.path().join("t"));
    let good = signed_scope(&t, &dir.path().join("good"), &key, None);
    let o = kvtrail(["verify", s(&good), "--allowed-signers", s(&allowed)]).run();
    let out = o.ok();
    assert!(out.contains("SIGNED") && out.contains(ID), "{out}");
    let o = kvtrail(["verify", s(&good)]).run();
    assert!(o.ok().contains("signer not checked"), "{}", o.stdout);
    // Signed by a key the allowed signers do not name.
    let o = kvtrail(["verify", s(&good), "--allowed-signers", s(&other_allowed)]).run();
    assert_eq!(o.code, 1, "{}", o.stdout);
    assert!(o.stdout.contains("do not name"), "{}", o.stdout);

    let case = |name: &str, edit: &dyn Fn(&Path), want: &str| {
        let f = copy_folder(&good, &dir.path().join(name));
        edit(&f);
        let o = kvtrail(["verify", s(&f), "--allowed-signers", s(&allowed)]).run();
        assert_eq!(o.code, 1, "{name}: {}{}", o.stdout, o.stderr);
        assert!(o.stdout.contains(want), "{name}: {}", o.stdout);
        assert!(o.stdout.contains("FAILED"), "{name}: {}", o.stdout);
    };
    // A file edited, and evidence.json recomputed over it.
    case(
        "edited",
        &|f| {
            let p = f.join("responses.csv");
            let mut b = std::fs::read(&p).unwrap();
            b.truncate(b.len() / 2);
            std::fs::write(&p, b).unwrap();
            reseal_evidence(f);
        },
        "responses.csv: sha256 differs from the statement",
    );
    // The statement's verdict edited, the signature kept.
    case(
        "payload",
        &|f| {
            let (mut env, mut st) = envelope(f);
            st["predicate"]["verdict"] = "no exposure found; the evidence is complete".into();
            env["payload"] = b64().encode(serde_json::to_vec(&st).unwrap()).into();
            put_envelope(f, &env);
        },
        "altered after signing",
    );
    // A statement whose subjects omit a file (signed by the right key over
    // the folder without it, then put back beside the file).
    case(
        "omitted",
        &|f| {
            let tmp = copy_folder(f, &dir.path().join("omit-src"));
            std::fs::remove_file(tmp.join("responses.csv")).unwrap();
            std::fs::remove_file(tmp.join(STATEMENT)).unwrap();
            let k = kvtrail::custody::keys::SigningKey::load(&key).unwrap();
            let p = kvtrail::custody::statement::Predicate::new("scope", &[]);
            kvtrail::custody::statement::sign_folder(&tmp, &k, p).unwrap();
            std::fs::copy(tmp.join(STATEMENT), f.join(STATEMENT)).unwrap();
        },
        "responses.csv: in the folder, not listed in the statement",
    );
    // The signature stripped.
    case(
        "unsigned",
        &|f| {
            let (mut env, _) = envelope(f);
            env["signatures"] = serde_json::json!([]);
            put_envelope(f, &env);
        },
        "unsigned",
    );
    // Replayed: another folder's statement (a shard of the same trace).
    let shard = signed_scope(&t, &dir.path().join("shard"), &key, Some("1"));
    case(
        "replayed",
        &|f| {
            std::fs::copy(shard.join(STATEMENT), f.join(STATEMENT)).unwrap();
        },
        "differs from the statement",
    );
    // A second envelope appended.
    case(
        "appended",
        &|f| {
            let p = f.join(STATEMENT);
            let mut t = std::fs::read_to_string(&p).unwrap();
            t.push_str(&std::fs::read_to_string(shard.join(STATEMENT)).unwrap());
            std::fs::write(&p, t).unwrap();
        },
        "envelopes where kvtrail writes one",
    );
    // The statement removed: fails only where a signature is required.
    let resigned = dir.path().join("resigned");
    copy_folder(&good, &resigned);
    std::fs::remove_file(resigned.join(STATEMENT)).unwrap();
    let o = kvtrail(["verify", s(&resigned)]).run();
    o.ok();
    let o = kvtrail([
        "verify",
        s(&resigned),
        "--allowed-signers",
        s(&allowed),
        "--require-signature",
    ])
    .run();
    assert_eq!(o.code, 1, "{}", o.stdout);
    assert!(o.stdout.contains("not signed"), "{}", o.stdout);
    // The same folder signed by another key through kvtrail: unknown.
    let by_other = signed_scope(&t, &dir.path().join("by-other"), &other_key, None);
    let o = kvtrail(["verify", s(&by_other), "--allowed-signers", s(&allowed)]).run();
    assert_eq!(o.code, 1, "{}", o.stdout);
    assert!(o.stdout.contains("do not name"), "{}", o.stdout);
    // A file added beside the statement.
    case(
        "added",
        &|f| std::fs::write(f.join("extra.txt"), "x").unwrap(),
        "extra.txt: in the folder, not listed in the statement",
    );
}

/// An edit of a folder copy.
type Edit = Box<dyn Fn(&Path)>;

#[test]
fn statements_that_cannot_be_read_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let (key, allowed) = keygen(dir.path(), "k");
    let t = decode_leak().record(&dir.path().join("t"));
    let good = signed_scope(&t, &dir.path().join("good"), &key, None);
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "garbage",
            Box::new(|f: &Path| std::fs::write(f.join(STATEMENT), "not json\n").unwrap()),
            "not a DSSE envelope",
        ),
        (
            "empty",
            Box::new(|f: &Path| std::fs::write(f.join(STATEMENT), "").unwrap()),
            "no DSSE envelope",
        ),
        (
            "payload type",
            Box::new(|f: &Path| {
                let (mut env, _) = envelope(f);
                env["payloadType"] = "text/plain".into();
                put_envelope(f, &env);
            }),
            "payloadType",
        ),
        (
            "payload not base64",
            Box::new(|f: &Path| {
                let (mut env, _) = envelope(f);
                env["payload"] = "%%%".into();
                put_envelope(f, &env);
            }),
            "not base64",
        ),
        (
            "ecdsa signer",
            Box::new(|f: &Path| {
                let (mut env, mut st) = envelope(f);
                let k = f.parent().unwrap().join("ecdsa-signer-key");
                let ok = Command::new("ssh-keygen")
                    .args(["-q", "-t", "ecdsa", "-N", "", "-f"])
                    .arg(&k)
                    .status()
                    .unwrap();
                assert!(ok.success());
                let public = std::fs::read_to_string(k.with_extension("pub")).unwrap();
                st["predicate"]["signer"]["public_key"] = public.trim().into();
                env["payload"] = b64().encode(serde_json::to_vec(&st).unwrap()).into();
                put_envelope(f, &env);
            }),
            "ed25519 only",
        ),
    ];
    for (name, edit, want) in cases {
        let f = copy_folder(&good, &dir.path().join(name.replace(' ', "-")));
        edit(&f);
        let o = kvtrail(["verify", s(&f), "--allowed-signers", s(&allowed)]).run();
        assert_eq!(o.code, 2, "{name}: {}{}", o.stdout, o.stderr);
        assert!(o.stderr.contains(want), "{name}: {}", o.stderr);
        assert!(
            o.stderr.contains("statement.intoto.jsonl"),
            "{name}: {}",
            o.stderr
        );
    }
}

#[test]
fn unsafe_or_non_ed25519_keys_are_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let (key, _) = keygen(dir.path(), "k");
    let t = decode_leak().record(&dir.path().join("t"));
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o640)).unwrap();
    let out = dir.path().join("o1");
    let err = kvtrail(["scope", s(&t), "--out", s(&out), "--signing-key", s(&key)])
        .run()
        .refused("readable by others");
    assert!(!err.contains("PRIVATE KEY"), "{err}");
    assert!(!out.exists());
    let ecdsa = dir.path().join("ecdsa");
    let st = Command::new("ssh-keygen")
        .args(["-q", "-t", "ecdsa", "-N", "", "-f"])
        .arg(&ecdsa)
        .status()
        .unwrap();
    assert!(st.success());
    let out = dir.path().join("o2");
    kvtrail(["scope", s(&t), "--out", s(&out), "--signing-key", s(&ecdsa)])
        .run()
        .refused("ed25519");
    assert!(!out.exists());
    let junk = dir.path().join("junk");
    std::fs::write(&junk, "-----BEGIN OPENSSH PRIVATE KEY-----\nAAAA\n").unwrap();
    std::fs::set_permissions(&junk, std::fs::Permissions::from_mode(0o600)).unwrap();
    kvtrail(["scope", s(&t), "--out", s(&out), "--signing-key", s(&junk)])
        .run()
        .refused("not an OpenSSH private key");
    assert!(!out.exists());
}

fn merge(parts: &[&Path], out: &Path, extra: &[&str]) -> crate::support::cli::Ran {
    let mut args = vec!["merge".to_string()];
    args.extend(parts.iter().map(|p| s(p).to_string()));
    args.extend(["--out".to_string(), s(out).to_string()]);
    args.extend(extra.iter().map(|a| a.to_string()));
    kvtrail(&args).run()
}

#[test]
fn forged_shard_is_refused_with_allowed_signers_and_marked_without() {
    let dir = tempfile::tempdir().unwrap();
    let (key, allowed) = keygen(dir.path(), "k");
    let (other_key, _) = keygen(dir.path(), "other");
    let t = decode_leak().record(&dir.path().join("t"));
    let s0 = signed_scope(&t, &dir.path().join("s0"), &key, Some("0"));
    let s1 = signed_scope(&t, &dir.path().join("s1"), &key, Some("1"));
    // Authenticated: merged, no marking, and signed in turn.
    let m = dir.path().join("m");
    let o = merge(
        &[&s0, &s1],
        &m,
        &["--allowed-signers", s(&allowed), "--signing-key", s(&key)],
    );
    o.ok();
    assert!(o.stderr.contains(ID), "{}", o.stderr);
    let sum: serde_json::Value =
        serde_json::from_slice(&std::fs::read(m.join("summary.json")).unwrap()).unwrap();
    assert!(sum["coverage"].get("shards_not_authenticated").is_none());
    let st = independent_check(&m, &key.with_extension("pub"));
    let inputs = st["predicate"]["inputs"].as_array().unwrap();
    assert_eq!(inputs.len(), 2);
    for (i, sh) in [&s0, &s1].iter().enumerate() {
        let bytes = std::fs::read(sh.join(STATEMENT)).unwrap();
        assert_eq!(
            inputs[i]["statement"]["sha256"].as_str().unwrap(),
            format!("{:x}", sha2::Sha256::digest(&bytes))
        );
    }
    kvtrail(["verify", s(&m), "--allowed-signers", s(&allowed)])
        .run()
        .ok();

    // The forged shard: its findings emptied, evidence.json recomputed.
    let forged = copy_folder(&s1, &dir.path().join("forged"));
    let p = forged.join("summary.json");
    let mut f: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    f["affected_responses"] = serde_json::json!([]);
    f["recipients"] = serde_json::json!([]);
    f["sources"] = serde_json::json!([]);
    std::fs::write(&p, serde_json::to_string_pretty(&f).unwrap()).unwrap();
    reseal_evidence(&forged);
    let err = merge(
        &[&s0, &forged],
        &dir.path().join("m2"),
        &["--allowed-signers", s(&allowed)],
    )
    .refused("not authenticated");
    assert!(
        err.contains("forged") && err.contains("summary.json"),
        "{err}"
    );
    assert!(!dir.path().join("m2").exists());
    // Its statement removed, or the folder re-signed with another key.
    let bare = copy_folder(&forged, &dir.path().join("bare"));
    std::fs::remove_file(bare.join(STATEMENT)).unwrap();
    let err = merge(
        &[&s0, &bare],
        &dir.path().join("m3"),
        &["--allowed-signers", s(&allowed)],
    )
    .refused("no signed statement");
    assert!(err.contains("bare"), "{err}");
    let other = signed_scope(&t, &dir.path().join("other-signed"), &other_key, Some("1"));
    let err = merge(
        &[&s0, &other],
        &dir.path().join("m4"),
        &["--allowed-signers", s(&allowed)],
    )
    .refused("do not name");
    assert!(err.contains("other-signed"), "{err}");

    // Without --allowed-signers: merged, and marked.
    let m5 = dir.path().join("m5");
    let o = merge(&[&s0, &s1], &m5, &[]);
    o.ok();
    assert!(
        o.stderr.contains("shards not authenticated"),
        "{}",
        o.stderr
    );
    let sum: serde_json::Value =
        serde_json::from_slice(&std::fs::read(m5.join("summary.json")).unwrap()).unwrap();
    assert_eq!(sum["coverage"]["shards_not_authenticated"], true, "{sum}");
    assert_eq!(sum["coverage"]["complete"], false, "{sum}");
    let verdict = sum["verdict"].as_str().unwrap();
    assert!(verdict.starts_with("shards not authenticated"), "{verdict}");
    assert!(!verdict.contains("evidence is complete"), "{verdict}");
    let html = std::fs::read_to_string(m5.join("report.html")).unwrap();
    assert!(html.contains("shards not authenticated"));
    assert!(
        o.stdout.contains("shards not authenticated"),
        "{}",
        o.stdout
    );
    let packs = dir.path().join("packs");
    kvtrail(["notify", s(&m5), "--out", s(&packs)]).run().ok();
    let letters: String = walk(&packs)
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect();
    assert!(letters.contains("shards not authenticated"));
    // The forged shard merged without --allowed-signers is marked too:
    // never "no exposure found; the evidence is complete".
    let m6 = dir.path().join("m6");
    merge(&[&s0, &forged], &m6, &[]).ok();
    let sum: serde_json::Value =
        serde_json::from_slice(&std::fs::read(m6.join("summary.json")).unwrap()).unwrap();
    assert!(
        !sum["verdict"]
            .as_str()
            .unwrap()
            .contains("evidence is complete")
    );
}

/// Every file under `dir`.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}

#[test]
fn notify_cites_the_scope_statement_and_signs_its_packs() {
    let dir = tempfile::tempdir().unwrap();
    let (key, allowed) = keygen(dir.path(), "k");
    let t = decode_leak().record(&dir.path().join("t"));
    let scope = signed_scope(&t, &dir.path().join("scope"), &key, None);
    let sha = format!(
        "{:x}",
        sha2::Sha256::digest(std::fs::read(scope.join(STATEMENT)).unwrap())
    );
    let packs = dir.path().join("packs");
    kvtrail([
        "notify",
        s(&scope),
        "--out",
        s(&packs),
        "--signing-key",
        s(&key),
    ])
    .run()
    .ok();
    let files = walk(&packs);
    let notices: Vec<&PathBuf> = files
        .iter()
        .filter(|p| p.file_name().is_some_and(|n| n == "notice.json"))
        .collect();
    assert!(!notices.is_empty());
    for n in notices {
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(n).unwrap()).unwrap();
        assert_eq!(v["evidence"]["scope_statement_sha256"], sha.as_str(), "{v}");
    }
    let register = std::fs::read_to_string(packs.join("register.md")).unwrap();
    assert!(register.contains(&sha), "{register}");
    let letter = files
        .iter()
        .find(|p| p.file_name().is_some_and(|n| n == "letter.md"))
        .unwrap();
    assert!(std::fs::read_to_string(letter).unwrap().contains(&sha));
    let st = {
        let line = std::fs::read_to_string(packs.join(STATEMENT)).unwrap();
        let env: serde_json::Value = serde_json::from_str(line.trim_end()).unwrap();
        let body = b64().decode(env["payload"].as_str().unwrap()).unwrap();
        serde_json::from_slice::<serde_json::Value>(&body).unwrap()
    };
    assert_eq!(st["predicate"]["command"], "notify");
    assert_eq!(
        st["predicate"]["inputs"][0]["statement"]["sha256"],
        sha.as_str()
    );
    let o = kvtrail(["verify", s(&packs), "--allowed-signers", s(&allowed)]).run();
    assert!(o.ok().contains("SIGNED"), "{}", o.stdout);
    // A scope folder whose statement fails is refused: the chain is broken.
    let bad = copy_folder(&scope, &dir.path().join("bad"));
    let (mut env, _) = envelope(&bad);
    env["signatures"][0]["sig"] = b64().encode([0u8; 64]).into();
    put_envelope(&bad, &env);
    kvtrail(["notify", s(&bad), "--out", s(&dir.path().join("p2"))])
        .run()
        .refused("signed statement does not hold");
    // An unsigned scope folder: the packs do not name a statement.
    let plain = dir.path().join("plain");
    kvtrail(["scope", s(&t), "--out", s(&plain)]).run().ok();
    let p3 = dir.path().join("p3");
    kvtrail(["notify", s(&plain), "--out", s(&p3)]).run().ok();
    let reg = std::fs::read_to_string(p3.join("register.json")).unwrap();
    assert!(!reg.contains("scope_statement_sha256"));
}

#[test]
fn export_signs_the_file_beside_it() {
    let dir = tempfile::tempdir().unwrap();
    let (key, allowed) = keygen(dir.path(), "k");
    let t = decode_leak().record(&dir.path().join("t"));
    let scope = signed_scope(&t, &dir.path().join("scope"), &key, None);
    let out = dir.path().join("findings.ocsf.jsonl");
    kvtrail([
        "export",
        s(&scope),
        "--format",
        "ocsf",
        "--out",
        s(&out),
        "--signing-key",
        s(&key),
    ])
    .run()
    .ok();
    let st = dir.path().join("findings.ocsf.jsonl.intoto.jsonl");
    let o = kvtrail(["verify", s(&st), "--allowed-signers", s(&allowed)]).run();
    assert!(o.ok().contains("SIGNED"), "{}", o.stdout);
    let mut b = std::fs::read(&out).unwrap();
    b.extend_from_slice(b"{}\n");
    std::fs::write(&out, b).unwrap();
    let o = kvtrail(["verify", s(&st), "--allowed-signers", s(&allowed)]).run();
    assert_eq!(o.code, 1, "{}", o.stdout);
    assert!(o.stdout.contains("findings.ocsf.jsonl: sha256 differs"));
    // Again without --force: refused, the statement untouched.
    kvtrail([
        "export",
        s(&scope),
        "--format",
        "ocsf",
        "--out",
        s(&out),
        "--signing-key",
        s(&key),
    ])
    .run()
    .refused("already exists");
}
