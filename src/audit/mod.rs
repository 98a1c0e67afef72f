//! `kvtrail audit`: a deploy gate for the incident's root cause and its
//! siblings. `audit_file` audits a deployment file, `audit_trace` a trace's
//! deployment plus its requests and KV events; `report` sorts the findings
//! into an [`AuditReport`] with its verdict.
//!
//! (a) Deployment (a simulator config, or a trace's manifest): every pool
//! against the context window. SGLang's admission limit of a pool is
//! max_req_input_len = min(context_window - 1, capacity - 1) - 5; a prefill
//! pool whose limit is below a decode pool's lets prompts in between be
//! rejected by prefill and accepted by decode: the incident (0.5.19: stale
//! KV with HTTP 200; 0.5.20+: HTTP 500 after the waiting timeout while
//! decode capacity is held). Also page sizes, allow_auto_truncate (the
//! stale-tail residual risk, every version), the KV checksum and the scrub
//! policy, with a recommendation (pool >= 2x context window).
//!
//! (b) Trace: internally rejected yet 2xx, prefilled < prompt with 2xx,
//! decode reads beyond what was transferred (a decode slot read by R whose
//! last write was not on R's behalf, without a share grant), transfers
//! landing in slots another request holds (reuse while a transfer was in
//! flight) and transfers copying source slots the request no longer held.
//! The KV checks run through the replay scheduler with a small backend of
//! their own (slot holder and last writer per slot).
//!
//! Severity: `error` and `warning` are findings (exit 1); `note` is advice.
//!
//! - `deployment`: the deployment checks (pools against the context window,
//!   page sizes, truncation, checksum and scrub policy).
//! - `trace`: the trace checks (requests, and the KV events through the
//!   lineage scheduler with a holder + last-writer backend).

pub mod deployment;
pub mod finding;
pub mod trace;

use crate::error::Result;
use crate::lineage::LineageOptions;
use crate::progress::Reporter;
use crate::trace::read::Trace;
use crate::words::count;
use serde::Serialize;
use std::path::Path;

pub use deployment::{DeploymentView, PoolView, audit_deployment};
pub use finding::{Finding, Severity};
pub use trace::audit_trace_events;

/// The audit report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AuditReport {
    pub format: String,
    pub version: u64,
    pub deployment: DeploymentView,
    /// Trace checks ran (a trace was given).
    pub trace_checked: bool,
    pub findings: Vec<Finding>,
    pub errors: u64,
    pub warnings: u64,
    pub notes: u64,
    pub verdict: String,
}

impl AuditReport {
    /// Exit code of a deploy gate: 1 on errors or warnings.
    pub fn exit_code(&self) -> i32 {
        if self.errors + self.warnings > 0 {
            1
        } else {
            0
        }
    }
}

/// Builds the report from findings.
pub fn report(d: DeploymentView, mut findings: Vec<Finding>, trace_checked: bool) -> AuditReport {
    findings
        .sort_by(|a, b| (a.severity, &a.kind, &a.subject).cmp(&(b.severity, &b.kind, &b.subject)));
    let n = |s: Severity| findings.iter().filter(|f| f.severity == s).count() as u64;
    let (errors, warnings, notes) = (n(Severity::Error), n(Severity::Warning), n(Severity::Note));
    let verdict = if errors + warnings == 0 {
        format!(
            "pass: no errors or warnings ({})",
            count(notes, "note", "notes")
        )
    } else {
        format!(
            "FAIL: {}, {}, {}",
            count(errors, "error", "errors"),
            count(warnings, "warning", "warnings"),
            count(notes, "note", "notes")
        )
    };
    AuditReport {
        format: "kvtrail-audit".into(),
        version: 1,
        deployment: d,
        trace_checked,
        findings,
        errors,
        warnings,
        notes,
        verdict,
    }
}

/// Audits a deployment file.
pub fn audit_file(path: &Path) -> Result<AuditReport> {
    let d = DeploymentView::load(path)?;
    let f = audit_deployment(&d);
    Ok(report(d, f, false))
}

/// Audits a trace: its manifest's deployment, its requests and its events.
pub fn audit_trace(
    trace: &Trace,
    opts: &LineageOptions,
    rep: &dyn Reporter,
) -> Result<AuditReport> {
    let d = DeploymentView::from_manifest(
        &trace.manifest,
        &trace.dir.display().to_string(),
        &trace.dir.join("trace.json"),
    )?;
    let mut f = audit_deployment(&d);
    f.extend(audit_trace_events(trace, &d, opts, rep)?);
    Ok(report(d, f, true))
}
