//! The simulator under trace-format revision 2: its ground truth follows
//! content (a grant on stale content covers nothing; copies carry the
//! current/stale bit), it lists cross-tenant shared reads, and the
//! `hicache` knob adds a host pool (role `cache`) that decode-tree entries
//! go out to and come back from. Every run is also checked against an
//! independent evaluation of its trace (support::sim::naive), so the truth is
//! what a trace-only reader must derive. The last tests hold `scope` to the
//! truth on these traces.
//!
//! Small cases are built from hand-made arrivals on a deployment whose
//! decode pool (750 pages of 16 tokens) and most-recently-freed free lists
//! make page reuse predictable:
//! - request 1 (tenant-a, no prefix) writes the low pages of both pools;
//! - request 2 (tenant-b, prefix group 100) has an over-long prompt: on
//!   sglang-0.5.19 a one-token placeholder whose decode preallocation lands
//!   on request 1's pages; its normal finish puts its first 100 pages,
//!   never written by it, into the decode radix tree;
//! - request 3 (tenant-d, prefix group 200) puts 100 pages it wrote itself
//!   into the tree;
//! - request 4 (tenant-c, no prefix) needs nearly the whole decode pool and
//!   evicts both tree entries (with `hicache`: to the host pool);
//! - request 5 (tenant-b, group 100) and request 6 (tenant-e, group 200)
//!   hit them (with `hicache`: loaded back from the host pool).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use crate::support::sim::{Simulated as Run, assert_truth_matches_trace, events, simulate};
use kvtrail::progress::NoReporter;
use kvtrail::schema::Op;
use kvtrail::sim::{self, Arrival, RunLabel, SimConfig, Truth};
use kvtrail::trace::Trace;
use kvtrail::trace::manifest::Role;

const SECOND: i64 = 1_000_000_000;

fn arrival(id: u64, tenant: &str, at_s: i64, prompt: u32, group: Option<u64>) -> Arrival {
    Arrival {
        request_id: id,
        external_id: Some(format!("req-{id}")),
        tenant: tenant.into(),
        arrival_ns: at_s * SECOND,
        prompt_tokens: prompt,
        output_tokens: 20,
        prefix_group: group,
        prefix_tokens: if group.is_some() { 1600 } else { 0 },
        recorded_prompt_hash: None,
    }
}

fn arrivals() -> Vec<Arrival> {
    vec![
        arrival(1, "tenant-a", 0, 3000, None),
        arrival(2, "tenant-b", 10, 11_000, Some(100)),
        arrival(3, "tenant-d", 20, 3000, Some(200)),
        arrival(4, "tenant-c", 30, 10_500, None),
        arrival(5, "tenant-b", 40, 2000, Some(100)),
        arrival(6, "tenant-e", 50, 3000, Some(200)),
    ]
}

fn config(sets: &[&str]) -> SimConfig {
    let mut c = SimConfig::default();
    for s in [
        "free_list=most-recently-freed",
        "decode.capacity_tokens=12000",
        "decode_radix_cache=true",
    ]
    .iter()
    .chain(sets)
    {
        c.set(s).unwrap();
    }
    c
}

fn run_arrivals(cfg: &SimConfig, arrivals: Vec<Arrival>) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let out = sim::run(
        cfg,
        arrivals,
        &dir.path().join("t"),
        &RunLabel {
            scenario: "revision2".into(),
            seed: 0,
        },
        &NoReporter,
    )
    .unwrap();
    Run {
        trace: dir.path().join("t"),
        dir,
        truth: out.truth,
        over_long: out.stats.over_long,
    }
}

/// request -> (tokens, [(source, tenant, tokens)]).
type Findings = BTreeMap<u64, (u64, Vec<(u64, String, u64)>)>;

/// Affected responses: request -> (foreign tokens, sources).
fn affected(t: &Truth) -> Findings {
    t.affected
        .iter()
        .map(|a| {
            let s = a
                .sources
                .iter()
                .map(|s| (s.request_id, s.tenant.clone(), s.tokens))
                .collect();
            (a.request_id, (a.foreign_tokens, s))
        })
        .collect()
}

/// Cross-tenant shared reads: request -> (tokens, sources).
fn cross_shared(t: &Truth) -> Findings {
    t.cross_tenant_shared
        .iter()
        .map(|c| {
            let s = c
                .sources
                .iter()
                .map(|s| (s.request_id, s.tenant.clone(), s.tokens))
                .collect();
            (c.request_id, (c.tokens, s))
        })
        .collect()
}

/// Copies per (source pool, destination pool), with the requests that
/// made them.
fn copies(trace: &Path) -> BTreeMap<(u16, u16), BTreeSet<u64>> {
    let mut out: BTreeMap<(u16, u16), BTreeSet<u64>> = BTreeMap::new();
    for (pool, evs) in events(trace) {
        for e in evs {
            if let Some(src) = e.src {
                out.entry((src.pool, pool))
                    .or_default()
                    .insert(e.request_id);
            }
        }
    }
    out
}

fn a(tenant: &str, src: u64, tokens: u64) -> (u64, String, u64) {
    (src, tenant.into(), tokens)
}

/// The arrivals without request 4: nothing evicts the tree entries.
fn arrivals_kept() -> Vec<Arrival> {
    arrivals()
        .into_iter()
        .filter(|a| a.request_id != 4)
        .collect()
}

#[test]
fn decode_tree_poisoning_names_the_earlier_writer() {
    let run = run_arrivals(&config(&[]), arrivals_kept());
    assert_truth_matches_trace(&run);
    let got = affected(&run.truth);
    // Request 2 decodes over its preallocation (request 1's pages).
    assert_eq!(got[&2].1.iter().map(|s| s.0).collect::<Vec<_>>(), [1]);
    // Request 5's tree hit is granted on pages request 2 allocated and never
    // wrote: 1599 slots of request 1's KV (slot 0 is request 2's own
    // placeholder token, shared within tenant-b).
    assert_eq!(got[&5], (1599, vec![a("tenant-a", 1, 1599)]));
    let five = run.truth.affected.iter().find(|a| a.request_id == 5);
    assert!(five.unwrap().cross_tenant);
    // Request 6 hits pages request 3 wrote, in both radix trees: shared,
    // but another tenant's prefix (the prefix-cache side channel), listed
    // apart.
    assert!(!got.contains_key(&6));
    assert_eq!(
        cross_shared(&run.truth),
        BTreeMap::from([(6, (3200, vec![a("tenant-d", 3, 3200)]))])
    );
    assert_eq!(run.truth.summary.cross_tenant_shared_responses, 1);
    // No host pool without hicache.
    let t = Trace::open(&run.trace).unwrap();
    assert_eq!(t.deployment().pools.len(), 2);
}

#[test]
fn hicache_carries_stale_and_current_pages_out_and_back() {
    let run = run_arrivals(&config(&["hicache=true"]), arrivals());
    assert_truth_matches_trace(&run);
    let t = Trace::open(&run.trace).unwrap();
    let host = t.deployment().pool(2).expect("a host pool");
    assert_eq!(host.role, Role::Cache);
    assert_eq!(host.page_size, 16);
    // Out (decode -> host) and back (host -> decode), by the engine only.
    let c = copies(&run.trace);
    assert_eq!(c[&(1, 2)], BTreeSet::from([0]));
    assert_eq!(c[&(2, 1)], BTreeSet::from([0]));
    // Both entries went out when request 4 needed the pool, and came back
    // for requests 5 and 6: the loads are allocated to the engine first.
    let ev = events(&run.trace);
    let out_rows = ev[&2].iter().filter(|e| e.op == Op::Write).count();
    let in_rows = ev[&1]
        .iter()
        .filter(|e| e.op == Op::Write && e.src.is_some_and(|s| s.pool == 2))
        .count();
    assert!(
        out_rows >= 2 && in_rows >= 2,
        "{out_rows} out, {in_rows} in"
    );
    assert!(
        ev[&1]
            .iter()
            .any(|e| e.op == Op::Alloc && e.request_id == 0),
        "a load back allocates device pages to the engine"
    );
    // The stale entry came back stale: the same finding as without the
    // tier. The current one came back current: shared, listed apart.
    let got = affected(&run.truth);
    assert_eq!(got[&5], (1599, vec![a("tenant-a", 1, 1599)]));
    assert!(!got.contains_key(&6));
    assert_eq!(
        cross_shared(&run.truth),
        BTreeMap::from([(6, (1600, vec![a("tenant-d", 3, 1600)]))])
    );
}

#[test]
fn a_full_host_pool_evicts_its_least_recently_used_entry() {
    // Room for one entry: request 3's offload evicts request 2's.
    let cfg = config(&["hicache=true", "hicache_host_tokens=1600"]);
    let run = run_arrivals(&cfg, arrivals());
    assert_truth_matches_trace(&run);
    let ev = events(&run.trace);
    assert!(
        ev[&2].iter().any(|e| e.op == Op::Free && e.request_id == 0),
        "the host pool frees its oldest entry"
    );
    // Request 5 finds nothing anywhere and computes its prefix itself.
    let got = affected(&run.truth);
    assert!(!got.contains_key(&5), "{got:?}");
    assert!(cross_shared(&run.truth).contains_key(&6));
}

#[test]
fn hicache_traces_verify() {
    let run = run_arrivals(&config(&["hicache=true"]), arrivals());
    let out = Command::new(env!("CARGO_BIN_EXE_kvtrail"))
        .args(["verify", run.trace.to_str().unwrap()])
        .env("KVTRAIL_NO_PROGRESS", "1")
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn files(root: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

const HICACHE: [&str; 3] = [
    "decode_radix_cache=true",
    "hicache=true",
    "hicache_host_tokens=8192",
];

#[test]
fn hicache_runs_are_deterministic_and_match_their_trace() {
    let a = simulate("incident", Some(1500), 5, &HICACHE);
    let b = simulate("incident", Some(1500), 5, &HICACHE);
    assert_eq!(files(&a.trace), files(&b.trace));
    assert_eq!(a.truth, b.truth);
    assert_truth_matches_trace(&a);
    let c = copies(&a.trace);
    assert!(
        c.contains_key(&(1, 2)) && c.contains_key(&(2, 1)),
        "generated traffic offloads and loads back: {:?}",
        c.keys()
    );
}

/// Scope's findings against the truth: affected responses with their
/// foreign tokens and sources, and blank reads.
fn check_scope(what: &str, run: &Run) {
    let trace = Trace::open(&run.trace).unwrap();
    let report = kvtrail::scope::scope(
        &trace,
        &kvtrail::lineage::LineageOptions::default(),
        &NoReporter,
    )
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    let found: Findings = report
        .affected_responses
        .iter()
        .filter(|r| r.foreign_tokens > 0)
        .map(|r| {
            let mut s: Vec<(u64, String, u64)> = r
                .sources
                .iter()
                .map(|s| (s.request_id, s.tenant.to_string(), s.tokens))
                .collect();
            s.sort_unstable();
            (r.request_id, (r.foreign_tokens, s))
        })
        .collect();
    assert_eq!(found, affected(&run.truth), "{what}: scope vs truth");
    let blank: BTreeMap<u64, u64> = report
        .blank_read_responses
        .iter()
        .map(|b| (b.request_id, b.tokens))
        .collect();
    let want: BTreeMap<u64, u64> = run
        .truth
        .blank
        .iter()
        .map(|b| (b.request_id, b.blank_tokens))
        .collect();
    assert_eq!(blank, want, "{what}: blank reads");
}

#[test]
fn scope_counts_reads_through_stale_grants_as_foreign() {
    check_scope(
        "hand-made decode tree poisoning",
        &run_arrivals(&config(&[]), arrivals_kept()),
    );
    check_scope(
        "incident seed 7 with decode_radix_cache",
        &simulate("incident", Some(3000), 7, &["decode_radix_cache=true"]),
    );
}

#[test]
fn scope_follows_content_through_the_host_pool() {
    check_scope(
        "hand-made hicache",
        &run_arrivals(&config(&["hicache=true"]), arrivals()),
    );
    check_scope(
        "incident with hicache",
        &simulate("incident", Some(1500), 5, &HICACHE),
    );
}

#[test]
fn bad_hicache_values_exit_2_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("t");
    for (sets, key) in [
        (vec!["hicache=true"], "decode_radix_cache"),
        (
            vec!["decode_radix_cache=true", "hicache_host_tokens=1000"],
            "hicache_host_tokens",
        ),
        (vec!["decode_radix_cache=true", "hicache=yes"], "hicache"),
    ] {
        let mut args = vec!["simulate", "--scenario", "incident", "--requests", "10"];
        for s in &sets {
            args.extend(["--set", s]);
        }
        args.extend(["--out", out.to_str().unwrap()]);
        let o = Command::new(env!("CARGO_BIN_EXE_kvtrail"))
            .args(&args)
            .env("KVTRAIL_NO_PROGRESS", "1")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{sets:?}: {err}");
        assert!(err.contains(key) && err.contains("hint"), "{sets:?}: {err}");
        assert!(!out.exists(), "{sets:?}: nothing written");
    }
}
