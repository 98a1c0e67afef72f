//! The simulator's ground truth against the replay (`kvtrail::scope`):
//! for every scenario and knob, the affected responses, their foreign
//! token counts, their sources (with tokens) and the blank reads must be
//! identical: precision and recall 100% both ways.

use crate::support::sim;

use std::collections::BTreeMap;

use kvtrail::lineage::LineageOptions;
use kvtrail::progress::NoReporter;
use kvtrail::trace::Trace;
use sim::simulate;

type Findings = BTreeMap<u64, (u64, Vec<(u64, u64)>)>;

fn check(name: &str, sets: &[&str]) {
    let run = simulate(name, Some(1500), 5, sets);
    let trace = Trace::open(&run.trace).unwrap();
    let report = kvtrail::scope::scope(&trace, &LineageOptions::default(), &NoReporter).unwrap();
    let truth: Findings = run
        .truth
        .affected
        .iter()
        .map(|a| {
            let s = a.sources.iter().map(|s| (s.request_id, s.tokens)).collect();
            (a.request_id, (a.foreign_tokens, s))
        })
        .collect();
    let found: Findings = report
        .affected_responses
        .iter()
        .filter(|r| r.foreign_tokens > 0)
        .map(|r| {
            let mut s: Vec<(u64, u64)> =
                r.sources.iter().map(|s| (s.request_id, s.tokens)).collect();
            s.sort_unstable();
            (r.request_id, (r.foreign_tokens, s))
        })
        .collect();
    assert_eq!(found, truth, "{name} {sets:?}: scope vs truth");
    assert!(
        report
            .affected_responses
            .iter()
            .all(|r| r.unknown_tokens == 0 && r.uncertain_tokens == 0),
        "{name}: a complete capture from engine start leaves nothing unknown"
    );
    let blank: BTreeMap<u64, u64> = run
        .truth
        .blank
        .iter()
        .map(|b| (b.request_id, b.blank_tokens))
        .collect();
    let found_blank: BTreeMap<u64, u64> = report
        .blank_read_responses
        .iter()
        .map(|b| (b.request_id, b.tokens))
        .collect();
    assert_eq!(found_blank, blank, "{name} {sets:?}: blank reads");
    assert_eq!(report.blank_reads, run.truth.summary.blank_reads);
}

#[test]
fn scope_finds_exactly_the_simulated_truth() {
    for (name, sets) in [
        ("incident", vec![]),
        ("incident", vec!["engine=sglang-0.5.20"]),
        (
            "incident",
            vec!["engine=sglang-0.5.23", "allow_auto_truncate=true"],
        ),
        ("incident", vec!["scrub_on_free=true"]),
        ("incident", vec!["decode_radix_cache=true"]),
        ("steady", vec![]),
        ("sibling-inflight", vec![]),
        ("sibling-stale-copy", vec![]),
    ] {
        check(name, &sets);
    }
}
