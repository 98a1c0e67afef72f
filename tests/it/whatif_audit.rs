//! `kvtrail audit`: the incident's deployment fails the gate and the fixed
//! one passes (simulator configs and real-size manifests); trace checks
//! find the incident's and the siblings' defects and pass clean traces.

use crate::support::cli::kvtrail;
use crate::support::sim::simulate;
use crate::support::whatif::replay;
use kvtrail::audit::{AuditReport, audit_file, audit_trace};
use kvtrail::lineage::LineageOptions;
use kvtrail::progress::NoReporter;
use kvtrail::sim::SimConfig;
use kvtrail::trace::Trace;

fn kinds(r: &AuditReport) -> Vec<String> {
    r.findings
        .iter()
        .filter(|f| f.severity != kvtrail::audit::Severity::Note)
        .map(|f| f.kind.clone())
        .collect()
}

fn manifest(ctx: u64, prefill: u64, decode: u64, ps: (u32, u32)) -> String {
    format!(
        r#"{{"format":"kvtrail-trace","version":1,
 "deployment":{{"name":"glm","engine":"sglang 0.5.19","context_window":{ctx},
  "pools":[{{"id":0,"name":"prefill-0","role":"prefill","capacity_tokens":{prefill},"page_size":{}}},
           {{"id":1,"name":"decode-0","role":"decode","capacity_tokens":{decode},"page_size":{}}}]}},
 "capture":{{"writer":"hook","started_ns":0,"ended_ns":0,"complete":true}}}}"#,
        ps.0, ps.1
    )
}

#[test]
fn deployments() {
    let dir = tempfile::tempdir().unwrap();
    let m = 1_048_576u64;
    // (file name, contents, expected non-note finding kinds, exit code)
    let incident_cfg = toml::to_string(&SimConfig::default()).unwrap();
    let fixed_cfg = {
        let mut c = SimConfig::default();
        c.set("prefill.capacity_tokens=32768").unwrap();
        c.set("engine=sglang-0.5.22").unwrap();
        toml::to_string(&c).unwrap()
    };
    let cases: Vec<(&str, String, Vec<&str>, i32)> = vec![
        (
            "incident.toml",
            incident_cfg,
            vec!["prefill_pool_below_decode_limit"],
            1,
        ),
        ("fixed.toml", fixed_cfg, vec![], 0),
        (
            "incident.json",
            manifest(m, 681_280, 2 * m, (64, 64)),
            vec!["prefill_pool_below_decode_limit"],
            1,
        ),
        ("fixed.json", manifest(m, 2 * m, 2 * m, (64, 64)), vec![], 0),
        ("tight.json", manifest(m, m, m, (64, 64)), vec![], 0),
        (
            "small.json",
            manifest(m, m / 2, m / 2, (64, 64)),
            vec!["pool_below_context_window", "pool_below_context_window"],
            1,
        ),
        (
            "pages.json",
            manifest(m, 2 * m, 2 * m, (1, 64)),
            vec!["page_size_mismatch"],
            1,
        ),
    ];
    for (name, text, expect, code) in cases {
        let p = dir.path().join(name);
        std::fs::write(&p, &text).unwrap();
        let r = audit_file(&p).unwrap();
        assert_eq!(kinds(&r), expect, "{name}: {:#?}", r.findings);
        assert_eq!(r.exit_code(), code, "{name}");
        let (c, out, err) = kvtrail(["audit", "--deployment", p.to_str().unwrap()])
            .run()
            .into_parts();
        assert_eq!(c, code, "{name}: {out}{err}");
    }
    // The incident's numbers in the message: 681,274 = min(1,048,575, 681,279) - 5.
    let p = dir.path().join("incident.json");
    let r = audit_file(&p).unwrap();
    assert!(
        r.findings[0].detail.contains("681,274"),
        "{}",
        r.findings[0].detail
    );
    assert!(
        r.findings[0]
            .recommendation
            .as_deref()
            .unwrap()
            .contains("2,097,152")
    );
    // Bad input: exit 2.
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "context_window = \"big\"").unwrap();
    let (c, _, err) = kvtrail(["audit", "--deployment", bad.to_str().unwrap()])
        .run()
        .into_parts();
    assert_eq!(c, 2, "{err}");
    let (c, _, _) = kvtrail(["audit", "--deployment", "/nonexistent.toml"])
        .run()
        .into_parts();
    assert_eq!(c, 2);
}

fn audit(trace: &std::path::Path) -> AuditReport {
    audit_trace(
        &Trace::open(trace).unwrap(),
        &LineageOptions::default(),
        &NoReporter,
    )
    .unwrap()
}

fn ids(r: &AuditReport, kind: &str) -> Vec<u64> {
    r.findings
        .iter()
        .find(|f| f.kind == kind)
        .map(|f| f.request_ids.clone())
        .unwrap_or_default()
}

#[test]
fn traces() {
    let inc = simulate("incident", Some(1200), 1, &[]);
    let truth = inc.truth.affected_ids();
    let r = audit(&inc.trace);
    for k in [
        "rejected_yet_2xx",
        "prefilled_less_than_prompt_2xx",
        "decode_read_beyond_transfer",
    ] {
        assert_eq!(ids(&r, k), truth, "{k}");
    }
    assert!(kinds(&r).contains(&"prefill_pool_below_decode_limit".to_string()));
    assert_eq!(r.exit_code(), 1);

    // The buggy engine with a 2x pool: clean deployment, clean trace.
    let out = inc.dir.path().join("pool2x");
    replay(&inc.trace, None, &["prefill.capacity_tokens=32768"], &out);
    let r = audit(&out);
    assert_eq!(kinds(&r), Vec::<String>::new(), "{:#?}", r.findings);
    assert_eq!(r.exit_code(), 0);
    let (c, _, _) = kvtrail(["audit", out.to_str().unwrap(), "--json"])
        .run()
        .into_parts();
    assert_eq!(c, 0);

    // Fixed engine with auto-truncation: the stale tail is caught in the events.
    let out = inc.dir.path().join("trunc");
    let run = replay(
        &inc.trace,
        Some("sglang-0.5.22"),
        &["allow_auto_truncate=true"],
        &out,
    );
    let r = audit(&out);
    assert_eq!(
        ids(&r, "decode_read_beyond_transfer"),
        run.output.truth.affected_ids()
    );

    // Siblings.
    let s = simulate("sibling-inflight", Some(1200), 1, &[]);
    let r = audit(&s.trace);
    assert!(
        !ids(&r, "transfer_into_reused_slots").is_empty(),
        "{:#?}",
        r.findings
    );
    let s = simulate("sibling-stale-copy", Some(600), 1, &[]);
    let r = audit(&s.trace);
    assert!(
        !ids(&r, "transfer_from_released_slots").is_empty(),
        "{:#?}",
        r.findings
    );
    assert!(ids(&r, "decode_read_beyond_transfer").is_empty());
}
