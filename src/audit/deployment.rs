//! `kvtrail audit`'s deployment checks: every pool against the context
//! window (SGLang's admission limit `max_req_input_len`, on the trace
//! manifest's pool), page sizes, allow_auto_truncate, the KV checksum and
//! the scrub policy, with a recommendation.

use super::{Finding, Severity, finding, fmt_n};
use crate::error::{Error, Result};
use crate::sim::config::{EngineVersion, SimConfig};
use crate::trace::manifest::{Manifest, max_req_input_len};
use crate::whatif::workload::{parse_engine, pool_tokens};
use serde::Serialize;
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
    pub max_req_input_len: u64,
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
}

impl DeploymentView {
    pub fn from_config(cfg: &SimConfig, source: &str) -> DeploymentView {
        let pool = |id: u16, name: &str, role: &str, p: &crate::sim::config::PoolConfig| PoolView {
            id,
            name: name.into(),
            role: role.into(),
            capacity_tokens: p.capacity_tokens,
            page_size: p.page_size,
            max_req_input_len: max_req_input_len(cfg.context_window, p.capacity_tokens),
        };
        DeploymentView {
            source: source.into(),
            engine: cfg.engine.name().into(),
            context_window: cfg.context_window,
            pools: vec![
                pool(0, "prefill-0", "prefill", &cfg.prefill),
                pool(1, "decode-0", "decode", &cfg.decode),
            ],
            allow_auto_truncate: Some(cfg.allow_auto_truncate),
            kv_checksum: Some(cfg.kv_checksum),
            scrub_on_free: Some(cfg.scrub_on_free),
        }
    }

    pub fn from_manifest(m: &Manifest, source: &str) -> DeploymentView {
        if let Some(v) = m.deployment.extra.get("simulator")
            && let Ok(cfg) = serde_json::from_value::<SimConfig>(v.clone())
        {
            return DeploymentView::from_config(&cfg, source);
        }
        let d = &m.deployment;
        DeploymentView {
            source: source.into(),
            engine: d.engine.clone(),
            context_window: d.context_window,
            pools: d
                .pools
                .iter()
                .map(|p| PoolView {
                    id: p.id,
                    name: p.name.clone(),
                    role: p.role.as_str().into(),
                    capacity_tokens: pool_tokens(p),
                    page_size: p.page_size,
                    max_req_input_len: max_req_input_len(d.context_window, pool_tokens(p)),
                })
                .collect(),
            allow_auto_truncate: None,
            kv_checksum: None,
            scrub_on_free: None,
        }
    }

    /// Reads a deployment file: a simulator config (TOML, or JSON), or a
    /// trace manifest (trace.json, or a trace directory).
    pub fn load(path: &Path) -> Result<DeploymentView> {
        let source = path.display().to_string();
        if path.is_dir() {
            return Ok(DeploymentView::from_manifest(
                &Manifest::load(path)?,
                &source,
            ));
        }
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        if path.extension().is_some_and(|e| e == "json")
            && let Ok(v) = serde_json::from_str::<serde_json::Value>(&text)
            && v.get("format").and_then(|f| f.as_str()) == Some("kvtrail-trace")
        {
            let m = Manifest::parse(&text, path)?;
            return Ok(DeploymentView::from_manifest(&m, &source));
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

/// Deployment checks.
pub fn audit_deployment(d: &DeploymentView) -> Vec<Finding> {
    let mut out = Vec::new();
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
    let engine = parse_engine(&d.engine);
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
