//! `verify`: recompute every digest and check every file against trace.json,
//! every row against the contract, and the trace-wide rules (`check.rs`,
//! `request_keys.rs`) exactly as `inspect` and `scope` check them.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rayon::prelude::*;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::trace::check::{self, FileRuns};
use crate::trace::files;
use crate::trace::manifest::{FileEntry, Manifest};
use crate::trace::read::{Trace, rel_path};
use crate::trace::request_keys::scan_request_rows;
use crate::trace::store::Source;

/// One problem found by `verify`.
#[derive(Debug, Clone, Serialize, PartialEq, Eq, PartialOrd, Ord)]
pub struct Problem {
    /// Path relative to the trace root (or "trace.json").
    pub path: String,
    /// missing | extra | modified | truncated | rows | unreadable | invalid |
    /// unclean | skipped | unverifiable | inprogress | hidden | refused |
    /// unread | empty
    pub kind: String,
    pub detail: String,
}

/// Result of verifying a trace.
#[derive(Debug, Clone, Serialize)]
pub struct VerifyReport {
    pub ok: bool,
    pub files_checked: usize,
    pub bytes_hashed: u64,
    pub rows_checked: u64,
    /// The evidence is whole: the capture closed cleanly (trace.json's
    /// `capture.complete`), no pool has a seq hole (lost events), no file
    /// that may hold rows is skipped by the readers, and the trace holds
    /// KV events at all.
    pub complete: bool,
    /// trace.json's `capture.complete`: the recorder closed cleanly.
    pub capture_closed: bool,
    /// Seq holes over all pools, and the events they lost (0 where the
    /// trace-wide checks could not run).
    pub seq_holes: u64,
    pub lost_events: u64,
    pub problems: Vec<Problem>,
}

/// Verifies a trace. Errors only when the trace cannot be read at all
/// (no or bad trace.json, or a read of a remote trace that failed);
/// everything else is a problem in the report.
pub fn verify(dir: &Path) -> Result<VerifyReport> {
    let (trace, refused) = Trace::scan(dir)?;
    let m = &trace.manifest;
    let mut problems = capture_problems(m);
    let listed = match &m.files {
        // An entry listed twice is checked (and counted) once; two
        // different entries for one path are both checked.
        Some(f) => {
            let mut seen = BTreeSet::new();
            f.iter()
                .filter(|e| seen.insert((&e.path, e.rows, &e.blake3)))
                .cloned()
                .collect()
        }
        None => {
            problems.push(Problem {
                path: "trace.json".into(),
                kind: "unverifiable".into(),
                detail: "trace.json has no `files` list: no digest can be checked".into(),
            });
            Vec::new()
        }
    };
    let on_disk: BTreeSet<String> = trace
        .request_files
        .iter()
        .chain(&trace.kv_files)
        .map(|p| rel_path(dir, p))
        .collect();
    let listed_paths: BTreeSet<String> = listed.iter().map(|f| f.path.clone()).collect();
    problems.extend(unlisted_problems(&trace, &refused, &on_disk, &listed_paths));
    // Each kv file's seq runs and copies, gathered while its rows are
    // checked, for the trace-wide checks at the end.
    let seen: Mutex<HashMap<PathBuf, FileRuns>> = Mutex::default();
    // Digests and row counts of listed files, in parallel.
    let checked: Vec<(Vec<Problem>, u64, u64)> = listed
        .par_iter()
        .map(|f| check_listed(&trace, f, &seen))
        .collect::<Result<_>>()?;
    let mut bytes_hashed = 0;
    let mut rows_checked = 0;
    for (p, b, r) in checked {
        problems.extend(p);
        bytes_hashed += b;
        rows_checked += r;
    }
    // Files on disk but not listed are still checked row by row.
    if m.files.is_some() {
        for extra in on_disk.difference(&listed_paths) {
            if let Err(e) = count_rows(&trace, &dir.join(extra), &seen) {
                problems.push(problem(&trace, extra.clone(), "invalid", e)?);
            }
        }
    } else {
        for p in trace.request_files.iter().chain(&trace.kv_files) {
            match count_rows(&trace, p, &seen) {
                Ok(n) => rows_checked += n,
                Err(e) => problems.push(problem(&trace, rel_path(dir, p), "invalid", e)?),
            }
        }
    }
    let (seq_holes, lost_events, kv_events) = trace_wide(&trace, seen, &mut problems)?;
    // No KV events is no evidence of what any request read: a hook that
    // wrote nothing, or the wrong file, must not pass for a clean capture.
    if kv_events == Some(0) {
        problems.push(Problem {
            path: "kv".into(),
            kind: "empty".into(),
            detail: crate::trace::NO_KV_EVENTS.into(),
        });
    }
    let unread = problems
        .iter()
        .any(|p| matches!(p.kind.as_str(), "unread" | "hidden" | "inprogress"));
    problems.sort();
    Ok(VerifyReport {
        ok: problems.is_empty(),
        files_checked: listed.len(),
        bytes_hashed,
        rows_checked,
        complete: m.capture.complete && seq_holes == 0 && !unread && kv_events != Some(0),
        capture_closed: m.capture.complete,
        seq_holes,
        lost_events,
        problems,
    })
}

/// `e` as a problem of the file at `path` (relative to the trace), unless
/// a read of the remote trace failed: then the report would rest on part
/// of the trace, and the failed read is the command's error.
fn problem(trace: &Trace, path: String, kind: &str, e: Error) -> Result<Problem> {
    if let Some(failed) = trace.root.read_failure() {
        return Err(failed);
    }
    Ok(Problem {
        path,
        kind: kind.into(),
        detail: e.to_string(),
    })
}

/// What trace.json's `capture` says of the capture: not closed cleanly,
/// lines skipped at import.
fn capture_problems(m: &Manifest) -> Vec<Problem> {
    let mut problems = Vec::new();
    if !m.capture.complete {
        problems.push(Problem {
            path: "trace.json".into(),
            kind: "unclean".into(),
            detail: if m.capture.extra.get("no_kv_events") == Some(&serde_json::Value::Bool(true)) {
                "capture.complete is false: the import found no KV events (capture.no_kv_events)".into()
            } else {
                "capture.complete is false: the recorder did not close cleanly; events may be missing at the end".into()
            },
        });
    }
    if let Some(n) = m
        .capture
        .extra
        .get("skipped_lines")
        .and_then(|v| v.as_u64())
    {
        problems.push(Problem {
            path: "trace.json".into(),
            kind: "skipped".into(),
            detail: format!("{n} malformed input lines were skipped at import (capture.skipped_lines): their events are lost"),
        });
    }
    problems
}

/// Problems of files trace.json does not list: entries refused when the
/// trace was opened (links out of it, FIFOs, devices; none of them is
/// opened), data files on disk but not listed, and files the readers skip.
/// Listed files are reported with their digests ([`check_listed`]).
fn unlisted_problems(
    trace: &Trace,
    refused: &[Error],
    on_disk: &BTreeSet<String>,
    listed_paths: &BTreeSet<String>,
) -> Vec<Problem> {
    let dir = &trace.dir;
    let mut problems = Vec::new();
    for e in refused {
        let path = error_path(e).map_or_else(|| "kv".into(), |p| rel_path(dir, p));
        if !listed_paths.contains(&path) {
            problems.push(Problem {
                path,
                kind: "refused".into(),
                detail: e.to_string(),
            });
        }
    }
    if trace.manifest.files.is_some() {
        for extra in on_disk.difference(listed_paths) {
            problems.push(Problem {
                path: extra.clone(),
                kind: "extra".into(),
                detail: "file is not listed in trace.json".into(),
            });
        }
    }
    for sub in ["requests", "kv"] {
        for (p, kind) in trace.unread_files(sub) {
            let path = rel_path(dir, &p);
            if listed_paths.contains(&path) {
                continue;
            }
            let (kind, detail) = match kind {
                files::TableFile::InProgress => (
                    "inprogress",
                    "part file left open by a capture that did not close; its rows are lost",
                ),
                files::TableFile::Hidden => (
                    "hidden",
                    "a *.parquet file under a name starting with `_` or `.` (Spark/Hadoop temporary or marker files): readers skip it; if it holds rows of the trace, rename it",
                ),
                _ => (
                    "unread",
                    "named like a data file but not `*.parquet` exactly (lower case, nothing after it): readers skip it; if it holds rows of the trace, rename it to end in `.parquet`",
                ),
            };
            problems.push(Problem {
                path,
                kind: kind.into(),
                detail: detail.into(),
            });
        }
    }
    problems
}

/// One file trace.json lists: present, read by the readers, inside the
/// trace and regular, its digest and its rows as trace.json says. Its
/// problems, bytes hashed and rows read.
fn check_listed(
    trace: &Trace,
    f: &FileEntry,
    seen: &Mutex<HashMap<PathBuf, FileRuns>>,
) -> Result<(Vec<Problem>, u64, u64)> {
    let root = &trace.root;
    let mut probs = Vec::new();
    let path = trace.dir.join(&f.path);
    let mut bytes = 0;
    let mut rows = 0;
    if !root.exists(&path).unwrap_or(false) {
        probs.push(Problem {
            path: f.path.clone(),
            kind: "missing".into(),
            detail: "listed in trace.json but not on disk".into(),
        });
        return Ok((probs, 0, 0));
    }
    // A listed file no reader reads: its rows are in no analysis.
    let skipped = files::reader_skips(&f.path);
    if let Some(why) = &skipped {
        probs.push(Problem {
            path: f.path.clone(),
            kind: "unread".into(),
            detail: format!(
                "listed in trace.json with {} rows, but no reader reads it: {why}; no analysis (inspect, scope) sees its rows, so the trace is not the recorded evidence. Restore the file's name as the capture wrote it (a data file ends in `.parquet` under requests/ or kv/)",
                f.rows
            ),
        });
    }
    // Never read (or hash) a file outside the trace or a FIFO.
    let file = match root.inside(&path).and_then(|_| root.open_file(&path)) {
        Ok(file) => file,
        Err(e) => {
            probs.push(problem(trace, f.path.clone(), "refused", e)?);
            return Ok((probs, 0, 0));
        }
    };
    // A local file is hashed as it was opened; a remote object's digest
    // is kept from its first read (a failed read fails the command).
    let hashed = match file {
        Source::Local(file) => file
            .metadata()
            .and_then(|md| files::hash_open(file, md.len()))
            .map_err(|e| e.to_string()),
        Source::Remote(_) => Ok(root.hash(&path)?),
    };
    match hashed {
        Ok((got, n)) => {
            bytes = n;
            if !got.eq_ignore_ascii_case(&f.blake3) {
                probs.push(Problem {
                    path: f.path.clone(),
                    kind: "modified".into(),
                    detail: format!("blake3 is {got}, trace.json says {}", f.blake3),
                });
            }
        }
        Err(detail) => probs.push(Problem {
            path: f.path.clone(),
            kind: "unreadable".into(),
            detail,
        }),
    }
    if skipped.is_some() {
        // Its rows are read by no analysis, so they are not checked as if
        // they were part of the trace either.
        return Ok((probs, bytes, 0));
    }
    match count_rows(trace, &path, seen) {
        Ok(n) => {
            rows = n;
            if n != f.rows {
                probs.push(Problem {
                    path: f.path.clone(),
                    kind: "rows".into(),
                    detail: format!("file has {n} rows, trace.json says {}", f.rows),
                });
            }
        }
        Err(e) => {
            let kind = if matches!(e, Error::Parquet { .. }) {
                "truncated"
            } else {
                "invalid"
            };
            probs.push(problem(trace, f.path.clone(), kind, e)?);
        }
    }
    Ok((probs, bytes, rows))
}

/// The rules that span rows and files, checked as inspect and scope check
/// them, once every file reads: unique request ids and known request
/// pools, known kv pools, unique seqs per pool, copies a DAG. Seq holes,
/// events lost, and the KV events counted (None: not checked).
fn trace_wide(
    trace: &Trace,
    seen: Mutex<HashMap<PathBuf, FileRuns>>,
    problems: &mut Vec<Problem>,
) -> Result<(u64, u64, Option<u64>)> {
    let unreadable = problems.iter().any(|p| {
        matches!(
            p.kind.as_str(),
            "invalid" | "truncated" | "refused" | "unreadable"
        )
    });
    let (mut seq_holes, mut lost_events) = (0u64, 0u64);
    let mut kv_events = None;
    if unreadable {
        return Ok((seq_holes, lost_events, kv_events));
    }
    let mut seen = seen.into_inner().unwrap_or_default();
    let runs: Option<Vec<FileRuns>> = trace.kv_files.iter().map(|p| seen.remove(p)).collect();
    let kv = match runs {
        Some(runs) => check::finish(trace, &runs, None, None),
        None => check::check_kv(trace, None, None),
    };
    if let Ok(k) = &kv {
        // Saturating: a pool's stream may start near seq 2^64.
        kv_events = Some(k.pools.iter().fold(0u64, |n, p| n.saturating_add(p.events)));
        for p in &k.pools {
            seq_holes = p.holes.saturating_add(seq_holes);
            lost_events = p.missing_events.saturating_add(lost_events);
        }
    }
    let checks = [
        scan_request_rows(trace, |_, _| {}).map(|_| ()),
        kv.map(|_| ()),
    ];
    for e in checks.into_iter().filter_map(|r| r.err()) {
        let path = error_path(&e).map_or_else(|| "kv".into(), |p| rel_path(&trace.dir, p));
        problems.push(problem(trace, path, "invalid", e)?);
    }
    Ok((seq_holes, lost_events, kv_events))
}

/// Reads every row of a data file through the checked reader; a kv file's
/// seq runs go into `seen`.
fn count_rows(trace: &Trace, path: &Path, seen: &Mutex<HashMap<PathBuf, FileRuns>>) -> Result<u64> {
    let rel = rel_path(&trace.dir, path);
    let mut n = 0;
    if rel.starts_with("kv/") {
        let mut runs = FileRuns::new(path);
        for chunk in trace.kv_file(path)? {
            let chunk = chunk?;
            for (i, e) in chunk.events.iter().enumerate() {
                runs.push(
                    e.pool,
                    e.seq,
                    e.src.map(|s| s.pool),
                    chunk.first_row + i as u64,
                )?;
            }
            n += chunk.events.len() as u64;
        }
        if let Ok(mut m) = seen.lock() {
            m.insert(path.to_path_buf(), runs);
        }
    } else {
        for batch in trace.request_file(path)? {
            n += batch?.len() as u64;
        }
    }
    Ok(n)
}

/// The file an error names, if any.
fn error_path(e: &Error) -> Option<&Path> {
    match e {
        Error::Invalid { loc, .. } | Error::Parquet { loc, .. } => loc.file.as_deref(),
        Error::Io { path, .. } => Some(path),
        Error::Other(_) => None,
    }
}
