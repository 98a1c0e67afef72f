//! `verify`: recompute every digest and check every file against trace.json.

use std::collections::BTreeSet;
use std::path::Path;

use rayon::prelude::*;
use serde::Serialize;

use crate::error::Result;
use crate::trace::read::{KvFileReader, RequestFileReader, Trace, rel_path};

/// One problem found by `verify`.
#[derive(Debug, Clone, Serialize, PartialEq, Eq, PartialOrd, Ord)]
pub struct Problem {
    /// Path relative to the trace root (or "trace.json").
    pub path: String,
    /// missing | extra | modified | truncated | rows | unreadable | invalid |
    /// unclean | skipped | unverifiable | inprogress | hidden
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
    pub complete: bool,
    pub problems: Vec<Problem>,
}

/// Verifies a trace. Errors only when the trace cannot be read at all
/// (no or bad trace.json); everything else is a problem in the report.
pub fn verify(dir: &Path) -> Result<VerifyReport> {
    let trace = Trace::open(dir)?;
    let m = &trace.manifest;
    let mut problems = Vec::new();
    if !m.capture.complete {
        problems.push(Problem {
            path: "trace.json".into(),
            kind: "unclean".into(),
            detail: "capture.complete is false: the recorder did not close cleanly; events may be missing at the end".into(),
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
    if m.files.is_some() {
        for extra in on_disk.difference(&listed_paths) {
            problems.push(Problem {
                path: extra.clone(),
                kind: "extra".into(),
                detail: "file is not listed in trace.json".into(),
            });
        }
    }
    for sub in ["requests", "kv"] {
        let (inprogress, hidden) = list_inprogress(&dir.join(sub));
        for p in inprogress {
            problems.push(Problem {
                path: rel_path(dir, &p),
                kind: "inprogress".into(),
                detail: "part file left open by a capture that did not close; its rows are lost"
                    .into(),
            });
        }
        for p in hidden {
            problems.push(Problem {
                path: rel_path(dir, &p),
                kind: "hidden".into(),
                detail: "a *.parquet file under a name starting with `_` or `.` (Spark/Hadoop temporary or marker files): readers skip it; if it holds rows of the trace, rename it"
                    .into(),
            });
        }
    }
    // Digests and row counts of listed files, in parallel.
    let checked: Vec<(Vec<Problem>, u64, u64)> = listed
        .par_iter()
        .map(|f| {
            let mut probs = Vec::new();
            let path = dir.join(&f.path);
            let mut bytes = 0;
            let mut rows = 0;
            if !path.is_file() {
                probs.push(Problem {
                    path: f.path.clone(),
                    kind: "missing".into(),
                    detail: "listed in trace.json but not on disk".into(),
                });
                return (probs, 0, 0);
            }
            let mut h = blake3::Hasher::new();
            match h.update_mmap(&path) {
                Ok(_) => {
                    bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
                    let got = h.finalize().to_hex().to_string();
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
            match count_rows(&trace, &path) {
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
            if let Err(e) = count_rows(&trace, &dir.join(extra)) {
                problems.push(Problem {
                    path: extra.clone(),
                    kind: "invalid".into(),
                    detail: e.to_string(),
                });
            }
        }
    } else {
        for p in trace.request_files.iter().chain(&trace.kv_files) {
            match count_rows(&trace, p) {
                Ok(n) => rows_checked += n,
                Err(e) => problems.push(Problem {
                    path: rel_path(dir, p),
                    kind: "invalid".into(),
                    detail: e.to_string(),
                }),
            }
        }
    }
    problems.sort();
    Ok(VerifyReport {
        ok: problems.is_empty(),
        files_checked: listed.len(),
        bytes_hashed,
        rows_checked,
        complete: m.capture.complete,
        problems,
    })
}

/// Reads every row of a data file through the checked reader.
fn count_rows(trace: &Trace, path: &Path) -> Result<u64> {
    let rel = rel_path(&trace.dir, path);
    let mut n = 0;
    if rel.starts_with("kv/") {
        for chunk in KvFileReader::open(path, trace.deployment())? {
            n += chunk?.events.len() as u64;
        }
    } else {
        for batch in RequestFileReader::open(path)? {
            n += batch?.len() as u64;
        }
    }
    Ok(n)
}

/// Files the reader does not take but that may hold rows: part files left
/// open (`*.parquet.inprogress`), and `*.parquet` files that the reader
/// skips because they or a folder above them start with `_` or `.`
/// (see [`crate::trace::read::list_parquet`]).
pub(crate) fn list_inprogress(dir: &Path) -> (Vec<std::path::PathBuf>, Vec<std::path::PathBuf>) {
    let mut inprogress = Vec::new();
    let mut hidden = Vec::new();
    let mut stack = vec![(dir.to_path_buf(), false)];
    while let Some((d, under_hidden)) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            let is_hidden = under_hidden || name.starts_with('.') || name.starts_with('_');
            if p.is_dir() {
                stack.push((p, is_hidden));
            } else if name.ends_with(".parquet.inprogress") {
                inprogress.push(p);
            } else if name.ends_with(".parquet") && is_hidden {
                hidden.push(p);
            }
        }
    }
    inprogress.sort();
    hidden.sort();
    (inprogress, hidden)
}
