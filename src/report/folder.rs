//! A scope folder read back: `ScopeFolder` is what `kvtrail scope TRACE
//! --out DIR` (or `merge`) wrote (`report::writer`), opened once for every
//! command that reads it (`notify`, `lookup`, an exporter).
//! `ScopeFolder::open` checks the folder against its evidence.json once
//! (`custody::check_folder`: every file re-hashed against the record as it
//! was read), parses summary.json, and keeps both; the request list
//! (requests.csv) is streamed on demand.
//!
//! The rules it applies have their homes elsewhere and are called, not
//! copied: the evidence check in `custody`, the format of requests.csv and
//! of its look-up file in `report::lookup_files`, the shard refusal in
//! `scope::shard`. Its tests are `report::writer`'s (folders written, then
//! read back here).
//!
//! `open_deferred` is the look-up's way in: large files (those with chunk
//! digests in evidence.json) are checked as they are read, so a look-up in
//! a 2 GB folder checks the kilobytes it reads, not every byte.
//!
//! A folder that does not match its evidence.json still opens: a look-up
//! answers and says so (`intact`), while a command that builds on the
//! folder takes it through `as_input`, which refuses it.

use std::path::{Path, PathBuf};

use crate::custody::{self, CheckedFolder, EVIDENCE_JSON, FolderReport};
use crate::error::{Error, Location, Result};
use crate::report::lookup_files::{self, IndexRow};
use crate::scope::{Coverage, ScopeReport};
use crate::trace::chunked::ChunkedFile;

/// The findings file of a scope folder.
pub const SUMMARY_JSON: &str = "summary.json";

/// A scope folder, checked against its evidence.json, with its summary.
#[derive(Debug, Clone)]
pub struct ScopeFolder {
    dir: PathBuf,
    summary: ScopeReport,
    summary_blake3: String,
    checked: CheckedFolder,
}

impl ScopeFolder {
    /// Opens a scope folder: it must hold evidence.json and summary.json;
    /// the evidence record must be one (else an error); every file is
    /// checked against it (differences are kept, see `intact`); summary.json
    /// must be a kvtrail scope report of format version 1.
    pub fn open(dir: &Path) -> Result<Self> {
        Self::open_as(dir, false)
    }

    /// `open` for a command that reads a few rows (a look-up): the files
    /// that have chunk digests in evidence.json are checked for presence
    /// and size, and their bytes as they are read (`read_mismatches`);
    /// every other file is re-hashed. A folder in which this finds any
    /// difference is checked whole instead (`open`), so its problems are
    /// all named.
    pub fn open_deferred(dir: &Path) -> Result<Self> {
        match Self::open_as(dir, true) {
            Ok(f) if f.intact() => Ok(f),
            _ => Self::open(dir),
        }
    }

    fn open_as(dir: &Path, defer: bool) -> Result<Self> {
        if !dir.join(EVIDENCE_JSON).is_file() {
            return Err(Error::invalid(
                Location::file(dir),
                "not a scope folder with a chain of custody (no evidence.json)",
                "pass the folder written by `kvtrail scope TRACE --out DIR` (kvtrail 0.1 or later)",
            ));
        }
        if !dir.join(SUMMARY_JSON).is_file() {
            return Err(Error::invalid(
                Location::file(dir),
                "not a scope folder (no evidence.json or summary.json)",
                "pass the folder written by `kvtrail scope TRACE --out DIR`",
            ));
        }
        let checked = if defer {
            custody::check_folder_deferred(dir)?
        } else {
            custody::check_folder(dir)?
        };
        let p = dir.join(SUMMARY_JSON);
        let bytes = checked.open_file(dir, SUMMARY_JSON)?.read_all()?;
        let summary = ScopeReport::from_json(&bytes).map_err(|e| {
            Error::invalid(
                Location::file(&p),
                format!("not a kvtrail scope summary: {e}"),
                "pass the folder written by `kvtrail scope TRACE --out DIR`",
            )
        })?;
        if summary.format != "kvtrail-scope" || summary.version != 1 {
            return Err(Error::invalid(
                Location::file(&p),
                format!(
                    "unsupported scope format {:?} version {}",
                    summary.format, summary.version
                ),
                "re-run `kvtrail scope --out` with this kvtrail",
            ));
        }
        Ok(ScopeFolder {
            dir: dir.to_path_buf(),
            summary,
            summary_blake3: blake3::hash(&bytes).to_hex().to_string(),
            checked,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// summary.json, parsed.
    pub fn summary(&self) -> &ScopeReport {
        &self.summary
    }

    /// blake3 of summary.json as it was read.
    pub fn summary_blake3(&self) -> &str {
        &self.summary_blake3
    }

    /// How complete the evidence behind the findings is (from summary.json).
    pub fn coverage(&self) -> &Coverage {
        &self.summary.coverage
    }

    /// The evidence digest: blake3 of evidence.json as it was checked.
    pub fn evidence_blake3(&self) -> &str {
        &self.checked.report.evidence_blake3
    }

    /// The evidence record (evidence.json as it was checked).
    pub fn evidence(&self) -> &custody::Evidence {
        &self.checked.evidence
    }

    /// The check of the folder against its evidence.json.
    pub fn check(&self) -> &FolderReport {
        &self.checked.report
    }

    /// Whether every file matches evidence.json and nothing else is there
    /// (after `open_deferred`: as far as checked, see `deferred`).
    pub fn intact(&self) -> bool {
        self.checked.report.ok && self.checked.read_mismatches().is_empty()
    }

    /// Whether the bytes of large files are checked as they are read
    /// (`open_deferred`), not all at opening (`open`).
    pub fn deferred(&self) -> bool {
        !self.checked.deferred.is_empty()
    }

    /// What reads found not to match evidence.json (`open_deferred`; empty
    /// when everything read so far matched).
    pub fn read_mismatches(&self) -> Vec<String> {
        self.checked.read_mismatches()
    }

    /// An output file of the folder, opened for reading through the check
    /// (`custody::CheckedFolder::open_file`); requests.csv with the
    /// message of a folder that has none.
    fn open_file(&self, name: &str) -> Result<ChunkedFile> {
        if name == lookup_files::REQUESTS_CSV && !self.checked.deferred.iter().any(|d| d == name) {
            return lookup_files::open_requests(&self.dir);
        }
        self.checked.open_file(&self.dir, name)
    }

    /// What the check found, one line per file: `kind path: detail`.
    pub fn evidence_problems(&self) -> Vec<String> {
        self.checked
            .report
            .problems
            .iter()
            .map(|p| format!("{} {}: {}", p.kind, p.path, p.detail))
            .collect()
    }

    /// Streams requests.csv (every request of the trace), calling `f` for
    /// each row until it returns false (`report::lookup_files::read_index`).
    pub fn requests(&self, f: impl FnMut(IndexRow) -> bool) -> Result<()> {
        lookup_files::read_index_from(&self.open_file(lookup_files::REQUESTS_CSV)?, f)
    }

    /// The folder's look-up index (`report::lookup_files::LookupIndex`), when it
    /// can be used: the folder matches its evidence.json (so neither the
    /// index nor requests.csv was changed since scope wrote them) and the
    /// index was built from the requests.csv recorded there. `Err` says why
    /// not; the caller then scans requests.csv (`requests`) and says so.
    pub fn lookup_index(&self) -> std::result::Result<lookup_files::LookupIndex, String> {
        if !self.dir.join(lookup_files::LOOKUP_INDEX).is_file() {
            return Err(format!(
                "this scope folder has no look-up index ({}; written by an older kvtrail), so requests.csv was scanned",
                lookup_files::LOOKUP_INDEX
            ));
        }
        if !self.intact() {
            return Err(
                "the folder does not match its evidence.json, so its look-up index was not used and requests.csv was scanned"
                    .into(),
            );
        }
        let Some(csv) = self
            .checked
            .evidence
            .outputs
            .iter()
            .find(|f| f.path == lookup_files::REQUESTS_CSV)
        else {
            return Err("evidence.json lists no requests.csv".into());
        };
        let open = |name: &str| {
            self.open_file(name).map_err(|e| {
                format!("{name} could not be opened ({e}), so requests.csv was scanned")
            })
        };
        lookup_files::LookupIndex::open(
            open(lookup_files::LOOKUP_INDEX)?,
            open(lookup_files::REQUESTS_CSV)?,
            &csv.blake3,
            csv.bytes,
        )
        .map_err(|why| format!("{why}, so requests.csv was scanned"))
    }

    /// Refuses a shard's folder where the findings of every pool are needed
    /// (`what`: the command, for the message).
    pub fn refuse_shard(&self, what: &str) -> Result<()> {
        crate::scope::shard::refuse_shard(&self.dir, &self.summary, what)
    }

    /// The folder as the input of another run (kind `scope`), each file
    /// with the digest the check confirmed; refused when the folder does
    /// not match its evidence.json.
    pub fn as_input(&self) -> Result<custody::Inputs> {
        self.checked.as_input(&self.dir, "scope")
    }
}
