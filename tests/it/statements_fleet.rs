//! `kvtrail fleet spark --signing-key`: every shard folder in `OUT.shards`
//! gets a signed statement as it comes back from its executor, and the
//! merged folder one of its own citing them; `verify --allowed-signers`
//! accepts each, `merge --allowed-signers` merges the shards into the same
//! summary, `verify --reproduce` re-runs the merge from the shards, and a
//! shard forged after the run (findings emptied,
//! evidence.json recomputed) is refused, by name. On local Spark
//! (`local[2]`, the pyspark of .ci/setup.d/50-sql.sh), as tests/it/fleet_spark.rs.
//!
//! Index:
//! - fleet_spark_signs_every_shard_and_a_forged_one_is_refused

use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine;
use sha2::Digest;

use crate::support::cli::{kvtrail, s};
use crate::support::reseal::reseal_evidence;
use crate::support::trace_builder::TraceBuilder;
use crate::support::venv;

const STATEMENT: &str = "statement.intoto.jsonl";

/// Tenant acme writes pool 1 (decode); globex reads it: two shards.
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

/// The statement a folder's envelope carries, decoded.
fn statement(folder: &Path) -> serde_json::Value {
    let line = std::fs::read_to_string(folder.join(STATEMENT)).unwrap();
    let env: serde_json::Value = serde_json::from_str(line.trim_end()).unwrap();
    assert_eq!(env["payloadType"], "application/vnd.in-toto+json", "{env}");
    let body = base64::engine::general_purpose::STANDARD
        .decode(env["payload"].as_str().unwrap())
        .unwrap();
    serde_json::from_slice(&body).unwrap()
}

fn summary(folder: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(folder.join("summary.json")).unwrap()).unwrap()
}

#[test]
fn fleet_spark_signs_every_shard_and_a_forged_one_is_refused() {
    let Some(py) = venv::SQL.python() else {
        return;
    };
    let submit = py.parent().unwrap().join("spark-submit");
    assert!(submit.is_file(), "run .ci/setup.d/50-sql.sh");
    let dir = tempfile::tempdir().unwrap();
    let (key, allowed) = crate::statements::keygen(dir.path(), "k");
    let (_, other_allowed) = crate::statements::keygen(dir.path(), "other");
    let t = decode_leak().record(&dir.path().join("t"));
    let out = dir.path().join("fleet");
    kvtrail([
        "fleet",
        "spark",
        s(&t),
        "--out",
        s(&out),
        "--master",
        "local[2]",
        "--spark-submit",
        s(&submit),
        "--backend",
        "cpu",
        "--conf",
        "spark.ui.enabled=false",
        "--signing-key",
        s(&key),
    ])
    .env("PYSPARK_PYTHON", &py)
    .env("PYSPARK_DRIVER_PYTHON", &py)
    .timeout(Duration::from_secs(600))
    .run()
    .ok();
    let shards_dir = dir.path().join("fleet.shards");
    let mut shards: Vec<PathBuf> = std::fs::read_dir(&shards_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    shards.sort();
    assert_eq!(shards.len(), 2, "{shards:?}");

    // Every shard is signed by the driver's key and verifies as it lies.
    for sh in &shards {
        let st = statement(sh);
        assert_eq!(st["_type"], "https://in-toto.io/Statement/v1");
        assert_eq!(st["predicate"]["command"], "fleet spark", "{st}");
        let subjects: Vec<&str> = st["subject"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["name"].as_str().unwrap())
            .collect();
        assert!(subjects.contains(&"summary.json"), "{subjects:?}");
        let o = kvtrail(["verify", s(sh), "--allowed-signers", s(&allowed)]).run();
        assert!(o.ok().contains("responder@example"), "{}", o.stdout);
        // Another key's allowed_signers does not name the signer: fails.
        let o = kvtrail(["verify", s(sh), "--allowed-signers", s(&other_allowed)]).run();
        assert_eq!(o.code, 1, "{}{}", o.stdout, o.stderr);
    }
    // The merged folder is signed too and cites each shard's statement.
    kvtrail(["verify", s(&out), "--allowed-signers", s(&allowed)])
        .run()
        .ok();
    let st = statement(&out);
    let inputs = st["predicate"]["inputs"].as_array().unwrap();
    assert_eq!(inputs.len(), 2, "{st}");
    for (i, sh) in shards.iter().enumerate() {
        let bytes = std::fs::read(sh.join(STATEMENT)).unwrap();
        assert_eq!(
            inputs[i]["statement"]["sha256"].as_str().unwrap(),
            format!("{:x}", sha2::Sha256::digest(&bytes)),
            "{st}"
        );
    }
    let merged = summary(&out);
    assert!(merged["coverage"].get("shards_not_authenticated").is_none());
    assert_eq!(merged["affected_responses"].as_array().unwrap().len(), 1);

    // Re-run from its shard folders, the merged folder is the same.
    let o = kvtrail(["verify", s(&out), "--reproduce"]).run();
    assert!(o.ok().contains("OK: reproduced"), "{}", o.stdout);

    // merge --allowed-signers takes the shards as they lie: same summary.
    let m = dir.path().join("m");
    let o = kvtrail([
        "merge",
        s(&shards[0]),
        s(&shards[1]),
        "--out",
        s(&m),
        "--allowed-signers",
        s(&allowed),
    ])
    .run();
    o.ok();
    assert!(o.stderr.contains("responder@example"), "{}", o.stderr);
    assert_eq!(summary(&m), merged);

    // A shard forged after the run: findings emptied, evidence.json
    // recomputed. verify without keys cannot tell; the statement can.
    let forged = dir.path().join("forged");
    std::fs::create_dir(&forged).unwrap();
    for e in std::fs::read_dir(&shards[1]).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), forged.join(e.file_name())).unwrap();
    }
    let mut f = summary(&forged);
    assert!(!f["affected_responses"].as_array().unwrap().is_empty());
    f["affected_responses"] = serde_json::json!([]);
    f["recipients"] = serde_json::json!([]);
    f["sources"] = serde_json::json!([]);
    std::fs::write(
        forged.join("summary.json"),
        serde_json::to_string_pretty(&f).unwrap(),
    )
    .unwrap();
    reseal_evidence(&forged);
    let o = kvtrail(["verify", s(&forged), "--allowed-signers", s(&allowed)]).run();
    assert_eq!(o.code, 1, "{}{}", o.stdout, o.stderr);
    let m2 = dir.path().join("m2");
    let err = kvtrail([
        "merge",
        s(&shards[0]),
        s(&forged),
        "--out",
        s(&m2),
        "--allowed-signers",
        s(&allowed),
    ])
    .run()
    .refused("not authenticated");
    assert!(
        err.contains("forged") && err.contains("summary.json"),
        "{err}"
    );
    assert!(!m2.exists());
}
