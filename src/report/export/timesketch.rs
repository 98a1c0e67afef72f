//! timeline.jsonl: the incident as a Timesketch timeline, one JSON object a
//! line, in time order: capture start and end, each affected response's
//! arrival and its foreign read window, each cross-tenant prefix-cache hit
//! (where prefix caches were promised per tenant), each request-level
//! anomaly (a prompt over its prefill pool's limit, or an error that looks
//! like success, answered 2xx), and each hole in the evidence.
//!
//! Every line has Timesketch's three required fields: `message`,
//! `datetime` (RFC 3339 with the `+00:00` offset and microseconds, through
//! jiff) and `timestamp_desc`, plus `timestamp` (the same instant in epoch
//! microseconds, so the importer need not parse), `data_type`
//! (`kvtrail:...`) and kvtrail's ids as flat keys. Holes in the evidence have
//! no time of their own: they are placed at the capture start with
//! `time_known: false`. Which customers a line names is
//! `input::Audience`'s rule: an external line names the tenant of its own
//! request only.

use jiff::Timestamp;
use jiff::fmt::temporal::DateTimePrinter;
use jiff::tz::Offset;
use serde_json::{Map, Value};

use super::input::{Audience, ExportInput, customer, other_customers, sources_words, tenant_kind};
use crate::scope::Tenant;
use crate::scope::anomalies::answered_ok;
use crate::words::count;

/// Epoch microseconds of epoch nanoseconds (rounded down).
fn micros(ns: i64) -> i64 {
    ns.div_euclid(1_000)
}

/// `datetime`: RFC 3339 in UTC with an explicit offset and six fractional
/// digits, the same instant as `micros`.
fn datetime(us: i64) -> String {
    const PRINTER: DateTimePrinter = DateTimePrinter::new().precision(Some(6));
    // Every i64 of microseconds is inside jiff's range (years -9999..9999).
    let ts = Timestamp::from_microsecond(us).unwrap_or(Timestamp::UNIX_EPOCH);
    PRINTER.timestamp_with_offset_to_string(&ts, Offset::UTC)
}

/// One line under construction; `rank` orders lines of the same instant.
struct Line {
    us: i64,
    rank: u8,
    obj: Map<String, Value>,
}

impl Line {
    fn new(ns: i64, rank: u8, data_type: &str, desc: &str, message: String) -> Self {
        let us = micros(ns);
        let mut obj = Map::new();
        obj.insert("message".into(), message.into());
        obj.insert("datetime".into(), datetime(us).into());
        obj.insert("timestamp".into(), us.into());
        obj.insert("timestamp_desc".into(), desc.into());
        obj.insert("data_type".into(), data_type.into());
        Line { us, rank, obj }
    }
    fn set(mut self, k: &str, v: impl Into<Value>) -> Self {
        self.obj.insert(k.to_string(), v.into());
        self
    }
    fn opt<T: Into<Value>>(self, k: &str, v: Option<T>) -> Self {
        match v {
            Some(v) => self.set(k, v),
            None => self,
        }
    }
}

/// Every line of timeline.jsonl, in file order.
pub fn lines(input: &ExportInput, audience: Audience) -> Vec<Value> {
    let r = &input.report;
    let d = &r.deployment;
    let incident = input.incident_uid();
    let complete = r.coverage.complete;
    let mut out: Vec<Line> = Vec::new();
    out.push(
        Line::new(
            d.capture_started_ns,
            0,
            "kvtrail:capture:start",
            "Capture start",
            format!(
                "Capture started on deployment {:?} ({}), written by {}",
                d.name, d.engine, d.capture_writer
            ),
        )
        .set("deployment", d.name.clone()),
    );
    let capture_end = if d.capture_ended_ns >= d.capture_started_ns {
        let how = if r.coverage.capture_complete {
            "the recorder closed cleanly"
        } else {
            "the capture is NOT complete (the recorder did not close cleanly)"
        };
        Line::new(
            d.capture_ended_ns,
            9,
            "kvtrail:capture:end",
            "Capture end",
            format!("Capture ended: {how}"),
        )
    } else {
        Line::new(
            d.capture_started_ns,
            9,
            "kvtrail:capture:end",
            "Capture end (not recorded; placed at capture start)",
            "Capture end not recorded: the capture is NOT complete".to_string(),
        )
        .set("time_known", false)
    };
    out.push(capture_end.set("capture_complete", r.coverage.capture_complete));

    for a in &r.affected_responses {
        let others = other_customers(&a.tenant, a.sources.iter().map(|s| &s.tenant));
        let who = |l: Line| {
            l.set("request_id", a.request_id)
                .opt("external_id", a.external_id.clone())
                .opt("tenant", customer(&a.tenant))
                .set("tenant_kind", tenant_kind(&a.tenant))
                .set("confidence", a.confidence.as_str())
                .set("cross_tenant", a.cross_tenant)
                .set("foreign_tokens", a.foreign_tokens)
        };
        if let Some(t) = a.arrival_ns {
            out.push(who(Line::new(
                t,
                2,
                "kvtrail:response:arrival",
                "Request arrival",
                format!(
                    "Affected response arrived: request {} ({}), later read {} of KV that was not its own",
                    a.request_id,
                    a.confidence.as_str(),
                    count(a.foreign_tokens, "token", "tokens")
                ),
            ))
            .opt("http_status", a.http_status));
        }
        let mut l = who(Line::new(
            a.first_read_ns,
            3,
            "kvtrail:response:foreign_read",
            "Foreign KV read window start",
            format!(
                "Request {} read KV that was not its own from {} to {} ({}; {}; {})",
                a.request_id,
                datetime(micros(a.first_read_ns)),
                datetime(micros(a.last_read_ns)),
                count(a.exposed_tokens, "token", "tokens"),
                sources_words(a, others.len()),
                a.reasons.join(", ")
            ),
        ))
        .set("read_window_end", datetime(micros(a.last_read_ns)))
        .set("read_window_end_timestamp", micros(a.last_read_ns))
        .set(
            "read_window_us",
            micros(a.last_read_ns).saturating_sub(micros(a.first_read_ns)),
        )
        .set("source_requests", a.sources.len() as u64)
        .set("source_customers", others.len() as u64);
        if audience == Audience::Internal {
            l = l.set("source_tenants", others.iter().copied().collect::<Vec<_>>());
        }
        out.push(l);
    }

    if input.prefix_hits_count() {
        for h in &r.cross_tenant_shared {
            let others = other_customers(&h.tenant, h.sources.iter().map(|s| &s.tenant));
            let (at, known) = match input.arrival_ns(h.request_id) {
                Some(t) => (t, true),
                None => (d.capture_ended_ns.max(d.capture_started_ns), false),
            };
            let mut l = Line::new(
                at,
                4,
                "kvtrail:response:prefix_cache_hit",
                if known {
                    "Request arrival"
                } else {
                    "Prefix-cache hit (arrival not recorded; placed at capture end)"
                },
                format!(
                    "Request {} hit {} of {} cached prefix although prefix caches are promised per tenant",
                    h.request_id,
                    count(h.tokens, "token", "tokens"),
                    if h.tenant == Tenant::Unknown {
                        "a customer's (the reader's customer is unknown)"
                    } else {
                        "another customer's"
                    }
                ),
            )
            .set("request_id", h.request_id)
            .opt("external_id", h.external_id.clone())
            .opt("tenant", customer(&h.tenant))
            .set("tenant_kind", tenant_kind(&h.tenant))
            .set("shared_tokens", h.tokens)
            .set("source_requests", h.sources.len() as u64)
            .set("source_customers", others.len() as u64);
            if !known {
                l = l.set("time_known", false);
            }
            if audience == Audience::Internal {
                l = l.set("source_tenants", others.iter().copied().collect::<Vec<_>>());
            }
            out.push(l);
        }
    }

    for an in &r.anomalies {
        if !answered_ok(an.http_status) {
            continue;
        }
        let (at, known) = match input.arrival_ns(an.request_id) {
            Some(t) => (t, true),
            None => (d.capture_started_ns, false),
        };
        let mut l = Line::new(
            at,
            5,
            &format!("kvtrail:anomaly:{}", an.kind),
            if known {
                "Request arrival"
            } else {
                "Anomaly (arrival not recorded; placed at capture start)"
            },
            format!(
                "Request {} answered {}: {}",
                an.request_id, an.http_status, an.detail
            ),
        )
        .set("request_id", an.request_id)
        .opt("external_id", an.external_id.clone())
        .set("tenant", an.tenant.clone())
        .set("anomaly", an.kind.clone())
        .set("http_status", an.http_status)
        .set("prompt_tokens", an.prompt_tokens)
        .opt("prefilled_tokens", an.prefilled_tokens)
        .opt("prefill_pool", an.prefill_pool)
        .opt("limit", an.limit);
        if !known {
            l = l.set("time_known", false);
        }
        out.push(l);
    }

    let hole = |message: String| {
        Line::new(
            d.capture_started_ns,
            1,
            "kvtrail:coverage:hole",
            "Evidence hole (time not recorded; placed at capture start)",
            message,
        )
        .set("time_known", false)
    };
    for g in &r.coverage.gaps {
        // Not `Gap::missing`: summary.json is input here, and a hand-made
        // one may hold a gap whose bounds are reversed.
        let missing = g
            .before_seq
            .saturating_sub(g.after_seq.map_or(0, |a| a.saturating_add(1)));
        out.push(
            hole(format!(
                "Evidence hole: pool {} lost {} events (seq {} to {})",
                g.pool,
                missing,
                g.after_seq.map_or(0, |s| s.saturating_add(1)),
                g.before_seq.saturating_sub(1)
            ))
            .set("pool", g.pool)
            .opt("after_seq", g.after_seq)
            .set("before_seq", g.before_seq)
            .set("missing_events", missing),
        );
    }
    for n in &input.coverage_notes(audience) {
        out.push(hole(format!("Evidence incomplete: {n}")));
    }

    out.sort_by_key(|l| (l.us, l.rank));
    out.into_iter()
        .map(|l| {
            let mut obj = l.obj;
            obj.insert("kvtrail_incident".into(), incident.clone().into());
            obj.insert("evidence_complete".into(), complete.into());
            obj.insert("audience".into(), audience.as_str().into());
            Value::Object(obj)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datetime_is_utc_with_offset_and_equals_the_microseconds() {
        assert_eq!(micros(-1), -1);
        assert_eq!(micros(1_999), 1);
        assert_eq!(datetime(0), "1970-01-01T00:00:00.000000+00:00");
        assert_eq!(datetime(micros(-1)), "1969-12-31T23:59:59.999999+00:00");
        assert_eq!(
            datetime(micros(1_788_221_069_821_506_613)),
            "2026-09-01T00:04:29.821506+00:00"
        );
        // The ends of a trace's i64 nanoseconds are inside jiff's range.
        assert_eq!(
            datetime(micros(i64::MAX)),
            "2262-04-11T23:47:16.854775+00:00"
        );
        assert_eq!(
            datetime(micros(i64::MIN)),
            "1677-09-21T00:12:43.145224+00:00"
        );
    }
}
