//! Notify, report.html, lookup and chain of custody, through the binary, on
//! a small incident-like trace built in code (`incident`):
//!
//! - golden: scope's report.html / requests.csv / timeline.json and every
//!   notify file are byte-identical to tests/data/notify-golden
//!   (regenerate with KVTRAIL_UPDATE_GOLDEN=1 after a deliberate change);
//! - isolation: no customer folder names another tenant or holds another
//!   tenant's ids or output hashes;
//! - custody: editing, deleting or adding any output file, or editing any
//!   input file, makes `verify` fail naming the file;
//! - lookup: affected on each side, not affected, not found;
//! - browser: Debian's chromium loads report.html headless, the inline
//!   script runs (data-ok), no console errors; a screenshot goes to
//!   target/report.png. Fails when CI is set and chromium is missing.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::support::cli::{kvtrail, s};
use crate::support::trace_builder::TraceBuilder;
use crate::support::updating_goldens;

/// 2026-09-01 00:00:00 UTC.
const BASE: i64 = 1_788_220_800_000_000_000;
const HOUR: i64 = 3_600_000_000_000;

pub(crate) const TENANTS: [&str; 4] = ["acme-corp", "globex", "initech", "umbrella"];

/// The external id of request `id`; request 5's is awkward on purpose
/// (CSV, Markdown and HTML syntax inside).
pub(crate) fn ext(id: u64) -> String {
    if id == 5 {
        return "chatcmpl-<i>5</i>|`x`,\"q\"".into();
    }
    format!(
        "chatcmpl-{}",
        &blake3::hash(&id.to_le_bytes()).to_hex()[..12]
    )
}

/// An incident in miniature: ordinary requests leave freed, unzeroed KV in
/// the decode pool; over-long prompts get a 1-token placeholder prefill
/// (prefilled_tokens 1, HTTP 200) and decode over the stale slots.
///
/// - r1 acme-corp, r2 globex, r3 initech, r4 globex: normal, own KV only.
/// - r5 umbrella (over-long): reads stale acme-corp r1 and globex r2 KV.
/// - r6 acme-corp (over-long): reads stale globex r4 KV.
/// - r7 initech (over-long): reads stale initech r3 KV (same customer).
/// - r8 umbrella: normal.
pub(crate) fn incident() -> TraceBuilder {
    let mut tb = TraceBuilder::pd();
    let req = |tb: &mut TraceBuilder, id: u64, t: &str, prompt: u32, long: bool| {
        let r = tb.req(id, t);
        r.external_id = Some(ext(id));
        r.arrival_ns = BASE + id as i64 * HOUR;
        r.finish_ns = Some(BASE + id as i64 * HOUR + 40_000_000_000);
        r.prompt_tokens = if long { 900 } else { prompt };
        r.prefilled_tokens = Some(if long { 1 } else { prompt });
        r.prefill_pool = Some(0);
        r.decode_pool = Some(1);
    };
    // Normal requests: prefill write, copy to decode, read, free.
    let normal = |tb: &mut TraceBuilder, id: u64, p: u32, d: u32, n: u32| {
        let w = tb.write(0, id, p, n);
        tb.alloc(1, id, d, n);
        tb.copy(1, id, d, n, 0, p, w);
        tb.read(1, id, d, n);
        tb.free(1, id, d, n);
        tb.free(0, id, p, n);
    };
    // Over-long: 1-token placeholder, decode preallocates n and reads all.
    let long = |tb: &mut TraceBuilder, id: u64, p: u32, d: u32, n: u32| {
        let w = tb.write(0, id, p, 1);
        tb.alloc(1, id, d, n);
        tb.copy(1, id, d, 1, 0, p, w);
        tb.read(1, id, d, n);
        tb.free(1, id, d, n);
        tb.free(0, id, p, 1);
    };
    for (id, t, prompt, lg) in [
        (1, "acme-corp", 8, false),
        (2, "globex", 8, false),
        (3, "initech", 6, false),
        (4, "globex", 4, false),
        (5, "umbrella", 0, true),
        (6, "acme-corp", 0, true),
        (7, "initech", 0, true),
        (8, "umbrella", 5, false),
    ] {
        req(&mut tb, id, t, prompt, lg);
    }
    normal(&mut tb, 1, 0, 0, 8);
    normal(&mut tb, 2, 8, 8, 8);
    normal(&mut tb, 3, 16, 30, 6);
    normal(&mut tb, 4, 24, 20, 4);
    long(&mut tb, 5, 40, 0, 16);
    long(&mut tb, 6, 41, 20, 4);
    long(&mut tb, 7, 42, 30, 6);
    normal(&mut tb, 8, 44, 50, 5);
    // Event times: each request's events one second apart from its arrival.
    let mut k = std::collections::HashMap::new();
    for e in &mut tb.events {
        let n = k.entry(e.request_id).or_insert(0i64);
        *n += 1;
        e.ts_ns = BASE + e.request_id as i64 * HOUR + *n * 1_000_000_000;
    }
    tb.deployment.name = "glm-mini / <b>workers</b>".into();
    tb.deployment.context_window = 1024;
    tb.deployment.pools[0].capacity_tokens = 64;
    tb
}

pub(crate) const CONFIG: &str = r#"operator_name = "Example Inference GmbH"
dpo_contact = "Dr. Erika Muster, dpo@example-inference.eu"
incident_id = "INC-2026-0042"
became_aware = "2026-09-10 08:00 UTC"
measures = ["Prefill pool enlarged to twice the context window.", "Over-long prompts are now rejected with HTTP 400."]
"#;

/// Records the incident, runs scope and notify in `root` with relative paths
/// (so the recorded command lines are the same everywhere).
fn setup(root: &Path) {
    incident().record(&root.join("trace"));
    kvtrail(["scope", "trace", "--out", "scope"])
        .cwd(root)
        .run()
        .ok();
    std::fs::write(root.join("notify.toml"), CONFIG).unwrap();
    kvtrail([
        "notify",
        "scope",
        "--out",
        "packs",
        "--config",
        "notify.toml",
    ])
    .cwd(root)
    .run()
    .ok();
}

pub(crate) fn files(dir: &Path) -> Vec<String> {
    kvtrail::custody::list_files(dir).unwrap()
}

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/notify-golden")
}

/// The bytes compared with the golden copy: absolute temp roots replaced.
fn normalised(root: &Path, rel: &str) -> Vec<u8> {
    let bytes = std::fs::read(root.join(rel)).unwrap();
    if rel.ends_with("evidence.json") {
        let root_s = std::fs::canonicalize(root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let t = String::from_utf8(bytes).unwrap().replace(&root_s, "$ROOT");
        return t.into_bytes();
    }
    bytes
}

fn golden_list(root: &Path) -> Vec<String> {
    let mut v: Vec<String> = [
        "report.html",
        "requests.csv",
        "timeline.json",
        "evidence.json",
    ]
    .iter()
    .map(|f| format!("scope/{f}"))
    .collect();
    v.extend(
        files(&root.join("packs"))
            .into_iter()
            .map(|f| format!("packs/{f}")),
    );
    v
}

#[test]
fn golden_outputs_are_byte_identical() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let g = golden_dir();
    let update = updating_goldens();
    let list = golden_list(dir.path());
    if update {
        let _ = std::fs::remove_dir_all(&g);
        for rel in &list {
            let p = g.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, normalised(dir.path(), rel)).unwrap();
        }
    }
    let mut want: Vec<String> = files(&g);
    want.sort();
    let mut have = list.clone();
    have.sort();
    assert_eq!(have, want, "output files differ from {}", g.display());
    for rel in &list {
        let a = normalised(dir.path(), rel);
        let b = std::fs::read(g.join(rel)).unwrap();
        assert!(
            a == b,
            "{rel} differs from the golden copy (KVTRAIL_UPDATE_GOLDEN=1 regenerates after a deliberate change)\n--- have\n{}",
            String::from_utf8_lossy(&a)
        );
    }
    // A second run elsewhere gives the same bytes.
    let dir2 = tempfile::tempdir().unwrap();
    setup(dir2.path());
    for rel in &list {
        assert_eq!(
            normalised(dir.path(), rel),
            normalised(dir2.path(), rel),
            "{rel} not deterministic"
        );
    }
}

/// Every file of every customer folder under `packs` names its own customer
/// and no other tenant, and holds no other tenant's external ids or output
/// hashes; notice.json lists only the customer's own requests.
pub(crate) fn assert_packs_are_isolated(packs: &Path, tb: &TraceBuilder) {
    let folders: Vec<String> = std::fs::read_dir(packs)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!folders.is_empty());
    for f in &folders {
        let mut text = String::new();
        for file in files(&packs.join(f)) {
            text.push_str(&std::fs::read_to_string(packs.join(f).join(file)).unwrap());
        }
        assert!(
            text.contains(f.as_str()),
            "{f}: letter does not name its customer"
        );
        for r in &tb.requests {
            let ids = [
                r.external_id.clone().unwrap(),
                kvtrail::schema::hex32(r.output_hash.as_ref().unwrap()),
            ];
            for id in ids {
                if r.tenant == *f {
                    continue;
                }
                assert!(!text.contains(&id), "{f}'s pack holds {id} of {}", r.tenant);
            }
            if r.tenant != *f {
                assert!(!text.contains(&r.tenant), "{f}'s pack names {}", r.tenant);
            }
        }
        // Every request id listed in notice.json is the customer's own.
        let v: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(packs.join(f).join("notice.json")).unwrap(),
        )
        .unwrap();
        for key in ["received_responses", "exposed_requests"] {
            for e in v[key].as_array().unwrap() {
                let id = e["request_id"].as_u64().unwrap();
                let owner = tb.requests.iter().find(|r| r.request_id == id).unwrap();
                assert_eq!(owner.tenant, *f, "{f}/notice.json lists request {id}");
            }
        }
    }
}

#[test]
fn packs_cover_both_sides_and_never_leak_another_tenant() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let tb = incident();
    let packs = dir.path().join("packs/customers");
    let mut folders: Vec<String> = std::fs::read_dir(&packs)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    folders.sort();
    // acme-corp (both sides), globex (source), initech (both, own data),
    // umbrella (recipient).
    assert_eq!(folders, TENANTS);
    assert_packs_are_isolated(&packs, &tb);
    // Facts per side.
    let notice = |t: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(packs.join(t).join("notice.json")).unwrap())
            .unwrap()
    };
    let ids = |v: &serde_json::Value, k: &str| -> Vec<u64> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|e| e["request_id"].as_u64().unwrap())
            .collect()
    };
    // (customer, roles, received response ids, exposed request ids)
    type Case<'a> = (&'a str, &'a [&'a str], &'a [u64], &'a [u64]);
    let cases: [Case; 4] = [
        ("acme-corp", &["recipient", "source"], &[6], &[1]),
        ("globex", &["source"], &[], &[2, 4]),
        ("initech", &["recipient", "source"], &[7], &[3]),
        ("umbrella", &["recipient"], &[5], &[]),
    ];
    for (t, roles, recv, src) in cases {
        let v = notice(t);
        assert_eq!(v["roles"], serde_json::json!(roles), "{t}");
        assert_eq!(ids(&v, "received_responses"), recv, "{t}");
        assert_eq!(ids(&v, "exposed_requests"), src, "{t}");
        assert_eq!(v["incident_id"], "INC-2026-0042");
        assert_eq!(v["contact"]["operator_name"], "Example Inference GmbH");
        assert_eq!(
            v["evidence"]["scope_evidence_blake3"].as_str().unwrap(),
            blake3::hash(&std::fs::read(dir.path().join("scope/evidence.json")).unwrap())
                .to_hex()
                .as_str()
        );
    }
    let umb = notice("umbrella");
    assert_eq!(umb["records"]["tokens"], 15);
    assert_eq!(umb["received_responses"][0]["other_customer_data"], true);
    let ini = notice("initech");
    assert_eq!(ini["received_responses"][0]["other_customer_data"], false);
    let reg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("packs/register.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(reg["affected_responses"], 3);
    assert_eq!(reg["cross_customer_responses"], 2);
    assert_eq!(reg["notification_packs"].as_array().unwrap().len(), 4);
    let csv = std::fs::read_to_string(dir.path().join("packs/register.csv")).unwrap();
    assert_eq!(csv.lines().count(), 2, "{csv}");
}

#[test]
fn stray_part_files_named_after_tenants_never_reach_another_customers_pack() {
    // Files the readers skip, under Hive folders and names that carry
    // tenant names: scope's coverage notes list them for the responder.
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let tb = incident();
    let trace = tb.record(&root.join("trace"));
    for (rel, tenant) in [
        (
            "requests/tenant=acme-corp/part-1.parquet.inprogress",
            "acme-corp",
        ),
        ("kv/tenant=globex/_globex-export.parquet", "globex"),
        ("kv/.initech-backup/part-0.parquet", "initech"),
        ("requests/umbrella.parquet.inprogress", "umbrella"),
    ] {
        let p = trace.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, format!("rows of {tenant}")).unwrap();
    }
    kvtrail(["scope", "trace", "--out", "scope"])
        .cwd(root)
        .run()
        .ok();
    std::fs::write(root.join("notify.toml"), CONFIG).unwrap();
    kvtrail([
        "notify",
        "scope",
        "--out",
        "packs",
        "--config",
        "notify.toml",
    ])
    .cwd(root)
    .run()
    .ok();
    // The responder's own report keeps the paths.
    let summary = std::fs::read_to_string(root.join("scope/summary.json")).unwrap();
    assert!(
        summary.contains("tenant=acme-corp/part-1.parquet.inprogress"),
        "{summary}"
    );
    // The packs say that files were not read, without naming them.
    let packs = root.join("packs/customers");
    let letter = std::fs::read_to_string(packs.join("globex/letter.md")).unwrap();
    assert!(
        letter.contains("4 files under requests/ or kv/ may hold rows that were not read"),
        "{letter}"
    );
    assert_packs_are_isolated(&packs, &tb);
}

#[test]
fn tenants_named_like_unknown_or_engine_are_notified() {
    // Real tenants literally named `(unknown)` and `(engine)`: r2 of
    // `(engine)` reads KV of r1 of `(unknown)`; r3 of `(unknown)` reads its
    // own tenant's KV (not cross-tenant); request 9 is missing from the
    // requests table (truly unattributed).
    let mut tb = TraceBuilder::pd();
    tb.req(1, "(unknown)");
    tb.req(2, "(engine)");
    tb.req(3, "(unknown)");
    tb.write(0, 1, 0, 4);
    tb.read(0, 2, 0, 2);
    tb.read(0, 3, 2, 2);
    tb.read(0, 9, 0, 1);
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    tb.record(&root.join("trace"));
    kvtrail(["scope", "trace", "--out", "scope"])
        .cwd(root)
        .run()
        .ok();
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join("scope/summary.json")).unwrap()).unwrap();
    let resp = |id: u64| -> serde_json::Value {
        v["affected_responses"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["request_id"] == id)
            .unwrap_or_else(|| panic!("r{id} not affected: {v}"))
            .clone()
    };
    assert_eq!(resp(2)["tenant"], "(engine)");
    assert_eq!(resp(2)["cross_tenant"], true);
    assert_eq!(resp(3)["tenant"], "(unknown)");
    assert_eq!(resp(3)["cross_tenant"], false, "same tenant: {}", resp(3));
    assert_eq!(resp(9)["tenant"], serde_json::Value::Null);
    assert_eq!(resp(9)["cross_tenant"], true);
    kvtrail(["notify", "scope", "--out", "packs"])
        .cwd(root)
        .run()
        .ok();
    let reg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join("packs/register.json")).unwrap()).unwrap();
    assert_eq!(reg["unattributed_responses"], 1, "{reg}");
    assert_eq!(reg["unattributed_source_requests"], 0, "{reg}");
    let packs = reg["notification_packs"].as_array().unwrap().clone();
    assert_eq!(packs.len(), 2, "{reg}");
    let mut customers = Vec::new();
    for p in &packs {
        let n: serde_json::Value = serde_json::from_slice(
            &std::fs::read(
                root.join("packs")
                    .join(p.as_str().unwrap())
                    .join("notice.json"),
            )
            .unwrap(),
        )
        .unwrap();
        customers.push((
            n["customer"].as_str().unwrap().to_string(),
            n["roles"].to_string(),
        ));
    }
    customers.sort();
    assert_eq!(
        customers,
        [
            ("(engine)".to_string(), r#"["recipient"]"#.to_string()),
            (
                "(unknown)".to_string(),
                r#"["recipient","source"]"#.to_string()
            ),
        ]
    );
    // lookup agrees: the tenant is affected.
    let a: serde_json::Value = serde_json::from_str(
        &kvtrail(["lookup", "scope", "--json", "--tenant", "(engine)"])
            .cwd(root)
            .run()
            .ok(),
    )
    .unwrap();
    assert_eq!(a["status"], "affected");
}

#[test]
fn folder_names_never_collide_or_escape() {
    let tenants: std::collections::BTreeSet<String> =
        ["Acme", "acme", "../etc", "", "a/b", "ok-name", "ünï"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    let names = kvtrail::notify::folder_names(&tenants);
    let mut lower: Vec<String> = names.values().map(|n| n.to_ascii_lowercase()).collect();
    lower.sort();
    lower.dedup();
    assert_eq!(lower.len(), tenants.len(), "{names:?}");
    for n in names.values() {
        assert!(
            !n.is_empty() && !n.starts_with('.') && !n.contains('/'),
            "{n}"
        );
    }
    assert_eq!(names["ok-name"], "ok-name");
}

fn verify(path: &Path) -> (i32, String) {
    let o = kvtrail(["verify", s(path)]).run();
    (o.code, o.stdout)
}

#[test]
fn verify_names_every_changed_file() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let root = dir.path();
    for folder in ["scope", "packs"] {
        let (code, out) = verify(&root.join(folder));
        assert_eq!(code, 0, "{folder}: {out}");
        assert!(out.contains("OK:"), "{out}");
    }
    // Every output file of both folders, and every input file of the trace
    // (checked through both folders: packs -> scope -> trace).
    let mut targets: Vec<(String, Vec<&str>)> = Vec::new();
    for f in files(&root.join("scope")) {
        targets.push((format!("scope/{f}"), vec!["scope", "packs"]));
    }
    for f in files(&root.join("packs")) {
        targets.push((format!("packs/{f}"), vec!["packs"]));
    }
    for f in files(&root.join("trace")) {
        targets.push((format!("trace/{f}"), vec!["scope", "packs"]));
    }
    targets.push(("notify.toml".into(), vec!["packs"]));
    assert!(targets.len() > 20, "{targets:?}");
    for (rel, folders) in &targets {
        let p = root.join(rel);
        let orig = std::fs::read(&p).unwrap();
        let mut edited = orig.clone();
        let mid = edited.len() / 2;
        edited[mid] ^= 0x01;
        std::fs::write(&p, &edited).unwrap();
        let name = rel.split_once('/').map(|x| x.1).unwrap_or(rel);
        for folder in folders {
            if *rel == format!("{folder}/evidence.json") {
                // A folder's own record that no longer parses as one is
                // refused (exit 2), naming it; one that does fails.
                let o = kvtrail(["verify", folder]).cwd(root).run();
                let err = o.stderr.as_str();
                let out = o.stdout.as_str();
                assert!(
                    (o.code == 2 && err.contains("evidence.json"))
                        || (o.code == 1 && out.contains("FAIL")),
                    "editing {rel}: verify {folder}: {out}{err}"
                );
                continue;
            }
            let (code, out) = verify(&root.join(folder));
            assert_eq!(code, 1, "editing {rel}: verify {folder} passed:\n{out}");
            assert!(
                out.contains("FAIL") && out.contains(name),
                "editing {rel}: verify {folder} does not name it:\n{out}"
            );
        }
        std::fs::write(&p, &orig).unwrap();
    }
    // Deleting and adding files.
    let p = root.join("packs/customers/globex/letter.md");
    let orig = std::fs::read(&p).unwrap();
    std::fs::remove_file(&p).unwrap();
    let (code, out) = verify(&root.join("packs"));
    assert_eq!(code, 1);
    assert!(
        out.contains("missing") && out.contains("customers/globex/letter.md"),
        "{out}"
    );
    std::fs::write(&p, orig).unwrap();
    std::fs::write(root.join("scope/extra.txt"), "x").unwrap();
    let (code, out) = verify(&root.join("scope"));
    assert_eq!(code, 1);
    assert!(out.contains("extra") && out.contains("extra.txt"), "{out}");
    // notify refuses a scope folder that no longer matches its evidence.
    let o = kvtrail(["notify", "scope", "--out", "packs2"])
        .cwd(root)
        .run();
    assert_eq!(o.code, 2);
    let err = o.stderr.as_str();
    assert!(
        err.contains("extra.txt") && err.contains("evidence.json"),
        "{err}"
    );
}

#[test]
fn lookup_answers_each_side_and_says_not_found_plainly() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let root = dir.path();
    let tb = incident();
    let json = |args: &[&str]| -> serde_json::Value {
        let mut a = vec!["lookup", "scope", "--json"];
        a.extend_from_slice(args);
        serde_json::from_str(&kvtrail(&a).cwd(root).run().ok()).unwrap()
    };
    let digest = blake3::hash(&std::fs::read(root.join("scope/evidence.json")).unwrap())
        .to_hex()
        .to_string();
    // (external id of request, status, recipient side, source side)
    let cases = [
        (5, "affected", true, false),
        (1, "affected", false, true),
        (6, "affected", true, false),
        (8, "not_affected", false, false),
    ];
    for (id, status, recv, src) in cases {
        let v = json(&["--external-id", &ext(id)]);
        assert_eq!(v["status"], status, "request {id}: {v}");
        let m = &v["matches"][0];
        assert_eq!(m["request_id"], id);
        assert_eq!(!m["as_recipient"].is_null(), recv, "{id}");
        assert_eq!(!m["as_source"].is_null(), src, "{id}");
        assert_eq!(v["evidence_blake3"], digest.as_str());
        assert_eq!(v["evidence_intact"], true);
        // Only the asker's own tenant appears.
        let text = v.to_string();
        let owner = &tb
            .requests
            .iter()
            .find(|r| r.request_id == id)
            .unwrap()
            .tenant;
        for t in TENANTS.iter().filter(|t| *t != owner) {
            assert!(!text.contains(t), "lookup of {id} names {t}: {text}");
        }
    }
    let hash = kvtrail::schema::hex32(tb.requests[4].output_hash.as_ref().unwrap());
    let v = json(&["--output-hash", &hash.to_uppercase()]);
    assert_eq!(v["status"], "affected");
    assert_eq!(v["matches"][0]["request_id"], 5);
    let v = json(&["--tenant", "globex"]);
    assert_eq!(v["status"], "affected");
    assert_eq!(v["matches"].as_array().unwrap().len(), 2);
    let v = json(&["--external-id", "chatcmpl-not-in-trace"]);
    assert_eq!(v["status"], "not_found");
    let text = kvtrail(["lookup", "scope", "--external-id", "chatcmpl-nope"])
        .cwd(root)
        .run()
        .ok();
    assert!(
        text.contains("NOT FOUND") && text.contains("Not found is not 'not affected'"),
        "{text}"
    );
    let text = kvtrail(["lookup", "scope", "--external-id", &ext(5)])
        .cwd(root)
        .run()
        .ok();
    assert!(
        text.contains("AFFECTED") && text.contains(&digest),
        "{text}"
    );
    let o = kvtrail(["lookup", "scope", "--output-hash", "xyz"])
        .cwd(root)
        .run();
    assert_eq!(o.code, 2);
    // A modified folder still answers but says so, with exit 1.
    std::fs::write(root.join("scope/tenants.csv"), "edited\n").unwrap();
    let o = kvtrail(["lookup", "scope", "--external-id", &ext(5)])
        .cwd(root)
        .run();
    assert_eq!(o.code, 1);
    assert!(o.stdout.as_str().contains("DOES NOT MATCH"));
}

#[test]
fn lookup_on_incomplete_evidence_never_says_not_affected() {
    let mut tb = incident();
    tb.lose(1, 2);
    tb.read(1, 8, 50, 1);
    // A request with no KV events: in the trace, nothing recorded against it.
    tb.req(9, "globex").external_id = Some(ext(9));
    let dir = tempfile::tempdir().unwrap();
    tb.record(&dir.path().join("trace"));
    kvtrail(["scope", "trace", "--out", "scope"])
        .cwd(dir.path())
        .run()
        .ok();
    let v: serde_json::Value = serde_json::from_str(
        &kvtrail(["lookup", "scope", "--json", "--external-id", &ext(9)])
            .cwd(dir.path())
            .run()
            .ok(),
    )
    .unwrap();
    assert_eq!(v["status"], "not_affected_incomplete_evidence", "{v}");
}

#[test]
fn report_html_escapes_the_trace_and_has_every_section() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let html = std::fs::read_to_string(dir.path().join("scope/report.html")).unwrap();
    assert!(!html.contains("<b>workers</b>"));
    // minijinja's HTML escaping: `/` too, as `&#x2f;`.
    assert!(html.contains("glm-mini &#x2f; &lt;b&gt;workers&lt;&#x2f;b&gt;"));
    for id in [
        "headline",
        "timeline",
        "customers",
        "mechanism",
        "coverage",
        "evidence",
    ] {
        assert!(html.contains(&format!("id=\"{id}\"")), "section {id}");
    }
    for t in TENANTS {
        assert!(html.contains(t), "{t}");
    }
    assert!(html.contains("<svg"));
    // No network: nothing is loaded from anywhere.
    for bad in ["http://", "https://", "src=", "@import", "url("] {
        let n = html.matches(bad).count();
        let allowed = if bad == "http://" { 1 } else { 0 }; // the SVG xmlns
        assert_eq!(n, allowed, "{bad} appears {n} times");
    }
}

/// Finds Debian's chromium; FAILS when CI is set and it is missing.
fn chromium() -> Option<PathBuf> {
    for c in ["chromium", "chromium-browser"] {
        if let Ok(o) = Command::new("sh")
            .args(["-c", &format!("command -v {c}")])
            .output()
            && o.status.success()
        {
            let p = String::from_utf8_lossy(&o.stdout).trim().to_string();
            if !p.is_empty() {
                return Some(PathBuf::from(p));
            }
        }
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI is set but chromium is not installed: run .ci/setup.d/40-chromium.sh"
    );
    eprintln!(
        "SKIP report_html_runs_in_a_headless_browser: chromium not installed (run .ci/setup.d/40-chromium.sh)"
    );
    None
}

fn chrome(bin: &Path, profile: &Path, extra: &[&str], page: &Path) -> Output {
    let url = format!("file://{}", page.display());
    Command::new(bin)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--enable-logging=stderr",
            "--v=0",
            &format!("--user-data-dir={}", profile.display()),
        ])
        .args(extra)
        .arg(&url)
        .output()
        .unwrap()
}

/// Lines of a chromium log that report a script error, a console message
/// or a blocked load.
fn console_errors(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| {
            ["Uncaught", "CONSOLE", "Refused to"]
                .iter()
                .any(|b| l.contains(b))
        })
        .map(str::to_string)
        .collect()
}

#[test]
fn report_html_runs_in_a_headless_browser() {
    let Some(bin) = chromium() else { return };
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let page = std::fs::canonicalize(dir.path().join("scope/report.html")).unwrap();
    // The detector first proves it sees a script error in a broken copy.
    let html = std::fs::read_to_string(&page).unwrap();
    let broken = dir.path().join("broken.html");
    std::fs::write(
        &broken,
        html.replace(
            "</main><script>",
            "</main><script>notDefined();</script><script>",
        ),
    )
    .unwrap();
    let o = chrome(&bin, &dir.path().join("profile0"), &["--dump-dom"], &broken);
    assert!(
        !console_errors(&String::from_utf8_lossy(&o.stderr)).is_empty(),
        "the browser log shows no error for a page that throws: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let o = chrome(&bin, &dir.path().join("profile"), &["--dump-dom"], &page);
    let dom = String::from_utf8_lossy(&o.stdout);
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(
        dom.contains("data-ok=\"1\""),
        "the report's script did not run\nDOM head: {}\nlog: {log}",
        &dom[..dom.len().min(400)]
    );
    let hits = console_errors(&log);
    assert!(hits.is_empty(), "browser reported: {hits:#?}");
    assert!(dom.contains("KV-cache isolation report"));
    // The screenshot step, for people to look at.
    let shot = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/report.png");
    let _ = std::fs::remove_file(&shot);
    let o = chrome(
        &bin,
        &dir.path().join("profile2"),
        &[
            &format!("--screenshot={}", shot.display()),
            "--window-size=1200,2400",
            "--hide-scrollbars",
        ],
        &page,
    );
    let meta = std::fs::metadata(&shot);
    assert!(
        meta.as_ref().is_ok_and(|m| m.len() > 10_000),
        "no screenshot at {}: {}",
        shot.display(),
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn config_markers_and_bad_config() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    incident().record(&root.join("trace"));
    kvtrail(["scope", "trace", "--out", "scope"])
        .cwd(root)
        .run()
        .ok();
    let o = kvtrail(["notify", "scope", "--out", "bare"])
        .cwd(root)
        .run();
    o.ok();
    let err = o.stderr.as_str();
    assert!(
        err.contains("operator_name") && err.contains("measures"),
        "{err}"
    );
    let notice = std::fs::read_to_string(root.join("bare/customers/globex/notice.json")).unwrap();
    for f in [
        "operator_name",
        "dpo_contact",
        "incident_id",
        "became_aware",
        "measures",
    ] {
        assert!(
            notice.contains(&format!("[to fill in: {f} in notify.toml]")),
            "{f}"
        );
    }
    let letter = std::fs::read_to_string(root.join("bare/customers/globex/letter.md")).unwrap();
    assert!(letter.matches("to fill in: ").count() >= 5, "{letter}");
    std::fs::write(root.join("typo.toml"), "operator_nme = \"x\"\n").unwrap();
    let o = kvtrail(["notify", "scope", "--out", "t", "--config", "typo.toml"])
        .cwd(root)
        .run();
    assert_eq!(o.code, 2);
    let err = o.stderr.as_str();
    assert!(
        err.contains("typo.toml") && err.contains("operator_nme"),
        "{err}"
    );
    // An existing non-empty output folder is refused.
    let o = kvtrail(["notify", "scope", "--out", "bare"])
        .cwd(root)
        .run();
    assert_eq!(o.code, 2);
    assert!(o.stderr.as_str().contains("not empty"));
}

#[test]
fn scope_records_a_trace_file_that_no_longer_matches_its_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    incident().record(&root.join("trace"));
    let victim = files(&root.join("trace"))
        .into_iter()
        .find(|f| f.starts_with("requests/"))
        .unwrap();
    // Rewrite the file as valid Parquet with one status changed.
    let p = root.join("trace").join(&victim);
    let mut rows: Vec<kvtrail::schema::RequestRecord> = kvtrail::trace::RequestFileReader::open(&p)
        .unwrap()
        .flat_map(|b| b.unwrap())
        .collect();
    rows[0].http_status = 299;
    kvtrail::trace::write::write_single_file(&p, &[kvtrail::trace::write::requests_batch(&rows)])
        .unwrap();
    let o = kvtrail(["scope", "trace", "--out", "scope"])
        .cwd(root)
        .run();
    assert_eq!(o.code, 0, "{}", o.stderr.as_str());
    let ev: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join("scope/evidence.json")).unwrap()).unwrap();
    let problems = ev["inputs"][0]["problems"].to_string();
    assert!(problems.contains(&victim), "{problems}");
    let html = std::fs::read_to_string(root.join("scope/report.html")).unwrap();
    assert!(html.contains("input problems") && html.contains(&victim.replace('/', "&#x2f;")));
    let (code, out) = verify(&root.join("scope"));
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("NOTE recorded") && out.contains(&victim),
        "{out}"
    );
}

#[test]
fn verify_checks_outputs_when_the_inputs_are_elsewhere() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path());
    let root = dir.path();
    // Ship the scope folder alone: outputs still verify, inputs are a note.
    let shipped = root.join("shipped");
    std::fs::create_dir_all(&shipped).unwrap();
    std::fs::rename(root.join("scope"), shipped.join("scope")).unwrap();
    let (code, out) = verify(&shipped.join("scope"));
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("NOTE inputs not on this machine"), "{out}");
    assert!(out.contains("0 input files checked"), "{out}");
    let p = shipped.join("scope/summary.json");
    let mut b = std::fs::read(&p).unwrap();
    b[10] ^= 1;
    std::fs::write(&p, b).unwrap();
    let (code, out) = verify(&shipped.join("scope"));
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("modified") && out.contains("summary.json"),
        "{out}"
    );
}

/// The incident plus cross-tenant prefix-cache hits in the prefill pool:
/// r9 globex caches a prefix that r10 hooli (a customer with nothing else)
/// is served from; r11 initech caches one that r12 umbrella (also a
/// recipient of foreign data) is served from.
pub(crate) fn incident_with_hits(
    scope: Option<kvtrail::trace::manifest::PrefixCacheScope>,
) -> TraceBuilder {
    let mut tb = incident();
    tb.deployment.prefix_cache_scope = scope;
    for (id, t) in [
        (9, "globex"),
        (10, "hooli"),
        (11, "initech"),
        (12, "umbrella"),
    ] {
        let r = tb.req(id, t);
        r.external_id = Some(ext(id));
        r.arrival_ns = BASE + id as i64 * HOUR;
        r.finish_ns = Some(BASE + id as i64 * HOUR + 40_000_000_000);
        r.prompt_tokens = 4;
        r.prefilled_tokens = Some(4);
        r.prefill_pool = Some(0);
    }
    let n = tb.events.len();
    tb.write(0, 9, 50, 4);
    tb.share(0, 10, 50, 4);
    tb.read(0, 10, 50, 4);
    tb.write(0, 11, 56, 4);
    tb.share(0, 12, 56, 4);
    tb.read(0, 12, 56, 3);
    for (k, e) in tb.events[n..].iter_mut().enumerate() {
        e.ts_ns = BASE + e.request_id as i64 * HOUR + (k as i64 + 1) * 1_000_000_000;
    }
    tb
}

fn scope_and_notify(root: &Path, tb: &TraceBuilder) {
    tb.record(&root.join("trace"));
    kvtrail(["scope", "trace", "--out", "scope"])
        .cwd(root)
        .run()
        .ok();
    std::fs::write(root.join("notify.toml"), CONFIG).unwrap();
    kvtrail([
        "notify",
        "scope",
        "--out",
        "packs",
        "--config",
        "notify.toml",
    ])
    .cwd(root)
    .run()
    .ok();
}

fn json_file(p: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn prefix_cache_breaches_are_notified_on_both_sides_and_never_name_the_other_customer() {
    use kvtrail::trace::manifest::PrefixCacheScope;
    let dir = tempfile::tempdir().unwrap();
    let tb = incident_with_hits(Some(PrefixCacheScope::Tenant));
    scope_and_notify(dir.path(), &tb);
    let sum = json_file(&dir.path().join("scope/summary.json"));
    assert_eq!(sum["counts"]["cross_tenant_shared_responses"], 2, "{sum}");
    let packs = dir.path().join("packs/customers");
    let mut folders: Vec<String> = std::fs::read_dir(&packs)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    folders.sort();
    assert_eq!(
        folders,
        ["acme-corp", "globex", "hooli", "initech", "umbrella"]
    );
    // The isolation invariant over a trace with hits: no pack names another
    // tenant or holds another tenant's ids or hashes.
    assert_packs_are_isolated(&packs, &tb);
    let notice = |t: &str| json_file(&packs.join(t).join("notice.json"));
    let ids = |v: &serde_json::Value, k: &str| -> Vec<u64> {
        v[k].as_array()
            .map(|a| {
                a.iter()
                    .map(|e| e["request_id"].as_u64().unwrap())
                    .collect()
            })
            .unwrap_or_default()
    };
    // (customer, roles, served, revealed)
    type Case<'a> = (&'a str, &'a [&'a str], &'a [u64], &'a [u64]);
    let cases: [Case; 5] = [
        ("acme-corp", &["recipient", "source"], &[], &[]),
        ("globex", &["source", "prefix_cache_source"], &[], &[9]),
        ("hooli", &["prefix_cache_reader"], &[10], &[]),
        (
            "initech",
            &["recipient", "source", "prefix_cache_source"],
            &[],
            &[11],
        ),
        (
            "umbrella",
            &["recipient", "prefix_cache_reader"],
            &[12],
            &[],
        ),
    ];
    for (t, roles, served, revealed) in cases {
        let v = notice(t);
        assert_eq!(v["roles"], serde_json::json!(roles), "{t}");
        assert_eq!(ids(&v, "prefix_cache_served"), served, "{t}");
        assert_eq!(ids(&v, "prefix_cache_revealed"), revealed, "{t}");
        for key in ["prefix_cache_served", "prefix_cache_revealed"] {
            for e in v[key].as_array().into_iter().flatten() {
                let id = e["request_id"].as_u64().unwrap();
                let owner = tb.requests.iter().find(|r| r.request_id == id).unwrap();
                assert_eq!(owner.tenant, t, "{t}/notice.json lists request {id}");
            }
        }
        let letter = std::fs::read_to_string(packs.join(t).join("letter.md")).unwrap();
        assert!(letter.contains("prefix-cache isolation breach"), "{t}");
        let lower = letter.to_lowercase();
        for bad in ["prompt content was disclosed to", "leaked", "leak of"] {
            assert!(!lower.contains(bad), "{t}: {bad}");
        }
    }
    let hooli = notice("hooli");
    assert_eq!(hooli["prefix_cache_served"][0]["tokens"], 4);
    assert_eq!(hooli["prefix_cache_served"][0]["external_id"], ext(10));
    assert_eq!(notice("umbrella")["prefix_cache_served"][0]["tokens"], 3);
    assert_eq!(
        notice("initech")["prefix_cache_revealed"][0]["responses"],
        1
    );
    let reg = json_file(&dir.path().join("packs/register.json"));
    assert_eq!(reg["prefix_cache"]["scope"], "tenant");
    assert_eq!(reg["prefix_cache"]["isolation_breach"], true);
    assert_eq!(reg["prefix_cache"]["responses"], 2);
    assert_eq!(reg["prefix_cache"]["source_requests"], 2);
    assert_eq!(reg["prefix_cache"]["tokens"], 7);
    assert_eq!(reg["notification_packs"].as_array().unwrap().len(), 5);
    let csv = std::fs::read_to_string(dir.path().join("packs/register.csv")).unwrap();
    assert!(
        csv.lines()
            .next()
            .unwrap()
            .ends_with(",prefix_cache_unattributed"),
        "{csv}"
    );
    assert_eq!(csv.lines().count(), 2, "{csv}");
}

#[test]
fn prefix_cache_hits_under_a_global_cache_are_counted_in_the_register_only() {
    use kvtrail::trace::manifest::PrefixCacheScope;
    for scope in [None, Some(PrefixCacheScope::Global)] {
        let dir = tempfile::tempdir().unwrap();
        let tb = incident_with_hits(scope);
        scope_and_notify(dir.path(), &tb);
        let packs = dir.path().join("packs/customers");
        let mut folders: Vec<String> = std::fs::read_dir(&packs)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        folders.sort();
        // hooli has nothing but a hit: no letter.
        assert_eq!(folders, TENANTS, "{scope:?}");
        assert_packs_are_isolated(&packs, &tb);
        for t in TENANTS {
            let text = std::fs::read_to_string(packs.join(t).join("notice.json")).unwrap();
            assert!(!text.contains("prefix_cache"), "{t}: {text}");
        }
        let reg = json_file(&dir.path().join("packs/register.json"));
        assert_eq!(reg["prefix_cache"]["scope"], "global");
        assert_eq!(reg["prefix_cache"]["isolation_breach"], false);
        assert_eq!(reg["prefix_cache"]["responses"], 2);
        assert!(
            reg["nature"]
                .as_str()
                .unwrap()
                .contains("Information: 2 responses")
        );
    }
}

/// Defect 14: requests missing from the requests table (unknown tenant)
/// and the engine are never customers, and a response whose reader or
/// source is unknown is never said to have carried another customer's
/// data as a certainty.
///
/// - r1 acme writes slots 0-3, r3 acme slots 10-11; r2 globex 4-7.
/// - r7 (missing) writes 8-9; the engine (request 0) writes 12-13.
/// - r2 globex reads 0-1 (acme r1: certainly another customer's) and 12-13
///   (the engine's).
/// - r9 (missing) reads 0-1 (acme r1) and 10-11 (acme r3): its tenant is
///   unknown.
/// - r1 acme reads 8-9 (r7, unknown tenant).
///
/// Customers: recipients globex and acme (2), sources acme (1). One
/// response (r2) certainly carried another customer's data; for two (r9,
/// r1) it cannot be told.
fn unknown_tenants() -> TraceBuilder {
    let mut tb = TraceBuilder::pd();
    tb.req(1, "acme");
    tb.req(2, "globex");
    tb.req(3, "acme");
    tb.write(0, 1, 0, 4);
    tb.write(0, 2, 4, 4);
    tb.write(0, 7, 8, 2);
    tb.write(0, 3, 10, 2);
    tb.write(0, 0, 12, 2);
    tb.read(0, 2, 0, 2);
    tb.read(0, 2, 12, 2);
    tb.read(0, 9, 0, 2);
    tb.read(0, 9, 10, 2);
    tb.read(0, 1, 8, 2);
    tb
}

#[test]
fn defect14_unknown_tenant_is_never_counted_as_a_customer() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    scope_and_notify(root, &unknown_tenants());
    let sum = json_file(&root.join("scope/summary.json"));
    let c = &sum["counts"];
    assert_eq!(c["affected_responses"], 3, "{c}");
    assert_eq!(c["recipient_tenants"], 2, "customers receiving: {c}");
    assert_eq!(c["source_tenants"], 1, "customers as sources: {c}");
    let verdict = sum["verdict"].as_str().unwrap();
    assert!(
        !verdict.contains("3 cross-tenant"),
        "an unknown tenant is no certain cross-tenant read: {verdict}"
    );

    let reg = json_file(&root.join("packs/register.json"));
    assert_eq!(reg["recipient_customers"], 2, "{reg}");
    assert_eq!(reg["source_customers"], 1, "{reg}");
    assert_eq!(reg["unattributed_responses"], 1, "{reg}");
    assert_eq!(reg["unattributed_source_requests"], 1, "{reg}");
    assert_eq!(reg["cross_customer_responses"], 1, "{reg}");
    let nature = reg["nature"].as_str().unwrap();
    assert!(
        nature.contains("in 1 of them that data belonged to another customer"),
        "{nature}"
    );
    let md = std::fs::read_to_string(root.join("packs/register.md")).unwrap();
    assert!(
        md.contains("2 on the receiving side, 1 on the source side"),
        "{md}"
    );
    let csv = std::fs::read_to_string(root.join("packs/register.csv")).unwrap();
    assert!(!csv.contains("in 3 of them"), "{csv}");

    // acme: r3's KV was read only by r9, whose tenant is unknown; r1
    // received KV of r7, whose tenant is unknown.
    let acme = json_file(&root.join("packs/customers/acme/notice.json"));
    let exposed = acme["exposed_requests"].as_array().unwrap();
    let r3 = exposed.iter().find(|e| e["request_id"] == 3).unwrap();
    assert_ne!(
        r3["reached_other_customers"], true,
        "read only by a response of unknown tenant: {r3}"
    );
    let r1 = exposed.iter().find(|e| e["request_id"] == 1).unwrap();
    assert_eq!(r1["reached_other_customers"], true, "globex read it: {r1}");
    let received = acme["received_responses"].as_array().unwrap();
    let got = received.iter().find(|e| e["request_id"] == 1).unwrap();
    assert_ne!(
        got["other_customer_data"], true,
        "the source's tenant is unknown: {got}"
    );
    assert_eq!(
        got["other_customer_data"],
        serde_json::Value::Null,
        "unknown, neither yes nor no: {got}"
    );
    assert_eq!(
        r3["reached_other_customers"],
        serde_json::Value::Null,
        "unknown, neither yes nor no: {r3}"
    );
    let letter = std::fs::read_to_string(root.join("packs/customers/acme/letter.md")).unwrap();
    assert!(
        !letter.contains("in 3 of them that data belonged to another customer"),
        "{letter}"
    );
    let globex = json_file(&root.join("packs/customers/globex/notice.json"));
    let g2 = &globex["received_responses"][0];
    assert_eq!(g2["other_customer_data"], true, "{g2}");

    // The human summary and report.html count customers only.
    let human = kvtrail(["scope", "trace"]).cwd(root).run();
    assert!(!human.stdout.contains("3 cross-tenant"), "{}", human.stdout);
    let html = std::fs::read_to_string(root.join("scope/report.html")).unwrap();
    for (n, label) in [
        ("1", "responses with another customer&#x27;s data"),
        ("2", "customers who received foreign data"),
        ("1", "customers whose data leaked"),
    ] {
        let card = format!(r#"<div class="n">{n}</div><div class="l">{label}</div>"#);
        assert!(html.contains(&card), "report.html lacks {card}");
    }
}
