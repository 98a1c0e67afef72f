//! The whole chain of custody, end to end, as a responder and then a
//! stranger run it: a trace sealed as it is made (the shipped JSON-lines
//! incident through `ingest`, simulated incidents of both engine models
//! through `simulate`), checked with its signer; a signed scope folder,
//! checked; `verify --reproduce` re-running the verdict; signed letters
//! naming the scope folder's statement; and every link refused once an
//! attacker who holds no key edits the evidence under it and recomputes
//! every unsigned digest (trace.json, evidence.json). The demo's own trace
//! (traces/incident-mini, unsealed) reproduces too.
//!
//! Index:
//! - the_shipped_incident_is_sealed_signed_and_reproduced
//! - simulated_incidents_of_both_engines_carry_the_chain
//! - the_demo_trace_reproduces
//! - an_edited_trace_breaks_every_link_above_it

use std::path::{Path, PathBuf};

use sha2::Digest;

use crate::support::cli::{kvtrail, s};
use crate::support::reseal::reseal_trace;

const ID: &str = "responder@example";
const STATEMENT: &str = "statement.intoto.jsonl";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn sha256(p: &Path) -> String {
    format!("{:x}", sha2::Sha256::digest(std::fs::read(p).unwrap()))
}

fn json(p: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

/// Every link above a sealed trace `t`: its seals with their signer, a
/// signed scope folder that reproduces, signed letters citing it. Returns
/// the scope folder and its summary.
fn chain(t: &Path, key: &Path, allowed: &Path, work: &Path) -> (PathBuf, serde_json::Value) {
    // The seals, with the signer named.
    let v = kvtrail(["verify", s(t), "--allowed-signers", s(allowed), "--json"]).run();
    let vj: serde_json::Value = serde_json::from_str(&v.stdout).unwrap_or_else(|e| {
        panic!("verify --json: {e}\n{}\n{}", v.stdout, v.stderr);
    });
    assert_eq!(vj["seals"]["ok"], true, "{vj}");
    assert_eq!(vj["seals"]["final_seal"], true, "{vj}");
    assert!(
        vj["seals"]["signers"][0].as_str().unwrap().starts_with(ID),
        "{vj}"
    );

    // A signed scope folder: its statement holds and names the last seal.
    let scope = work.join("scope");
    kvtrail(["scope", s(t), "--out", s(&scope), "--signing-key", s(key)])
        .expect(&[0])
        .run();
    let o = kvtrail(["verify", s(&scope), "--allowed-signers", s(allowed)]).run();
    let text = o.ok();
    assert!(text.contains("SIGNED"), "{text}");
    assert!(text.contains(ID), "{text}");
    let env: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(scope.join(STATEMENT))
            .unwrap()
            .trim_end(),
    )
    .unwrap();
    use base64::Engine as _;
    let body = base64::engine::general_purpose::STANDARD
        .decode(env["payload"].as_str().unwrap())
        .unwrap();
    let st: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let last_seal = &st["predicate"]["inputs"][0]["last_seal"];
    let name = last_seal["name"]
        .as_str()
        .expect("a sealed input names its last seal");
    assert_eq!(last_seal["sha256"], sha256(&t.join(name)).as_str());

    // A stranger re-runs the verdict from the recorded input.
    let r = kvtrail(["verify", s(&scope), "--reproduce"]).run();
    let text = r.ok();
    assert!(text.starts_with("OK: reproduced"), "{text}");

    // The letters name the scope folder's statement, and are signed.
    let summary = json(&scope.join("summary.json"));
    let packs = work.join("packs");
    kvtrail([
        "notify",
        s(&scope),
        "--out",
        s(&packs),
        "--signing-key",
        s(key),
    ])
    .expect(&[0])
    .run();
    let scope_sha = sha256(&scope.join(STATEMENT));
    let register = std::fs::read_to_string(packs.join("register.json")).unwrap();
    if !summary["affected_responses"].as_array().unwrap().is_empty() {
        assert!(register.contains(&scope_sha), "{register}");
    }
    let o = kvtrail(["verify", s(&packs), "--allowed-signers", s(allowed)]).run();
    assert!(o.ok().contains("SIGNED"), "{}", o.stdout);
    (scope, summary)
}

/// `kvtrail simulate` of `scenario` into `dir/trace`, sealed with `key`.
fn sealed_simulation(dir: &Path, key: &Path, scenario: &str, requests: &str) -> PathBuf {
    let t = dir.join("trace");
    kvtrail(["simulate", "--scenario", scenario, "--requests", requests])
        .args(["--out", s(&t), "--signing-key", s(key)])
        .expect(&[0])
        .run();
    t
}

#[test]
fn the_shipped_incident_is_sealed_signed_and_reproduced() {
    let d = tempfile::tempdir().unwrap();
    let (key, allowed) = crate::support::keys::keygen(d.path(), "key", ID);
    let t = d.path().join("incident");
    let o = kvtrail([
        "ingest",
        s(&root().join("tests/data/jsonl/incident.jsonl")),
        "--deployment",
        s(&root().join("tests/data/jsonl/deploy.json")),
        "--out",
        s(&t),
        "--signing-key",
        s(&key),
    ])
    .run();
    o.ok();
    let (_scope, summary) = chain(&t, &key, &allowed, d.path());
    // The shipped incident: request 2 (globex) read acme's KV, and a lost
    // decode event keeps the evidence from being complete.
    assert!(
        !summary["affected_responses"].as_array().unwrap().is_empty(),
        "{summary}"
    );
    let verdict = summary["verdict"].as_str().unwrap();
    assert!(!verdict.contains("no exposure"), "{verdict}");
}

#[test]
fn simulated_incidents_of_both_engines_carry_the_chain() {
    for scenario in ["incident", "vllm-stale-reference"] {
        let d = tempfile::tempdir().unwrap();
        let (key, allowed) = crate::support::keys::keygen(d.path(), "key", ID);
        let t = sealed_simulation(d.path(), &key, scenario, "400");
        let (_scope, summary) = chain(&t, &key, &allowed, d.path());
        assert!(
            !summary["affected_responses"].as_array().unwrap().is_empty(),
            "{scenario}: {summary}"
        );
    }
}

#[test]
fn the_demo_trace_reproduces() {
    let d = tempfile::tempdir().unwrap();
    let (key, allowed) = crate::support::keys::keygen(d.path(), "key", ID);
    // A copy of the shipped trace, so the folder's relative input holds.
    let t = d.path().join("incident-mini");
    crate::support::files::copy_dir(&root().join("traces/incident-mini"), &t);
    let scope = d.path().join("scope");
    kvtrail(["scope", s(&t), "--out", s(&scope), "--signing-key", s(&key)])
        .expect(&[0])
        .run();
    let o = kvtrail(["verify", s(&scope), "--allowed-signers", s(&allowed)]).run();
    assert!(o.ok().contains("SIGNED"), "{}", o.stdout);
    let r = kvtrail(["verify", s(&scope), "--reproduce"]).run();
    assert!(r.ok().starts_with("OK: reproduced"), "{}", r.stdout);
}

#[test]
fn an_edited_trace_breaks_every_link_above_it() {
    let d = tempfile::tempdir().unwrap();
    let (key, allowed) = crate::support::keys::keygen(d.path(), "key", ID);
    let t = sealed_simulation(d.path(), &key, "incident", "300");
    let scope = d.path().join("scope");
    kvtrail(["scope", s(&t), "--out", s(&scope), "--signing-key", s(&key)])
        .expect(&[0])
        .run();
    // The attacker, holding no key, removes the kv file that holds the
    // leak's reads and recomputes trace.json over what is left.
    let kv = crate::support::files::paths(&t.join("kv"));
    let biggest = kv
        .iter()
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .expect("kv files")
        .clone();
    std::fs::remove_file(&biggest).unwrap();
    reseal_trace(&t);
    // The trace's own digests agree again; its seals do not.
    let v = kvtrail(["verify", s(&t), "--allowed-signers", s(&allowed)]).run();
    assert_eq!(v.code, 1, "{}{}", v.stdout, v.stderr);
    assert!(v.stdout.contains("FAIL seal"), "{}", v.stdout);
    // The scope folder's inputs no longer match what it recorded.
    let f = kvtrail(["verify", s(&scope), "--allowed-signers", s(&allowed)]).run();
    assert_eq!(f.code, 1, "{}{}", f.stdout, f.stderr);
    // And a reproduction names the input, not a byte of some output.
    let r = kvtrail(["verify", s(&scope), "--reproduce"]).run();
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stdout.contains("recorded input has changed"),
        "{}",
        r.stdout
    );
}
