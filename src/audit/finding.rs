//! One audit finding ([`Finding`], its [`Severity`]) and the helpers the
//! deployment and trace checks build findings with.

use serde::Serialize;

/// How serious a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Error,
    Warning,
    Note,
}

/// One audit finding.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Finding {
    pub severity: Severity,
    pub kind: String,
    /// Pool id, or request id for trace findings.
    pub subject: Option<String>,
    pub detail: String,
    pub recommendation: Option<String>,
    /// Trace findings: requests involved (sorted, at most 100 listed).
    pub request_ids: Vec<u64>,
    pub count: u64,
}

pub(crate) fn fmt_n(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

pub(crate) fn finding(
    sev: Severity,
    kind: &str,
    subject: Option<String>,
    detail: String,
    rec: Option<String>,
) -> Finding {
    Finding {
        severity: sev,
        kind: kind.into(),
        subject,
        detail,
        recommendation: rec,
        request_ids: Vec::new(),
        count: 1,
    }
}
