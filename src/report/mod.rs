//! Report writers for a scope report: JSON (stdout and summary.json), CSV
//! (responses.csv, tenants.csv), Parquet (findings.parquet, through
//! `trace::write`) and the one-screen human summary. Pure functions from a
//! `ScopeReport` to bytes: deterministic, no clocks, no absolute paths.

pub mod bundle;
pub mod csv;
pub mod fmt;
pub mod html;
pub mod index;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{ArrayRef, BooleanArray, RecordBatch, StringArray, UInt16Array, UInt64Array};
use arrow_schema::{DataType, Field, Schema};

use crate::error::Result;
use crate::scope::{Confidence, ScopeReport};

/// The report as pretty JSON with a trailing newline.
pub fn to_json(r: &ScopeReport) -> String {
    let mut s = serde_json::to_string_pretty(r).expect("scope report serializes");
    s.push('\n');
    s
}

fn opt<T: ToString>(v: &Option<T>) -> String {
    v.as_ref().map(|x| x.to_string()).unwrap_or_default()
}

/// The distinct tenants of a response's sources as shown to people, sorted.
fn source_labels(a: &crate::scope::Response) -> Vec<String> {
    let mut st: Vec<String> = a.sources.iter().map(|x| x.tenant.to_string()).collect();
    st.sort_unstable();
    st.dedup();
    st
}

/// responses.csv: one row per affected response (text cells made safe for
/// spreadsheets by `csv::text`).
pub fn responses_csv(r: &ScopeReport) -> String {
    let rows = r.affected_responses.iter().map(|a| {
        let st = source_labels(a);
        let ids: Vec<String> = a.sources.iter().map(|x| x.request_id.to_string()).collect();
        [
            a.request_id.to_string(),
            csv::text(a.external_id.as_deref().unwrap_or("")).into_owned(),
            csv::text(&a.tenant.to_string()).into_owned(),
            opt(&a.arrival_ns),
            opt(&a.http_status),
            opt(&a.output_hash),
            a.foreign_tokens.to_string(),
            a.unknown_tokens.to_string(),
            a.uncertain_tokens.to_string(),
            a.cross_tenant.to_string(),
            a.confidence.as_str().to_string(),
            csv::text_list(a.reasons.iter().map(String::as_str)),
            csv::text_list(st.iter().map(String::as_str)),
            ids.join(";"),
        ]
    });
    csv::to_string(
        &[
            "request_id",
            "external_id",
            "tenant",
            "arrival_ns",
            "http_status",
            "output_hash",
            "foreign_tokens",
            "unknown_tokens",
            "uncertain_tokens",
            "cross_tenant",
            "confidence",
            "reasons",
            "source_tenants",
            "source_request_ids",
        ],
        rows,
    )
}

/// tenants.csv: one row per (role, tenant); role is recipient or source.
pub fn tenants_csv(r: &ScopeReport) -> String {
    let rec = r.recipients.iter().map(|t| {
        [
            "recipient".to_string(),
            csv::text(&t.tenant.to_string()).into_owned(),
            t.responses.to_string(),
            t.responses.to_string(),
            t.foreign_tokens.to_string(),
            String::new(),
        ]
    });
    let src = r.sources.iter().map(|t| {
        [
            "source".to_string(),
            csv::text(&t.tenant.to_string()).into_owned(),
            t.recipient_responses.to_string(),
            t.requests.to_string(),
            t.tokens.to_string(),
            t.cross_tenant_tokens.to_string(),
        ]
    });
    csv::to_string(
        &[
            "role",
            "tenant",
            "responses",
            "requests",
            "tokens",
            "cross_tenant_tokens",
        ],
        rec.chain(src),
    )
}

/// findings.parquet rows: one per (response, source); a response without
/// sources (unknown or after-gap reads only) gets one row with null source.
pub fn findings_batch(r: &ScopeReport) -> RecordBatch {
    let mut rid = Vec::new();
    let mut ext: Vec<Option<String>> = Vec::new();
    let mut ten: Vec<Option<String>> = Vec::new();
    let mut status: Vec<Option<u16>> = Vec::new();
    let mut src: Vec<Option<u64>> = Vec::new();
    let mut sten: Vec<Option<String>> = Vec::new();
    let mut tok = Vec::new();
    let mut fseq: Vec<Option<u64>> = Vec::new();
    let mut lseq: Vec<Option<u64>> = Vec::new();
    let mut cross = Vec::new();
    let mut conf = Vec::new();
    for a in &r.affected_responses {
        let mut push = |s: Option<&crate::scope::Source>| {
            rid.push(a.request_id);
            ext.push(a.external_id.clone());
            ten.push(a.tenant.customer().map(str::to_string));
            status.push(a.http_status);
            src.push(s.map(|x| x.request_id));
            sten.push(s.and_then(|x| x.tenant.customer().map(str::to_string)));
            tok.push(s.map(|x| x.tokens).unwrap_or(a.exposed_tokens));
            fseq.push(s.map(|x| x.first_seq));
            lseq.push(s.map(|x| x.last_seq));
            cross.push(s.map(|x| x.cross_tenant).unwrap_or(false));
            conf.push(
                s.map(|x| x.confidence)
                    .unwrap_or(Confidence::Possible)
                    .as_str(),
            );
        };
        if a.sources.is_empty() {
            push(None);
        }
        for s in &a.sources {
            push(Some(s));
        }
    }
    let schema = Arc::new(Schema::new(vec![
        Field::new("request_id", DataType::UInt64, false),
        Field::new("external_id", DataType::Utf8, true),
        // null: the engine (request 0) or a request missing from the
        // requests table, never a name a tenant could have.
        Field::new("tenant", DataType::Utf8, true),
        Field::new("http_status", DataType::UInt16, true),
        Field::new("source_request_id", DataType::UInt64, true),
        Field::new("source_tenant", DataType::Utf8, true),
        Field::new("tokens", DataType::UInt64, false),
        Field::new("first_seq", DataType::UInt64, true),
        Field::new("last_seq", DataType::UInt64, true),
        Field::new("cross_tenant", DataType::Boolean, false),
        Field::new("confidence", DataType::Utf8, false),
    ]));
    let cols: Vec<ArrayRef> = vec![
        Arc::new(UInt64Array::from(rid)),
        Arc::new(StringArray::from(ext)),
        Arc::new(StringArray::from(ten)),
        Arc::new(UInt16Array::from(status)),
        Arc::new(UInt64Array::from(src)),
        Arc::new(StringArray::from(sten)),
        Arc::new(UInt64Array::from(tok)),
        Arc::new(UInt64Array::from(fseq)),
        Arc::new(UInt64Array::from(lseq)),
        Arc::new(BooleanArray::from(cross)),
        Arc::new(StringArray::from(conf)),
    ];
    RecordBatch::try_new(schema, cols).expect("findings batch matches its schema")
}

/// Writes responses.csv, tenants.csv, findings.parquet and summary.json
/// into `dir` (created if needed). Returns the paths written.
/// Files and the folder are owner-only (`custody::create_private_dir`); the
/// caller checks the folder first (`custody::prepare_out`).
pub fn write_out(r: &ScopeReport, dir: &Path) -> Result<Vec<PathBuf>> {
    crate::custody::create_private_dir(dir)?;
    let mut written = Vec::new();
    for (name, text) in [
        ("responses.csv", responses_csv(r)),
        ("tenants.csv", tenants_csv(r)),
        ("summary.json", to_json(r)),
    ] {
        let p = dir.join(name);
        crate::custody::write_private(&p, text)?;
        written.push(p);
    }
    let p = dir.join("findings.parquet");
    crate::trace::write::write_single_file(&p, &[findings_batch(r)])?;
    crate::custody::make_private(&p)?;
    written.push(p);
    written.sort();
    Ok(written)
}

use fmt::term;

fn ns(v: Option<i64>) -> String {
    fmt::utc_opt(v)
}

/// The one-screen human summary.
pub fn human(r: &ScopeReport) -> String {
    let mut s = String::new();
    let d = &r.deployment;
    let c = &r.counts;
    let cov = &r.coverage;
    let _ = writeln!(s, "kvtrail scope: {} ({})", term(&d.name), term(&d.engine));
    let _ = writeln!(
        s,
        "  replayed {} kv events ({} slot touches, {} read slots) over {} pools; {} requests",
        c.kv_events,
        c.slot_touches,
        c.read_slots,
        d.pools.len(),
        c.requests
    );
    let _ = writeln!(s);
    let _ = writeln!(s, "VERDICT: {}", r.verdict);
    let _ = writeln!(s);
    if !r.affected_responses.is_empty() {
        let _ = writeln!(
            s,
            "affected responses: {} ({} confirmed, {} possible), {} cross-tenant, {} foreign tokens",
            c.affected_responses,
            c.confirmed_responses,
            c.possible_responses,
            c.cross_tenant_responses,
            c.foreign_tokens
        );
        let _ = writeln!(
            s,
            "  window: foreign reads {} .. {}; affected arrivals {} .. {}",
            ns(r.time_window.first_exposure_ns),
            ns(r.time_window.last_exposure_ns),
            ns(r.time_window.first_arrival_ns),
            ns(r.time_window.last_arrival_ns)
        );
        let _ = writeln!(
            s,
            "  {:>10}  {:<16} {:>6} {:>9} {:>5}  {:<10} sources",
            "request", "tenant", "status", "foreign", "cross", "confidence"
        );
        const SHOW: usize = 10;
        for a in r.affected_responses.iter().take(SHOW) {
            let st: Vec<String> = source_labels(a)
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
                if a.cross_tenant { "yes" } else { "no" },
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
        let _ = writeln!(
            s,
            "recipients ({}): {}",
            r.recipients.len(),
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
            r.sources.len(),
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
    let _ = writeln!(
        s,
        "blank reads (integrity defects): {} slots in {} responses",
        r.blank_reads,
        r.blank_read_responses.len()
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
        let _ = writeln!(s, "  - ... {} more notes in --json", cov.notes.len() - 8);
    }
    s
}
