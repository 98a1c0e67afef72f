//! The scope folder in the formats of other tools: OCSF findings
//! (findings.ocsf.jsonl, `report::ocsf`) for a SIEM or AWS Security Hub, and
//! a Timesketch timeline (timeline.jsonl, `report::timesketch`) for the
//! analysts. `scope --out` writes both (`write_scope_exports`, before
//! evidence.json, so the evidence covers them); `kvtrail export` renders
//! them again from a checked scope folder (`ExportInput::from_folder`).
//!
//! Both paths render from the same bytes: the folder's summary.json (parsed
//! with `ScopeReport::from_json`), the rows of requests.csv that the
//! findings need (arrival times of anomalies and prefix-cache hits), and
//! the blake3 of the trace's trace.json as evidence.json records it. So an
//! export equals what scope wrote, byte for byte.
//!
//! Who may read a file is its `Audience`. `External` (the default, and the
//! only form scope writes) names each finding's own recipient and nobody
//! else: source customers are counts, their requests are not listed.
//! `Internal` (`kvtrail export --internal`) adds the source customers and
//! their requests, and labels every event as internal.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::custody::{self, Inputs};
use crate::error::{Error, Location, Result};
use crate::report::fmt::count;
use crate::report::folder::{SUMMARY_JSON, ScopeFolder};
use crate::report::index::{self, IndexRow};
use crate::scope::{Response, ScopeReport, Tenant};

/// The OCSF findings of a scope folder.
pub const OCSF_JSONL: &str = "findings.ocsf.jsonl";
/// The Timesketch timeline of a scope folder.
pub const TIMELINE_JSONL: &str = "timeline.jsonl";

/// An export format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// OCSF 1.8.0 Data Security Findings plus one Incident Finding.
    Ocsf,
    /// Timesketch JSONL.
    Timesketch,
}

impl Format {
    /// The file name scope writes this format under.
    pub fn file_name(self) -> &'static str {
        match self {
            Format::Ocsf => OCSF_JSONL,
            Format::Timesketch => TIMELINE_JSONL,
        }
    }
}

/// Who a file is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Audience {
    /// Safe to pass on: each event names only its own recipient; source
    /// customers are counts.
    External,
    /// The operator's own responders: source customers and their requests
    /// named; every event labelled internal.
    Internal,
}

impl Audience {
    pub fn as_str(self) -> &'static str {
        match self {
            Audience::External => "external",
            Audience::Internal => "internal",
        }
    }
}

/// What an export is rendered from.
#[derive(Debug, Clone)]
pub struct ExportInput {
    /// summary.json, parsed.
    pub report: ScopeReport,
    /// blake3 of the trace's trace.json as evidence.json records it (it
    /// lists the blake3 of every data file of the trace).
    pub trace_blake3: String,
    /// The rows of requests.csv of the anomalies and prefix-cache hits.
    pub requests: BTreeMap<u64, IndexRow>,
}

impl ExportInput {
    /// From the files of a scope folder being written (after requests.csv
    /// and summary.json).
    fn read(dir: &Path, trace_blake3: String) -> Result<Self> {
        let p = dir.join(SUMMARY_JSON);
        let bytes = std::fs::read(&p).map_err(|e| Error::io(&p, e))?;
        let report = ScopeReport::from_json(&bytes).map_err(|e| {
            Error::invalid(
                Location::file(&p),
                format!("not a kvtrail scope summary: {e}"),
                "pass the folder written by `kvtrail scope TRACE --out DIR`",
            )
        })?;
        let requests = needed_rows(&report, |f| index::read_index(dir, f))?;
        Ok(ExportInput {
            report,
            trace_blake3,
            requests,
        })
    }

    /// From a scope folder read back: refused unless it matches its
    /// evidence.json and that record names the trace it was made from.
    pub fn from_folder(folder: &ScopeFolder) -> Result<Self> {
        // The same refusal as any run building on the folder.
        folder.as_input()?;
        let ev = folder.dir().join(custody::EVIDENCE_JSON);
        let Some(trace) = folder.evidence().inputs.iter().find(|i| i.kind == "trace") else {
            return Err(Error::invalid(
                Location::file(&ev),
                "the evidence record names no trace input (a folder written by `kvtrail merge` records its shard folders instead)",
                "export a folder written by `kvtrail scope TRACE --out DIR`, or each shard folder",
            ));
        };
        let Some(trace_blake3) = trace_json_blake3(trace) else {
            return Err(Error::invalid(
                Location::file(&ev),
                "the evidence record's trace input lists no trace.json",
                "re-create the folder with `kvtrail scope TRACE --out DIR`",
            ));
        };
        let report = folder.summary().clone();
        let requests = needed_rows(&report, |f| folder.requests(f))?;
        Ok(ExportInput {
            report,
            trace_blake3: trace_blake3.to_string(),
            requests,
        })
    }

    /// The incident's id: `kvtrail:` and the first 32 hex digits of the
    /// trace's trace.json digest (the same trace is the same incident).
    pub fn incident_uid(&self) -> String {
        let d = self.trace_blake3.get(..32).unwrap_or(&self.trace_blake3);
        format!("kvtrail:{d}")
    }

    /// Arrival of a request from requests.csv.
    pub fn arrival_ns(&self, request_id: u64) -> Option<i64> {
        self.requests.get(&request_id).map(|r| r.arrival_ns)
    }

    /// The coverage notes an audience may read: external files get them
    /// worded without file paths (a trace's file names can carry customers'
    /// names, e.g. Hive folders by tenant), as notification packs do.
    pub fn coverage_notes(&self, audience: Audience) -> Vec<String> {
        match audience {
            Audience::External => crate::scope::customer_notes(&self.report.coverage),
            Audience::Internal => self.report.coverage.notes.clone(),
        }
    }

    /// Whether cross-tenant prefix-cache hits are isolation findings here
    /// (the deployment promised per-tenant prefix caches).
    pub fn prefix_hits_count(&self) -> bool {
        self.report.deployment.tenant_prefix_cache()
    }
}

/// blake3 of trace.json in a trace's inputs.
fn trace_json_blake3(i: &Inputs) -> Option<&str> {
    i.files
        .iter()
        .find(|f| f.path == "trace.json")
        .map(|f| f.blake3.as_str())
}

/// The rows of requests.csv an export needs: anomalies and prefix-cache
/// hits carry no times of their own.
fn needed_rows(
    r: &ScopeReport,
    read: impl FnOnce(&mut dyn FnMut(IndexRow) -> bool) -> Result<()>,
) -> Result<BTreeMap<u64, IndexRow>> {
    let want: BTreeSet<u64> = r
        .anomalies
        .iter()
        .map(|a| a.request_id)
        .chain(r.cross_tenant_shared.iter().map(|h| h.request_id))
        .collect();
    let mut rows = BTreeMap::new();
    if want.is_empty() {
        return Ok(rows);
    }
    read(&mut |row: IndexRow| {
        if want.contains(&row.request_id) {
            rows.insert(row.request_id, row);
        }
        rows.len() < want.len()
    })?;
    Ok(rows)
}

/// One export as bytes: JSON lines, one event a line, `\n`-terminated.
pub fn render(input: &ExportInput, format: Format, audience: Audience) -> String {
    let lines = match format {
        Format::Ocsf => super::ocsf::events(input, audience),
        Format::Timesketch => super::timesketch::lines(input, audience),
    };
    let mut s = String::new();
    for v in lines {
        s.push_str(&serde_json::to_string(&v).expect("JSON values serialize"));
        s.push('\n');
    }
    s
}

/// Writes findings.ocsf.jsonl and timeline.jsonl (external) into a scope
/// folder being written: after summary.json and requests.csv, before
/// evidence.json. `trace` is the trace's inputs as evidence.json will
/// record them.
pub fn write_scope_exports(dir: &Path, trace: &Inputs) -> Result<Vec<PathBuf>> {
    let Some(d) = trace_json_blake3(trace) else {
        return Err(Error::Other(
            "scope: the trace's inputs list no trace.json".into(),
        ));
    };
    let input = ExportInput::read(dir, d.to_string())?;
    let mut written = Vec::new();
    for f in [Format::Ocsf, Format::Timesketch] {
        let p = dir.join(f.file_name());
        custody::write_private(&p, render(&input, f, Audience::External))?;
        written.push(p);
    }
    Ok(written)
}

/// A tenant for an export: the customer's name, or None for the engine and
/// an unknown tenant (never a string a customer could be named).
pub(crate) fn customer(t: &Tenant) -> Option<&str> {
    t.customer()
}

/// What kind of tenant it is: `customer`, `engine` or `unknown`.
pub(crate) fn tenant_kind(t: &Tenant) -> &'static str {
    match t {
        Tenant::Customer(_) => "customer",
        Tenant::Engine => "engine",
        Tenant::Unknown => "unknown",
    }
}

/// Distinct customers among `tenants` other than `recipient`.
pub(crate) fn other_customers<'a>(
    recipient: &Tenant,
    tenants: impl Iterator<Item = &'a Tenant>,
) -> BTreeSet<&'a str> {
    tenants
        .filter(|t| *t != recipient)
        .filter_map(customer)
        .collect()
}

/// A response's sources for people: `3 source requests of 2 other
/// customers`; where the reader's customer is unknown the customers are
/// not called "other" (which of them, if any, is its own cannot be told).
pub(crate) fn sources_words(a: &Response, others: usize) -> String {
    let reqs = count(a.sources.len() as u64, "source request", "source requests");
    if a.tenant == Tenant::Unknown {
        format!(
            "{reqs} of {} (the reader's customer is unknown)",
            count(others as u64, "customer", "customers")
        )
    } else {
        format!(
            "{reqs} of {}",
            count(others as u64, "other customer", "other customers")
        )
    }
}

/// `kvtrail export`: one format rendered from a scope folder, after the
/// folder is checked against its evidence.json.
pub fn export(scope_dir: &Path, format: Format, audience: Audience) -> Result<String> {
    let folder = ScopeFolder::open(scope_dir)?;
    let input = ExportInput::from_folder(&folder)?;
    Ok(render(&input, format, audience))
}

/// Writes an export to `out` (owner-only, through a temporary file in the
/// same folder renamed into place, so a failed write leaves nothing
/// half-written). Refuses a path inside the scope folder (an extra file
/// breaks its chain of custody) and an existing file unless `force`.
pub fn write_export(scope_dir: &Path, out: &Path, bytes: &str, force: bool) -> Result<()> {
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let hint_dir = "pass --out FILE in an existing, writable folder";
    let parent_abs = std::fs::canonicalize(parent).map_err(|e| {
        Error::invalid(
            Location::file(out),
            format!("cannot write here: its folder cannot be opened ({e})"),
            hint_dir,
        )
    })?;
    if !parent_abs.is_dir() {
        return Err(Error::invalid(
            Location::file(out),
            "cannot write here: what should be its folder is not a folder",
            hint_dir,
        ));
    }
    let scope_abs = std::fs::canonicalize(scope_dir).map_err(|e| Error::io(scope_dir, e))?;
    if parent_abs.starts_with(&scope_abs) {
        return Err(Error::invalid(
            Location::file(out),
            "is inside the scope folder: a file added there breaks the folder's chain of custody (evidence.json)",
            "pass --out FILE outside the scope folder",
        ));
    }
    match std::fs::symlink_metadata(out) {
        Ok(m) if m.is_dir() => {
            return Err(Error::invalid(
                Location::file(out),
                "is a folder",
                "pass --out FILE, the path of the file to write",
            ));
        }
        Ok(_) if !force => {
            return Err(Error::invalid(
                Location::file(out),
                "already exists",
                "pass another --out FILE, or --force to replace it",
            ));
        }
        _ => {}
    }
    custody::write_private_atomic(out, bytes.as_bytes()).map_err(|e| match e {
        Error::Io { source, .. } => Error::invalid(
            Location::file(out),
            format!("cannot be written ({source}); nothing was written"),
            hint_dir,
        ),
        e => e,
    })
}
