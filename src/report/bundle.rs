//! What `scope --out` writes besides the findings files of `write_out`:
//! the request index, its look-up index and the traffic timeline
//! (`lookup_files`), the human report (report.html), the exports for other tools
//! (findings.ocsf.jsonl and timeline.jsonl, `export`) and, last, the
//! chain-of-custody record (evidence.json over
//! every file in the folder, with the trace's input digests re-checked).
//! `merge --out` writes the same files from its shard folders
//! (`write_merge_extras`), so a merged folder is a full scope folder.

use std::path::{Path, PathBuf};

use crate::custody;
use crate::error::Result;
use crate::report::{export, html, lookup_files};
use crate::scope::ScopeReport;
use crate::scope::shard::ShardFolder;
use crate::trace::read::Trace;

/// File name of the human report.
pub const REPORT_HTML: &str = "report.html";

/// Writes requests.csv, timeline.json, report.html, findings.ocsf.jsonl,
/// timeline.jsonl and evidence.json into
/// `dir` (after `report::write_out`). `command` is the command line as
/// given. Returns the paths written and the evidence digest.
pub fn write_scope_extras(
    trace: &Trace,
    r: &ScopeReport,
    dir: &Path,
    command: &[String],
) -> Result<(Vec<PathBuf>, String)> {
    custody::create_private_dir(dir)?;
    let tl = lookup_files::write_index(trace, r, dir)?;
    let inputs = custody::trace_inputs(trace)?;
    let p = dir.join(REPORT_HTML);
    custody::write_private(&p, html::report_html(r, &tl, &inputs, command)?)?;
    export::write_scope_exports(dir, &inputs)?;
    let digest = custody::write_evidence(dir, "scope", command, vec![inputs])?;
    let written = [
        lookup_files::REQUESTS_CSV,
        lookup_files::LOOKUP_INDEX,
        lookup_files::TIMELINE_JSON,
        REPORT_HTML,
        export::OCSF_JSONL,
        export::TIMELINE_JSONL,
        custody::EVIDENCE_JSON,
    ]
    .iter()
    .map(|n| dir.join(n))
    .collect();
    Ok((written, digest))
}

/// The same files for `merge --out` (after `report::write_out` of the
/// merged report), from the checked shard folders instead of the trace:
/// requests.csv and timeline.json as a single run writes them (every shard
/// holds the trace's whole request index), report.html with the trace
/// digests the shards recorded, and evidence.json whose inputs are the
/// shard folders (every file, evidence.json included, so the merged folder
/// cites each shard's evidence digest). Returns the paths written and the
/// evidence digest.
pub fn write_merge_extras(
    shards: &[ShardFolder],
    r: &ScopeReport,
    dir: &Path,
    command: &[String],
) -> Result<(Vec<PathBuf>, String)> {
    let Some(first) = shards.first() else {
        return Err(crate::error::Error::Other("merge: no shard given".into()));
    };
    custody::create_private_dir(dir)?;
    let tl = lookup_files::copy_index(&first.dir, r, dir)?;
    let p = dir.join(REPORT_HTML);
    custody::write_private(&p, html::report_html(r, &tl, &first.trace, command)?)?;
    export::write_scope_exports(dir, &first.trace)?;
    let inputs = shards.iter().map(|s| s.files.clone()).collect();
    let digest = custody::write_evidence(dir, "scope", command, inputs)?;
    let written = [
        lookup_files::REQUESTS_CSV,
        lookup_files::LOOKUP_INDEX,
        lookup_files::TIMELINE_JSON,
        REPORT_HTML,
        export::OCSF_JSONL,
        export::TIMELINE_JSONL,
        custody::EVIDENCE_JSON,
    ]
    .iter()
    .map(|n| dir.join(n))
    .collect();
    Ok((written, digest))
}
