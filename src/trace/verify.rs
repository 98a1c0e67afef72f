//! `verify`: recompute every digest and check every file against trace.json,
//! every row against the contract, and the trace-wide rules (`check.rs`,
//! `index.rs`) exactly as `inspect` and `scope` check them.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rayon::prelude::*;
use serde::Serialize;

use crate::error::Result;
use crate::trace::check::{self, FileRuns};
use crate::trace::files;
use crate::trace::index::scan_requests;
use crate::trace::read::{KvFileReader, RequestFileReader, Trace, rel_path};

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
/// (no or bad trace.json); everything else is a problem in the report.
pub fn verify(dir: &Path) -> Result<VerifyReport> {
    let (trace, refused) = Trace::scan(dir)?;
    let root = files::root(dir)?;
    let m = &trace.manifest;
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
    // Links out of the trace, FIFOs, devices: listed ones are reported
    // with the digests below, the others here. None of them is opened.
    for e in &refused {
        let path = error_path(e).map_or_else(|| "kv".into(), |p| rel_path(dir, p));
        if !listed_paths.contains(&path) {
            problems.push(Problem {
                path,
                kind: "refused".into(),
                detail: e.to_string(),
            });
        }
    }
    if m.files.is_some() {
        for extra in on_disk.difference(&listed_paths) {
            problems.push(Problem {
                path: extra.clone(),
                kind: "extra".into(),
                detail: "file is not listed in trace.json".into(),
            });
        }
    }
    // Files the readers skip: listed ones are reported with the digests
    // below (with the reason), the others here.
    for sub in ["requests", "kv"] {
        for (p, kind) in unread_files(&dir.join(sub)) {
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
    // Each kv file's seq runs and copies, gathered while its rows are
    // checked, for the trace-wide checks at the end.
    let seen: Mutex<HashMap<PathBuf, FileRuns>> = Mutex::default();
    // Digests and row counts of listed files, in parallel.
    let checked: Vec<(Vec<Problem>, u64, u64)> = listed
        .par_iter()
        .map(|f| {
            let mut probs = Vec::new();
            let path = dir.join(&f.path);
            let mut bytes = 0;
            let mut rows = 0;
            if !files::exists(&path).unwrap_or(false) {
                probs.push(Problem {
                    path: f.path.clone(),
                    kind: "missing".into(),
                    detail: "listed in trace.json but not on disk".into(),
                });
                return (probs, 0, 0);
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
            let file = match files::inside(&root, &path).and_then(|_| files::open_regular(&path)) {
                Ok(file) => file,
                Err(e) => {
                    probs.push(Problem {
                        path: f.path.clone(),
                        kind: "refused".into(),
                        detail: e.to_string(),
                    });
                    return (probs, 0, 0);
                }
            };
            let hashed = if files::is_remote(&path) {
                drop(file);
                files::hash_remote(&path).map_err(|e| std::io::Error::other(e.to_string()))
            } else {
                let mut h = blake3::Hasher::new();
                h.update_reader(file)
                    .map(|h| (h.finalize().to_hex().to_string(), h.count()))
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
                Err(e) => probs.push(Problem {
                    path: f.path.clone(),
                    kind: "unreadable".into(),
                    detail: e.to_string(),
                }),
            }
            if skipped.is_some() {
                // Its rows are read by no analysis, so they are not
                // checked as if they were part of the trace either.
                return (probs, bytes, 0);
            }
            match count_rows(&trace, &path, &seen) {
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
                Err(e) => probs.push(Problem {
                    path: f.path.clone(),
                    kind: if matches!(e, crate::Error::Parquet { .. }) {
                        "truncated".into()
                    } else {
                        "invalid".into()
                    },
                    detail: e.to_string(),
                }),
            }
            (probs, bytes, rows)
        })
        .collect();
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
                problems.push(Problem {
                    path: extra.clone(),
                    kind: "invalid".into(),
                    detail: e.to_string(),
                });
            }
        }
    } else {
        for p in trace.request_files.iter().chain(&trace.kv_files) {
            match count_rows(&trace, p, &seen) {
                Ok(n) => rows_checked += n,
                Err(e) => problems.push(Problem {
                    path: rel_path(dir, p),
                    kind: "invalid".into(),
                    detail: e.to_string(),
                }),
            }
        }
    }
    // The rules that span rows and files, checked as inspect and scope
    // check them, once every file reads: unique request ids and known
    // request pools, known kv pools, unique seqs per pool, copies a DAG.
    let unreadable = problems.iter().any(|p| {
        matches!(
            p.kind.as_str(),
            "invalid" | "truncated" | "refused" | "unreadable"
        )
    });
    let (mut seq_holes, mut lost_events) = (0u64, 0u64);
    let mut kv_events = None;
    if !unreadable {
        let mut seen = seen.into_inner().unwrap_or_default();
        let runs: Option<Vec<FileRuns>> = trace.kv_files.iter().map(|p| seen.remove(p)).collect();
        let kv = match runs {
            Some(runs) => check::finish(&trace, &runs, None, None),
            None => check::check_kv(&trace, None, None),
        };
        if let Ok(k) = &kv {
            // Saturating: a pool's stream may start near seq 2^64.
            kv_events = Some(k.pools.iter().fold(0u64, |n, p| n.saturating_add(p.events)));
            for p in &k.pools {
                seq_holes = p.holes.saturating_add(seq_holes);
                lost_events = p.missing_events.saturating_add(lost_events);
            }
        }
        let checks = [scan_requests(&trace, |_| {}).map(|_| ()), kv.map(|_| ())];
        for e in checks.into_iter().filter_map(|r| r.err()) {
            problems.push(Problem {
                path: error_path(&e).map_or_else(|| "kv".into(), |p| rel_path(dir, p)),
                kind: "invalid".into(),
                detail: e.to_string(),
            });
        }
    }
    // A remote object that changed or could not be read makes the report
    // rest on part of the trace: an error, not a problem of one file.
    if let Some(e) = files::remote_failure(dir) {
        return Err(e);
    }
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

/// Reads every row of a data file through the checked reader; a kv file's
/// seq runs go into `seen`.
fn count_rows(trace: &Trace, path: &Path, seen: &Mutex<HashMap<PathBuf, FileRuns>>) -> Result<u64> {
    let rel = rel_path(&trace.dir, path);
    let mut n = 0;
    if rel.starts_with("kv/") {
        let mut runs = FileRuns::new(path);
        for chunk in KvFileReader::open(path, trace.deployment())? {
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
        for batch in RequestFileReader::open(path)? {
            n += batch?.len() as u64;
        }
    }
    Ok(n)
}

/// Files under `dir` (`requests/` or `kv/` of a trace) that the readers
/// do not take but that may hold rows, with what each is
/// ([`files::table_file`]): part files left open (`*.parquet.inprogress`),
/// `*.parquet` files under a name starting with `_` or `.`, and names that
/// look like data files but are not `*.parquet` exactly (`x.PARQUET`).
pub(crate) fn unread_files(dir: &Path) -> Vec<(PathBuf, files::TableFile)> {
    let parent = dir.parent().unwrap_or(Path::new("."));
    let Ok(root) = files::root(if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    }) else {
        return Vec::new();
    };
    // Refused entries are reported where the trace is opened.
    files::walk(&root, dir)
        .files
        .into_iter()
        .filter(|(_, k)| *k != files::TableFile::Data)
        .collect()
}

/// The file an error names, if any.
fn error_path(e: &crate::Error) -> Option<&Path> {
    match e {
        crate::Error::Invalid { loc, .. } | crate::Error::Parquet { loc, .. } => {
            loc.file.as_deref()
        }
        crate::Error::Io { path, .. } => Some(path),
        crate::Error::Other(_) => None,
    }
}
