//! The scope report as JSON: what `scope --json` prints and what
//! summary.json holds (read back by `notify`, `lookup` and `merge`).

use crate::scope::ScopeReport;

/// The report as pretty JSON with a trailing newline.
pub fn to_json(r: &ScopeReport) -> String {
    let mut s = serde_json::to_string_pretty(r).expect("scope report serializes");
    s.push('\n');
    s
}
