//! report.html: the incident report for people who do not read JSON.
//! One self-contained file (inline CSS, inline SVG charts, one small inline
//! script for table sorting; a Content-Security-Policy that forbids any
//! network access): headline numbers, the exposure timeline against total
//! traffic, the customers on both sides, cross-tenant prefix-cache hits
//! (a section of their own, only when there are any), the mechanism seen
//! in the trace (prompt_tokens vs prefilled_tokens vs HTTP status),
//! coverage and confidence, and the evidence (command, tool version,
//! input digests).
//!
//! The markup lives in templates/report.html.j2 (built into the binary),
//! rendered with minijinja's HTML auto-escaping: every value the template
//! prints is escaped unless it is markup on purpose, so no string from a
//! trace can be left unescaped by mistake. This file only gathers the
//! values (numbers, times, the chart's geometry) into the template's
//! context. Pure function of its inputs: no clock, no absolute paths, same
//! bytes for the same trace and command.

use minijinja::{AutoEscape, Environment, UndefinedBehavior};
use serde_json::{Value, json};

use crate::custody::Inputs;
use crate::error::{Error, Result};
use crate::report::lookup_files::Timeline;
use crate::scope::anomalies::{
    ERROR_LOOKS_LIKE_SUCCESS, PROMPT_EXCEEDS_PREFILL_POOL, error_looks_like_success,
};
use crate::scope::{Crossing, DeploymentInfo, ScopeReport, Tenant};
use crate::text::{duration, utc, utc_opt};

/// Most rows shown per table; the CSV files hold all of them.
pub const MAX_ROWS: usize = 500;

/// The report's markup.
const TEMPLATE: &str = include_str!("../../templates/report.html.j2");

/// The exposure timeline's geometry: all requests per bucket (top) and
/// affected responses per bucket (bottom), same time axis; the template
/// draws it as inline SVG.
fn timeline_view(tl: &Timeline) -> Value {
    let n = tl.requests.len().max(1);
    let (w, left, right) = (960.0f64, 56.0f64, 12.0f64);
    let bw = (w - left - right) / n as f64;
    let (top_h, bot_h, gap) = (130.0f64, 90.0f64, 34.0f64);
    let y0 = 18.0f64;
    let y1 = y0 + top_h + gap;
    let total_h = y1 + bot_h + 40.0;
    let max_t = tl.requests.iter().copied().max().unwrap_or(0).max(1);
    let max_a = tl.affected.iter().copied().max().unwrap_or(0).max(1);
    let mut bars = Vec::new();
    for i in 0..n {
        let x = left + i as f64 * bw;
        let from = tl.start_ns + i as i64 * tl.width_ns;
        let to = from + tl.width_ns;
        let t = tl.requests.get(i).copied().unwrap_or(0);
        let a = tl.affected.get(i).copied().unwrap_or(0);
        let c = tl.confirmed.get(i).copied().unwrap_or(0);
        let ok = tl.ok_responses.get(i).copied().unwrap_or(0);
        let th = top_h * t as f64 / max_t as f64;
        let ah = (bot_h * a as f64 / max_a as f64).max(2.0);
        bars.push(json!({
            "x": format!("{x:.2}"),
            "width": format!("{:.2}", (bw - 1.0).max(0.5)),
            "y": format!("{:.2}", y0 + top_h - th),
            "height": format!("{th:.2}"),
            "affected": a > 0,
            "ay": format!("{:.2}", y1 + bot_h - ah),
            "aheight": format!("{ah:.2}"),
            "title": format!(
                "{} .. {}: {}, {ok} with 2xx, {a} affected ({c} confirmed)",
                utc(from),
                utc(to),
                crate::words::count(t, "request", "requests")
            ),
        }));
    }
    let end = tl.start_ns + n as i64 * tl.width_ns;
    let ya = y1 + bot_h + 16.0;
    json!({
        "w": w.to_string(),
        "total_h": total_h.to_string(),
        "left": left.to_string(),
        "right_x": (w - right).to_string(),
        "mid_x": (left + (w - left - right) / 2.0).to_string(),
        "top_line": (y0 + top_h).to_string(),
        "bottom_line": (y1 + bot_h).to_string(),
        "label_top": (y0 + 10.0).to_string(),
        "label_bottom": (y1 + 10.0).to_string(),
        "caption_bottom": (y1 - 6.0).to_string(),
        "axis_y": ya.to_string(),
        "interval_y": (ya + 16.0).to_string(),
        "max_t": max_t,
        "max_a": max_a,
        "bars": bars,
        "start": utc(tl.start_ns),
        "end": utc(end),
        "interval": duration(tl.width_ns),
    })
}

/// The whole report.html.
pub fn report_html(
    r: &ScopeReport,
    tl: &Timeline,
    inputs: &Inputs,
    command: &[String],
) -> Result<String> {
    let c = &r.counts;
    let d = &r.deployment;
    let cov = &r.coverage;
    let w = &r.time_window;
    let verdict_class = if r.any_exposure() {
        "bad"
    } else if !cov.complete {
        "warn"
    } else {
        "ok"
    };
    // A tenant unknown on either side: its own card, never counted as
    // another customer's data.
    let cross_unknown = c
        .cross_tenant_unknown_responses
        .min(c.cross_tenant_responses);
    let mut cards = json!([
        [c.affected_responses.to_string(), "affected responses"],
        [
            format!("{} / {}", c.confirmed_responses, c.possible_responses),
            "confirmed / possible"
        ],
        [
            (c.cross_tenant_responses - cross_unknown).to_string(),
            "responses with another customer's data"
        ],
        [
            c.recipient_tenants.to_string(),
            "customers who received foreign data"
        ],
        [c.source_tenants.to_string(), "customers whose data leaked"],
        [c.source_requests.to_string(), "source requests"],
        [c.foreign_tokens.to_string(), "foreign tokens read"],
        [c.requests.to_string(), "requests in the trace"],
    ]);
    if cross_unknown > 0 {
        if let Some(v) = cards.as_array_mut() {
            v.insert(
                3,
                json!([
                    cross_unknown.to_string(),
                    "responses where a tenant is unknown: another customer's data cannot be ruled out"
                ]),
            );
        }
    }
    // Per customer, what certainly crossed to another customer.
    let mut recv_cross: std::collections::BTreeMap<&Tenant, u64> = Default::default();
    let mut src_cross: std::collections::BTreeMap<&Tenant, u64> = Default::default();
    for a in &r.affected_responses {
        if a.crossing() == Crossing::Yes {
            *recv_cross.entry(&a.tenant).or_default() += 1;
        }
        for x in &a.sources {
            if x.crossing(&a.tenant) == Crossing::Yes {
                let e = src_cross.entry(&x.tenant).or_default();
                *e = e.saturating_add(x.tokens);
            }
        }
    }
    let window = w.first_exposure_ns.map(|_| {
        json!({
            "first": utc_opt(w.first_exposure_ns),
            "last": utc_opt(w.last_exposure_ns),
            "duration": duration(w.last_exposure_ns.unwrap_or(0) - w.first_exposure_ns.unwrap_or(0)),
            "first_arrival": utc_opt(w.first_arrival_ns),
            "last_arrival": utc_opt(w.last_arrival_ns),
        })
    });
    let recipients: Vec<Value> = r
        .recipients
        .iter()
        .take(MAX_ROWS)
        .map(|t| {
            json!({
                "tenant": t.tenant.to_string(),
                "responses": t.responses,
                "cross_tenant_responses": recv_cross.get(&t.tenant).copied().unwrap_or(0),
                "foreign_tokens": t.foreign_tokens,
                "confirmed": t.confirmed,
                "possible": t.possible,
            })
        })
        .collect();
    let sources: Vec<Value> = r
        .sources
        .iter()
        .take(MAX_ROWS)
        .map(|t| {
            json!({
                "tenant": t.tenant.to_string(),
                "requests": t.requests,
                "tokens": t.tokens,
                "cross_tenant_tokens": src_cross.get(&t.tenant).copied().unwrap_or(0),
                "recipient_responses": t.recipient_responses,
                "recipient_tenants": t.recipient_tenants.len(),
            })
        })
        .collect();
    let prefix_cache = (!r.cross_tenant_shared.is_empty()).then(|| {
        let hits: Vec<Value> = r
            .cross_tenant_shared
            .iter()
            .take(MAX_ROWS)
            .map(|hit| {
                json!({
                    "request_id": hit.request_id,
                    "external_id": hit.external_id.as_deref().unwrap_or("-"),
                    "tenant": hit.tenant.to_string(),
                    "tokens": hit.tokens,
                    "sources": hit.sources.iter().map(|x| json!({
                        "tenant": x.tenant.to_string(),
                        "tokens": x.tokens,
                        "request_id": x.request_id,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        json!({
            "breach": r.deployment.tenant_prefix_cache(),
            "count": r.cross_tenant_shared.len(),
            "hits": hits,
        })
    });
    let short_ok = r
        .affected_responses
        .iter()
        .filter(|a| match (a.prompt_tokens, a.http_status) {
            (Some(p), Some(st)) => error_looks_like_success(p, a.prefilled_tokens, st),
            _ => false,
        })
        .count();
    let pools = pools_view(d);
    let affected: Vec<Value> = r
        .affected_responses
        .iter()
        .take(MAX_ROWS)
        .map(|a| {
            json!({
                "request_id": a.request_id,
                "external_id": a.external_id.as_deref().unwrap_or("-"),
                "tenant": a.tenant.to_string(),
                "arrival_key": a.arrival_ns.unwrap_or(a.first_read_ns),
                "arrival": utc_opt(a.arrival_ns),
                "prompt_tokens": a.prompt_tokens,
                "prefilled_tokens": a.prefilled_tokens,
                "http_status": a.http_status,
                "foreign_tokens": a.foreign_tokens,
                "sources": a.sources.len(),
                "confidence": a.confidence.as_str(),
            })
        })
        .collect();
    let mut kinds: std::collections::BTreeMap<&str, usize> = Default::default();
    for a in &r.anomalies {
        *kinds.entry(a.kind.as_str()).or_default() += 1;
    }
    let anomalies: Vec<Value> = kinds
        .into_iter()
        .map(|(k, n)| {
            let what = match k {
                ERROR_LOOKS_LIKE_SUCCESS => {
                    "fewer tokens prefilled than sent, answered with a 2xx status"
                }
                PROMPT_EXCEEDS_PREFILL_POOL => {
                    "prompt at or over the prefill pool's max_req_input_len"
                }
                _ => "",
            };
            json!({ "kind": k, "n": n, "what": what })
        })
        .collect();
    let files = files_view(inputs);
    let view = json!({
        "version": env!("CARGO_PKG_VERSION"),
        "name": d.name,
        "engine": d.engine,
        "verdict": r.verdict,
        "verdict_class": verdict_class,
        "cards": cards,
        "window": window,
        "capture_start": utc(d.capture_started_ns),
        "capture_end": utc(d.capture_ended_ns),
        "kv_events": c.kv_events,
        "pool_count": d.pools.len(),
        "timeline": timeline_view(tl),
        "recipients": recipients,
        "recipients_total": r.recipients.len(),
        "sources": sources,
        "sources_total": r.sources.len(),
        "prefix_cache": prefix_cache,
        "context_window": d.context_window,
        "pools": pools,
        "short_ok": short_ok,
        "affected": affected,
        "affected_total": r.affected_responses.len(),
        "anomalies": anomalies,
        "coverage": {
            "complete": cov.complete,
            "capture_complete": cov.capture_complete,
            "from_engine_start": match cov.from_engine_start {
                Some(true) => "yes",
                Some(false) => "NO",
                None => "unknown",
            },
            "lost_events": cov.lost_events,
            "gaps": cov.gaps.len(),
            "blank_reads": r.blank_reads,
            "blank_read_responses": r.blank_read_responses.len(),
            "notes": cov.notes,
        },
        "command": command.join(" "),
        "problems": inputs.problems,
        "files": files,
        "files_total": inputs.files.len(),
        "max_rows": MAX_ROWS,
    });
    render(view)
}

/// The pools table of the report.
fn pools_view(d: &DeploymentInfo) -> Vec<Value> {
    d
        .pools
        .iter()
        .map(|p| {
            json!({
                "name": p.name,
                "id": p.id,
                "role": p.role,
                "capacity_tokens": p.capacity_tokens,
                "page_size": p.page_size,
                "max_req_input_len": crate::trace::manifest::prompt_limit(&d.engine, d.context_window, p.capacity_tokens),
            })
        })
        .collect()
}

/// The input files table of the report.
fn files_view(inputs: &Inputs) -> Vec<Value> {
    inputs
        .files
        .iter()
        .take(MAX_ROWS)
        .map(|f| {
            json!({
                "path": f.path,
                "bytes": f.bytes,
                "blake3": f.blake3,
                "matches": match f.matches_manifest {
                    Some(true) => "yes",
                    Some(false) => "NO",
                    None => "-",
                },
            })
        })
        .collect()
}

/// Renders the built-in template over `view`.
fn render(view: Value) -> Result<String> {
    let mut env = Environment::new();
    env.set_undefined_behavior(UndefinedBehavior::Strict);
    env.set_keep_trailing_newline(true);
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_auto_escape_callback(|_| AutoEscape::Html);
    env.add_function("count", |n: u64, one: String, many: String| {
        crate::words::count(n, &one, &many)
    });
    env.add_function("noun", |n: u64, one: String, many: String| {
        crate::words::noun(n, &one, &many).to_string()
    });
    env.render_named_str("report.html.j2", TEMPLATE, view)
        .map_err(|e| Error::Other(format!("report.html: the built-in template failed: {e:#}")))
}
