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

// ---- issue 32: audit ----------------------------------------------------

use crate::support::cli::s;
use crate::support::trace_builder::{TraceBuilder, pool};
use kvtrail::trace::Role;

/// A vLLM manifest with `deployment_keys` (JSON members) added to its
/// deployment.
fn vllm_manifest(deployment_keys: &str) -> String {
    format!(
        r#"{{"format":"kvtrail-trace","version":1,
 "deployment":{{"name":"fleet","engine":"vllm-0.33.0","context_window":32768,{deployment_keys}
  "pools":[{{"id":0,"name":"prefill-0","role":"prefill","capacity_tokens":65536,"page_size":16}},
           {{"id":1,"name":"decode-0","role":"decode","capacity_tokens":65536,"page_size":16}}]}},
 "capture":{{"writer":"hook","started_ns":0,"ended_ns":0,"complete":true}}}}"#
    )
}

/// An SGLang manifest (the incident's engine, pools at 2x the context
/// window) with `deployment_keys` added to its deployment.
fn sglang_manifest(engine: &str, deployment_keys: &str) -> String {
    format!(
        r#"{{"format":"kvtrail-trace","version":1,
 "deployment":{{"name":"glm","engine":"{engine}","context_window":1048576,{deployment_keys}
  "pools":[{{"id":0,"name":"prefill-0","role":"prefill","capacity_tokens":2097152,"page_size":64}},
           {{"id":1,"name":"decode-0","role":"decode","capacity_tokens":2097152,"page_size":64}}]}},
 "capture":{{"writer":"hook","started_ns":0,"ended_ns":0,"complete":true}}}}"#
    )
}

fn audit_cli(path: &std::path::Path) -> (i32, String, String) {
    kvtrail(["audit", "--deployment", s(path)])
        .run()
        .into_parts()
}

#[test]
fn defect11_audit_refuses_a_deployment_value_it_cannot_read() {
    let dir = tempfile::tempdir().unwrap();
    let lease = "kv_lease_duration";
    let cases: Vec<(String, &str)> = [
        r#""kv_lease_duration":"1","#,
        r#""kv_lease_duration":1.5,"#,
        r#""kv_lease_duration":true,"#,
        r#""kv_lease_duration":1e30,"#,
        r#""kv_lease_duration":null,"#,
        r#""kv_lease_duration":18446744073709551615,"#,
        r#""kv_transfer_config":{"kv_connector_extra_config":{"kv_lease_duration":"30"}},"#,
        r#""kv_transfer_config":{"kv_connector_extra_config":{"kv_lease_duration":2.0}},"#,
    ]
    .iter()
    .map(|k| (vllm_manifest(k), lease))
    .chain(
        [
            (r#""kv_load_failure_policy":5,"#, "kv_load_failure_policy"),
            (
                r#""kv_transfer_config":{"kv_load_failure_policy":["fail"]},"#,
                "kv_load_failure_policy",
            ),
            (r#""kv_transfer_config":"fail","#, "kv_transfer_config"),
            (
                r#""kv_transfer_config":{"kv_connector_extra_config":30},"#,
                "kv_connector_extra_config",
            ),
            (
                r#""kv_lease_duration":30,"kv_transfer_config":{"kv_connector_extra_config":{"kv_lease_duration":1}},"#,
                "kv_lease_duration",
            ),
        ]
        .iter()
        .map(|(k, key)| (vllm_manifest(k), *key)),
    )
    .chain(
        [
            (r#""allow_auto_truncate":"yes","#, "allow_auto_truncate"),
            (r#""kv_checksum":1,"#, "kv_checksum"),
            (r#""scrub_on_free":null,"#, "scrub_on_free"),
            (r#""simulator":{"engine":5},"#, "simulator"),
            (r#""bug_stale_copy":"on","#, "bug_stale_copy"),
        ]
        .iter()
        .map(|(k, key)| (sglang_manifest("sglang-0.5.22", k), *key)),
    )
    .collect();
    for (i, (text, key)) in cases.iter().enumerate() {
        let p = dir.path().join(format!("m{i}.json"));
        std::fs::write(&p, text).unwrap();
        let (code, out, err) = audit_cli(&p);
        assert_eq!(code, 2, "case {i} ({key}): {out}{err}");
        assert!(err.contains(key), "case {i}: {err}");
        assert!(!out.contains("does not say"), "case {i}: {out}");
    }
    // A pool's max_total_num_tokens that is not a number.
    let bad_pool = sglang_manifest("sglang-0.5.22", "").replacen(
        r#""page_size":64}"#,
        r#""page_size":64,"max_total_num_tokens":"681280"}"#,
        1,
    );
    assert!(bad_pool.contains("max_total_num_tokens"));
    let p = dir.path().join("pool.json");
    std::fs::write(&p, &bad_pool).unwrap();
    let (code, _, err) = audit_cli(&p);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("pools[0].max_total_num_tokens"), "{err}");
    // Readable values still work, nested or not.
    for (k, code) in [
        (r#""kv_lease_duration":1,"#, 1),
        (
            r#""kv_lease_duration":30,"kv_load_failure_policy":"recompute","#,
            0,
        ),
        (
            r#""kv_transfer_config":{"kv_load_failure_policy":"fail","kv_connector_extra_config":{"kv_lease_duration":30}},"#,
            0,
        ),
    ] {
        let p = dir.path().join("ok.json");
        std::fs::write(&p, vllm_manifest(k)).unwrap();
        let (c, out, err) = audit_cli(&p);
        assert_eq!(c, code, "{k}: {out}{err}");
    }
}

#[test]
fn defect12_audit_fails_a_deployment_that_declares_a_known_bug() {
    let dir = tempfile::tempdir().unwrap();
    let fixed = {
        let mut c = SimConfig::default();
        c.set("prefill.capacity_tokens=32768").unwrap();
        c.set("engine=sglang-0.5.22").unwrap();
        c
    };
    let vllm = kvtrail::sim::scenario::scenario("vllm-steady", None, 1)
        .unwrap()
        .config;
    let mut cases: Vec<(&str, SimConfig)> = Vec::new();
    for set in ["bug_stale_copy=true", "bug_inflight_reuse=true"] {
        let mut c = fixed.clone();
        c.set(set).unwrap();
        cases.push((set, c));
    }
    for set in [
        "bug_stale_reference_ppm=2000",
        "bug_lease_expiry=true",
        "bug_out_of_range_ppm=1000",
    ] {
        let mut c = vllm.clone();
        c.set(set).unwrap();
        cases.push((set, c));
    }
    // The tier bugs, each on its scenario (the tier they spoil is on).
    for (set, name) in [
        ("bug_stale_cpu_offload_ppm", "vllm-cpu-offload-stale"),
        ("bug_stale_lmcache_ppm", "vllm-lmcache-stale"),
    ] {
        let c = kvtrail::sim::scenario::scenario(name, None, 1)
            .unwrap()
            .config;
        cases.push((set, c));
    }
    // Every bug_* switch of the model is among the cases.
    let keys: Vec<String> = serde_json::to_value(SimConfig::default())
        .unwrap()
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| k.starts_with("bug_"))
        .cloned()
        .collect();
    for k in &keys {
        assert!(cases.iter().any(|(s, _)| s.starts_with(k.as_str())), "{k}");
    }
    let clean = dir.path().join("clean.toml");
    std::fs::write(&clean, toml::to_string(&fixed).unwrap()).unwrap();
    assert_eq!(audit_file(&clean).unwrap().exit_code(), 0);
    for (set, c) in cases {
        let p = dir.path().join("bug.toml");
        std::fs::write(&p, toml::to_string(&c).unwrap()).unwrap();
        let r = audit_file(&p).unwrap();
        assert_eq!(r.exit_code(), 1, "{set}: {:#?}", r.findings);
        let key = set.split('=').next().unwrap();
        assert!(
            r.findings
                .iter()
                .any(|f| f.severity == kvtrail::audit::Severity::Error && f.detail.contains(key)),
            "{set}: {:#?}",
            r.findings
        );
        let (code, out, err) = audit_cli(&p);
        assert_eq!(code, 1, "{set}: {out}{err}");
    }
    // A manifest that declares one, at the deployment's top level.
    let p = dir.path().join("m.json");
    std::fs::write(
        &p,
        sglang_manifest("sglang-0.5.22", r#""bug_inflight_reuse":true,"#),
    )
    .unwrap();
    let (code, out, err) = audit_cli(&p);
    assert_eq!(code, 1, "{out}{err}");
    // And the trace of a simulated sibling, whose manifest carries the config.
    let sib = simulate("sibling-stale-copy", Some(200), 1, &[]);
    let (code, out, err) = kvtrail(["audit", "--deployment", s(&sib.trace.join("trace.json"))])
        .run()
        .into_parts();
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("bug_stale_copy"), "{out}");
}

/// A hand-made SGLang trace: context window 48 and pools of 64 slots
/// (max_req_input_len = min(47, 63) - 5 = 42). Each (prompt, prefilled)
/// request is answered 200 and reads only KV it wrote.
fn truncation_trace(
    dir: &std::path::Path,
    name: &str,
    engine: &str,
    extra: &[(&str, serde_json::Value)],
    reqs: &[(u32, u32)],
) -> std::path::PathBuf {
    let mut tb =
        TraceBuilder::with_pools(vec![pool(0, Role::Prefill, 64), pool(1, Role::Decode, 64)]);
    tb.deployment.engine = engine.into();
    tb.deployment.context_window = 48;
    for (k, v) in extra {
        tb.deployment.extra.insert(k.to_string(), v.clone());
    }
    for (i, &(prompt, prefilled)) in reqs.iter().enumerate() {
        let id = i as u64 + 1;
        let r = tb.req(id, "acme");
        r.prompt_tokens = prompt;
        r.prefilled_tokens = Some(prefilled);
        r.prefill_pool = Some(0);
        r.decode_pool = Some(1);
        tb.alloc(1, id, 0, 8);
        tb.write(1, id, 0, 8);
        tb.read(1, id, 0, 8);
        tb.free(1, id, 0, 8);
    }
    tb.record(&dir.join(name))
}

#[test]
fn defect15_audit_knows_what_auto_truncation_does() {
    let dir = tempfile::tempdir().unwrap();
    // At the limit (fully prefilled), past it (truncated to 42) and past
    // the context window (truncated to 42).
    let clean = [(42, 42), (45, 42), (100, 42), (10, 10)];
    let sim_cfg = {
        let mut c = SimConfig::default();
        c.set("engine=sglang-0.5.22").unwrap();
        c.set("allow_auto_truncate=true").unwrap();
        c.set("context_window=48").unwrap();
        c.set("prefill.capacity_tokens=64").unwrap();
        c.set("decode.capacity_tokens=64").unwrap();
        c.set("prefill.page_size=1").unwrap();
        c.set("decode.page_size=1").unwrap();
        serde_json::to_value(c).unwrap()
    };
    for (name, engine, extra) in [
        ("sim", "sglang-0.5.22", vec![("simulator", sim_cfg.clone())]),
        (
            "recorded",
            "sglang 0.5.22",
            vec![("allow_auto_truncate", serde_json::json!(true))],
        ),
    ] {
        let t = truncation_trace(dir.path(), name, engine, &extra, &clean);
        let r = audit(&t);
        assert_eq!(kinds(&r), Vec::<String>::new(), "{name}: {:#?}", r.findings);
        assert_eq!(r.exit_code(), 0, "{name}");
        // Shorter than truncation leaves is still an error.
        let bad = truncation_trace(
            dir.path(),
            &format!("{name}-short"),
            engine,
            &extra,
            &[(45, 40), (42, 42)],
        );
        let r = audit(&bad);
        assert_eq!(ids(&r, "prefilled_less_than_prompt_2xx"), vec![1], "{name}");
        assert!(ids(&r, "rejected_yet_2xx").is_empty(), "{name}");
    }
    // Without truncation the same requests are errors (the scheduler
    // rejects prompts of 42 and more).
    let t = truncation_trace(
        dir.path(),
        "no-trunc",
        "sglang-0.5.22",
        &[("allow_auto_truncate", serde_json::json!(false))],
        &[(42, 42), (45, 45), (10, 10)],
    );
    assert_eq!(ids(&audit(&t), "rejected_yet_2xx"), vec![1, 2]);
    // vLLM admits up to max_model_len (48 here), not SGLang's limit.
    let t = truncation_trace(
        dir.path(),
        "vllm",
        "vllm-0.33.0",
        &[],
        &[(45, 45), (47, 47), (10, 10)],
    );
    let r = audit(&t);
    assert_eq!(kinds(&r), Vec::<String>::new(), "{:#?}", r.findings);
    // A simulated clean auto-truncate run: scope finds nothing, and
    // neither does the audit.
    let sim = simulate(
        "incident",
        Some(600),
        1,
        &[
            "engine=sglang-0.5.22",
            "prefill.capacity_tokens=32768",
            "allow_auto_truncate=true",
        ],
    );
    assert!(sim.truth.affected_ids().is_empty());
    let r = audit(&sim.trace);
    assert_eq!(kinds(&r), Vec::<String>::new(), "{:#?}", r.findings);
}

#[test]
fn small_engine_string_with_a_suffix_keeps_the_placeholder_note() {
    let dir = tempfile::tempdir().unwrap();
    for engine in [
        "sglang-0.5.19.post1",
        "sglang 0.5.19 (PD)",
        "SGLang==0.5.19+cu128",
    ] {
        let p = dir.path().join("m.json");
        std::fs::write(&p, sglang_manifest(engine, "")).unwrap();
        let r = audit_file(&p).unwrap();
        assert!(
            r.findings
                .iter()
                .any(|f| f.kind == "engine_has_placeholder_bug"),
            "{engine}: {:#?}",
            r.findings
        );
    }
    // A pre-release is not the release: no version-specific claim.
    let p = dir.path().join("rc.json");
    std::fs::write(&p, sglang_manifest("sglang-0.5.20rc1", "")).unwrap();
    let r = audit_file(&p).unwrap();
    assert!(
        !r.findings
            .iter()
            .any(|f| f.kind == "engine_has_placeholder_bug")
    );
}

#[test]
fn small_audit_counts_agree_with_their_nouns() {
    let dir = tempfile::tempdir().unwrap();
    let t = truncation_trace(
        dir.path(),
        "one",
        "sglang-0.5.22",
        &[("allow_auto_truncate", serde_json::json!(false))],
        &[(45, 45), (10, 10)],
    );
    let r = audit(&t);
    let f = r
        .findings
        .iter()
        .find(|f| f.kind == "rejected_yet_2xx")
        .unwrap();
    assert!(f.detail.starts_with("1 request had"), "{}", f.detail);
    assert!(
        r.verdict.starts_with("FAIL: 1 error, 0 warnings"),
        "{}",
        r.verdict
    );
}

// ---- issue 31: one slot rule for scope and audit ------------------------

/// A grant holds until its slots are written again; a `free` does not end
/// it (docs/trace-format.md, `share`). Request 2 is granted request 1's
/// decode slots, frees them, then reads them: a shared read for scope and
/// no read beyond the transfer for audit. Request 3 reads the same slots
/// without a grant: foreign for scope, beyond the transfer for audit.
#[test]
fn share_then_free_then_read_by_the_grantee_agrees_in_scope_and_audit() {
    let dir = tempfile::tempdir().unwrap();
    let mut tb = TraceBuilder::pd();
    for (id, tenant) in [(1, "acme"), (2, "acme"), (3, "initech")] {
        let r = tb.req(id, tenant);
        r.prefill_pool = Some(0);
        r.decode_pool = Some(1);
    }
    tb.alloc(1, 1, 0, 8);
    tb.write(1, 1, 0, 8);
    tb.share(1, 2, 0, 8);
    tb.free(1, 2, 0, 8);
    tb.read(1, 2, 0, 8);
    tb.read(1, 3, 0, 8);
    tb.free(1, 1, 0, 8);
    let trace = tb.record(&dir.path().join("t"));

    let report = crate::support::trace_builder::scope(&trace);
    let affected: Vec<u64> = report
        .affected_responses
        .iter()
        .map(|a| a.request_id)
        .collect();
    assert_eq!(affected, [3], "scope: only the read without a grant");
    let r = audit(&trace);
    assert_eq!(
        ids(&r, "decode_read_beyond_transfer"),
        affected,
        "audit must agree with scope: {:#?}",
        r.findings
    );
}
