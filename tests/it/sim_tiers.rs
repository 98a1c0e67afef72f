//! The vLLM model's KV tiers (docs/engine-vllm.md, "KV tiers"): a
//! SimpleCPUOffload-style CPU tier on decode (pool 2) and an LMCache-style
//! store shared by both instances (pool 3), each a pool of role `cache`.
//! For each tier: a clean run has no foreign read in the truth and scope
//! reports none; with the planted stale-key defect the truth has foreign
//! reads, each with its true source, and scope equals the truth exactly;
//! the naive evaluation of the trace (support::sim) agrees every time. A
//! stale run streamed through a real sidecar gives the same findings.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use kvtrail::progress::NoReporter;
use kvtrail::record::{Listen, NoLog, RecordConfig, Sidecar, WhenBehind};
use kvtrail::schema::{KvEvent, Op};
use kvtrail::scope::ScopeReport;
use kvtrail::trace::Trace;
use kvtrail::trace::manifest::Role;

use crate::sim_vllm::check_against_truth;
use crate::support::cli::kvtrail;
use crate::support::record::{connect_to, kv_line, request_line};
use crate::support::sim::{self, Simulated, events, simulate};

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

fn cache_pool(trace: &Path, id: u16, name: &str) {
    let t = Trace::open(trace).unwrap();
    let p = t.deployment().pool(id).expect("the tier's pool");
    assert_eq!((p.role, p.name.as_str()), (Role::Cache, name));
    assert_eq!(p.page_size, 16);
}

/// Requests that loaded from `tier` (copies into their own blocks); the
/// affected responses of a stale run answer 200.
fn tier_loads(run: &Simulated, tier: u16, what: &str) -> usize {
    let loaders: BTreeSet<u64> = events(&run.trace)
        .values()
        .flatten()
        .filter(|e| e.src.is_some_and(|s| s.pool == tier) && e.request_id != 0)
        .map(|e| e.request_id)
        .collect();
    assert!(!run.truth.affected.is_empty(), "{what}: no planted read");
    for a in &run.truth.affected {
        assert_eq!(a.http_status, 200, "{what}: r{}", a.request_id);
    }
    assert!(!loaders.is_empty(), "{what}: no load from the tier");
    loaders.len()
}

fn clean(name: &str, seed: u64, sets: &[&str]) -> Simulated {
    let run = simulate(name, Some(600), seed, sets);
    let what = format!("{name} {sets:?} seed {seed}");
    let r = check_against_truth(&what, &run);
    assert_eq!(run.truth.summary.affected_responses, 0, "{what}");
    assert!(run.truth.blank.is_empty(), "{what}");
    assert_eq!(r.counts.affected_responses, 0, "{what}");
    run
}

#[test]
fn cpu_offload_clean_stores_loads_and_reports_nothing() {
    let mut loads = 0;
    for seed in [1, 7] {
        let run = clean("vllm-cpu-offload", seed, &[]);
        cache_pool(&run.trace, 2, "cpu-0");
        let c = copies(&run.trace);
        // Stores by the engine (decode -> cpu), loads by requests back.
        assert_eq!(c[&(1, 2)], BTreeSet::from([0]), "seed {seed}");
        let back = c.get(&(2, 1)).cloned().unwrap_or_default();
        assert!(!back.contains(&0), "loads are the requests'");
        loads += back.len();
        eprintln!(
            "vllm-cpu-offload seed {seed}: {} loading requests",
            back.len()
        );
    }
    assert!(loads > 0, "the CPU tier serves some misses");
}

#[test]
fn lmcache_clean_stores_from_both_instances_and_reports_nothing() {
    let mut loads = 0;
    for seed in [1, 7] {
        let run = clean("vllm-lmcache", seed, &[]);
        cache_pool(&run.trace, 3, "lmcache-0");
        let c = copies(&run.trace);
        assert_eq!(c[&(0, 3)], BTreeSet::from([0]), "seed {seed}");
        let back = c.get(&(3, 0)).cloned().unwrap_or_default();
        assert!(!back.contains(&0), "loads are the requests'");
        loads += back.len();
        eprintln!("vllm-lmcache seed {seed}: {} loading requests", back.len());
    }
    assert!(loads > 0, "the store serves some prefill misses");
    // Both tiers at once, unsalted prefixes, another block size.
    clean(
        "vllm-lmcache",
        3,
        &["cpu_offload_tokens=32768", "cache_salt=none"],
    );
    clean(
        "vllm-cpu-offload",
        3,
        &["block_size=32", "lmcache_tokens=65536"],
    );
}

#[test]
fn stale_cpu_tier_pages_are_found_with_their_true_source() {
    for seed in [1, 7] {
        let run = simulate("vllm-cpu-offload-stale", Some(600), seed, &[]);
        let what = format!("vllm-cpu-offload-stale seed {seed}");
        check_against_truth(&what, &run);
        tier_loads(&run, 2, &what);
        eprintln!(
            "{what}: {} affected, {} foreign tokens",
            run.truth.summary.affected_responses, run.truth.summary.foreign_tokens
        );
        // The same run without the planted defect is clean: the findings
        // are the planted stale pages'.
        clean(
            "vllm-cpu-offload-stale",
            seed,
            &["bug_stale_cpu_offload_ppm=0"],
        );
    }
}

#[test]
fn stale_lmcache_pages_are_found_with_their_true_source() {
    for seed in [1, 7] {
        let run = simulate("vllm-lmcache-stale", Some(600), seed, &[]);
        let what = format!("vllm-lmcache-stale seed {seed}");
        check_against_truth(&what, &run);
        tier_loads(&run, 3, &what);
        eprintln!(
            "{what}: {} affected, {} foreign tokens",
            run.truth.summary.affected_responses, run.truth.summary.foreign_tokens
        );
        clean("vllm-lmcache-stale", seed, &["bug_stale_lmcache_ppm=0"]);
    }
}

#[test]
fn runs_without_a_tier_carry_no_tier_key_or_pool() {
    let run = simulate("vllm-steady", Some(50), 1, &[]);
    let t = Trace::open(&run.trace).unwrap();
    assert_eq!(t.deployment().pools.len(), 2);
    let sim = &t.deployment().extra["simulator"];
    for k in kvtrail::sim::config::VLLM_TIER_KEYS {
        assert!(sim.get(k).is_none(), "{k} in a trace without tiers");
    }
    let run = simulate("vllm-lmcache-stale", Some(50), 1, &[]);
    let t = Trace::open(&run.trace).unwrap();
    let sim = &t.deployment().extra["simulator"];
    assert_eq!(sim["lmcache_chunk_tokens"], 256);
    assert_eq!(sim["bug_stale_lmcache_ppm"], 300_000);
    assert!(sim.get("cpu_offload_tokens").is_none());
}

fn refused(args: &[&str], key: &str) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("t");
    let mut all = vec!["simulate", "--requests", "10"];
    all.extend_from_slice(args);
    all.extend(["--out", out.to_str().unwrap()]);
    let r = kvtrail(all).run();
    assert_eq!(r.code, 2, "{args:?}: {}", r.stderr);
    assert!(
        r.stderr.contains(key) && r.stderr.contains("hint"),
        "{args:?}: {}",
        r.stderr
    );
    assert!(!out.exists(), "{args:?}: nothing written");
}

#[test]
fn bad_tier_values_exit_2_naming_the_key() {
    for (sets, key) in [
        (
            &["--scenario", "incident", "--set", "cpu_offload_tokens=4096"][..],
            "cpu_offload_tokens",
        ),
        (
            &["--scenario", "steady", "--set", "lmcache_tokens=4096"],
            "lmcache_tokens",
        ),
        (
            &["--scenario", "incident", "--set", "bug_stale_lmcache_ppm=5"],
            "bug_stale_lmcache_ppm",
        ),
        (
            &[
                "--scenario",
                "vllm-steady",
                "--set",
                "cpu_offload_tokens=1000",
            ],
            "cpu_offload_tokens",
        ),
        (
            &[
                "--scenario",
                "vllm-steady",
                "--set",
                "cpu_offload_tokens=16",
            ],
            "cpu_offload_tokens",
        ),
        (
            &[
                "--scenario",
                "vllm-steady",
                "--set",
                "lmcache_tokens=4096",
                "--set",
                "lmcache_chunk_tokens=40",
            ],
            "lmcache_chunk_tokens",
        ),
        (
            &["--scenario", "vllm-steady", "--set", "lmcache_tokens=4000"],
            "lmcache_tokens",
        ),
        (
            &[
                "--scenario",
                "vllm-steady",
                "--set",
                "bug_stale_cpu_offload_ppm=10",
            ],
            "cpu_offload_tokens",
        ),
        (
            &[
                "--scenario",
                "vllm-cpu-offload",
                "--set",
                "bug_stale_cpu_offload_ppm=2000000",
            ],
            "bug_stale_cpu_offload_ppm",
        ),
        (
            &["--scenario", "vllm-lmcache", "--set", "lmcache_tokens=-1"],
            "lmcache_tokens",
        ),
    ] {
        refused(sets, key);
    }
}

/// Streams a simulated trace through a sidecar, one connection per pool
/// (the tier pools included), events in time order across connections,
/// request rows last; returns the recorded trace's folder.
fn stream(run: &Simulated, dir: &Path) -> std::path::PathBuf {
    let t = Trace::open(&run.trace).unwrap();
    let deployment = t.deployment().clone();
    let sock = dir.join("s.sock");
    let out = dir.join("rec");
    let mut cfg = RecordConfig::new(Listen::Unix(sock.clone()));
    // As fast as the test writes: wait rather than drop when the writer
    // is behind (a loaded machine), so nothing is lost to compare.
    cfg.when_behind = WhenBehind::Wait;
    cfg.recorder.from_engine_start = t.manifest.from_engine_start();
    let sidecar = Sidecar::start(cfg, deployment.clone(), &out, Arc::new(NoLog)).unwrap();
    let mut conns: BTreeMap<u16, _> = deployment
        .pools
        .iter()
        .map(|p| (p.id, std::io::BufWriter::new(connect_to(&sock, &[p.id]))))
        .collect();
    let events = events(&run.trace);
    let mut all: Vec<&KvEvent> = events.values().flatten().collect();
    all.sort_by_key(|e| (e.ts_ns, e.pool, e.seq));
    for (i, e) in all.iter().enumerate() {
        writeln!(conns.get_mut(&e.pool).unwrap(), "{}", kv_line(e)).unwrap();
        // Keep the connections close to each other, as engines are.
        if i % 512 == 511 {
            for c in conns.values_mut() {
                c.flush().unwrap();
            }
        }
    }
    let first = conns.get_mut(&0).unwrap();
    for r in sim::requests(&run.trace) {
        writeln!(first, "{}", request_line(&r)).unwrap();
    }
    for (_, c) in conns {
        drop(c.into_inner().ok());
    }
    sidecar.shutdown().unwrap();
    out
}

fn findings(r: &ScopeReport) -> BTreeMap<u64, (u64, Vec<(u64, u64)>)> {
    r.affected_responses
        .iter()
        .map(|a| {
            let s = a.sources.iter().map(|s| (s.request_id, s.tokens)).collect();
            (a.request_id, (a.foreign_tokens, s))
        })
        .collect()
}

#[test]
fn stale_tier_runs_streamed_through_record_give_the_same_findings() {
    for (name, copies_in) in [
        ("vllm-cpu-offload-stale", (2, 1)),
        ("vllm-lmcache-stale", (3, 0)),
    ] {
        let run = simulate(name, Some(600), 7, &[]);
        let direct = check_against_truth(name, &run);
        assert!(direct.counts.affected_responses > 0, "{name}");
        let dir = tempfile::tempdir().unwrap();
        let rec = stream(&run, dir.path());
        assert!(copies(&rec).contains_key(&copies_in), "{name}");
        let t = Trace::open(&rec).unwrap();
        let r = kvtrail::scope::scope(&t, &Default::default(), &NoReporter).unwrap();
        assert!(r.coverage.complete, "{name}: {:?}", r.coverage.notes);
        assert_eq!(
            findings(&r),
            findings(&direct),
            "{name}: recorded vs simulated"
        );
        let shares = events(&rec)
            .values()
            .flatten()
            .filter(|e| e.op == Op::Share)
            .count();
        assert!(shares > 0, "{name}");
    }
}
