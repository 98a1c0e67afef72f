//! `kvtrail audit`'s deployment checks (`audit_deployment` over a
//! [`DeploymentView`], read from a simulator config or a trace's manifest;
//! vLLM's settings are `whatif::extras::VllmView`): every pool against the
//! context window (SGLang's admission limit `max_req_input_len`, on the
//! trace manifest's pool), page sizes, allow_auto_truncate, the KV checksum and
//! the scrub policy, with a recommendation. A vLLM deployment gets vLLM's
//! checks instead (`audit_vllm`): each instance's KV cache against
//! `max_model_len`, `kv_load_failure_policy`, and the NixlConnector's
//! `kv_lease_duration` against its heartbeats and the transfer times.

use super::finding::{Finding, Severity, finding, fmt_n};
use crate::engines::is_vllm_engine;
use crate::error::{Error, Location, Result};
use crate::sim::config::{EngineVersion, FailurePolicy, SimConfig};
use crate::trace::manifest::{Manifest, prompt_limit};
use crate::whatif::extras::{VllmView, boolean, shown, unreadable};
use crate::whatif::workload::{pool_tokens, simulator_config};
use serde::Serialize;
use serde_json::{Map, Value};
use std::path::Path;

/// One pool as the audit sees it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolView {
    pub id: u16,
    pub name: String,
    pub role: String,
    /// SGLang max_total_num_tokens.
    pub capacity_tokens: u64,
    pub page_size: u32,
    /// The prompt length at or over which the engine refuses a request on
    /// this pool ([`prompt_limit`]): SGLang's max_req_input_len, vLLM's
    /// max_model_len (at most the pool).
    pub max_req_input_len: u64,
}

/// A defect of the engine model that the deployment declares (a `bug_*`
/// key set to true or a rate above 0).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeclaredBug {
    pub key: String,
    /// The value as written (JSON).
    pub value: String,
}

/// The deployment as audited; knobs are None when the source does not say.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeploymentView {
    pub source: String,
    pub engine: String,
    pub context_window: u64,
    pub pools: Vec<PoolView>,
    pub allow_auto_truncate: Option<bool>,
    pub kv_checksum: Option<bool>,
    pub scrub_on_free: Option<bool>,
    /// vLLM's P/D settings (a vLLM deployment only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vllm: Option<VllmView>,
    /// Known defects the deployment declares (a gate never passes them).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub declared_bugs: Vec<DeclaredBug>,
}

/// The `bug_*` keys of an object that declare a defect: true, or a number
/// above 0. Null, false and 0 declare none; any other value is an error
/// naming the key (`prefix` + key).
fn declared_bugs(o: &Map<String, Value>, loc: &Location, prefix: &str) -> Result<Vec<DeclaredBug>> {
    let mut out = Vec::new();
    for (k, v) in o {
        if !k.starts_with("bug_") {
            continue;
        }
        let on = match v {
            Value::Null | Value::Bool(false) => false,
            Value::Bool(true) => true,
            Value::Number(n) if n.as_u64().is_some() => n.as_u64() != Some(0),
            v => {
                return Err(unreadable(
                    loc,
                    &format!("{prefix}{k}"),
                    v,
                    "true, false or a whole number (parts per million)",
                ));
            }
        };
        if on {
            out.push(DeclaredBug {
                key: k.clone(),
                value: shown(v),
            });
        }
    }
    Ok(out)
}

impl DeploymentView {
    pub fn from_config(cfg: &SimConfig, source: &str) -> DeploymentView {
        let engine = cfg.engine.name();
        let pool = |id: u16, name: &str, role: &str, p: &crate::sim::config::PoolConfig| PoolView {
            id,
            name: name.into(),
            role: role.into(),
            capacity_tokens: p.capacity_tokens,
            page_size: p.page_size,
            max_req_input_len: prompt_limit(engine, cfg.context_window, p.capacity_tokens),
        };
        let vllm = cfg.engine.is_vllm().then(|| {
            let t = &cfg.timing;
            let blocks = cfg.context_window.div_ceil(cfg.block_size().max(1) as u64);
            let mut slowest_ns = (t.transfer_base_us as u128) * 1000
                + t.transfer_ns_per_page as u128 * blocks as u128;
            if t.straggler_ppm > 0 {
                slowest_ns += t.straggler_delay_ms as u128 * 1_000_000;
            }
            VllmView {
                kv_load_failure_policy: Some(
                    match cfg.failure_policy() {
                        FailurePolicy::Fail => "fail",
                        FailurePolicy::Recompute => "recompute",
                    }
                    .into(),
                ),
                kv_lease_duration: Some(cfg.lease_s() as i64),
                heartbeats: Some(!cfg.bug_lease_expiry.unwrap_or(false)),
                slowest_transfer_ms: Some(
                    slowest_ns.div_ceil(1_000_000).min(u64::MAX as u128) as u64
                ),
                reference_check: Some(cfg.reference_check.unwrap_or(false)),
            }
        });
        let sglang = !cfg.engine.is_vllm();
        // Every bug_* switch the engine model has, read from the config
        // itself (a switch added later is checked without a change here).
        let bugs = match serde_json::to_value(cfg) {
            Ok(Value::Object(o)) => declared_bugs(&o, &Location::default(), "").unwrap_or_default(),
            _ => Vec::new(),
        };
        DeploymentView {
            source: source.into(),
            engine: engine.into(),
            context_window: cfg.context_window,
            pools: vec![
                pool(0, "prefill-0", "prefill", &cfg.prefill),
                pool(1, "decode-0", "decode", &cfg.decode),
            ],
            allow_auto_truncate: sglang.then_some(cfg.allow_auto_truncate),
            kv_checksum: sglang.then_some(cfg.kv_checksum),
            scrub_on_free: Some(cfg.scrub_on_free),
            vllm,
            declared_bugs: bugs,
        }
    }

    /// The deployment of a manifest read from `manifest_path` (named in
    /// errors): its simulator config when it carries one, else its pools
    /// and the keys audit reads (`allow_auto_truncate`, `kv_checksum`,
    /// `scrub_on_free`, `bug_*` and vLLM's keys, docs/what-if.md). A key
    /// that is present but cannot be read is an error naming it.
    pub fn from_manifest(
        m: &Manifest,
        source: &str,
        manifest_path: &Path,
    ) -> Result<DeploymentView> {
        let loc = Location::file(manifest_path);
        let d = &m.deployment;
        if let Some(cfg) = simulator_config(d, &loc)? {
            return Ok(DeploymentView::from_config(&cfg, source));
        }
        let vllm = is_vllm_engine(&d.engine);
        let mut pools = Vec::with_capacity(d.pools.len());
        for (i, p) in d.pools.iter().enumerate() {
            let tokens = pool_tokens(p, i, &loc)?;
            pools.push(PoolView {
                id: p.id,
                name: p.name.clone(),
                role: p.role.as_str().into(),
                capacity_tokens: tokens,
                page_size: p.page_size,
                max_req_input_len: prompt_limit(&d.engine, d.context_window, tokens),
            });
        }
        let key = |k: &str| format!("deployment.{k}");
        let sglang_knob = |k: &str| -> Result<Option<bool>> {
            let v = boolean(d.extra.get(k), &loc, &key(k))?;
            Ok(if vllm { None } else { v })
        };
        Ok(DeploymentView {
            source: source.into(),
            engine: d.engine.clone(),
            context_window: d.context_window,
            pools,
            allow_auto_truncate: sglang_knob("allow_auto_truncate")?,
            kv_checksum: sglang_knob("kv_checksum")?,
            scrub_on_free: boolean(d.extra.get("scrub_on_free"), &loc, &key("scrub_on_free"))?,
            vllm: if vllm {
                Some(VllmView::from_extra(&d.extra, &loc)?)
            } else {
                None
            },
            declared_bugs: declared_bugs(&d.extra, &loc, "deployment.")?,
        })
    }

    /// Reads a deployment file: a simulator config (TOML, or JSON), or a
    /// trace manifest (trace.json, or a trace directory).
    pub fn load(path: &Path) -> Result<DeploymentView> {
        let source = path.display().to_string();
        if path.is_dir() {
            return DeploymentView::from_manifest(
                &Manifest::load(path)?,
                &source,
                &path.join("trace.json"),
            );
        }
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        if path.extension().is_some_and(|e| e == "json")
            && let Ok(v) = serde_json::from_str::<serde_json::Value>(&text)
            && v.get("format").and_then(|f| f.as_str()) == Some("kvtrail-trace")
        {
            let m = Manifest::parse(&text, path)?;
            return DeploymentView::from_manifest(&m, &source, path);
        }
        let cfg = SimConfig::load(path).map_err(|e| match e {
            Error::Invalid { loc, what, .. } => Error::Invalid {
                loc,
                what,
                hint: "give a deployment config (TOML/JSON, keys of docs/simulator.md) or a trace.json".into(),
            },
            other => other,
        })?;
        Ok(DeploymentView::from_config(&cfg, &source))
    }
}

/// vLLM's deployment checks (docs/engine-vllm.md "Audit").
pub fn audit_vllm(d: &DeploymentView, v: &VllmView) -> Vec<Finding> {
    let mut out = Vec::new();
    let ctx = d.context_window;
    for p in &d.pools {
        let subject = Some(format!("pool {} ({})", p.id, p.name));
        if p.capacity_tokens < ctx {
            out.push(finding(
                Severity::Error,
                "pool_below_max_model_len",
                subject,
                format!(
                    "{} instance's KV cache of {} tokens cannot hold one request of max_model_len {}: vLLM refuses to start such an instance (kv_cache_planning.py, _check_enough_kv_cache_memory)",
                    p.role,
                    fmt_n(p.capacity_tokens),
                    fmt_n(ctx)
                ),
                Some(format!(
                    "raise gpu_memory_utilization (or the pool: capacity_tokens) to at least {} tokens, or lower max_model_len",
                    fmt_n(ctx)
                )),
            ));
        } else if p.capacity_tokens < 2 * ctx && p.role != "mixed" {
            out.push(finding(
                Severity::Note,
                "pool_headroom",
                subject,
                format!(
                    "{} instance's KV cache of {} tokens holds fewer than two requests of max_model_len {}: one long request queues the rest, and references wait in decode's queue while the producer's lease runs",
                    p.role,
                    fmt_n(p.capacity_tokens),
                    fmt_n(ctx)
                ),
                Some(format!(
                    "give each instance at least {} tokens (2 x max_model_len)",
                    fmt_n(2 * ctx)
                )),
            ));
        }
    }
    match v.kv_load_failure_policy.as_deref() {
        Some("fail") => out.push(finding(
            Severity::Note,
            "kv_load_failure_policy_fail",
            None,
            "kv_load_failure_policy = fail: a load NIXL reports failed ends the request with HTTP 500".into(),
            Some("set kv_load_failure_policy = \"recompute\" (kv_transfer_config) to serve it after a local prefill on decode; neither policy acts on a load NIXL reports done".into()),
        )),
        Some("recompute") => {}
        Some(other) => out.push(finding(
            Severity::Warning,
            "kv_load_failure_policy_unknown",
            None,
            format!("kv_load_failure_policy = `{other}` is not a value vLLM 0.33.0 accepts (fail, recompute)"),
            Some("set kv_load_failure_policy to \"fail\" or \"recompute\"".into()),
        )),
        None => out.push(finding(
            Severity::Note,
            "kv_load_failure_policy_unknown",
            None,
            "the deployment does not say its kv_load_failure_policy (vLLM's default is fail: HTTP 500 on a failed load)".into(),
            Some("record kv_transfer_config.kv_load_failure_policy in the deployment".into()),
        )),
    }
    match v.kv_lease_duration {
        Some(l) if l < 1 => out.push(finding(
            Severity::Error,
            "kv_lease_duration_invalid",
            None,
            format!("kv_lease_duration = {l}: the producer releases a request's blocks before decode can read them"),
            Some("set kv_lease_duration (kv_connector_extra_config) to whole seconds, 30 by default".into()),
        )),
        Some(l) => {
            let ext = l * 2 / 3;
            if ext == 0 {
                out.push(finding(
                    Severity::Warning,
                    "kv_lease_not_renewable",
                    None,
                    format!("kv_lease_duration = {l} s: a heartbeat extends the lease by {l} * 2 // 3 = 0 s (base_worker.py _handle_heartbeat), so a reference that waits in decode's queue longer than {l} s is released and its blocks reused; decode then reads them and answers HTTP 200 (vllm-project/vllm#52234's fail-open path)"),
                    Some("set kv_lease_duration to at least 2 (30 is vLLM's default)".into()),
                ));
            }
            if v.heartbeats == Some(false) {
                out.push(finding(
                    Severity::Warning,
                    "kv_lease_without_heartbeats",
                    None,
                    format!("decode's heartbeats do not reach the producer: every reference expires {l} s after its prefill, however long decode still needs it; a later read takes reused blocks with HTTP 200"),
                    Some("restore the heartbeat path, and set kv_lease_duration above the longest decode queue wait plus transfer".into()),
                ));
            }
            if let Some(ms) = v.slowest_transfer_ms
                && ms >= (l as u64).saturating_mul(1000)
            {
                out.push(finding(
                    Severity::Warning,
                    "kv_lease_below_transfer_time",
                    None,
                    format!("the slowest transfer takes {} ms, not less than kv_lease_duration = {l} s: only heartbeats keep the blocks while it runs", fmt_n(ms)),
                    Some(format!("set kv_lease_duration above {} s", ms.div_ceil(1000))),
                ));
            }
        }
        None => out.push(finding(
            Severity::Note,
            "kv_lease_duration_unknown",
            None,
            "the deployment does not say its kv_lease_duration (vLLM's default is 30 s)".into(),
            Some("record kv_transfer_config.kv_connector_extra_config.kv_lease_duration in the deployment".into()),
        )),
    }
    if v.reference_check != Some(true) {
        out.push(finding(
            Severity::Note,
            "engine_fails_open_on_stale_reference",
            None,
            "vLLM 0.33.0 accepts any load NIXL reports done: a stale reference (blocks the producer released and reused) is read, cached and answered with HTTP 200 (vllm-project/vllm#52234, open; no release fixes it)".into(),
            Some("keep kv_lease_duration well above decode's queue wait, never replay kv_transfer_params, and scope traces (kvtrail scope) for foreign reads; what-if: kvtrail replay TRACE --set reference_check=true".into()),
        ));
    }
    out
}

/// What a declared `bug_*` switch of the engine model does.
fn bug_effect(key: &str) -> &'static str {
    match key {
        "bug_inflight_reuse" => {
            "decode frees a failed request's slots while a transfer into them is in flight, and the late transfer lands in slots already given to another request, which reads that KV and answers HTTP 200 (#24527 class)"
        }
        "bug_stale_copy" => {
            "prefill frees its slots when the forward ends, before the transfer has copied them, and the copy carries whatever another request wrote there into decode, answered HTTP 200 (vLLM #52234 class)"
        }
        "bug_stale_reference_ppm" => {
            "decode dispatches handed an earlier, consumed producer reference read blocks the producer released and reused, and answer HTTP 200 (vllm-project/vllm#52234)"
        }
        "bug_lease_expiry" => {
            "decode's heartbeats never reach the producer, so a lease runs out while decode still holds the reference and a later read takes reused blocks with HTTP 200 (vllm-project/vllm#52234)"
        }
        "bug_out_of_range_ppm" => {
            "decode dispatches whose reference names blocks past the end of the producer's pool read memory of no request, which NIXL reports done and decode answers with HTTP 200 (vllm-project/vllm#52234)"
        }
        "bug_stale_cpu_offload_ppm" => {
            "the CPU offload tier frees an evicted entry's blocks but keeps its key, so a later prefix hit loads whatever reused those blocks, another request's KV, and answers HTTP 200"
        }
        "bug_stale_lmcache_ppm" => {
            "the external KV store frees an evicted chunk but keeps its key, so a later hit on either instance loads another request's KV and answers HTTP 200"
        }
        _ => "a defect of the engine model that exposes KV across requests",
    }
}

/// The `bug_*` switches a deployment declares: an error each (a warning
/// where the simulator's `reference_check` fails the loads they spoil).
fn declared_bug_findings(d: &DeploymentView) -> Vec<Finding> {
    let checked = d.vllm.as_ref().and_then(|v| v.reference_check) == Some(true);
    d.declared_bugs
        .iter()
        .map(|b| {
            let (sev, tail) = if checked {
                (
                    Severity::Warning,
                    "; reference_check (a mitigation, not a vLLM option) fails such loads, so kv_load_failure_policy applies instead of a stale read",
                )
            } else {
                (Severity::Error, "")
            };
            finding(
                sev,
                "declared_engine_defect",
                Some(b.key.clone()),
                format!(
                    "the deployment declares {} = {}: {}{tail}",
                    b.key,
                    b.value,
                    bug_effect(&b.key)
                ),
                Some(format!(
                    "do not deploy an engine with this defect: take the engine's fix, then set {} to its default (off)",
                    b.key
                )),
            )
        })
        .collect()
}

/// Deployment checks.
pub fn audit_deployment(d: &DeploymentView) -> Vec<Finding> {
    let mut out = declared_bug_findings(d);
    if let Some(v) = &d.vllm {
        out.extend(audit_vllm(d, v));
        return out;
    }
    let ctx = d.context_window;
    let rec_cap = 2 * ctx;
    let recommend = format!(
        "give every prefill and decode pool capacity_tokens >= 2 x context_window ({}), as the operator chose after the incident; at the very least the context window ({}), so that the pool is not what limits max_req_input_len (then it is context_window - 6 on every pool alike)",
        fmt_n(rec_cap),
        fmt_n(ctx)
    );
    let front_limit = ctx.saturating_sub(1);
    let max_decode = d
        .pools
        .iter()
        .filter(|p| p.role == "decode" || p.role == "mixed")
        .map(|p| p.max_req_input_len)
        .max();
    let engine = EngineVersion::parse(&d.engine);
    for p in &d.pools {
        let subject = Some(format!("pool {} ({})", p.id, p.name));
        // The pool binds when capacity - 1 < context_window - 1; otherwise
        // the limit is context_window - 6 on every pool (SGLang's margin).
        let covers = p.capacity_tokens >= ctx;
        if p.role == "prefill"
            && let Some(dl) = max_decode
            && p.max_req_input_len < dl
        {
            let hi = dl.min(ctx) - 1;
            let mut consequence = match engine {
                Some(EngineVersion::V0519) => "under sglang-0.5.19 prefill forwards a 1-token placeholder and decode generates over its whole preallocation of stale KV from other requests, answered HTTP 200 (the incident)".to_string(),
                Some(_) => format!("under {} prefill answers 400 but decode, which preallocated the prompt, waits out its timeout (HTTP 500 after ~300 s with the decode-answer router) and holds that decode capacity until then", d.engine),
                None => format!("engine `{}`: depending on the version this is the incident (0.5.19: stale KV, HTTP 200) or a 500 after decode's timeout with decode capacity held (0.5.20+)", d.engine),
            };
            if d.allow_auto_truncate == Some(true) {
                consequence.push_str("; with allow_auto_truncate on, prefill truncates and sends a short transfer marked last, and decode reads the stale tail with HTTP 200 in every version");
                if d.kv_checksum == Some(true) {
                    consequence.push_str(" (the KV checksum turns that into a 500)");
                }
            }
            out.push(finding(
                Severity::Error,
                "prefill_pool_below_decode_limit",
                subject,
                format!(
                    "prefill pool of {} tokens: max_req_input_len = min({} - 1, {} - 1) - 5 = {}, below decode's {}; prompts of {}..={} tokens pass the front end and decode but are rejected by prefill: {consequence}",
                    fmt_n(p.capacity_tokens),
                    fmt_n(ctx),
                    fmt_n(p.capacity_tokens),
                    fmt_n(p.max_req_input_len),
                    fmt_n(dl),
                    fmt_n(p.max_req_input_len),
                    fmt_n(hi),
                ),
                Some(recommend.clone()),
            ));
        } else if !covers {
            out.push(finding(
                Severity::Warning,
                "pool_below_context_window",
                subject,
                format!(
                    "{} pool of {} tokens is smaller than the {}-token context window: max_req_input_len = {} (the pool binds, not the context window); prompts of {}..={} tokens pass the front end but are rejected here",
                    p.role,
                    fmt_n(p.capacity_tokens),
                    fmt_n(ctx),
                    fmt_n(p.max_req_input_len),
                    fmt_n(p.max_req_input_len),
                    fmt_n(front_limit)
                ),
                Some(recommend.clone()),
            ));
        } else if p.capacity_tokens < rec_cap && p.role != "mixed" {
            out.push(finding(
                Severity::Note,
                "pool_headroom",
                subject,
                format!(
                    "{} pool of {} tokens covers the context window but holds fewer than two maximal requests",
                    p.role,
                    fmt_n(p.capacity_tokens)
                ),
                Some(recommend.clone()),
            ));
        }
    }
    let sizes: std::collections::BTreeSet<u32> = d
        .pools
        .iter()
        .filter(|p| p.role != "mixed")
        .map(|p| p.page_size)
        .collect();
    if sizes.len() > 1 {
        out.push(finding(
            Severity::Warning,
            "page_size_mismatch",
            None,
            format!(
                "prefill and decode pools use different page sizes ({:?}); transfers map pages one to one and a partial last page can carry stale slots",
                sizes
            ),
            Some("use one page size across the PD pools".into()),
        ));
    }
    match d.scrub_on_free {
        Some(true) => {}
        Some(false) => out.push(finding(
            Severity::Note,
            "no_scrub_on_free",
            None,
            "freed KV is not zeroed (SGLang never zeroes it): any stale read exposes the previous occupant's KV".into(),
            Some("scrub-on-free (a mitigation, not an SGLang option) turns a stale read into a blank one".into()),
        )),
        None => out.push(finding(
            Severity::Note,
            "scrub_policy_unknown",
            None,
            "the manifest does not say whether freed KV is zeroed; SGLang does not zero it".into(),
            None,
        )),
    }
    if engine.is_none() {
        out.push(finding(
            Severity::Note,
            "engine_version_unknown",
            None,
            format!(
                "engine `{}` names no release kvtrail models ({}): what it does with a prompt only prefill rejects is not known here",
                d.engine,
                EngineVersion::names()
            ),
            Some("record the engine's release in deployment.engine (e.g. sglang-0.5.22)".into()),
        ));
    }
    if matches!(engine, Some(EngineVersion::V0519)) {
        out.push(finding(
            Severity::Note,
            "engine_has_placeholder_bug",
            None,
            "sglang-0.5.19 answers a prompt only prefill rejects with a placeholder and HTTP 200; harmless only while no pool is below the decode limit".into(),
            Some("upgrade to sglang-0.5.22 or later".into()),
        ));
    }
    out
}
