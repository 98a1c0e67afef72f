//! The live findings a trace carries (`live-findings.json`, written by
//! `record` at close) against a fresh `scope` of the same trace: what
//! `kvtrail verify TRACE` reports.
//!
//! Compared per affected response: foreign, unknown, uncertain and
//! exposed tokens, confidence, cross-tenant, and each source (tokens,
//! confidence, cross-tenant); per cross-tenant prefix hit: tokens and
//! sources. A difference where live said less than scope (a response or
//! source missed, fewer tokens, a weaker confidence, a crossing not seen)
//! is an understatement: the live monitor told the operator less than
//! the evidence holds, and verify fails. Where live said more (a response
//! scope does not find, more tokens) the difference is reported, not
//! failed: live takes copies it could not see in time as uncertain.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use super::{LIVE_FINDINGS, LiveFindings};
use crate::error::{Error, Location, Result};
use crate::progress::NoReporter;
use crate::scope::{Confidence, Response, SharedHit};

/// One field where live and scope differ.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Difference {
    /// `affected response` or `prefix hit`.
    pub finding: &'static str,
    pub request_id: u64,
    /// The field (`exposed_tokens`, `source 7 tokens`, …; `finding` for a
    /// finding only one side has).
    pub field: String,
    pub live: String,
    pub scope: String,
    /// Live said less than scope here.
    pub live_said_less: bool,
}

/// live-findings.json against a fresh scope.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    /// The findings equal, field by field.
    pub equal: bool,
    /// Somewhere live said less than scope (verify fails).
    pub live_said_less: bool,
    /// What live-findings.json says of itself: its view was exact (then
    /// any difference is a defect, not a bound it counted).
    pub live_exact: bool,
    pub live_affected: usize,
    pub scope_affected: usize,
    pub live_prefix_hits: usize,
    pub scope_prefix_hits: usize,
    pub differences: Vec<Difference>,
}

/// Reads `TRACE/live-findings.json`: None when the trace has none (it was
/// recorded without live detection). A file that is not live findings is
/// an error naming it (exit 2).
pub fn read(trace: &Path) -> Result<Option<LiveFindings>> {
    let p = trace.join(LIVE_FINDINGS);
    let bytes = match std::fs::read(&p) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(&p, e)),
    };
    serde_json::from_slice(&bytes).map(Some).map_err(|e| {
        Error::invalid(
            Location::file(&p).row(e.line() as u64),
            format!("not live findings: {e}"),
            "the file is written by `kvtrail record --live` at close; a trace without it is \
             verified without the live comparison",
        )
    })
}

/// Compares the trace's live findings with a fresh scope; None when the
/// trace has no live findings.
pub fn compare_trace(trace: &Path) -> Result<Option<Comparison>> {
    let Some(live) = read(trace)? else {
        return Ok(None);
    };
    let t = crate::trace::Trace::open(trace)?;
    let scope = crate::scope::scope(&t, &Default::default(), &NoReporter)?;
    Ok(Some(compare(
        &live,
        &scope.affected_responses,
        &scope.cross_tenant_shared,
    )))
}

fn conf_rank(c: Confidence) -> u8 {
    match c {
        Confidence::Confirmed => 1,
        Confidence::Possible => 0,
    }
}

/// Compares live findings with scope's.
pub fn compare(live: &LiveFindings, scope: &[Response], hits: &[SharedHit]) -> Comparison {
    let mut d = Vec::new();
    let l: BTreeMap<u64, &Response> = live
        .affected_responses
        .iter()
        .map(|a| (a.request_id, a))
        .collect();
    let s: BTreeMap<u64, &Response> = scope.iter().map(|a| (a.request_id, a)).collect();
    for (&id, &sa) in &s {
        match l.get(&id) {
            None => d.push(only(
                "affected response",
                id,
                false,
                &format!("{} exposed tokens", sa.exposed_tokens),
            )),
            Some(la) => responses(&mut d, la, sa),
        }
    }
    for (&id, &la) in &l {
        if !s.contains_key(&id) {
            d.push(only(
                "affected response",
                id,
                true,
                &format!("{} exposed tokens", la.exposed_tokens),
            ));
        }
    }
    let lh: BTreeMap<u64, &SharedHit> = live
        .cross_tenant_shared
        .iter()
        .map(|h| (h.request_id, h))
        .collect();
    let sh: BTreeMap<u64, &SharedHit> = hits.iter().map(|h| (h.request_id, h)).collect();
    for (&id, &h) in &sh {
        match lh.get(&id) {
            None => d.push(only(
                "prefix hit",
                id,
                false,
                &format!("{} tokens", h.tokens),
            )),
            Some(l) => prefix_hits(&mut d, l, h),
        }
    }
    for (&id, &h) in &lh {
        if !sh.contains_key(&id) {
            d.push(only(
                "prefix hit",
                id,
                true,
                &format!("{} tokens", h.tokens),
            ));
        }
    }
    Comparison {
        equal: d.is_empty(),
        live_said_less: d.iter().any(|x| x.live_said_less),
        live_exact: live.exact,
        live_affected: l.len(),
        scope_affected: s.len(),
        live_prefix_hits: lh.len(),
        scope_prefix_hits: sh.len(),
        differences: d,
    }
}

/// A finding only one side has (`in_live`: live's).
fn only(finding: &'static str, id: u64, in_live: bool, what: &str) -> Difference {
    let (live, scope) = if in_live {
        (what.to_string(), "none".to_string())
    } else {
        ("none".to_string(), what.to_string())
    };
    Difference {
        finding,
        request_id: id,
        field: "finding".into(),
        live,
        scope,
        live_said_less: !in_live,
    }
}

/// Pushes a difference of a number: less when live's is smaller.
fn num(d: &mut Vec<Difference>, finding: &'static str, id: u64, field: String, l: u64, s: u64) {
    if l != s {
        d.push(Difference {
            finding,
            request_id: id,
            field,
            live: l.to_string(),
            scope: s.to_string(),
            live_said_less: l < s,
        });
    }
}

fn flag(d: &mut Vec<Difference>, id: u64, field: String, l: bool, s: bool) {
    if l != s {
        d.push(Difference {
            finding: "affected response",
            request_id: id,
            field,
            live: l.to_string(),
            scope: s.to_string(),
            live_said_less: !l && s,
        });
    }
}

fn confidence(d: &mut Vec<Difference>, id: u64, field: String, l: Confidence, s: Confidence) {
    if l != s {
        d.push(Difference {
            finding: "affected response",
            request_id: id,
            field,
            live: l.as_str().into(),
            scope: s.as_str().into(),
            live_said_less: conf_rank(l) < conf_rank(s),
        });
    }
}

fn responses(d: &mut Vec<Difference>, l: &Response, s: &Response) {
    const F: &str = "affected response";
    let id = s.request_id;
    for (field, a, b) in [
        ("foreign_tokens", l.foreign_tokens, s.foreign_tokens),
        ("unknown_tokens", l.unknown_tokens, s.unknown_tokens),
        ("uncertain_tokens", l.uncertain_tokens, s.uncertain_tokens),
        ("exposed_tokens", l.exposed_tokens, s.exposed_tokens),
    ] {
        num(d, F, id, field.into(), a, b);
    }
    confidence(d, id, "confidence".into(), l.confidence, s.confidence);
    flag(d, id, "cross_tenant".into(), l.cross_tenant, s.cross_tenant);
    let ls: BTreeMap<u64, _> = l.sources.iter().map(|x| (x.request_id, x)).collect();
    for x in &s.sources {
        let f = |w: &str| format!("source {} {w}", x.request_id);
        match ls.get(&x.request_id) {
            None => d.push(Difference {
                finding: F,
                request_id: id,
                field: f("tokens"),
                live: "none".into(),
                scope: x.tokens.to_string(),
                live_said_less: true,
            }),
            Some(y) => {
                num(d, F, id, f("tokens"), y.tokens, x.tokens);
                confidence(d, id, f("confidence"), y.confidence, x.confidence);
                flag(d, id, f("cross_tenant"), y.cross_tenant, x.cross_tenant);
            }
        }
    }
    for y in &l.sources {
        if !s.sources.iter().any(|x| x.request_id == y.request_id) {
            d.push(Difference {
                finding: F,
                request_id: id,
                field: format!("source {} tokens", y.request_id),
                live: y.tokens.to_string(),
                scope: "none".into(),
                live_said_less: false,
            });
        }
    }
}

fn prefix_hits(d: &mut Vec<Difference>, l: &SharedHit, s: &SharedHit) {
    const F: &str = "prefix hit";
    let id = s.request_id;
    num(d, F, id, "tokens".into(), l.tokens, s.tokens);
    let ls: BTreeMap<u64, u64> = l.sources.iter().map(|x| (x.request_id, x.tokens)).collect();
    let ss: BTreeMap<u64, u64> = s.sources.iter().map(|x| (x.request_id, x.tokens)).collect();
    for (&src, &t) in &ss {
        num(
            d,
            F,
            id,
            format!("source {src} tokens"),
            ls.get(&src).copied().unwrap_or(0),
            t,
        );
    }
    for (&src, &t) in &ls {
        if !ss.contains_key(&src) {
            num(d, F, id, format!("source {src} tokens"), t, 0);
        }
    }
}
