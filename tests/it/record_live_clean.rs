//! No false alarms (docs/live.md, "What it costs"): clean simulated
//! requests of both engine models, with prefix cache, decode radix cache
//! and HiCache (SGLang) or a CPU offload tier and an LMCache store (vLLM),
//! streamed through the real sidecar with live detection on, raise no
//! alert and no live finding, and a fresh scope agrees. Each run also
//! shows that the features it names were exercised (prefix hits, copies
//! into and out of the cache tier), so a pass is never vacuous.

use kvtrail::schema::Op;
use kvtrail::trace::Trace;
use kvtrail::trace::manifest::Role;

use crate::record_live::{fresh_scope, read_findings, stream};
use crate::support::sim;

const REQUESTS: u64 = 20_000;

fn clean(name: &str, sets: &[&str]) {
    let run = sim::simulate(name, Some(REQUESTS), 11, sets);
    let t = Trace::open(&run.trace).unwrap();
    let cache: Vec<u16> = t
        .deployment()
        .pools
        .iter()
        .filter(|p| p.role == Role::Cache)
        .map(|p| p.id)
        .collect();
    let events = sim::events(&run.trace);
    let all = || events.values().flatten();
    let shares = all().filter(|e| e.op == Op::Share).count();
    let tier_copies = all()
        .filter(|e| {
            e.src.is_some_and(|s| s.pool != e.pool)
                && (cache.contains(&e.pool) || e.src.is_some_and(|s| cache.contains(&s.pool)))
        })
        .count();
    assert!(shares > 0, "{name} {sets:?}: no prefix hit exercised");
    assert!(
        !cache.is_empty() && tier_copies > 0,
        "{name} {sets:?}: no copy through a cache tier exercised"
    );
    assert_eq!(sim::requests(&run.trace).len() as u64, REQUESTS);

    let dir = tempfile::tempdir().unwrap();
    let out = stream(&run, dir.path());
    let live = read_findings(&out);
    // The stream waits for the writer (`--when-behind wait`), so no
    // event may be missing: any hole is a defect.
    assert_eq!(
        live.live.seq_holes, 0,
        "{name} {sets:?}: the sidecar lost events: {:?}",
        live.live
    );
    assert!(live.exact, "{name} {sets:?}: {:?}", live.live);
    assert_eq!(
        live.live.events_applied,
        all().count() as u64,
        "{name} {sets:?}: every event classified"
    );
    assert_eq!(live.live.alerts, 0, "{name} {sets:?}: {:?}", live.live);
    assert!(
        live.affected_responses.is_empty(),
        "{name} {sets:?}: live findings on clean requests: {:?}",
        &live.affected_responses[..live.affected_responses.len().min(3)]
    );
    assert!(live.cross_tenant_shared.is_empty(), "{name} {sets:?}");
    let scope = fresh_scope(&out);
    assert!(scope.affected_responses.is_empty(), "{name} {sets:?}");
    eprintln!(
        "{name} {sets:?}: {REQUESTS} clean requests, {} events ({shares} prefix hits, {tier_copies} tier copies): 0 alerts",
        live.live.events_applied
    );
}

/// One test, the configurations in turn: three 20 000-request streams
/// at once would crowd a small machine for no added check.
#[test]
fn clean_requests_of_both_engine_models_raise_nothing() {
    clean("steady", &["decode_radix_cache=true", "hicache=true"]);
    clean("vllm-cpu-offload", &[]);
    clean("vllm-lmcache", &[]);
}
