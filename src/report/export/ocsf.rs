//! findings.ocsf.jsonl: the findings as OCSF 1.8.0 events, one JSON object
//! a line. One Data Security Finding (class 2006) per affected response
//! (kind `foreign`), and per cross-tenant prefix-cache hit where the
//! deployment promised per-tenant prefix caches (kind `prefix_cache`); last,
//! one Incident Finding (class 2005, profile `incident`) rolling them up.
//!
//! OCSF rules kept here: `type_uid` = `class_uid * 100 + activity_id`,
//! `time` in epoch milliseconds, no null values (an absent value is an
//! absent key), everything kvtrail-specific under `unmapped`. The mapping
//! is documented in docs/exports.md. Which customers an event names is
//! `input::Audience`'s rule: an external event names its recipient only.

use serde_json::{Map, Value, json};

use super::input::{Audience, ExportInput, customer, other_customers, sources_words, tenant_kind};
use crate::scope::{Confidence, Crossing, Response, SharedHit, Tenant};
use crate::words::count;

/// The OCSF schema version the events follow.
pub const OCSF_VERSION: &str = "1.8.0";

const CATEGORY_FINDINGS: u64 = 2;
const CLASS_DATA_SECURITY_FINDING: u64 = 2006;
const CLASS_INCIDENT_FINDING: u64 = 2005;
const ACTIVITY_CREATE: u64 = 1;
const STATUS_NEW: u64 = 1;
/// data_security.data_lifecycle_state_id: KV in GPU memory, in use.
const DATA_IN_USE: u64 = 3;
/// resource_details.role_id.
const ROLE_AFFECTED: u64 = 3;
const ROLE_RELATED: u64 = 4;
/// Who an Incident Finding is assigned to until the operator's SIEM sets it.
pub const ASSIGNEE_GROUP: &str = "Incident response";

/// An object without null values: `opt` leaves a None out.
struct Obj(Map<String, Value>);

impl Obj {
    fn new() -> Self {
        Obj(Map::new())
    }
    fn set(mut self, k: &str, v: impl Into<Value>) -> Self {
        self.0.insert(k.to_string(), v.into());
        self
    }
    fn opt<T: Into<Value>>(self, k: &str, v: Option<T>) -> Self {
        match v {
            Some(v) => self.set(k, v),
            None => self,
        }
    }
    fn done(self) -> Value {
        Value::Object(self.0)
    }
}

/// Epoch milliseconds of epoch nanoseconds (rounded down).
fn ms(ns: i64) -> i64 {
    ns.div_euclid(1_000_000)
}

fn severity_name(id: u64) -> &'static str {
    match id {
        0 => "Unknown",
        1 => "Informational",
        2 => "Low",
        3 => "Medium",
        4 => "High",
        5 => "Critical",
        _ => "Other",
    }
}

fn confidence_name(id: u64) -> &'static str {
    match id {
        1 => "Low",
        2 => "Medium",
        3 => "High",
        _ => "Unknown",
    }
}

/// Severity of an affected response: High for a confirmed cross-tenant
/// read, Medium for a possible one (cross-tenant cannot be ruled out), Low
/// for a confirmed read of KV that was no other customer's.
fn response_severity(a: &Response) -> u64 {
    match (a.confidence, a.cross_tenant) {
        (Confidence::Confirmed, true) => 4,
        (Confidence::Possible, _) => 3,
        (Confidence::Confirmed, false) => 2,
    }
}

/// Severity of a prefix-cache hit under a per-tenant promise: Medium (no
/// foreign KV entered the response; the hit tells through timing that
/// another customer sent the prefix).
const PREFIX_HIT_SEVERITY: u64 = 3;

fn confidence_id(c: Confidence) -> u64 {
    match c {
        Confidence::Confirmed => 3,
        Confidence::Possible => 2,
    }
}

/// The header every event shares.
fn base(class_uid: u64, class_name: &str, severity_id: u64, time_ms: i64) -> Obj {
    Obj::new()
        .set("activity_id", ACTIVITY_CREATE)
        .set("activity_name", "Create")
        .set("category_uid", CATEGORY_FINDINGS)
        .set("category_name", "Findings")
        .set("class_uid", class_uid)
        .set("class_name", class_name)
        .set("type_uid", class_uid * 100 + ACTIVITY_CREATE)
        .set("type_name", format!("{class_name}: Create"))
        .set("severity_id", severity_id)
        .set("severity", severity_name(severity_id))
        .set("time", time_ms)
}

fn metadata(cx: &Context, audience: Audience, uid: &str, profiles: &[&str]) -> Value {
    let mut labels = vec![format!("kvtrail:{}", audience.as_str())];
    if audience == Audience::Internal {
        labels.push("kvtrail:names-source-customers".into());
    }
    let mut m = Obj::new()
        .set("version", OCSF_VERSION)
        .set(
            "product",
            json!({
                "name": "kvtrail",
                "vendor_name": "kvtrail",
                "version": env!("CARGO_PKG_VERSION"),
            }),
        )
        .set("uid", uid)
        .set("correlation_uid", cx.incident_uid.clone())
        .set("labels", labels);
    if !profiles.is_empty() {
        m = m.set("profiles", profiles.to_vec());
    }
    m.done()
}

/// The affected response as an OCSF resource, owned by its recipient (no
/// owner when the tenant is the engine or unknown).
fn response_resource(request_id: u64, external_id: Option<&str>, tenant: &Tenant) -> Value {
    Obj::new()
        .set("uid", format!("request:{request_id}"))
        .opt("name", external_id)
        .set("type", "LLM response")
        .set("role_id", ROLE_AFFECTED)
        .set("role", "Affected")
        .opt("owner", customer(tenant).map(|n| json!({ "name": n })))
        .done()
}

/// A source request as a related resource (internal files only).
fn source_resource(request_id: u64, external_id: Option<&str>, tenant: &Tenant) -> Value {
    Obj::new()
        .set("uid", format!("request:{request_id}"))
        .opt("name", external_id)
        .set("type", "LLM request (KV source)")
        .set("role_id", ROLE_RELATED)
        .set("role", "Related")
        .opt("owner", customer(tenant).map(|n| json!({ "name": n })))
        .done()
}

/// One finding: its finding_info (also listed in the Incident Finding),
/// its event, and its severity.
struct Finding {
    info: Value,
    event: Value,
    severity: u64,
    time_ms: i64,
}

/// What differs between the kinds of Data Security Finding (class 2006).
struct DataSecurity {
    severity: u64,
    start_ms: i64,
    end_ms: Option<i64>,
    time_ms: i64,
    confidence: u64,
    /// `data_security.detection_pattern`.
    pattern: &'static str,
}

/// One Data Security Finding (class 2006): the event every kind shares
/// around what differs.
fn data_security_finding(
    d: DataSecurity,
    message: String,
    info: Value,
    resources: Vec<Value>,
    metadata: Value,
    unmapped: Value,
) -> Finding {
    let event = base(
        CLASS_DATA_SECURITY_FINDING,
        "Data Security Finding",
        d.severity,
        d.time_ms,
    )
    .set("start_time", d.start_ms)
    .opt("end_time", d.end_ms)
    .set("status_id", STATUS_NEW)
    .set("status", "New")
    .set("confidence_id", d.confidence)
    .set("confidence", confidence_name(d.confidence))
    .set("is_alert", true)
    .set("message", message)
    .set("finding_info", info.clone())
    .set(
        "data_security",
        json!({
            "data_lifecycle_state_id": DATA_IN_USE,
            "data_lifecycle_state": "Data in-Use",
            "detection_pattern": d.pattern,
        }),
    )
    .set("resources", resources)
    .set("metadata", metadata)
    .set("unmapped", unmapped)
    .done();
    Finding {
        info,
        event,
        severity: d.severity,
        time_ms: d.time_ms,
    }
}

fn foreign_finding(cx: &Context, audience: Audience, a: &Response) -> Finding {
    let uid = format!("{}:response:{}", cx.incident_uid, a.request_id);
    let severity = response_severity(a);
    let conf = confidence_id(a.confidence);
    let (first, last) = (ms(a.first_read_ns), ms(a.last_read_ns));
    let others = other_customers(&a.tenant, a.sources.iter().map(|s| &s.tenant));
    let info = Obj::new()
        .set("uid", uid.clone())
        .set(
            "title",
            "KV-cache isolation failure: a response read KV that was not its own",
        )
        .set(
            "types",
            vec!["KV-cache isolation failure", "foreign KV read"],
        )
        .set("first_seen_time", first)
        .set("last_seen_time", last)
        .set("data_sources", vec!["kvtrail trace"])
        .done();
    let message = format!(
        "Response (request {}) read {} of KV that was not its own ({}{}); {}",
        a.request_id,
        count(a.foreign_tokens, "token", "tokens"),
        a.confidence.as_str(),
        match a.crossing() {
            Crossing::Yes => ", cross-tenant",
            Crossing::Unknown => ", a tenant unknown",
            Crossing::No => "",
        },
        sources_words(a, others.len())
    );
    let mut resources = vec![response_resource(
        a.request_id,
        a.external_id.as_deref(),
        &a.tenant,
    )];
    let mut unmapped = Obj::new()
        .set("kind", "foreign")
        .set("audience", audience.as_str())
        .set("request_id", a.request_id)
        .opt("external_id", a.external_id.clone())
        .set("tenant_kind", tenant_kind(&a.tenant))
        .set("in_requests_table", a.in_requests_table)
        .opt("arrival_ns", a.arrival_ns)
        .opt("finish_ns", a.finish_ns)
        .opt("http_status", a.http_status)
        .opt("output_hash", a.output_hash.clone())
        .set("foreign_tokens", a.foreign_tokens)
        .set("unknown_tokens", a.unknown_tokens)
        .set("uncertain_tokens", a.uncertain_tokens)
        .set("exposed_tokens", a.exposed_tokens)
        .set("cross_tenant", a.cross_tenant)
        .set("confidence", a.confidence.as_str())
        .set("reasons", a.reasons.clone())
        .set("first_read_ns", a.first_read_ns)
        .set("last_read_ns", a.last_read_ns)
        .set("source_requests", a.sources.len() as u64)
        .set("source_customers", others.len() as u64)
        .set("evidence_complete", cx.evidence_complete)
        .opt("trace_json_blake3", cx.trace_blake3.clone());
    if audience == Audience::Internal {
        let sources: Vec<Value> = a
            .sources
            .iter()
            .map(|s| {
                Obj::new()
                    .set("request_id", s.request_id)
                    .opt("external_id", s.external_id.clone())
                    .opt("tenant", customer(&s.tenant))
                    .set("tenant_kind", tenant_kind(&s.tenant))
                    .set("tokens", s.tokens)
                    .set("first_ts_ns", s.first_ts_ns)
                    .set("last_ts_ns", s.last_ts_ns)
                    .set("pools", s.pools.clone())
                    .set("cross_tenant", s.cross_tenant)
                    .set("confidence", s.confidence.as_str())
                    .done()
            })
            .collect();
        unmapped = unmapped
            .set("source_tenants", others.iter().copied().collect::<Vec<_>>())
            .set("sources", sources);
        resources.extend(
            a.sources
                .iter()
                .map(|s| source_resource(s.request_id, s.external_id.as_deref(), &s.tenant)),
        );
    }
    data_security_finding(
        DataSecurity {
            severity,
            start_ms: first,
            end_ms: Some(last),
            time_ms: last,
            confidence: conf,
            pattern: "KV-cache read of another request's KV (lineage replay)",
        },
        message,
        info,
        resources,
        metadata(cx, audience, &uid, &[]),
        unmapped.done(),
    )
}

/// Where a prefix-cache finding is placed in time: the reader's arrival
/// and finish when its requests-table row is known (`arrival_ns`), else
/// `fallback_ns`.
pub struct PrefixTime {
    pub arrival_ns: Option<i64>,
    pub finish_ns: Option<i64>,
    pub fallback_ns: i64,
}

fn prefix_finding(cx: &Context, audience: Audience, h: &SharedHit, t: &PrefixTime) -> Finding {
    let uid = format!("{}:prefix-cache:{}", cx.incident_uid, h.request_id);
    // Placed at the request's arrival; without a requests-table row, at
    // the end of the capture.
    let at_ns = t.arrival_ns.unwrap_or(t.fallback_ns);
    let at = ms(at_ns);
    let end = t.arrival_ns.and(t.finish_ns).map(ms).filter(|e| *e >= at);
    let conf = if cx.evidence_complete { 3 } else { 2 };
    let others = other_customers(&h.tenant, h.sources.iter().map(|s| &s.tenant));
    let info = Obj::new()
        .set("uid", uid.clone())
        .set(
            "title",
            "KV-cache isolation failure: a response hit another customer's cached prefix",
        )
        .set(
            "types",
            vec![
                "KV-cache isolation failure",
                "cross-tenant prefix-cache hit",
            ],
        )
        .set("first_seen_time", at)
        .set("last_seen_time", end.unwrap_or(at))
        .set("data_sources", vec!["kvtrail trace"])
        .done();
    let message = format!(
        "Response (request {}) hit {} of cached prefix KV of {} although prefix caches are promised per tenant",
        h.request_id,
        count(h.tokens, "token", "tokens"),
        if h.tenant == Tenant::Unknown {
            format!(
                "{} (the reader's customer is unknown)",
                count(others.len() as u64, "customer", "customers")
            )
        } else {
            count(others.len() as u64, "other customer", "other customers")
        }
    );
    let mut resources = vec![response_resource(
        h.request_id,
        h.external_id.as_deref(),
        &h.tenant,
    )];
    let mut unmapped = Obj::new()
        .set("kind", "prefix_cache")
        .set("audience", audience.as_str())
        .set("request_id", h.request_id)
        .opt("external_id", h.external_id.clone())
        .set("tenant_kind", tenant_kind(&h.tenant))
        .set("in_requests_table", t.arrival_ns.is_some())
        .opt("arrival_ns", t.arrival_ns)
        .set("shared_tokens", h.tokens)
        .set("source_requests", h.sources.len() as u64)
        .set("source_customers", others.len() as u64)
        .set("evidence_complete", cx.evidence_complete)
        .opt("trace_json_blake3", cx.trace_blake3.clone());
    if audience == Audience::Internal {
        let sources: Vec<Value> = h
            .sources
            .iter()
            .map(|s| {
                Obj::new()
                    .set("request_id", s.request_id)
                    .opt("tenant", customer(&s.tenant))
                    .set("tenant_kind", tenant_kind(&s.tenant))
                    .set("tokens", s.tokens)
                    .done()
            })
            .collect();
        unmapped = unmapped
            .set("source_tenants", others.iter().copied().collect::<Vec<_>>())
            .set("sources", sources);
        resources.extend(
            h.sources
                .iter()
                .map(|s| source_resource(s.request_id, None, &s.tenant)),
        );
    }
    data_security_finding(
        DataSecurity {
            severity: PREFIX_HIT_SEVERITY,
            start_ms: at,
            end_ms: end,
            time_ms: at,
            confidence: conf,
            pattern: "prefix-cache hit on another tenant's KV under prefix_cache_scope = \"tenant\" (lineage replay)",
        },
        message,
        info,
        resources,
        metadata(cx, audience, &uid, &[]),
        unmapped.done(),
    )
}

/// What a finding says of the evidence it comes from: a scope folder's
/// (`Context::of`), or the live sidecar's (no trace digest yet).
pub struct Context {
    pub incident_uid: String,
    pub evidence_complete: bool,
    pub trace_blake3: Option<String>,
}

impl Context {
    fn of(input: &ExportInput) -> Self {
        Context {
            incident_uid: input.incident_uid(),
            evidence_complete: input.report.coverage.complete,
            trace_blake3: Some(input.trace_blake3.clone()),
        }
    }
}

/// The Data Security Finding (class 2006) of one affected response, as
/// findings.ocsf.jsonl writes it.
pub fn foreign_event(cx: &Context, audience: Audience, a: &Response) -> Value {
    foreign_finding(cx, audience, a).event
}

/// The Data Security Finding (class 2006) of one cross-tenant
/// prefix-cache hit under a per-tenant promise.
pub fn prefix_event(cx: &Context, audience: Audience, h: &SharedHit, t: &PrefixTime) -> Value {
    prefix_finding(cx, audience, h, t).event
}

/// A Data Security Finding (class 2006) saying detection itself is
/// degraded: `lost` events of `pool` are missing, so reads after them
/// cannot be classified with certainty (severity Medium, confidence Low).
pub fn degraded_event(cx: &Context, pool: u16, lost: u64, time_ns: i64) -> Value {
    let uid = format!("{}:degraded:{pool}:{time_ns}", cx.incident_uid);
    let t = ms(time_ns);
    let info = Obj::new()
        .set("uid", uid.clone())
        .set("title", "KV lineage detection degraded: events lost")
        .set("types", vec!["capture loss"])
        .set("first_seen_time", t)
        .set("last_seen_time", t)
        .set("data_sources", vec!["kvtrail trace"])
        .done();
    let message = format!(
        "live detection degraded: {} lost on pool {pool}",
        count(lost, "event", "events")
    );
    let unmapped = Obj::new()
        .set("kind", "capture_loss")
        .set("pool", pool)
        .set("lost_events", lost)
        .set("evidence_complete", false)
        .opt("trace_json_blake3", cx.trace_blake3.clone());
    data_security_finding(
        DataSecurity {
            severity: 3,
            start_ms: t,
            end_ms: None,
            time_ms: t,
            confidence: 1,
            pattern: "seq holes in the KV event stream (lineage replay)",
        },
        message,
        info,
        Vec::new(),
        metadata(cx, Audience::Internal, &uid, &[]),
        unmapped.done(),
    )
    .event
}

/// A request the guard in the engine checked before its first token and
/// did not find clean (a live alert): what it found and what it did.
#[derive(Debug, Clone)]
pub struct GuardCheck {
    pub request_id: u64,
    pub external_id: Option<String>,
    pub tenant: Tenant,
    pub pool: u16,
    /// `foreign` or `unknown`.
    pub verdict: &'static str,
    /// `alert`, `abort` or `allow`.
    pub action: &'static str,
    /// The source requests the guard named: id, external id, tenant.
    pub sources: Vec<(u64, Option<String>, Tenant)>,
    pub slots_read: u64,
    pub slots_foreign: u64,
    pub slots_unknown: u64,
    pub time_ns: i64,
}

/// The Data Security Finding (class 2006) of a guard decision: High for
/// a foreign read (confidence High: the guard applies the slot rule to the
/// engine's own events), Medium for a request aborted because its KV's
/// owner could not be seen (confidence Low). Internal: it names the
/// source requests and their customers.
pub fn guard_event(cx: &Context, g: &GuardCheck) -> Value {
    let uid = format!("{}:guard:{}", cx.incident_uid, g.request_id);
    let t = ms(g.time_ns);
    let foreign = g.verdict == "foreign";
    let others = other_customers(&g.tenant, g.sources.iter().map(|s| &s.2));
    let info = Obj::new()
        .set("uid", uid.clone())
        .set(
            "title",
            if foreign {
                "KV-cache isolation failure caught by the guard before the first token"
            } else {
                "KV of unknown owner: request stopped by the guard before the first token"
            },
        )
        .set(
            "types",
            vec!["KV-cache isolation failure", "guard decision"],
        )
        .set("first_seen_time", t)
        .set("last_seen_time", t)
        .set("data_sources", vec!["kvtrail guard"])
        .done();
    let did = match g.action {
        "abort" => "aborted before its first token",
        "alert" => "let run (alert only)",
        _ => "let run",
    };
    let message = if foreign {
        format!(
            "guard: request {} was about to read {} of {} KV slots holding other requests' content ({} of {}); {did}",
            g.request_id,
            g.slots_foreign,
            g.slots_read,
            count(g.sources.len() as u64, "source request", "source requests"),
            count(others.len() as u64, "other customer", "other customers"),
        )
    } else {
        format!(
            "guard: request {} was about to read {} of {} KV slots whose owner the engine cannot see; {did}",
            g.request_id, g.slots_unknown, g.slots_read
        )
    };
    let mut resources = vec![response_resource(
        g.request_id,
        g.external_id.as_deref(),
        &g.tenant,
    )];
    resources.extend(
        g.sources
            .iter()
            .map(|(id, ext, t)| source_resource(*id, ext.as_deref(), t)),
    );
    let sources: Vec<Value> = g
        .sources
        .iter()
        .map(|(id, ext, t)| {
            Obj::new()
                .set("request_id", *id)
                .opt("external_id", ext.clone())
                .opt("tenant", customer(t))
                .set("tenant_kind", tenant_kind(t))
                .done()
        })
        .collect();
    let unmapped = Obj::new()
        .set("kind", "guard")
        .set("audience", Audience::Internal.as_str())
        .set("request_id", g.request_id)
        .opt("external_id", g.external_id.clone())
        .set("tenant_kind", tenant_kind(&g.tenant))
        .set("verdict", g.verdict)
        .set("action", g.action)
        .set("slots_read", g.slots_read)
        .set("slots_foreign", g.slots_foreign)
        .set("slots_unknown", g.slots_unknown)
        .set("source_tenants", others.iter().copied().collect::<Vec<_>>())
        .set("sources", sources)
        .set("evidence_complete", false)
        .opt("trace_json_blake3", cx.trace_blake3.clone());
    data_security_finding(
        DataSecurity {
            severity: if foreign { 4 } else { 3 },
            start_ms: t,
            end_ms: None,
            time_ms: t,
            confidence: if foreign { 3 } else { 1 },
            pattern: "KV-cache read of another request's KV (guard in the engine)",
        },
        message,
        info,
        resources,
        metadata(cx, Audience::Internal, &uid, &[]),
        unmapped.done(),
    )
    .event
}

/// A live alert storm's summary: the alerts of one window that were not
/// sent one by one, counted by trigger (`folded`).
pub fn storm_event(
    cx: &Context,
    folded: &std::collections::BTreeMap<&'static str, u64>,
    start_ns: i64,
    end_ns: i64,
) -> Value {
    let uid = format!("{}:storm:{end_ns}", cx.incident_uid);
    let total: u64 = folded.values().sum();
    let foreign =
        folded.contains_key("first_foreign_read") || folded.contains_key("guard_foreign_read");
    let (start, end) = (ms(start_ns), ms(end_ns));
    let info = Obj::new()
        .set("uid", uid.clone())
        .set("title", "KV lineage alert storm: alerts aggregated")
        .set("types", vec!["alert storm"])
        .set("first_seen_time", start)
        .set("last_seen_time", end)
        .set("data_sources", vec!["kvtrail trace"])
        .done();
    let kinds: Vec<String> = folded.iter().map(|(k, n)| format!("{k} {n}")).collect();
    let message = format!(
        "alert storm: {} not sent one by one ({}); every finding is in live-findings.json at close and in kvtrail scope",
        count(total, "more alert", "more alerts"),
        kinds.join(", ")
    );
    let unmapped = Obj::new()
        .set("kind", "alert_storm")
        .set("aggregated_alerts", total)
        .set(
            "folded",
            folded
                .iter()
                .map(|(k, n)| ((*k).to_string(), Value::from(*n)))
                .collect::<Map<String, Value>>(),
        )
        .set("evidence_complete", false)
        .opt("trace_json_blake3", cx.trace_blake3.clone());
    data_security_finding(
        DataSecurity {
            severity: if foreign { 4 } else { 3 },
            start_ms: start,
            end_ms: Some(end),
            time_ms: end,
            confidence: 1,
            pattern: "many findings in one window (lineage replay)",
        },
        message,
        info,
        Vec::new(),
        metadata(cx, Audience::Internal, &uid, &[]),
        unmapped.done(),
    )
    .event
}

/// Every event of findings.ocsf.jsonl, in file order.
pub fn events(input: &ExportInput, audience: Audience) -> Vec<Value> {
    let r = &input.report;
    let cx = Context::of(input);
    let mut findings: Vec<Finding> = r
        .affected_responses
        .iter()
        .map(|a| foreign_finding(&cx, audience, a))
        .collect();
    let hits: &[SharedHit] = if input.prefix_hits_count() {
        &r.cross_tenant_shared
    } else {
        &[]
    };
    findings.extend(hits.iter().map(|h| {
        let row = input.requests.get(&h.request_id);
        let t = PrefixTime {
            arrival_ns: row.map(|r| r.arrival_ns),
            finish_ns: row.and_then(|r| r.finish_ns),
            fallback_ns: r.deployment.capture_ended_ns,
        };
        prefix_finding(&cx, audience, h, &t)
    }));
    let complete = r.coverage.complete;
    // No finding: Informational on complete evidence; Unknown when the
    // evidence has holes (exposure cannot be ruled out).
    let severity = findings
        .iter()
        .map(|f| f.severity)
        .max()
        .unwrap_or(if complete { 1 } else { 0 });
    let d = &r.deployment;
    let capture_end_ms = ms(d.capture_ended_ns.max(d.capture_started_ns));
    let time = findings
        .iter()
        .map(|f| f.time_ms)
        .max()
        .unwrap_or(capture_end_ms);
    let conf = if complete { 3 } else { 2 };
    let uid = input.incident_uid();
    let recipients: std::collections::BTreeSet<&str> = r
        .affected_responses
        .iter()
        .map(|a| &a.tenant)
        .chain(hits.iter().map(|h| &h.tenant))
        .filter_map(customer)
        .collect();
    let sources: std::collections::BTreeSet<&str> = r
        .affected_responses
        .iter()
        .flat_map(|a| other_customers(&a.tenant, a.sources.iter().map(|s| &s.tenant)))
        .chain(
            hits.iter()
                .flat_map(|h| other_customers(&h.tenant, h.sources.iter().map(|s| &s.tenant))),
        )
        .collect();
    let mut unmapped = Obj::new()
        .set("audience", audience.as_str())
        .set("verdict", r.verdict.clone())
        .set("evidence_complete", complete)
        .set("capture_complete", r.coverage.capture_complete)
        .set("coverage_notes", input.coverage_notes(audience))
        .set("gaps", r.coverage.gaps.len() as u64)
        .set("requests", r.counts.requests)
        .set("affected_responses", r.counts.affected_responses)
        .set("confirmed_responses", r.counts.confirmed_responses)
        .set("possible_responses", r.counts.possible_responses)
        .set("cross_tenant_responses", r.counts.cross_tenant_responses)
        .set("prefix_cache_findings", hits.len() as u64)
        .set("foreign_tokens", r.counts.foreign_tokens)
        .set("recipient_customers", recipients.len() as u64)
        .set("source_customers", sources.len() as u64)
        .set("anomalies", r.counts.anomalies)
        .set("deployment", d.name.clone())
        .set("engine", d.engine.clone())
        .set("capture_started_ns", d.capture_started_ns)
        .set("capture_ended_ns", d.capture_ended_ns)
        .set("trace_json_blake3", input.trace_blake3.clone());
    if audience == Audience::Internal {
        unmapped = unmapped
            .set(
                "recipient_tenants",
                recipients.iter().copied().collect::<Vec<_>>(),
            )
            .set(
                "source_tenants",
                sources.iter().copied().collect::<Vec<_>>(),
            );
    }
    let status_detail = if complete {
        "evidence complete".to_string()
    } else {
        format!(
            "evidence INCOMPLETE ({}): exposure beyond these findings cannot be ruled out",
            count(
                r.coverage.notes.len() as u64,
                "coverage note",
                "coverage notes"
            )
        )
    };
    let incident = base(CLASS_INCIDENT_FINDING, "Incident Finding", severity, time)
        .opt("start_time", r.time_window.first_exposure_ns.map(ms))
        .opt("end_time", r.time_window.last_exposure_ns.map(ms))
        .set("status_id", STATUS_NEW)
        .set("status", "New")
        .set("status_detail", status_detail)
        .set("confidence_id", conf)
        .set("confidence", confidence_name(conf))
        .set("is_suspected_breach", r.any_exposure())
        .set("message", format!("kvtrail scope: {}", r.verdict))
        .set(
            "desc",
            format!(
                "KV-cache isolation incident on deployment {:?} ({}): {}",
                d.name, d.engine, r.verdict
            ),
        )
        .set("assignee_group", json!({ "name": ASSIGNEE_GROUP }))
        .set(
            "finding_info_list",
            findings.iter().map(|f| f.info.clone()).collect::<Vec<_>>(),
        )
        .set("metadata", metadata(&cx, audience, &uid, &["incident"]))
        .set("unmapped", unmapped.done())
        .done();
    let mut out: Vec<Value> = findings.into_iter().map(|f| f.event).collect();
    out.push(incident);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response(confidence: Confidence, cross_tenant: bool) -> Response {
        Response {
            request_id: 1,
            external_id: None,
            tenant: Tenant::Unknown,
            in_requests_table: false,
            arrival_ns: None,
            finish_ns: None,
            http_status: None,
            finish_reason: None,
            prompt_tokens: None,
            prefilled_tokens: None,
            output_tokens: None,
            output_hash: None,
            foreign_tokens: 1,
            unknown_tokens: 0,
            uncertain_tokens: 0,
            exposed_tokens: 1,
            cross_tenant,
            confidence,
            reasons: vec![],
            first_read_ns: 0,
            last_read_ns: 0,
            sources: vec![],
        }
    }

    #[test]
    fn milliseconds_round_down_and_severities_follow_confidence_and_tenancy() {
        assert_eq!(ms(1_999_999), 1);
        assert_eq!(ms(-1), -1);
        assert_eq!(ms(i64::MIN), i64::MIN / 1_000_000 - 1);
        let (c, p) = (Confidence::Confirmed, Confidence::Possible);
        for (conf, cross, want) in [
            (c, true, "High"),
            (p, true, "Medium"),
            (p, false, "Medium"),
            (c, false, "Low"),
        ] {
            let got = severity_name(response_severity(&response(conf, cross)));
            assert_eq!(got, want, "{conf:?} cross-tenant {cross}");
        }
        assert_eq!(confidence_name(confidence_id(c)), "High");
        assert_eq!(confidence_name(confidence_id(p)), "Medium");
    }
}
