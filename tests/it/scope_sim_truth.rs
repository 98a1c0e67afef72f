//! Scope against the simulator's ground truth: for every scenario (and the
//! engine versions and knobs that change the request path), the affected
//! responses, their foreign tokens, cross-tenant flags and per-source
//! breakdown, and the blank reads equal the truth exactly (precision and
//! recall 100%), all `confirmed` with complete coverage. The committed
//! `traces/incident-mini` is checked against its committed truth.

use crate::support::sim;

use std::collections::BTreeMap;
use std::path::Path;

use kvtrail::scope::{Confidence, ScopeReport};
use kvtrail::sim::Truth;

fn scope(dir: &Path) -> ScopeReport {
    let trace = kvtrail::trace::Trace::open(dir).unwrap();
    kvtrail::scope::scope(
        &trace,
        &kvtrail::lineage::LineageOptions::default(),
        &kvtrail::progress::NoReporter,
    )
    .unwrap()
}

/// Compares a scope report with a truth file; `what` names the case.
fn check(what: &str, r: &ScopeReport, truth: &Truth) {
    assert!(r.coverage.complete, "{what}: {:?}", r.coverage.notes);
    let got: BTreeMap<u64, _> = r
        .affected_responses
        .iter()
        .map(|a| {
            assert_eq!(
                a.confidence,
                Confidence::Confirmed,
                "{what}: r{}",
                a.request_id
            );
            assert_eq!((a.unknown_tokens, a.uncertain_tokens), (0, 0), "{what}");
            let srcs: Vec<(u64, String, u64)> = a
                .sources
                .iter()
                .map(|s| (s.request_id, s.tenant.to_string(), s.tokens))
                .collect();
            (
                a.request_id,
                (
                    a.tenant.to_string(),
                    a.http_status,
                    a.foreign_tokens,
                    a.cross_tenant,
                    srcs,
                ),
            )
        })
        .collect();
    let want: BTreeMap<u64, _> = truth
        .affected
        .iter()
        .map(|a| {
            let srcs: Vec<(u64, String, u64)> = a
                .sources
                .iter()
                .map(|s| (s.request_id, s.tenant.clone(), s.tokens))
                .collect();
            (
                a.request_id,
                (
                    a.tenant.clone(),
                    Some(a.http_status),
                    a.foreign_tokens,
                    a.cross_tenant,
                    srcs,
                ),
            )
        })
        .collect();
    let false_pos: Vec<&u64> = got.keys().filter(|k| !want.contains_key(k)).collect();
    let missed: Vec<&u64> = want.keys().filter(|k| !got.contains_key(k)).collect();
    assert!(
        false_pos.is_empty(),
        "{what}: precision < 100%: {false_pos:?}"
    );
    assert!(missed.is_empty(), "{what}: recall < 100%: {missed:?}");
    assert_eq!(got, want, "{what}: per-response details");
    let blank_got: Vec<(u64, u64)> = r
        .blank_read_responses
        .iter()
        .map(|b| (b.request_id, b.tokens))
        .collect();
    let blank_want: Vec<(u64, u64)> = truth
        .blank
        .iter()
        .map(|b| (b.request_id, b.blank_tokens))
        .collect();
    assert_eq!(blank_got, blank_want, "{what}: blank reads");
    assert_eq!(r.counts.requests, truth.summary.requests, "{what}");
    assert_eq!(r.counts.kv_events, truth.summary.kv_events, "{what}");
}

#[test]
fn every_scenario_matches_the_ground_truth() {
    let cases: &[(&str, &[&str])] = &[
        ("incident", &[]),
        ("incident", &["allow_auto_truncate=true"]),
        ("incident", &["engine=sglang-0.5.20"]),
        (
            "incident",
            &["engine=sglang-0.5.23", "allow_auto_truncate=true"],
        ),
        ("incident", &["scrub_on_free=true"]),
        ("steady", &[]),
        ("sibling-inflight", &[]),
        ("sibling-stale-copy", &[]),
    ];
    let mut affected_somewhere = 0;
    for (name, sets) in cases {
        let run = sim::simulate(name, Some(1_500), 5, sets);
        let r = scope(&run.trace);
        check(&format!("{name} {sets:?}"), &r, &run.truth);
        affected_somewhere += r.affected_responses.len();
    }
    assert!(affected_somewhere > 0, "the scenarios exercise exposures");
}

#[test]
fn committed_incident_mini_matches_its_truth() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces");
    let truth: Truth = serde_json::from_str(
        &std::fs::read_to_string(root.join("incident-mini.truth.json")).unwrap(),
    )
    .unwrap();
    let r = scope(&root.join("incident-mini"));
    check("traces/incident-mini", &r, &truth);
    assert!(!r.affected_responses.is_empty());
}
