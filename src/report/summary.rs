//! The one-screen human summary of a scope report (`scope` and `merge`
//! without `--json`): verdict, affected responses (the first ten), the
//! customers on both sides, blank reads, request anomalies and how complete
//! the evidence is. Every string from the trace goes through `text::term`.

use std::fmt::Write as _;

use crate::scope::{Crossing, Response, ScopeReport, Tenant};
use crate::text::{term, utc_opt};
use crate::words::count;

/// The one-screen human summary.
pub fn human(r: &ScopeReport) -> String {
    let mut s = String::new();
    let d = &r.deployment;
    let c = &r.counts;
    let cov = &r.coverage;
    let _ = writeln!(s, "kvtrail scope: {} ({})", term(&d.name), term(&d.engine));
    let _ = writeln!(
        s,
        "  replayed {} ({}, {}) over {}; {}",
        count(c.kv_events, "kv event", "kv events"),
        count(c.slot_touches, "slot touch", "slot touches"),
        count(c.read_slots, "read slot", "read slots"),
        count(d.pools.len() as u64, "pool", "pools"),
        count(c.requests, "request", "requests")
    );
    let _ = writeln!(s);
    let _ = writeln!(s, "VERDICT: {}", r.verdict);
    let _ = writeln!(s);
    if !r.affected_responses.is_empty() {
        let _ = writeln!(
            s,
            "affected responses: {} ({} confirmed, {} possible), {}, {}",
            c.affected_responses,
            c.confirmed_responses,
            c.possible_responses,
            c.cross_tenant_words(),
            count(c.foreign_tokens, "foreign token", "foreign tokens")
        );
        let _ = writeln!(
            s,
            "  window: foreign reads {} .. {}; affected arrivals {} .. {}",
            utc_opt(r.time_window.first_exposure_ns),
            utc_opt(r.time_window.last_exposure_ns),
            utc_opt(r.time_window.first_arrival_ns),
            utc_opt(r.time_window.last_arrival_ns)
        );
        let _ = writeln!(
            s,
            "  {:>10}  {:<16} {:>6} {:>9} {:>5}  {:<10} sources",
            "request", "tenant", "status", "foreign", "cross", "confidence"
        );
        const SHOW: usize = 10;
        for a in r.affected_responses.iter().take(SHOW) {
            let st: Vec<String> = source_tenants(a)
                .iter()
                .map(|t| term(t).into_owned())
                .collect();
            let _ = writeln!(
                s,
                "  {:>10}  {:<16} {:>6} {:>9} {:>5}  {:<10} {}",
                a.request_id,
                term(&a.tenant.to_string()),
                a.http_status.map(|x| x.to_string()).unwrap_or("-".into()),
                a.foreign_tokens,
                match a.crossing() {
                    Crossing::Yes => "yes",
                    Crossing::No => "no",
                    Crossing::Unknown => "?",
                },
                a.confidence.as_str(),
                if st.is_empty() {
                    a.reasons.join(",")
                } else {
                    st.join(",")
                }
            );
        }
        if r.affected_responses.len() > SHOW {
            let _ = writeln!(
                s,
                "  ... {} more (use --json or --out DIR for all)",
                r.affected_responses.len() - SHOW
            );
        }
        let list = |v: Vec<String>| {
            let n = v.len();
            let mut t = v.into_iter().take(8).collect::<Vec<_>>().join(", ");
            if n > 8 {
                let _ = write!(t, ", ... ({n} in all)");
            }
            t
        };
        if r.affected_responses
            .iter()
            .any(|a| a.crossing() == Crossing::Unknown)
        {
            let _ = writeln!(
                s,
                "  cross \"?\": a tenant is unknown (missing from the requests table), so whether the data was another customer's cannot be told"
            );
        }
        let _ = writeln!(
            s,
            "recipients ({}): {}",
            customers(c.recipient_tenants, r.recipients.iter().map(|t| &t.tenant)),
            list(
                r.recipients
                    .iter()
                    .map(|t| format!("{} ({} resp)", term(&t.tenant.to_string()), t.responses))
                    .collect()
            )
        );
        let _ = writeln!(
            s,
            "sources ({}): {}",
            customers(c.source_tenants, r.sources.iter().map(|t| &t.tenant)),
            list(
                r.sources
                    .iter()
                    .map(|t| format!(
                        "{} ({} req, {} tok)",
                        term(&t.tenant.to_string()),
                        t.requests,
                        t.tokens
                    ))
                    .collect()
            )
        );
    }
    if !r.cross_tenant_shared.is_empty() {
        let what = if r.deployment.tenant_prefix_cache() {
            "prefix-cache isolation breaches (prefix_cache_scope is \"tenant\")"
        } else {
            "information: prefix_cache_scope is global"
        };
        let _ = writeln!(
            s,
            "cross-tenant prefix-cache hits: {} ({what}); no foreign KV entered them",
            count(r.cross_tenant_shared.len() as u64, "response", "responses")
        );
        const SHOW: usize = 10;
        for h in r.cross_tenant_shared.iter().take(SHOW) {
            let src: Vec<String> = h
                .sources
                .iter()
                .map(|x| format!("{} ({} tok)", term(&x.tenant.to_string()), x.tokens))
                .collect();
            let _ = writeln!(
                s,
                "  {:>10}  {:<16} {:>6} tok  from {}",
                h.request_id,
                term(&h.tenant.to_string()),
                h.tokens,
                src.join(", ")
            );
        }
        if r.cross_tenant_shared.len() > SHOW {
            let _ = writeln!(
                s,
                "  ... {} more (use --json or --out DIR for all)",
                r.cross_tenant_shared.len() - SHOW
            );
        }
    }
    let _ = writeln!(
        s,
        "blank reads (integrity defects): {} in {}",
        count(r.blank_reads, "slot", "slots"),
        count(r.blank_read_responses.len() as u64, "response", "responses")
    );
    if !r.anomalies.is_empty() {
        let mut kinds: std::collections::BTreeMap<&str, usize> = Default::default();
        for a in &r.anomalies {
            *kinds.entry(a.kind.as_str()).or_default() += 1;
        }
        let k: Vec<String> = kinds.iter().map(|(k, n)| format!("{k}: {n}")).collect();
        let _ = writeln!(s, "request anomalies: {}", k.join(", "));
    }
    let _ = writeln!(
        s,
        "evidence: {}",
        if cov.complete {
            "complete"
        } else {
            "INCOMPLETE"
        }
    );
    for n in cov.notes.iter().take(8) {
        let _ = writeln!(s, "  - {}", term(n));
    }
    if cov.notes.len() > 8 {
        let _ = writeln!(
            s,
            "  - ... {} in --json",
            count(cov.notes.len() as u64 - 8, "more note", "more notes")
        );
    }
    s
}

/// The distinct tenants of a response's sources as shown to people, sorted
/// (the summary's and responses.csv's `sources`).
pub fn source_tenants(a: &Response) -> Vec<String> {
    let mut st: Vec<String> = a.sources.iter().map(|x| x.tenant.to_string()).collect();
    st.sort_unstable();
    st.dedup();
    st
}

/// `2` customers, and what else the list holds that is no customer:
/// `1, plus unknown tenants`.
fn customers<'a>(n: u64, tenants: impl Iterator<Item = &'a Tenant>) -> String {
    let mut t = n.to_string();
    let (mut unknown, mut engine) = (false, false);
    for x in tenants {
        unknown |= *x == Tenant::Unknown;
        engine |= *x == Tenant::Engine;
    }
    match (unknown, engine) {
        (true, true) => t.push_str(", plus unknown tenants and the engine"),
        (true, false) => t.push_str(", plus unknown tenants"),
        (false, true) => t.push_str(", plus the engine"),
        (false, false) => {}
    }
    t
}
