//! Report writers for a scope report, one file per output form: JSON
//! (`json`: stdout and summary.json), CSV (`csv`: responses.csv,
//! tenants.csv, and the spreadsheet rule every CSV cell goes through), the
//! findings as an Arrow batch (`arrow`, written as findings.parquet through
//! `trace::write`), the one-screen human summary (`summary`) and report.html
//! (`html`); `lookup_files` and `bundle` write the rest of a scope folder, and
//! `export` the same findings for other tools (`ocsf`: OCSF findings for a
//! SIEM; `timesketch`: a Timesketch timeline). The text helpers they share
//! (escaping for terminals and Markdown; UTC times and durations) are the
//! crate's `text`. Pure functions from a `ScopeReport`
//! to bytes: deterministic, no clocks, no absolute paths.

pub mod arrow;
pub mod bundle;
pub mod csv;
pub mod export;
pub mod folder;
pub mod html;
pub mod json;
pub mod lookup_files;
pub mod summary;
pub mod writer;

use std::path::{Path, PathBuf};

use crate::error::Result;
use crate::scope::ScopeReport;

pub use json::to_json;
pub use summary::human;

/// Writes responses.csv, tenants.csv, findings.parquet and summary.json
/// into `dir` (created if needed). Returns the paths written.
/// Files and the folder are owner-only (`custody::create_private_dir`); the
/// caller checks the folder first (`custody::prepare_out`).
pub fn write_out(r: &ScopeReport, dir: &Path) -> Result<Vec<PathBuf>> {
    crate::custody::create_private_dir(dir)?;
    let mut written = Vec::new();
    for (name, text) in [
        ("responses.csv", csv::responses_csv(r)),
        ("tenants.csv", csv::tenants_csv(r)),
        ("summary.json", to_json(r)),
    ] {
        let p = dir.join(name);
        crate::custody::write_private(&p, text)?;
        written.push(p);
    }
    let p = dir.join("findings.parquet");
    crate::trace::write::write_single_file(&p, &[arrow::findings_batch(r)])?;
    crate::custody::make_private(&p)?;
    written.push(p);
    written.sort();
    Ok(written)
}
