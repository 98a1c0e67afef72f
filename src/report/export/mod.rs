//! The scope folder in the formats of other tools: OCSF findings
//! (findings.ocsf.jsonl, `ocsf`) for a SIEM or AWS Security Hub, and
//! a Timesketch timeline (timeline.jsonl, `timesketch`) for the
//! analysts. `scope --out` writes both (`write_scope_exports`, before
//! evidence.json, so the evidence covers them); `kvtrail export` renders
//! them again from a checked scope folder (`ExportInput::from_folder`) and
//! `write_export` writes the file atomically, never inside the scope folder
//! (an extra file there breaks its chain of custody).
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
//!
//! The folder's files import downwards only: `input` (what both formats
//! render from) is a leaf, `ocsf` and `timesketch` import it, and this
//! parent imports all three; no child imports the parent.

mod input;
pub mod ocsf;
pub mod timesketch;

use std::path::{Path, PathBuf};

use input::trace_json_blake3;
pub use input::{Audience, ExportInput};

use crate::custody::{self, Inputs};
use crate::error::{Error, Location, Result};
use crate::report::folder::ScopeFolder;

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

/// One export as bytes: JSON lines, one event a line, `\n`-terminated.
pub fn render(input: &ExportInput, format: Format, audience: Audience) -> String {
    let lines = match format {
        Format::Ocsf => ocsf::events(input, audience),
        Format::Timesketch => timesketch::lines(input, audience),
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
