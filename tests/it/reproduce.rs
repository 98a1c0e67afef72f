//! `kvtrail verify SCOPE_DIR --reproduce`: a scope folder (and a merged
//! one) re-run from the inputs its evidence.json records is the same, byte
//! for byte; a folder whose findings were edited and whose evidence.json
//! was recomputed (so that `verify` alone passes it) fails, naming the
//! file; with `--signing-key --out FILE` the reproduction is signed.
//!
//! Index:
//! - an_untouched_folder_reproduces_and_the_reproduction_is_signed
//! - a_tampered_output_fails_naming_the_first_difference
//! - a_merged_folder_reproduces_from_its_shards
//! - what_cannot_be_reproduced_exits_2
//! - a_folder_of_a_trace_in_s3_reproduces_from_the_bucket

use std::path::Path;

use crate::support::cli::{kvtrail, s};
use crate::support::reseal::reseal_evidence;
use crate::support::trace_builder::TraceBuilder;

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

/// The files of a folder with their bytes.
fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn an_untouched_folder_reproduces_and_the_reproduction_is_signed() {
    let dir = tempfile::tempdir().unwrap();
    let (key, allowed) = crate::statements::keygen(dir.path(), "k");
    let t = decode_leak().record(&dir.path().join("t"));
    let out = dir.path().join("scope");
    kvtrail([
        "scope",
        s(&t),
        "--out",
        s(&out),
        "--backend",
        "cpu",
        "--threads",
        "2",
        "--signing-key",
        s(&key),
    ])
    .run()
    .ok();
    let before = snapshot(&out);
    let o = kvtrail(["verify", s(&out), "--reproduce"]).run();
    let stdout = o.ok();
    assert!(stdout.contains("OK: reproduced"), "{stdout}");
    // Nothing is left beside the folder, and the folder is untouched.
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["k", "k.allowed", "k.pub", "scope", "t"]);
    assert_eq!(snapshot(&out), before);
    // Moved elsewhere with its trace, it still reproduces (paths are
    // relative to the folder).
    let moved = dir.path().join("elsewhere");
    std::fs::create_dir(&moved).unwrap();
    std::fs::rename(&t, moved.join("t")).unwrap();
    std::fs::rename(&out, moved.join("scope")).unwrap();
    let out = moved.join("scope");
    let st = dir.path().join("reproduced.intoto.jsonl");
    let o = kvtrail([
        "verify",
        s(&out),
        "--reproduce",
        "--json",
        "--signing-key",
        s(&key),
        "--out",
        s(&st),
    ])
    .run();
    o.ok();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout_bytes).unwrap();
    assert_eq!(v["ok"], true, "{v}");
    assert!(v["first_difference"].is_null(), "{v}");
    assert!(v["identical"].as_u64().unwrap() >= 10, "{v}");
    // The reproduction's statement lists the folder's files (beside the
    // folder, so verified from a copy of it in the folder's place).
    let copy = dir.path().join("copy");
    std::fs::create_dir(&copy).unwrap();
    for (name, bytes) in snapshot(&out) {
        if name != "statement.intoto.jsonl" {
            std::fs::write(copy.join(&name), bytes).unwrap();
        }
    }
    std::fs::copy(&st, copy.join("x.intoto.jsonl")).unwrap();
    let o = kvtrail([
        "verify",
        s(&copy.join("x.intoto.jsonl")),
        "--allowed-signers",
        s(&allowed),
    ])
    .run();
    assert!(o.ok().contains("SIGNED"), "{}", o.stdout);
}

#[test]
fn a_tampered_output_fails_naming_the_first_difference() {
    let dir = tempfile::tempdir().unwrap();
    let t = decode_leak().record(&dir.path().join("t"));
    let out = dir.path().join("scope");
    kvtrail(["scope", s(&t), "--out", s(&out)]).run().ok();
    // The findings emptied, evidence.json recomputed: verify alone passes.
    let p = out.join("responses.csv");
    let text = std::fs::read_to_string(&p).unwrap();
    let header = text.lines().next().unwrap();
    std::fs::write(&p, format!("{header}\n")).unwrap();
    reseal_evidence(&out);
    kvtrail(["verify", s(&out)]).run().ok();
    let o = kvtrail(["verify", s(&out), "--reproduce"]).run();
    assert_eq!(o.code, 1, "{}{}", o.stdout, o.stderr);
    assert!(
        o.stdout
            .contains("NOT reproduced: responses.csv: differs from the re-run at byte"),
        "{}",
        o.stdout
    );
    // A file removed (and evidence.json recomputed without it).
    let out2 = dir.path().join("scope2");
    kvtrail(["scope", s(&t), "--out", s(&out2)]).run().ok();
    std::fs::remove_file(out2.join("timeline.jsonl")).unwrap();
    let p = out2.join("evidence.json");
    let mut ev: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    ev["outputs"]
        .as_array_mut()
        .unwrap()
        .retain(|f| f["path"] != "timeline.jsonl");
    std::fs::write(&p, serde_json::to_string_pretty(&ev).unwrap()).unwrap();
    let o = kvtrail(["verify", s(&out2), "--reproduce"]).run();
    assert_eq!(o.code, 1, "{}{}", o.stdout, o.stderr);
    assert!(
        o.stdout
            .contains("timeline.jsonl: written by the re-run, missing from the folder"),
        "{}",
        o.stdout
    );
}

#[test]
fn a_merged_folder_reproduces_from_its_shards() {
    let dir = tempfile::tempdir().unwrap();
    let t = decode_leak().record(&dir.path().join("t"));
    let mut parts = Vec::new();
    for p in ["0", "1"] {
        let o = dir.path().join(format!("s{p}"));
        kvtrail(["scope", s(&t), "--pools", p, "--out", s(&o)])
            .run()
            .ok();
        parts.push(o);
    }
    let m = dir.path().join("m");
    kvtrail(["merge", s(&parts[0]), s(&parts[1]), "--out", s(&m)])
        .run()
        .ok();
    let o = kvtrail(["verify", s(&m), "--reproduce"]).run();
    assert!(o.ok().contains("OK: reproduced"), "{}", o.stdout);
    // The merged summary edited and resealed: not reproduced.
    let p = m.join("summary.json");
    let mut sum: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    sum["verdict"] = "no exposure found; the evidence is complete".into();
    std::fs::write(&p, serde_json::to_string_pretty(&sum).unwrap()).unwrap();
    reseal_evidence(&m);
    let o = kvtrail(["verify", s(&m), "--reproduce"]).run();
    assert_eq!(o.code, 1, "{}{}", o.stdout, o.stderr);
    assert!(o.stdout.contains("summary.json: differs"), "{}", o.stdout);
}

#[test]
fn what_cannot_be_reproduced_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let t = decode_leak().record(&dir.path().join("t"));
    let out = dir.path().join("scope");
    kvtrail(["scope", s(&t), "--out", s(&out)]).run().ok();
    // The trace is gone.
    let gone = dir.path().join("t-gone");
    std::fs::rename(&t, &gone).unwrap();
    let o = kvtrail(["verify", s(&out), "--reproduce"]).run();
    assert_eq!(o.code, 2, "{}{}", o.stdout, o.stderr);
    std::fs::rename(&gone, &t).unwrap();
    // A notify folder is not re-run.
    let packs = dir.path().join("packs");
    kvtrail(["notify", s(&out), "--out", s(&packs)]).run().ok();
    let o = kvtrail(["verify", s(&packs), "--reproduce"]).run();
    assert_eq!(o.code, 2, "{}{}", o.stdout, o.stderr);
    assert!(o.stderr.contains("only scope folders"), "{}", o.stderr);
    // A recorded command line that is not kvtrail's.
    let p = out.join("evidence.json");
    let mut ev: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    ev["command"] = serde_json::json!(["kvtrail", "frobnicate"]);
    std::fs::write(&p, serde_json::to_string_pretty(&ev).unwrap()).unwrap();
    let o = kvtrail(["verify", s(&out), "--reproduce"]).run();
    assert_eq!(o.code, 2, "{}{}", o.stdout, o.stderr);
    assert!(o.stderr.contains("does not parse"), "{}", o.stderr);
}

/// A scope folder of a trace in S3 (moto, .ci/setup.d/56-moto.sh) records
/// the trace's URL; `verify --reproduce` reads the trace from the bucket
/// again: identical, signed on request; a tampered folder fails naming
/// the file; the trace gone from the bucket cannot be re-run (exit 2).
#[test]
fn a_folder_of_a_trace_in_s3_reproduces_from_the_bucket() {
    use crate::support::objstore::{on_s3, start};
    let dir = tempfile::tempdir().unwrap();
    let (key, allowed) = crate::statements::keygen(dir.path(), "k");
    let t = decode_leak().record(&dir.path().join("t"));
    let spec = dir.path().join("spec.json");
    std::fs::write(
        &spec,
        serde_json::json!({
            "bucket": "traces",
            "uploads": [{"dir": t, "prefix": "leak"}],
        })
        .to_string(),
    )
    .unwrap();
    let server = start(&["s3", s(&spec)]);
    let url = "s3://traces/leak";
    let out = dir.path().join("scope");
    on_s3(
        &server,
        kvtrail([
            "scope",
            url,
            "--out",
            s(&out),
            "--backend",
            "cpu",
            "--signing-key",
            s(&key),
        ]),
    )
    .run()
    .ok();
    let ev: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("evidence.json")).unwrap()).unwrap();
    assert_eq!(ev["inputs"][0]["root"], url, "{ev}");
    // The local copy of the trace is gone: only the bucket has it.
    std::fs::remove_dir_all(&t).unwrap();
    let before = snapshot(&out);
    let st = dir.path().join("reproduced.intoto.jsonl");
    let o = on_s3(
        &server,
        kvtrail([
            "verify",
            s(&out),
            "--reproduce",
            "--json",
            "--signing-key",
            s(&key),
            "--out",
            s(&st),
        ]),
    )
    .run();
    o.ok();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout_bytes).unwrap();
    assert_eq!(v["ok"], true, "{v}");
    assert!(v["identical"].as_u64().unwrap() >= 10, "{v}");
    assert!(o.stderr.contains(url), "{}", o.stderr);
    assert_eq!(snapshot(&out), before);
    assert!(st.is_file());
    // The folder's own statement still holds after the re-run.
    kvtrail(["verify", s(&out), "--allowed-signers", s(&allowed)])
        .run()
        .ok();
    // Findings emptied, evidence.json recomputed: not reproduced.
    let p = out.join("responses.csv");
    let text = std::fs::read_to_string(&p).unwrap();
    let header = text.lines().next().unwrap();
    std::fs::write(&p, format!("{header}\n")).unwrap();
    reseal_evidence(&out);
    let o = on_s3(&server, kvtrail(["verify", s(&out), "--reproduce"])).run();
    assert_eq!(o.code, 1, "{}{}", o.stdout, o.stderr);
    assert!(
        o.stdout.contains("NOT reproduced: responses.csv: differs"),
        "{}",
        o.stdout
    );
    // The recorded URL names a prefix the bucket does not hold.
    let p = out.join("evidence.json");
    let mut ev: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    ev["inputs"][0]["root"] = "s3://traces/gone".into();
    std::fs::write(&p, serde_json::to_string_pretty(&ev).unwrap()).unwrap();
    let o = on_s3(&server, kvtrail(["verify", s(&out), "--reproduce"])).run();
    assert_eq!(o.code, 2, "{}{}", o.stdout, o.stderr);
}
