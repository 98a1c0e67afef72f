//! What-if replay and diff on the incident scenario: the fixed engine
//! (no exposure; 500 after decode's timeout, or 400 with the router that
//! acts on prefill's error; the decode capacity those requests hold), the
//! buggy engine with a 2x prefill pool (no exposure), the buggy engine
//! unchanged (the same trace, byte for byte: determinism), and the
//! stale-tail reads coming back with allow_auto_truncate under the fix.

use std::collections::BTreeSet;

use crate::support::cli::kvtrail;
use crate::support::files;
use crate::support::sim::{Simulated, simulate};
use crate::support::whatif::replay;
use kvtrail::lineage::LineageOptions;
use kvtrail::progress::NoReporter;
use kvtrail::trace::Trace;
use kvtrail::whatif::diff::{DiffReport, diff};

const REQUESTS: u64 = 1200;

fn diff_of(before: &std::path::Path, after: &std::path::Path) -> DiffReport {
    diff(
        &Trace::open(before).unwrap(),
        &Trace::open(after).unwrap(),
        &LineageOptions::default(),
        &NoReporter,
    )
    .unwrap()
}

fn affected(sim: &Simulated) -> BTreeSet<u64> {
    let ids: BTreeSet<u64> = sim.truth.affected_ids().into_iter().collect();
    assert!(
        !ids.is_empty(),
        "the incident scenario must have affected responses"
    );
    ids
}

fn changed_ids(d: &DiffReport) -> BTreeSet<u64> {
    d.changed.iter().map(|c| c.request_id).collect()
}

#[test]
fn buggy_engine_unchanged_reproduces_the_trace_byte_for_byte() {
    let sim = simulate("incident", Some(REQUESTS), 1, &[]);
    let out = sim.dir.path().join("same");
    let run = replay(&sim.trace, None, &[], &out);
    assert_eq!(run.output.truth.affected_ids(), sim.truth.affected_ids());
    assert_eq!(files::contents(&sim.trace), files::contents(&out));
    let d = diff_of(&sim.trace, &out);
    assert!(d.changed.is_empty());
    assert_eq!(d.unchanged, REQUESTS);
    assert_eq!(
        d.exposure.before.affected_responses,
        d.exposure.after.affected_responses
    );
}

#[test]
fn fixed_engine_answers_500_after_the_timeout_and_holds_decode_capacity() {
    let sim = simulate("incident", Some(REQUESTS), 1, &[]);
    let hit = affected(&sim);
    let out = sim.dir.path().join("fix");
    replay(&sim.trace, Some("sglang-0.5.22"), &[], &out);
    let d = diff_of(&sim.trace, &out);
    assert_eq!(d.exposure.after.affected_responses, 0);
    assert!(d.exposure.after.evidence_complete);
    assert_eq!(d.exposure.before.affected_responses, hit.len() as u64);
    assert_eq!(changed_ids(&d), hit, "only the over-long requests change");
    assert_eq!(d.unchanged, REQUESTS - hit.len() as u64);
    for c in &d.changed {
        assert_eq!(
            (c.before.http_status, c.after.http_status),
            (200, 500),
            "{}",
            c.request_id
        );
        assert_eq!(c.before.prefilled_tokens, Some(1));
        assert_eq!(c.after.prefilled_tokens, Some(0));
        assert!(c.what.contains(&"foreign_reads_gone".to_string()));
        assert_eq!(c.after.foreign_tokens, 0);
        let lat = c.after.latency_ms.unwrap();
        assert!(
            lat >= 300_000.0,
            "500 only after the 300 s waiting timeout: {lat}"
        );
        // Held from preallocation to the deferred release (timeout + 30 s).
        let hold = c.after.decode_hold_ms.unwrap();
        assert!((330_000.0..331_000.0).contains(&hold), "{hold}");
        assert!(c.after.decode_slot_seconds >= c.prompt_tokens as f64 * 330.0);
    }
    assert_eq!(
        d.status_transitions.get("200->500"),
        Some(&(hit.len() as u64))
    );
    let h = &d.rejected_decode_hold.after;
    assert_eq!(h.requests, hit.len() as u64);
    assert!(h.peak_slots as u32 >= d.changed.iter().map(|c| c.prompt_tokens).max().unwrap());
    assert!(
        d.headline.contains("-> 0 (0 cross-tenant"),
        "{}",
        d.headline
    );
}

#[test]
fn router_acting_on_prefill_error_answers_400_at_once_but_decode_still_holds() {
    let sim = simulate("incident", Some(REQUESTS), 1, &[]);
    let hit = affected(&sim);
    let out = sim.dir.path().join("perr");
    replay(
        &sim.trace,
        Some("sglang-0.5.22"),
        &["router=prefill-error"],
        &out,
    );
    let d = diff_of(&sim.trace, &out);
    assert_eq!(d.exposure.after.affected_responses, 0);
    assert_eq!(changed_ids(&d), hit);
    for c in &d.changed {
        assert_eq!(c.after.http_status, 400);
        assert!(c.after.latency_ms.unwrap() < 1_000.0);
        assert!(c.after.decode_hold_ms.unwrap() >= 330_000.0);
    }
}

#[test]
fn buggy_engine_with_a_2x_prefill_pool_has_no_exposure() {
    let sim = simulate("incident", Some(REQUESTS), 1, &[]);
    let hit = affected(&sim);
    let out = sim.dir.path().join("pool2x");
    replay(&sim.trace, None, &["prefill.capacity_tokens=32768"], &out);
    let d = diff_of(&sim.trace, &out);
    assert_eq!(d.exposure.before.engine, "sglang-0.5.19");
    assert_eq!(d.exposure.after.engine, "sglang-0.5.19");
    assert_eq!(d.exposure.after.affected_responses, 0);
    assert_eq!(changed_ids(&d), hit);
    for c in &d.changed {
        assert_eq!((c.before.http_status, c.after.http_status), (200, 200));
        assert_eq!(c.after.prefilled_tokens, Some(c.prompt_tokens));
    }
    assert_eq!(d.rejected_decode_hold.after.requests, 0);
}

#[test]
fn allow_auto_truncate_brings_the_stale_tail_back_under_the_fixed_engine() {
    let sim = simulate("incident", Some(REQUESTS), 1, &[]);
    let hit = affected(&sim);
    let out = sim.dir.path().join("trunc");
    replay(
        &sim.trace,
        Some("sglang-0.5.22"),
        &["allow_auto_truncate=true"],
        &out,
    );
    let d = diff_of(&sim.trace, &out);
    let after: BTreeSet<u64> = d
        .changed
        .iter()
        .filter(|c| c.after.foreign_tokens > 0)
        .map(|c| c.request_id)
        .collect();
    assert!(hit.iter().all(|id| {
        // over-long requests: still exposed, now by a truncated transfer
        let c = d.changed.iter().find(|c| c.request_id == *id);
        c.is_none_or(|c| c.after.foreign_tokens > 0 && c.after.http_status == 200)
    }));
    assert!(d.exposure.after.affected_responses >= hit.len() as u64);
    // Prompts past the context window are truncated too (400 -> 200, stale tail).
    assert!(after.len() as u64 + hit.len() as u64 >= d.exposure.after.affected_responses);
    assert!(d.status_transitions.get("400->200").copied().unwrap_or(0) > 0);
}

#[test]
fn replay_is_deterministic_and_keeps_request_identity() {
    let sim = simulate("incident", Some(600), 1, &[]);
    let a = sim.dir.path().join("a");
    let b = sim.dir.path().join("b");
    replay(&sim.trace, Some("sglang-0.5.20"), &[], &a);
    replay(&sim.trace, Some("sglang-0.5.20"), &[], &b);
    assert_eq!(files::contents(&a), files::contents(&b));
    let key = |p: &std::path::Path| {
        let t = Trace::open(p).unwrap();
        let mut v: Vec<_> = t
            .requests()
            .flat_map(|b| b.unwrap())
            .map(|r| {
                (
                    r.request_id,
                    r.external_id,
                    r.tenant,
                    r.arrival_ns,
                    r.prompt_tokens,
                    r.prompt_hash,
                )
            })
            .collect();
        v.sort();
        v
    };
    assert_eq!(key(&sim.trace), key(&a));
    let (d1, d2) = (diff_of(&sim.trace, &a), diff_of(&sim.trace, &a));
    assert_eq!(
        serde_json::to_string(&d1).unwrap(),
        serde_json::to_string(&d2).unwrap()
    );
}

#[test]
fn cli_replay_compare_json_and_bad_input() {
    let sim = simulate("incident", Some(400), 1, &[]);
    let out = sim.dir.path().join("cli");
    let (code, stdout, stderr) = kvtrail([
        "replay",
        sim.trace.to_str().unwrap(),
        "--engine",
        "sglang-0.5.22",
        "--out",
        out.to_str().unwrap(),
        "--compare",
        "--json",
    ])
    .run()
    .into_parts();
    assert_eq!(code, 0, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["format"], "kvtrail-diff");
    assert_eq!(v["exposure"]["after"]["affected_responses"], 0);
    let (code, stdout2, _) = kvtrail([
        "diff",
        sim.trace.to_str().unwrap(),
        out.to_str().unwrap(),
        "--json",
    ])
    .run()
    .into_parts();
    assert_eq!(code, 0);
    assert_eq!(stdout, stdout2);
    let (code, _, stderr) = kvtrail([
        "replay",
        sim.trace.to_str().unwrap(),
        "--set",
        "no_such_key=1",
        "--out",
        sim.dir.path().join("bad").to_str().unwrap(),
    ])
    .run()
    .into_parts();
    assert_eq!(code, 2);
    assert!(stderr.contains("unknown key"), "{stderr}");
    let (code, _, stderr) = kvtrail(["replay", "/nonexistent/trace", "--out", "/tmp/x-never"])
        .run()
        .into_parts();
    assert_eq!(code, 2, "{stderr}");
    let (code, _, stderr) = kvtrail([
        "replay",
        sim.trace.to_str().unwrap(),
        "--engine",
        "sglang-9.9",
        "--out",
        sim.dir.path().join("bad2").to_str().unwrap(),
    ])
    .run()
    .into_parts();
    assert_eq!(code, 2);
    assert!(stderr.contains("unknown engine"), "{stderr}");
}

#[test]
fn trace_from_another_writer_replays_with_its_recorded_deployment() {
    let golden = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/golden-v1");
    let dir = tempfile::tempdir().unwrap();
    for (engine, name) in [(None, "a"), (Some("sglang-0.5.22"), "b")] {
        let out = dir.path().join(name);
        let run = replay(&golden, engine, &[], &out);
        assert_eq!(run.config.context_window, 4096);
        assert_eq!(run.config.prefill.capacity_tokens, 64);
        assert_eq!(
            run.config.engine.name(),
            engine.unwrap_or("sglang-0.5.19"),
            "`sglang 0.5.19 (PD)` is parsed from the manifest"
        );
        let d = diff_of(&golden, &out);
        assert_eq!(d.requests_compared, 3);
        assert!(d.only_before.is_empty() && d.only_after.is_empty());
    }
}
