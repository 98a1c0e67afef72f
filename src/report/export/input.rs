//! What both exports are rendered from, shared by `ocsf` and
//! `timesketch`: `ExportInput` (summary.json parsed, the rows of
//! requests.csv the findings need, the trace.json digest evidence.json
//! records; from a folder being written or a checked `ScopeFolder`, so
//! `kvtrail export` equals what scope wrote), `Audience` (who may read a
//! file: external events name their own customer only, internal ones the
//! source customers too) and the tenant wording both formats use
//! (`customer`, `tenant_kind`, `other_customers`, `sources_words`).
//! A leaf: it imports neither its parent nor its siblings.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use crate::custody::{self, Inputs};
use crate::error::{Error, Location, Result};
use crate::report::folder::{SUMMARY_JSON, ScopeFolder};
use crate::report::lookup_files::{self, IndexRow};
use crate::scope::{Response, ScopeReport, Tenant};
use crate::words::count;

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
    pub(super) fn read(dir: &Path, trace_blake3: String) -> Result<Self> {
        let p = dir.join(SUMMARY_JSON);
        let bytes = std::fs::read(&p).map_err(|e| Error::io(&p, e))?;
        let report = ScopeReport::from_json(&bytes).map_err(|e| {
            Error::invalid(
                Location::file(&p),
                format!("not a kvtrail scope summary: {e}"),
                "pass the folder written by `kvtrail scope TRACE --out DIR`",
            )
        })?;
        let requests = needed_rows(&report, |f| lookup_files::read_index(dir, f))?;
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
pub(super) fn trace_json_blake3(i: &Inputs) -> Option<&str> {
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

/// A tenant for an export: the customer's name, or None for the engine and
/// an unknown tenant (never a string a customer could be named).
pub(super) fn customer(t: &Tenant) -> Option<&str> {
    t.customer()
}

/// What kind of tenant it is: `customer`, `engine` or `unknown`.
pub(super) fn tenant_kind(t: &Tenant) -> &'static str {
    match t {
        Tenant::Customer(_) => "customer",
        Tenant::Engine => "engine",
        Tenant::Unknown => "unknown",
    }
}

/// Distinct customers among `tenants` other than `recipient`.
pub(super) fn other_customers<'a>(
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
pub(super) fn sources_words(a: &Response, others: usize) -> String {
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
