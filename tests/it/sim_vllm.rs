//! The vLLM engine model (`--engine vllm-0.33.0`): its scenarios against
//! the ground truth and the independent replay (scope) on several seeds;
//! vllm-project/vllm#52234's stale reference as a cross-tenant foreign
//! read answered 200; what-if replay of the failure policy, the lease and
//! the reference check with their cost; audit of vLLM deployments; bad
//! input (engine names, keys of the other engine, impossible values).

use crate::support::cli::kvtrail;
use crate::support::sim::{self, Simulated, simulate};
use crate::support::whatif::replay;

use std::collections::BTreeMap;
use std::path::Path;

use kvtrail::audit::{AuditReport, Severity, audit_file, audit_trace};
use kvtrail::lineage::LineageOptions;
use kvtrail::progress::NoReporter;
use kvtrail::scope::{Confidence, ScopeReport};
use kvtrail::sim::SimConfig;
use kvtrail::trace::Trace;
use kvtrail::whatif::diff::{DiffReport, diff};

fn scope(dir: &Path) -> ScopeReport {
    let t = Trace::open(dir).unwrap();
    kvtrail::scope::scope(&t, &LineageOptions::default(), &NoReporter).unwrap()
}

fn diff_of(before: &Path, after: &Path) -> DiffReport {
    diff(
        &Trace::open(before).unwrap(),
        &Trace::open(after).unwrap(),
        &LineageOptions::default(),
        &NoReporter,
    )
    .unwrap()
}

type Found = BTreeMap<u64, (u16, u64, bool, Vec<(u64, String, u64)>)>;

/// Scope equals the truth exactly: affected responses, status, foreign
/// tokens, cross-tenant flag, sources with tokens; blank reads; all
/// confirmed with complete evidence. Also the naive evaluation.
pub(crate) fn check_against_truth(what: &str, run: &Simulated) -> ScopeReport {
    sim::assert_truth_matches_trace(run);
    let r = scope(&run.trace);
    assert!(r.coverage.complete, "{what}: {:?}", r.coverage.notes);
    let got: Found = r
        .affected_responses
        .iter()
        .filter(|a| a.foreign_tokens > 0)
        .map(|a| {
            assert_eq!(
                a.confidence,
                Confidence::Confirmed,
                "{what}: r{}",
                a.request_id
            );
            assert_eq!((a.unknown_tokens, a.uncertain_tokens), (0, 0), "{what}");
            let mut s: Vec<(u64, String, u64)> = a
                .sources
                .iter()
                .map(|s| (s.request_id, s.tenant.to_string(), s.tokens))
                .collect();
            s.sort();
            (
                a.request_id,
                (
                    a.http_status.unwrap_or(0),
                    a.foreign_tokens,
                    a.cross_tenant,
                    s,
                ),
            )
        })
        .collect();
    let want: Found = run
        .truth
        .affected
        .iter()
        .map(|a| {
            let s = a
                .sources
                .iter()
                .map(|s| (s.request_id, s.tenant.clone(), s.tokens))
                .collect();
            (
                a.request_id,
                (a.http_status, a.foreign_tokens, a.cross_tenant, s),
            )
        })
        .collect();
    assert_eq!(got, want, "{what}: scope vs truth");
    let blank: Vec<(u64, u64)> = r
        .blank_read_responses
        .iter()
        .map(|b| (b.request_id, b.tokens))
        .collect();
    let want_blank: Vec<(u64, u64)> = run
        .truth
        .blank
        .iter()
        .map(|b| (b.request_id, b.blank_tokens))
        .collect();
    assert_eq!(blank, want_blank, "{what}: blank reads");
    assert_eq!(r.counts.requests, run.truth.summary.requests, "{what}");
    assert_eq!(r.counts.kv_events, run.truth.summary.kv_events, "{what}");
    r
}

#[test]
fn scenarios_and_knobs_match_the_truth_on_several_seeds() {
    let cases: &[(&str, &[&str])] = &[
        ("vllm-steady", &[]),
        ("vllm-steady", &["cache_salt=none"]),
        ("vllm-steady", &["prefix_cache=false"]),
        ("vllm-steady", &["transfer_failure_ppm=50000"]),
        (
            "vllm-steady",
            &[
                "transfer_failure_ppm=50000",
                "kv_load_failure_policy=recompute",
            ],
        ),
        ("vllm-stale-reference", &[]),
        (
            "vllm-stale-reference",
            &["cache_salt=none", "block_size=32"],
        ),
        ("vllm-stale-reference", &["reference_check=true"]),
        ("vllm-lease-expiry", &[]),
        (
            "vllm-lease-expiry",
            &["kv_lease_duration=1", "bug_lease_expiry=false"],
        ),
    ];
    let mut exposed = 0;
    for (name, sets) in cases {
        for seed in [1, 7] {
            let run = simulate(name, Some(600), seed, sets);
            let r = check_against_truth(&format!("{name} {sets:?} seed {seed}"), &run);
            exposed += r.counts.affected_responses;
        }
    }
    assert!(exposed > 0, "the bug scenarios expose KV");
}

#[test]
fn stale_reference_reproduces_52234_as_a_cross_tenant_200() {
    for seed in [1, 2, 3] {
        let run = simulate("vllm-stale-reference", Some(1500), seed, &[]);
        let t = &run.truth;
        assert!(
            t.summary.affected_responses >= 3,
            "seed {seed}: {:?}",
            t.summary
        );
        // The previous prompt's KV, answered as a success.
        assert!(
            t.affected.iter().all(|a| a.http_status == 200),
            "seed {seed}"
        );
        assert!(t.summary.cross_tenant_responses >= 1, "seed {seed}");
        let r = check_against_truth(&format!("stale seed {seed}"), &run);
        assert_eq!(
            r.counts.cross_tenant_responses,
            t.summary.cross_tenant_responses
        );
        // Every other response is a clean 200 (or a 400 at the front end).
        assert!(
            t.summary
                .status_counts
                .keys()
                .all(|&s| s == 200 || s == 400),
            "{:?}",
            t.summary.status_counts
        );
    }
}

/// vllm-project/vllm#52234's "out-of-range remote_block_ids: 200, garbage"
/// row: the load reads memory of no request; the hook's run names source
/// slots past the producer's pool, which the sidecar records as a hole in
/// the decode pool. Scope must never call such a trace complete nor any
/// garbage reader unaffected, and what it confirms must be true.
#[test]
fn out_of_range_block_ids_are_holes_and_never_complete() {
    let knob = "bug_out_of_range_ppm=30000";
    let mut garbage = 0;
    for seed in [1, 2] {
        let run = simulate("vllm-stale-reference", Some(600), seed, &[knob]);
        let t = &run.truth;
        garbage += t.garbage.len();
        assert_eq!(t.summary.garbage_responses, t.garbage.len() as u64);
        // Fail-open: NIXL reported the reads done; every garbage reader is
        // answered 200.
        assert!(t.garbage.iter().all(|g| g.http_status == 200), "{t:?}");
        assert!(t.garbage.iter().all(|g| g.garbage_tokens > 0));
        // The files verify; the holes are the decode pool's (inspect).
        let dir = run.trace.to_str().unwrap();
        let v = kvtrail(["verify", dir]).run();
        assert_eq!(v.code, 0, "{}", v.stderr);
        let i = kvtrail(["inspect", dir, "--json"]).run();
        let ij: serde_json::Value = serde_json::from_str(&i.stdout).unwrap();
        let holes = |pool: u64| {
            ij["kv"]["pools"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["pool"] == pool)
                .unwrap()["holes"]
                .as_u64()
                .unwrap()
        };
        assert_eq!(holes(0), 0, "seed {seed}");
        assert!(holes(1) >= 1, "seed {seed}");
        let r = scope(&run.trace);
        assert!(!r.coverage.complete, "seed {seed}");
        assert!(r.coverage.lost_events >= 1, "seed {seed}");
        assert!(r.verdict.contains("INCOMPLETE"), "{}", r.verdict);
        let found: BTreeMap<u64, &kvtrail::scope::Response> = r
            .affected_responses
            .iter()
            .map(|a| (a.request_id, a))
            .collect();
        let foreign: BTreeMap<u64, &kvtrail::sim::truth::Affected> =
            t.affected.iter().map(|a| (a.request_id, a)).collect();
        for g in &t.garbage {
            let a = found.get(&g.request_id).unwrap_or_else(|| {
                panic!("seed {seed}: garbage reader r{} not reported", g.request_id)
            });
            // Every garbage slot it read is reported (as a possibly foreign
            // or an uncertain read), none as own.
            assert!(
                a.foreign_tokens + a.unknown_tokens + a.uncertain_tokens >= g.garbage_tokens,
                "seed {seed}: {a:?} {g:?}"
            );
            assert_eq!(a.http_status, Some(200));
            if !foreign.contains_key(&g.request_id) {
                assert_eq!(a.confidence, Confidence::Possible, "r{}", g.request_id);
            }
        }
        // Every true foreign read is reported; whatever scope confirms is
        // true, with its true sources among them.
        for a in &t.affected {
            assert!(
                found.contains_key(&a.request_id),
                "seed {seed}: r{}",
                a.request_id
            );
        }
        for a in &r.affected_responses {
            if a.confidence != Confidence::Confirmed {
                continue;
            }
            let want = foreign
                .get(&a.request_id)
                .unwrap_or_else(|| panic!("seed {seed}: r{} confirmed, truth clean", a.request_id));
            let truth_src: Vec<u64> = want.sources.iter().map(|s| s.request_id).collect();
            assert!(
                a.sources.iter().any(|s| truth_src.contains(&s.request_id)),
                "seed {seed}: r{} sources {:?} vs {truth_src:?}",
                a.request_id,
                a.sources
            );
        }
        assert_eq!(r.counts.requests, t.summary.requests, "seed {seed}");
    }
    assert!(garbage >= 2, "the knob must fire: {garbage}");
    // The reference check refuses blocks the producer does not hold for
    // that reference: the loads fail, no garbage, no hole, and the policy
    // decides (500 under fail, a local prefill under recompute).
    for (sets, status) in [
        (&[knob, "reference_check=true"][..], 500),
        (
            &[
                knob,
                "reference_check=true",
                "kv_load_failure_policy=recompute",
            ][..],
            200,
        ),
    ] {
        let run = simulate("vllm-stale-reference", Some(600), 1, sets);
        assert!(run.truth.garbage.is_empty(), "{sets:?}");
        assert_eq!(run.truth.summary.garbage_responses, 0);
        check_against_truth(&format!("{sets:?}"), &run);
        if status == 500 {
            assert!(
                run.truth
                    .summary
                    .status_counts
                    .get(&500)
                    .copied()
                    .unwrap_or(0)
                    >= 1
            );
        } else {
            assert!(!run.truth.summary.status_counts.contains_key(&500));
        }
    }
}

#[test]
fn steady_is_clean() {
    for seed in [1, 4] {
        let run = simulate("vllm-steady", Some(1500), seed, &[]);
        assert_eq!(run.truth.summary.affected_responses, 0, "seed {seed}");
        assert!(run.truth.blank.is_empty());
        assert!(run.truth.summary.requests == 1500);
        let r = scope(&run.trace);
        assert_eq!(r.counts.affected_responses, 0);
        assert!(r.coverage.complete);
    }
}

#[test]
fn trace_carries_the_vllm_deployment() {
    let run = simulate("vllm-stale-reference", Some(50), 1, &[]);
    let t = Trace::open(&run.trace).unwrap();
    let d = t.deployment();
    assert_eq!(d.engine, "vllm-0.33.0");
    assert_eq!(d.pools[0].page_size, 16);
    // num_gpu_blocks counts vLLM's null block 0.
    assert_eq!(d.pools[0].extra["num_gpu_blocks"], 131_072 / 16 + 1);
    assert_eq!(d.pools[0].capacity_tokens, (131_072 / 16 + 1) * 16);
    let sim = &d.extra["simulator"];
    assert_eq!(sim["kv_load_failure_policy"], "fail");
    assert_eq!(sim["kv_lease_duration"], 30);
    assert_eq!(sim["cache_salt"], "tenant");
    for k in kvtrail::sim::config::SGLANG_KEYS {
        assert!(sim.get(k).is_none(), "{k} in a vLLM trace");
    }
    // Per-tenant cache_salt is the operator's isolation promise.
    assert!(d.tenant_prefix_cache());
}

#[test]
fn simulation_is_deterministic() {
    let a = simulate("vllm-lease-expiry", Some(300), 9, &[]);
    let b = simulate("vllm-lease-expiry", Some(300), 9, &[]);
    for f in [
        "trace.json",
        "requests/part-00000.parquet",
        "kv/pool=1/part-00000.parquet",
    ] {
        assert_eq!(
            std::fs::read(a.trace.join(f)).unwrap(),
            std::fs::read(b.trace.join(f)).unwrap(),
            "{f}"
        );
    }
}

#[test]
fn whatif_policy_alone_does_not_close_the_stale_reference() {
    let run = simulate("vllm-stale-reference", Some(1500), 3, &[]);
    let dir = tempfile::tempdir().unwrap();
    // A replay under the recorded config is the baseline: both replays
    // run the same recovered workload, so only the config differs.
    let base = dir.path().join("base");
    let rec = dir.path().join("recompute");
    let fail = dir.path().join("check-fail");
    let fixed = dir.path().join("check-recompute");
    replay(&run.trace, None, &[], &base);
    replay(
        &run.trace,
        None,
        &["kv_load_failure_policy=recompute"],
        &rec,
    );
    replay(&run.trace, None, &["reference_check=true"], &fail);
    replay(
        &run.trace,
        None,
        &["reference_check=true", "kv_load_failure_policy=recompute"],
        &fixed,
    );
    let d0 = diff_of(&run.trace, &base);
    assert_eq!(
        d0.exposure.before.affected_responses, d0.exposure.after.affected_responses,
        "the recorded config replays the same exposure"
    );
    let exposed = d0.exposure.after.affected_responses;
    assert!(exposed >= 3);

    // recompute acts on failed loads only: a stale read is reported done.
    let d = diff_of(&base, &rec);
    assert_eq!(
        d.exposure.after.affected_responses, exposed,
        "{}",
        d.headline
    );
    assert!(d.status_transitions.is_empty(), "{}", d.headline);

    // The reference check under fail: the exposed requests become 500s.
    let d = diff_of(&base, &fail);
    assert_eq!(d.exposure.after.affected_responses, 0, "{}", d.headline);
    let failed = d.status_transitions.get("200->500").copied().unwrap_or(0);
    assert!(failed >= exposed, "{}", d.headline);
    for c in d
        .changed
        .iter()
        .filter(|c| c.what.contains(&"foreign_reads_gone".into()))
    {
        assert_eq!(c.after.http_status, 500, "r{}", c.request_id);
    }

    // ... and with recompute: served 200 after a local prefill on decode.
    let d = diff_of(&base, &fixed);
    assert_eq!(d.exposure.after.affected_responses, 0, "{}", d.headline);
    assert!(d.status_transitions.is_empty(), "{}", d.headline);
    let before = d.decode_prompt_tokens.before;
    let after = d.decode_prompt_tokens.after;
    assert!(after > before, "{before} -> {after}");
    assert!(
        d.headline.contains("prompt tokens computed on decode"),
        "{}",
        d.headline
    );
    for c in d
        .changed
        .iter()
        .filter(|c| c.what.contains(&"foreign_reads_gone".into()))
    {
        assert_eq!(c.after.http_status, 200);
        assert!(c.after.decode_prompt_tokens >= c.before.decode_prompt_tokens);
        assert!(c.after.latency_ms.unwrap() > c.before.latency_ms.unwrap());
    }
}

#[test]
fn whatif_longer_lease_closes_the_lease_expiry() {
    let run = simulate("vllm-lease-expiry", Some(1200), 3, &[]);
    assert!(run.truth.summary.affected_responses > 0);
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base");
    let long = dir.path().join("lease");
    replay(&run.trace, None, &[], &base);
    replay(&run.trace, None, &["kv_lease_duration=600"], &long);
    let d = diff_of(&base, &long);
    assert!(d.exposure.before.affected_responses > 0, "{}", d.headline);
    assert_eq!(d.exposure.after.affected_responses, 0, "{}", d.headline);
    // The lease knob and the engine are named in the replayed deployment.
    let t = Trace::open(&long).unwrap();
    assert_eq!(t.deployment().extra["simulator"]["kv_lease_duration"], 600);
}

#[test]
fn replay_cli_on_a_vllm_trace() {
    let run = simulate("vllm-stale-reference", Some(400), 3, &[]);
    let out = run.dir.path().join("r");
    let r = kvtrail([
        "replay",
        run.trace.to_str().unwrap(),
        "--engine",
        "vllm-0.33.0",
        "--set",
        "reference_check=true",
        "--set",
        "kv_load_failure_policy=recompute",
        "--out",
        out.to_str().unwrap(),
        "--compare",
    ])
    .env("KVTRAIL_NO_PROGRESS", "1")
    .run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains("-> 0 (0 cross-tenant"), "{}", r.stdout);
    assert!(r.stderr.contains("under vllm-0.33.0"), "{}", r.stderr);
    // The reference model's outputs re-run from the trace (fidelity).
    let r = kvtrail(["counterfactual", run.trace.to_str().unwrap()])
        .env("KVTRAIL_NO_PROGRESS", "1")
        .run();
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains("mismatch 0"), "{}", r.stdout);
}

fn kinds(r: &AuditReport) -> Vec<(Severity, String)> {
    r.findings
        .iter()
        .map(|f| (f.severity, f.kind.clone()))
        .collect()
}

#[test]
fn audit_learns_vllm_deployments() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, c: &SimConfig| {
        let p = dir.path().join(name);
        std::fs::write(&p, toml::to_string(c).unwrap()).unwrap();
        p
    };
    let sc = kvtrail::sim::scenario::scenario("vllm-steady", None, 1).unwrap();
    let good = sc.config.clone();
    let r = audit_file(&write("good.toml", &good)).unwrap();
    assert_eq!(r.exit_code(), 0, "{:?}", kinds(&r));
    assert!(kinds(&r).contains(&(Severity::Note, "kv_load_failure_policy_fail".into())));
    assert!(kinds(&r).contains(&(
        Severity::Note,
        "engine_fails_open_on_stale_reference".into()
    )));
    // No SGLang admission findings for vLLM.
    assert!(
        !kinds(&r)
            .iter()
            .any(|(_, k)| k.contains("max_req_input_len") || k.contains("decode_limit"))
    );

    let mut lease1 = good.clone();
    lease1.kv_lease_duration = Some(1);
    lease1.kv_load_failure_policy = Some(kvtrail::sim::config::FailurePolicy::Recompute);
    let r = audit_file(&write("lease1.toml", &lease1)).unwrap();
    assert_eq!(r.exit_code(), 1);
    let f = r
        .findings
        .iter()
        .find(|f| f.kind == "kv_lease_not_renewable")
        .unwrap();
    assert!(
        f.recommendation
            .as_ref()
            .unwrap()
            .contains("kv_lease_duration")
    );
    assert!(
        !kinds(&r)
            .iter()
            .any(|(_, k)| k == "kv_load_failure_policy_fail")
    );

    let mut slow = good.clone();
    slow.timing.straggler_ppm = 1000;
    slow.timing.straggler_delay_ms = 45_000;
    slow.bug_lease_expiry = Some(true);
    let r = audit_file(&write("slow.toml", &slow)).unwrap();
    let k = kinds(&r);
    assert!(
        k.contains(&(Severity::Warning, "kv_lease_below_transfer_time".into())),
        "{k:?}"
    );
    assert!(
        k.contains(&(Severity::Warning, "kv_lease_without_heartbeats".into())),
        "{k:?}"
    );

    let mut small = good.clone();
    small.decode.capacity_tokens = 20_000;
    let r = audit_file(&write("small.toml", &small)).unwrap();
    assert!(kinds(&r).contains(&(Severity::Note, "pool_headroom".into())));

    // A recorded vLLM manifest below max_model_len, with vLLM's own
    // kv_transfer_config keys.
    let m = dir.path().join("trace.json");
    std::fs::write(
        &m,
        r#"{"format":"kvtrail-trace","version":1,
 "deployment":{"name":"fleet","engine":"vllm 0.33.0","context_window":32768,
  "kv_transfer_config":{"kv_load_failure_policy":"fail","kv_connector_extra_config":{"kv_lease_duration":1}},
  "pools":[{"id":0,"name":"prefill-0","role":"prefill","capacity_tokens":16384,"page_size":16},
           {"id":1,"name":"decode-0","role":"decode","capacity_tokens":65536,"page_size":16}]},
 "capture":{"writer":"hook","started_ns":0,"ended_ns":0,"complete":true}}"#,
    )
    .unwrap();
    let r = audit_file(&m).unwrap();
    let k = kinds(&r);
    assert!(
        k.contains(&(Severity::Error, "pool_below_max_model_len".into())),
        "{k:?}"
    );
    assert!(
        k.contains(&(Severity::Warning, "kv_lease_not_renewable".into())),
        "{k:?}"
    );
    assert!(
        k.contains(&(Severity::Note, "kv_load_failure_policy_fail".into())),
        "{k:?}"
    );
    let v = r.deployment.vllm.as_ref().unwrap();
    assert_eq!(v.kv_lease_duration, Some(1));

    // The trace check names the stale reads of the bug scenario.
    let run = simulate("vllm-stale-reference", Some(800), 3, &[]);
    let r = audit_trace(
        &Trace::open(&run.trace).unwrap(),
        &LineageOptions::default(),
        &NoReporter,
    )
    .unwrap();
    let f = r
        .findings
        .iter()
        .find(|f| f.kind == "transfer_from_released_slots")
        .expect("stale reads found");
    // Every exposed response; a stale pull whose blocks still held that
    // request's own content is named too (a read of released blocks).
    for id in run.truth.affected_ids() {
        assert!(f.request_ids.contains(&id), "r{id} not named");
    }
    let clean = simulate("vllm-steady", Some(800), 3, &[]);
    let r = audit_trace(
        &Trace::open(&clean.trace).unwrap(),
        &LineageOptions::default(),
        &NoReporter,
    )
    .unwrap();
    assert_eq!(r.exit_code(), 0, "{:?}", kinds(&r));
}

/// Runs the CLI and requires exit 2 with every fragment in stderr.
fn refused(args: &[&str], fragments: &[&str]) {
    let r = kvtrail(args).env("KVTRAIL_NO_PROGRESS", "1").run();
    assert_eq!(r.code, 2, "{args:?}: {}", r.stderr);
    assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    for f in fragments {
        assert!(r.stderr.contains(f), "{args:?}: no `{f}` in\n{}", r.stderr);
    }
}

#[test]
fn bad_input_names_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("t");
    let o = out.to_str().unwrap();
    fn with<'a>(o: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
        let mut a = vec!["simulate", "--requests", "5", "--out", o];
        a.extend_from_slice(extra);
        a
    }
    let sim = |extra: &[&'static str]| with(o, extra);
    refused(
        &sim(&["--scenario", "vllm-steady", "--engine", "vllm-0.34.0"]),
        &["unknown engine `vllm-0.34.0`", "vllm-0.33.0", "--set"],
    );
    refused(
        &sim(&["--scenario", "steady", "--engine", "vllm-fixed"]),
        &["unknown engine", "no vLLM release fixes"],
    );
    refused(
        &sim(&["--scenario", "steady", "--engine", "sglang-9"]),
        &["unknown engine", "vllm-0.33.0"],
    );
    // vLLM keys on an SGLang engine, and the other way round.
    refused(
        &sim(&[
            "--scenario",
            "steady",
            "--set",
            "kv_load_failure_policy=recompute",
        ]),
        &["kv_load_failure_policy", "vLLM key", "sglang-0.5.19"],
    );
    refused(
        &sim(&["--scenario", "vllm-steady", "--engine", "sglang-0.5.22"]),
        &["is a vLLM key", "sglang-0.5.22"],
    );
    refused(
        &sim(&["--scenario", "vllm-steady", "--set", "kv_checksum=true"]),
        &["kv_checksum", "SGLang key", "vllm-0.33.0"],
    );
    refused(
        &sim(&["--scenario", "sibling-inflight", "--engine", "vllm-0.33.0"]),
        &["SGLang key"],
    );
    // Impossible values.
    for (set, key) in [
        ("block_size=0", "block_size"),
        ("block_size=-16", "block_size"),
        ("kv_lease_duration=0", "kv_lease_duration"),
        ("kv_lease_duration=-5", "kv_lease_duration"),
        ("kv_lease_duration=100000000", "kv_lease_duration"),
        ("kv_load_failure_policy=retry", "kv_load_failure_policy"),
        ("bug_stale_reference_ppm=2000000", "bug_stale_reference_ppm"),
        ("bug_out_of_range_ppm=1000001", "bug_out_of_range_ppm"),
        ("bug_out_of_range_ppm=-3", "bug_out_of_range_ppm"),
        ("transfer_failure_ppm=-1", "transfer_failure_ppm"),
        ("cache_salt=user", "cache_salt"),
        ("prefill.page_size=32", "block_size"),
        ("decode.capacity_tokens=8192", "max_model_len"),
        ("block_size=48", "multiple"),
    ] {
        refused(&sim(&["--scenario", "vllm-steady", "--set", set]), &[key]);
    }
    // The SGLang incident's pools cannot run as vLLM: vLLM would not start.
    refused(
        &sim(&["--scenario", "incident", "--engine", "vllm-0.33.0"]),
        &["prefill.capacity_tokens", "refuses to start"],
    );
    assert!(!out.exists() || std::fs::read_dir(&out).unwrap().next().is_none());

    // Replay: the same checks against a vLLM trace.
    let run = simulate("vllm-steady", Some(20), 1, &[]);
    let t = run.trace.to_str().unwrap();
    let r_out = dir.path().join("r");
    let ro = r_out.to_str().unwrap();
    refused(
        &["replay", t, "--engine", "sglang-0.5.23", "--out", ro],
        &["vLLM key"],
    );
    refused(
        &["replay", t, "--set", "kv_lease_duration=0", "--out", ro],
        &["kv_lease_duration"],
    );
    refused(
        &["replay", t, "--engine", "vllm-0.40.0", "--out", ro],
        &["unknown engine", "--set"],
    );
}

#[test]
fn block_size_moves_the_pools_with_it() {
    let mut c = kvtrail::sim::scenario::scenario("vllm-steady", None, 1)
        .unwrap()
        .config;
    c.set("block_size=64").unwrap();
    assert_eq!((c.prefill.page_size, c.decode.page_size), (64, 64));
    let mut s = SimConfig::default();
    s.set("prefill.capacity_tokens=32768").unwrap();
    s.set("engine=vllm-0.33.0").unwrap();
    assert_eq!(s.block_size, Some(16));
    let run = simulate("vllm-stale-reference", Some(300), 5, &["block_size=64"]);
    check_against_truth("block 64", &run);
}
