//! The exports of a scope folder: findings.ocsf.jsonl (OCSF 1.8.0) and
//! timeline.jsonl (Timesketch), as `scope --out` writes them and as
//! `kvtrail export` renders them again. Every file is checked by the
//! independent validators of tests/export/validate.py (the OCSF schema
//! through ocsf-json-schema + jsonschema; Timesketch's own JSONL reader), in
//! the venv of .ci/setup.d/55-export-validators.sh; a missing venv fails.
//!
//! Traces: the committed incident-mini, a simulated incident, a
//! prefix-cache breach (a trace where prefix caches are promised per
//! tenant), and hostile tenant names and external ids.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use kvtrail::trace::manifest::PrefixCacheScope;
use serde_json::Value;

use crate::support::cli::{kvtrail, s, simulate};
use crate::support::trace_builder::TraceBuilder;
use crate::support::updating_goldens;
use crate::support::venv::EXPORT;

const OCSF: &str = "findings.ocsf.jsonl";
const TIMELINE: &str = "timeline.jsonl";

fn incident_mini() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/incident-mini")
}

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/export-golden")
}

fn scope_out(trace: &Path, out: &Path) {
    kvtrail(["scope", s(trace), "--out", s(out), "--backend", "cpu"])
        .run()
        .ok();
}

/// Runs the independent validator on a file; returns its counts.
fn validate(kind: &str, file: &Path) -> Value {
    let py = EXPORT.required();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/export/validate.py");
    let o = Command::new(py)
        .arg(script)
        .arg(kind)
        .arg(file)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{kind} validator refused {}:\n{}",
        file.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

fn lines(p: &Path) -> Vec<Value> {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn summary(dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap()
}

/// Runs `kvtrail export` to stdout; returns the bytes.
fn export(dir: &Path, format: &str, internal: bool) -> Vec<u8> {
    let mut args = vec!["export", s(dir), "--format", format];
    if internal {
        args.push("--internal");
    }
    let r = kvtrail(args).run();
    r.ok();
    r.stdout_bytes
}

/// Both files validate; event counts follow from summary.json; `export`
/// equals what scope wrote byte for byte; the internal forms validate too.
/// Returns the internal forms' paths.
fn check_folder(dir: &Path, tmp: &Path) -> (PathBuf, PathBuf) {
    let sum = summary(dir);
    let affected = sum["affected_responses"].as_array().unwrap().len() as u64;
    let tenant_scope = sum["deployment"]["prefix_cache_scope"] == "tenant";
    let hits = if tenant_scope {
        sum["cross_tenant_shared"]
            .as_array()
            .map_or(0, |a| a.len() as u64)
    } else {
        0
    };

    let v = validate("ocsf", &dir.join(OCSF));
    assert_eq!(v["lines"], v["events"]);
    assert_eq!(v["classes"]["2006"].as_u64().unwrap_or(0), affected + hits);
    assert_eq!(v["classes"]["2005"], 1);
    let evs = lines(&dir.join(OCSF));
    for e in &evs {
        let (c, a) = (
            e["class_uid"].as_u64().unwrap(),
            e["activity_id"].as_u64().unwrap(),
        );
        assert_eq!(e["type_uid"].as_u64().unwrap(), c * 100 + a);
        assert_eq!(e["metadata"]["labels"][0], "kvtrail:external");
    }
    let kinds: Vec<&str> = evs
        .iter()
        .filter_map(|e| e["unmapped"]["kind"].as_str())
        .collect();
    assert_eq!(
        kinds.iter().filter(|k| **k == "prefix_cache").count() as u64,
        hits
    );
    let incident = evs.last().unwrap();
    assert_eq!(incident["class_uid"], 2005);
    assert!(
        incident["metadata"]["profiles"]
            .as_array()
            .unwrap()
            .contains(&Value::from("incident"))
    );
    assert_eq!(
        incident["finding_info_list"].as_array().unwrap().len() as u64,
        affected + hits
    );
    assert_eq!(
        incident["unmapped"]["evidence_complete"],
        sum["coverage"]["complete"]
    );

    let t = validate("timesketch", &dir.join(TIMELINE));
    assert_eq!(t["lines"], t["events"]);
    let tl = lines(&dir.join(TIMELINE));
    let count = |dt: &str| tl.iter().filter(|l| l["data_type"] == dt).count() as u64;
    let arrivals = sum["affected_responses"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["arrival_ns"].is_i64())
        .count() as u64;
    assert_eq!(count("kvtrail:response:arrival"), arrivals);
    assert_eq!(count("kvtrail:response:foreign_read"), affected);
    assert_eq!(count("kvtrail:response:prefix_cache_hit"), hits);
    assert_eq!(count("kvtrail:capture:start"), 1);
    assert_eq!(count("kvtrail:capture:end"), 1);
    let answered_2xx = sum["anomalies"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| (200..300).contains(&a["http_status"].as_u64().unwrap()))
        .count();
    let anomalies = tl
        .iter()
        .filter(|l| {
            l["data_type"]
                .as_str()
                .unwrap()
                .starts_with("kvtrail:anomaly:")
        })
        .count();
    assert_eq!(anomalies, answered_2xx);
    let holes = sum["coverage"]["gaps"].as_array().unwrap().len()
        + sum["coverage"]["notes"].as_array().unwrap().len();
    assert_eq!(count("kvtrail:coverage:hole") as usize, holes);
    // Time order; capture start first.
    let ts: Vec<i64> = tl
        .iter()
        .map(|l| l["timestamp"].as_i64().unwrap())
        .collect();
    assert!(ts.windows(2).all(|w| w[0] <= w[1]), "{ts:?}");
    assert_eq!(tl[0]["data_type"], "kvtrail:capture:start");

    // export re-emits scope's files byte for byte.
    for (format, file) in [("ocsf", OCSF), ("timesketch", TIMELINE)] {
        let want = std::fs::read(dir.join(file)).unwrap();
        assert!(
            export(dir, format, false) == want,
            "export {format} differs"
        );
        let out = tmp.join(format!("out-{format}.jsonl"));
        kvtrail(["export", s(dir), "--format", format, "--out", s(&out)])
            .run()
            .ok();
        assert!(std::fs::read(&out).unwrap() == want);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&out).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }
    let no_temp = std::fs::read_dir(tmp)
        .unwrap()
        .all(|e| !e.unwrap().file_name().to_string_lossy().ends_with(".tmp"));
    assert!(no_temp);

    let int_ocsf = tmp.join("internal.ocsf.jsonl");
    std::fs::write(&int_ocsf, export(dir, "ocsf", true)).unwrap();
    let vi = validate("ocsf", &int_ocsf);
    assert_eq!(vi["classes"], v["classes"]);
    for e in lines(&int_ocsf) {
        assert_eq!(e["metadata"]["labels"][0], "kvtrail:internal");
    }
    let int_tl = tmp.join("internal.timeline.jsonl");
    std::fs::write(&int_tl, export(dir, "timesketch", true)).unwrap();
    assert_eq!(validate("timesketch", &int_tl)["events"], t["events"]);
    // The folder still verifies: the exports are in its evidence.
    kvtrail(["verify", s(dir)]).run().ok();
    (int_ocsf, int_tl)
}

/// Every string value (keys included) of a JSON value.
fn strings(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::String(s) => out.push(s.clone()),
        Value::Array(a) => a.iter().for_each(|x| strings(x, out)),
        Value::Object(o) => {
            for (k, x) in o {
                out.push(k.clone());
                strings(x, out);
            }
        }
        _ => {}
    }
}

/// Whether an event names `tenant`: as a string value, or (for names
/// distinctive enough) anywhere in a string.
fn names(v: &Value, tenant: &str) -> bool {
    let mut all = Vec::new();
    strings(v, &mut all);
    all.iter()
        .any(|x| x == tenant || (tenant.chars().count() >= 8 && x.contains(tenant)))
}

/// The tenants of a scope folder's requests (every customer of the trace).
fn tenants(dir: &Path) -> BTreeSet<String> {
    let mut t = BTreeSet::new();
    kvtrail::report::lookup_files::read_index(dir, |r| {
        t.insert(r.tenant);
        true
    })
    .unwrap();
    t
}

/// The external files name, per event, only the customer whose request it
/// is; the Incident Finding names none. Returns how many (event, source
/// customer) pairs the internal file names, so a caller can see that the
/// rule was tested on a trace where it could fail.
fn assert_external_safe(dir: &Path, int_ocsf: &Path, int_tl: &Path) -> usize {
    let all = tenants(dir);
    let check = |file: &Path, owner: &dyn Fn(&Value) -> Option<String>| {
        let mut named_others = 0;
        for e in lines(file) {
            let own = owner(&e);
            for t in &all {
                if Some(t) != own.as_ref() && names(&e, t) {
                    named_others += 1;
                }
            }
        }
        named_others
    };
    let ocsf_owner = |e: &Value| {
        e["resources"][0]["owner"]["name"]
            .as_str()
            .map(str::to_string)
    };
    let tl_owner = |e: &Value| e["tenant"].as_str().map(str::to_string);
    assert_eq!(check(&dir.join(OCSF), &ocsf_owner), 0, "{}", dir.display());
    assert_eq!(
        check(&dir.join(TIMELINE), &tl_owner),
        0,
        "{}",
        dir.display()
    );
    let incident = lines(&dir.join(OCSF)).pop().unwrap();
    assert!(all.iter().all(|t| !names(&incident, t)));
    check(int_ocsf, &ocsf_owner) + check(int_tl, &tl_owner)
}

fn golden(name: &str, file: &Path) {
    let g = golden_dir().join(name);
    let have = std::fs::read(file).unwrap();
    if updating_goldens() {
        std::fs::create_dir_all(g.parent().unwrap()).unwrap();
        std::fs::write(&g, &have).unwrap();
    }
    let want = std::fs::read(&g).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (regenerate with KVTRAIL_UPDATE_GOLDEN=1)",
            g.display()
        )
    });
    assert!(
        want == have,
        "{} differs from {} (regenerate with KVTRAIL_UPDATE_GOLDEN=1 after a deliberate change)",
        file.display(),
        g.display()
    );
}

#[test]
fn incident_mini_exports_validate_match_goldens_and_name_no_other_customer() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("scope");
    scope_out(&incident_mini(), &dir);
    let (int_ocsf, int_tl) = check_folder(&dir, tmp.path());
    assert!(assert_external_safe(&dir, &int_ocsf, &int_tl) > 0);
    golden("incident-mini/findings.ocsf.jsonl", &dir.join(OCSF));
    golden("incident-mini/timeline.jsonl", &dir.join(TIMELINE));
    golden("incident-mini/findings.internal.ocsf.jsonl", &int_ocsf);
    golden("incident-mini/timeline.internal.jsonl", &int_tl);
}

#[test]
fn simulated_incident_exports_validate_and_name_no_other_customer() {
    let tmp = tempfile::tempdir().unwrap();
    let t = simulate(
        &tmp.path().join("t"),
        &["--scenario", "incident", "--seed", "7", "--requests", "400"],
    );
    let dir = tmp.path().join("scope");
    scope_out(&t, &dir);
    let sum = summary(&dir);
    assert!(!sum["affected_responses"].as_array().unwrap().is_empty());
    let (int_ocsf, int_tl) = check_folder(&dir, tmp.path());
    assert!(assert_external_safe(&dir, &int_ocsf, &int_tl) > 0);
}

/// The validators are not vacuous: each rule they apply refuses a file
/// broken against it.
#[test]
fn the_validators_refuse_broken_files() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("scope");
    scope_out(&incident_mini(), &dir);
    let ocsf = std::fs::read_to_string(dir.join(OCSF)).unwrap();
    let tl = std::fs::read_to_string(dir.join(TIMELINE)).unwrap();
    let py = EXPORT.required();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/export/validate.py");
    let refused = |kind: &str, text: String, want: &str| {
        let p = tmp.path().join("broken.jsonl");
        std::fs::write(&p, text).unwrap();
        let o = Command::new(&py)
            .arg(&script)
            .arg(kind)
            .arg(&p)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "{want}: {err}");
    };
    refused(
        "ocsf",
        ocsf.replacen("\"type_uid\":200601", "\"type_uid\":200602", 1),
        "type_uid",
    );
    refused(
        "ocsf",
        ocsf.replacen("\"is_alert\":true", "\"is_alert\":null", 1),
        "null value",
    );
    refused(
        "ocsf",
        ocsf.replacen("\"activity_id\":1,", "\"activity_id\":1,\"extra\":1,", 1),
        "Additional properties",
    );
    refused(
        "ocsf",
        ocsf.replacen("\"severity_id\":4", "\"severity_id\":7", 1),
        "severity_id",
    );
    refused(
        "ocsf",
        ocsf.replace("\"profiles\":[\"incident\"],", ""),
        "incident profile",
    );
    refused("timesketch", tl.replace("+00:00\"", "\""), "no UTC offset");
    refused(
        "timesketch",
        tl.replacen("\"timestamp\":1", "\"timestamp\":2", 1),
        "epoch microseconds",
    );
    refused(
        "timesketch",
        tl.replacen("\"timestamp_desc\":", "\"desc\":", 1),
        "Missing field",
    );
    refused("timesketch", format!("{tl}\n"), "blank");
    refused(
        "timesketch",
        tl.replacen("\"datetime\":\"2026", "\"datetime\":\"x2026", 1),
        "not ISO 8601",
    );
}

#[test]
fn prefix_cache_breach_is_a_finding_only_under_the_tenant_promise() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, scope, want) in [
        ("tenant", Some(PrefixCacheScope::Tenant), 1),
        ("global", Some(PrefixCacheScope::Global), 0),
    ] {
        let mut tb = TraceBuilder::pd();
        tb.deployment.prefix_cache_scope = scope;
        tb.req(1, "acme");
        tb.req(2, "globex");
        tb.write(0, 1, 0, 4);
        tb.share(0, 2, 0, 4);
        tb.read(0, 2, 0, 4);
        let t = tb.record(&tmp.path().join(format!("t-{name}")));
        let dir = tmp.path().join(format!("scope-{name}"));
        scope_out(&t, &dir);
        let work = tmp.path().join(format!("work-{name}"));
        std::fs::create_dir(&work).unwrap();
        let (int_ocsf, int_tl) = check_folder(&dir, &work);
        let evs = lines(&dir.join(OCSF));
        let hits: Vec<&Value> = evs
            .iter()
            .filter(|e| e["unmapped"]["kind"] == "prefix_cache")
            .collect();
        assert_eq!(hits.len(), want, "{name}");
        if want == 1 {
            let h = hits[0];
            assert_eq!(h["resources"][0]["owner"]["name"], "globex");
            assert_eq!(h["unmapped"]["source_customers"], 1);
            assert!(!names(h, "acme"));
            // The internal form names the source.
            let int = lines(&int_ocsf);
            assert!(names(&int[0], "acme"));
            assert!(assert_external_safe(&dir, &int_ocsf, &int_tl) > 0);
            golden("prefix-cache/findings.ocsf.jsonl", &dir.join(OCSF));
            golden("prefix-cache/timeline.jsonl", &dir.join(TIMELINE));
        }
        // The incident says it either way: suspected breach only under the
        // promise.
        let incident = evs.last().unwrap();
        assert_eq!(incident["is_suspected_breach"], want == 1);
    }
}

#[test]
fn hostile_tenant_names_and_external_ids_survive_as_data() {
    let tenants = [
        "=cmd|' /C calc'!A0",
        "quo\"te\\back\nnew line",
        "ünï©ødé 🚀 \u{202e}rtl",
        "{\"tenant\": null}",
    ];
    let ids = [
        "=HYPERLINK(\"http://x\",\"y\")",
        "+1\r\n-2\t@3",
        "",
        "\u{0}nul",
    ];
    let mut tb = TraceBuilder::pd();
    for (i, (t, x)) in tenants.iter().zip(ids).enumerate() {
        tb.req(i as u64 + 1, t).external_id = Some(x.to_string());
    }
    // 2 reads 1's KV, 4 reads 3's.
    tb.write(0, 1, 0, 4);
    tb.read(0, 2, 0, 4);
    tb.write(0, 3, 10, 4);
    tb.read(0, 4, 10, 4);
    let tmp = tempfile::tempdir().unwrap();
    let t = tb.record(&tmp.path().join("t"));
    let dir = tmp.path().join("scope");
    scope_out(&t, &dir);
    let (int_ocsf, int_tl) = check_folder(&dir, tmp.path());
    assert!(assert_external_safe(&dir, &int_ocsf, &int_tl) > 0);

    let evs = lines(&dir.join(OCSF));
    for (rid, i) in [(2u64, 1usize), (4, 3)] {
        let e = evs
            .iter()
            .find(|e| e["unmapped"]["request_id"] == rid)
            .unwrap();
        assert_eq!(e["resources"][0]["owner"]["name"], tenants[i]);
        assert_eq!(e["resources"][0]["name"], ids[i]);
        assert_eq!(e["unmapped"]["external_id"], ids[i]);
        let arrival = lines(&dir.join(TIMELINE))
            .into_iter()
            .find(|l| l["data_type"] == "kvtrail:response:arrival" && l["request_id"] == rid)
            .unwrap();
        assert_eq!(arrival["tenant"], tenants[i]);
        assert_eq!(arrival["external_id"], ids[i]);
    }
    // The internal form names each source exactly.
    let int = lines(&int_ocsf);
    let e2 = int
        .iter()
        .find(|e| e["unmapped"]["request_id"] == 2)
        .unwrap();
    assert_eq!(e2["unmapped"]["sources"][0]["tenant"], tenants[0]);
    assert_eq!(e2["unmapped"]["sources"][0]["external_id"], ids[0]);
    assert_eq!(e2["unmapped"]["source_tenants"][0], tenants[0]);
}

#[test]
fn a_merged_folder_carries_the_same_exports_as_a_single_run() {
    let tmp = tempfile::tempdir().unwrap();
    let single = tmp.path().join("single");
    scope_out(&incident_mini(), &single);
    // Signed shards, merged authenticated: the same exports as one run.
    let (key, allowed) = crate::statements::keygen(tmp.path(), "key");
    let mut shards = Vec::new();
    for (i, pools) in ["0", "1"].iter().enumerate() {
        let out = tmp.path().join(format!("shard-{i}"));
        kvtrail([
            "scope",
            s(&incident_mini()),
            "--pools",
            pools,
            "--out",
            s(&out),
            "--backend",
            "cpu",
            "--signing-key",
            s(&key),
        ])
        .run()
        .ok();
        // A shard's own exports validate (its evidence is not complete).
        validate("ocsf", &out.join(OCSF));
        validate("timesketch", &out.join(TIMELINE));
        shards.push(out);
    }
    let merged = tmp.path().join("merged");
    kvtrail([
        "merge",
        s(&shards[0]),
        s(&shards[1]),
        "--out",
        s(&merged),
        "--allowed-signers",
        s(&allowed),
    ])
    .run()
    .ok();
    for f in [OCSF, TIMELINE] {
        assert!(
            std::fs::read(merged.join(f)).unwrap() == std::fs::read(single.join(f)).unwrap(),
            "{f}"
        );
    }
    // export needs the trace's digest from evidence.json, which a merged
    // folder does not record: refused, with the way out.
    kvtrail(["export", s(&merged), "--format", "ocsf"])
        .run()
        .refused("names no trace input");
}

#[test]
fn bad_input_is_refused_and_nothing_is_written_half_way() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("scope");
    scope_out(&incident_mini(), &dir);

    // Unknown format.
    let r = kvtrail(["export", s(&dir), "--format", "csv"]).run();
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("invalid value 'csv'"), "{}", r.stderr);

    // Not a scope folder.
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    kvtrail(["export", s(&empty), "--format", "ocsf"])
        .run()
        .refused("no evidence.json");

    // --out inside the scope folder, onto a folder, under a missing or
    // non-folder parent.
    let parent_file = tmp.path().join("plain");
    std::fs::write(&parent_file, "x").unwrap();
    for (out, want) in [
        (dir.join("x.jsonl"), "inside the scope folder"),
        (tmp.path().to_path_buf(), "is a folder"),
        (tmp.path().join("missing/x.jsonl"), "cannot write here"),
        (parent_file.join("x.jsonl"), "cannot write here"),
    ] {
        kvtrail(["export", s(&dir), "--format", "ocsf", "--out", s(&out)])
            .run()
            .refused(want);
        assert!(!dir.join("x.jsonl").exists());
    }
    kvtrail(["verify", s(&dir)]).run().ok();

    // An existing file is kept unless --force.
    let out = tmp.path().join("o.jsonl");
    std::fs::write(&out, "keep").unwrap();
    kvtrail(["export", s(&dir), "--format", "ocsf", "--out", s(&out)])
        .run()
        .refused("already exists");
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "keep");
    kvtrail([
        "export",
        s(&dir),
        "--format",
        "ocsf",
        "--out",
        s(&out),
        "--force",
    ])
    .run()
    .ok();
    assert!(std::fs::read(&out).unwrap() == std::fs::read(dir.join(OCSF)).unwrap());

    // A folder failing its evidence check: export refuses, nothing is
    // written; verify names the edited export.
    let mut b = std::fs::read(dir.join(OCSF)).unwrap();
    b.extend_from_slice(b"{}\n");
    std::fs::write(dir.join(OCSF), b).unwrap();
    let v = kvtrail(["verify", s(&dir)]).run();
    assert_eq!(v.code, 1, "{}", v.stderr);
    assert!(
        format!("{}{}", v.stdout, v.stderr).contains(OCSF),
        "{}",
        v.stdout
    );
    let out2 = tmp.path().join("o2.jsonl");
    for format in ["ocsf", "timesketch"] {
        kvtrail(["export", s(&dir), "--format", format, "--out", s(&out2)])
            .run()
            .refused("does not match its evidence.json");
        assert!(!out2.exists());
    }
}

/// A file a trace's readers skip, under a name that carries a customer's
/// name (Hive folders by tenant do): the responder's coverage notes quote
/// the path, the external exports count the file without naming it.
#[test]
fn external_exports_word_coverage_notes_without_file_paths() {
    let tmp = tempfile::tempdir().unwrap();
    let mut tb = TraceBuilder::pd();
    tb.req(1, "acme");
    tb.req(2, "globex");
    tb.write(0, 1, 0, 4);
    tb.read(0, 2, 0, 4);
    let t = tb.record(&tmp.path().join("t"));
    std::fs::write(t.join("requests/_umbrella-corp-requests.parquet"), b"x").unwrap();
    let dir = tmp.path().join("scope");
    scope_out(&t, &dir);
    let sum = summary(&dir);
    assert_eq!(sum["coverage"]["complete"], false);
    let hidden = "umbrella-corp";
    assert!(sum["coverage"]["notes"].to_string().contains(hidden));
    let (int_ocsf, int_tl) = check_folder(&dir, tmp.path());
    for f in [dir.join(OCSF), dir.join(TIMELINE)] {
        let text = std::fs::read_to_string(&f).unwrap();
        assert!(!text.contains(hidden), "{}", f.display());
        assert!(text.contains("evidence_complete\":false"));
    }
    for f in [&int_ocsf, &int_tl] {
        assert!(std::fs::read_to_string(f).unwrap().contains(hidden));
    }
    let incident = lines(&dir.join(OCSF)).pop().unwrap();
    assert_eq!(incident["unmapped"]["evidence_complete"], false);
    assert!(
        incident["status_detail"]
            .as_str()
            .unwrap()
            .contains("INCOMPLETE")
    );
}
