//! Counterfactual replay: on every affected response of every simulated
//! scenario the as-recorded re-run reproduces the recorded output hash
//! (fidelity), and the re-run without foreign KV changes the output; a
//! wrong evaluator is caught; traces from other engines are skipped with a
//! clear message and exit 0.

use crate::support::cli::kvtrail;
use crate::support::sim::simulate;
use crate::support::whatif::replay;
use kvtrail::lineage::LineageOptions;
use kvtrail::progress::NoReporter;
use kvtrail::trace::Trace;
use kvtrail::whatif::counterfactual::{
    Context, CounterfactualReport, CpuModel, Fidelity, ModelEval, counterfactual,
};

fn run(trace: &std::path::Path, model: &dyn ModelEval) -> CounterfactualReport {
    counterfactual(
        &Trace::open(trace).unwrap(),
        model,
        &LineageOptions::default(),
        &NoReporter,
    )
    .unwrap()
}

/// (scenario, requests, replay engine and sets applied to its trace first)
const CASES: &[(&str, u64, Option<&str>, &[&str])] = &[
    ("incident", 1500, None, &[]),
    ("steady", 800, None, &[]),
    ("sibling-inflight", 1200, None, &[]),
    ("sibling-stale-copy", 600, None, &[]),
    // a what-if trace: the fixed engine with auto-truncation (stale tails)
    (
        "incident",
        1000,
        Some("sglang-0.5.22"),
        &["allow_auto_truncate=true"],
    ),
];

#[test]
fn fidelity_on_every_affected_response_of_every_scenario() {
    for &(name, n, engine, sets) in CASES {
        let sim = simulate(name, Some(n), 1, &[]);
        let (trace, truth_ids) = if engine.is_some() || !sets.is_empty() {
            let out = sim.dir.path().join("whatif");
            let r = replay(&sim.trace, engine, sets, &out);
            (out, r.output.truth.affected_ids())
        } else {
            (sim.trace.clone(), sim.truth.affected_ids())
        };
        let r = run(&trace, &CpuModel);
        assert!(r.applicable, "{name}: {:?}", r.reason);
        let ids: Vec<u64> = r.responses.iter().map(|x| x.request_id).collect();
        assert_eq!(ids, truth_ids, "{name}: the affected set is the truth's");
        assert_eq!(r.fidelity_mismatch, 0, "{name}");
        for x in &r.responses {
            let expect = if x.http_status == 200 {
                Fidelity::Ok
            } else {
                Fidelity::NoOutputRecorded
            };
            assert_eq!(x.fidelity, expect, "{name} request {}", x.request_id);
            if x.fidelity == Fidelity::Ok {
                assert_eq!(
                    x.output_changed,
                    Some(true),
                    "{name} request {}",
                    x.request_id
                );
                assert!(x.foreign_positions > 0 && x.foreign_attention_share > 0.0);
                assert!(x.foreign_attention_share <= 1.0);
            }
        }
        if name == "steady" {
            assert_eq!(r.affected_responses, 0);
        } else {
            assert!(r.fidelity_ok > 0, "{name}: something to check");
        }
    }
}

#[test]
fn incident_placeholders_attend_almost_only_foreign_kv() {
    let sim = simulate("incident", Some(1500), 1, &[]);
    let r = run(&sim.trace, &CpuModel);
    assert!(!r.responses.is_empty());
    for x in &r.responses {
        // 1 own prompt token + the generated ones; the rest is stale KV.
        assert!(
            x.foreign_attention_share > 0.9,
            "{}",
            x.foreign_attention_share
        );
    }
}

/// An evaluator that is off by one token: fidelity must fail.
struct Wrong;

impl ModelEval for Wrong {
    fn name(&self) -> &'static str {
        "wrong"
    }
    fn eval(&self, batch: &[Context]) -> kvtrail::Result<Vec<Vec<u32>>> {
        let mut out = CpuModel.eval(batch)?;
        for o in &mut out {
            if let Some(t) = o.first_mut() {
                *t ^= 1;
            }
        }
        Ok(out)
    }
}

#[test]
fn a_wrong_evaluator_fails_fidelity_and_the_cli_exits_1_only_then() {
    let sim = simulate("incident", Some(1000), 1, &[]);
    let r = run(&sim.trace, &Wrong);
    assert!(r.fidelity_mismatch > 0);
    assert_eq!(r.fidelity_ok, 0);
    assert!(r.responses.iter().all(|x| x.output_changed.is_none()));
    let (code, out, err) = kvtrail(["counterfactual", sim.trace.to_str().unwrap(), "--json"])
        .run()
        .into_parts();
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["fidelity_mismatch"], 0);
    assert_eq!(v["applicable"], true);
}

#[test]
fn traces_from_other_engines_are_skipped_with_a_clear_message() {
    let golden = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/golden-v1");
    let r = run(&golden, &CpuModel);
    assert!(!r.applicable);
    assert!(r.responses.is_empty());
    assert!(
        r.reason
            .as_deref()
            .unwrap()
            .contains("needs the reference model")
    );
    let (code, out, _) = kvtrail(["counterfactual", golden.to_str().unwrap()])
        .run()
        .into_parts();
    assert_eq!(code, 0);
    assert!(
        out.contains("counterfactual replay needs the reference model"),
        "{out}"
    );
    let (code, _, err) = kvtrail(["counterfactual", "/nonexistent"])
        .run()
        .into_parts();
    assert_eq!(code, 2, "{err}");
}
