//! Checking an output folder against its evidence.json: every output
//! file re-hashed and, when asked, every input, recursing into input
//! folders with their own evidence.json.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::custody::claims::{SUMMARY_JSON, compare_claims, derive_from_trace, read_claims};
use crate::custody::evidence::{
    Chunks, EVIDENCE_JSON, Evidence, FileDigest, FolderProblem, FolderReport, Inputs, MAX_NESTING,
};
use crate::custody::inputs::{abs, hash_file, list_files};
use crate::custody::record::{bad_record, load_evidence, read_evidence};
use crate::custody::statement::is_folder_record;
use crate::error::{Error, Location, Result};
use crate::trace::chunked::{self, ChunkDigest, ChunkedFile, MismatchLog};

/// An output folder checked once against its evidence.json (its own files,
/// not its inputs): the record as it was read and what the check found.
#[derive(Debug, Clone)]
pub struct CheckedFolder {
    pub evidence: Evidence,
    /// Size of evidence.json as read.
    pub evidence_bytes: u64,
    pub report: FolderReport,
    /// Files whose bytes are checked as they are read, not yet
    /// (`check_folder_deferred`); empty after `check_folder`.
    pub deferred: Vec<String>,
    /// What reads of deferred files found not to match (shared by every
    /// file opened through `open_file`).
    mismatches: MismatchLog,
}

/// Reads a folder's evidence.json once and checks every file of the folder
/// against it (`verify_folder` without the inputs). A difference is in the
/// report, not an error; a record that is not one is an error.
pub fn check_folder(dir: &Path) -> Result<CheckedFolder> {
    check_folder_as(dir, false)
}

/// `check_folder`, with the bytes of every file that has chunk digests
/// left to be checked as they are read (`CheckedFolder::open_file`): those
/// files are checked for presence, kind and size only, every other file
/// is re-hashed. For a command that reads a few rows of a large folder (a
/// look-up); `CheckedFolder::read_mismatches` then says whether anything
/// it read did not match.
pub fn check_folder_deferred(dir: &Path) -> Result<CheckedFolder> {
    check_folder_as(dir, true)
}

fn check_folder_as(dir: &Path, defer: bool) -> Result<CheckedFolder> {
    let (evidence, digest, evidence_bytes) = read_evidence(dir)?;
    let mut deferred = Vec::new();
    let report = verify_record(
        dir,
        &evidence,
        digest,
        false,
        defer.then_some(&mut deferred),
        &mut Vec::new(),
    )?;
    Ok(CheckedFolder {
        evidence,
        evidence_bytes,
        report,
        deferred,
        mismatches: MismatchLog::default(),
    })
}

impl CheckedFolder {
    /// The folder as the input of another run (`kind`: what that run's
    /// evidence.json calls it): every file with the digest the check
    /// confirmed, evidence.json included. A folder that does not match its
    /// evidence.json is refused: the chain of custody would be broken.
    pub fn as_input(&self, dir: &Path, kind: &str) -> Result<Inputs> {
        if !self.deferred.is_empty() {
            return Err(Error::Other(format!(
                "{}: the folder was checked for reading a few rows only; a run that builds on it checks it whole (custody::check_folder)",
                dir.display()
            )));
        }
        let rep = &self.report;
        if !rep.ok {
            let first = rep
                .problems
                .iter()
                .find(|p| p.side == "output")
                .or(rep.problems.first())
                .map(|p| format!("{}: {}", p.path, p.detail))
                .unwrap_or_default();
            return Err(Error::invalid(
                Location::file(&dir.join(EVIDENCE_JSON)),
                format!(
                    "the folder does not match its evidence.json ({} problems; first: {first})",
                    rep.problems.len()
                ),
                "run `kvtrail verify` on the folder; re-create it from the original input instead of editing it",
            ));
        }
        // Every file was re-hashed against this very record and matches it
        // (and nothing else is there): the record's digests are the files'
        // digests, so each file is read once, not twice.
        let mut files: Vec<FileDigest> = self
            .evidence
            .outputs
            .iter()
            .map(|f| FileDigest {
                manifest_blake3: None,
                matches_manifest: None,
                chunks: None,
                ..f.clone()
            })
            .collect();
        files.push(FileDigest {
            path: EVIDENCE_JSON.into(),
            bytes: self.evidence_bytes,
            blake3: rep.evidence_blake3.clone(),
            manifest_blake3: None,
            matches_manifest: None,
            chunks: None,
        });
        files.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(Inputs {
            kind: kind.into(),
            root: abs(dir),
            files,
            problems: Vec::new(),
        })
    }

    /// Opens the output file `name` of the folder `dir` for reading: a
    /// deferred file checked chunk by chunk against evidence.json as it is
    /// read, any other as it is (it was re-hashed by the check).
    pub fn open_file(&self, dir: &Path, name: &str) -> Result<ChunkedFile> {
        let path = dir.join(name);
        if !self.deferred.iter().any(|d| d == name) {
            return ChunkedFile::open(&path, name);
        }
        let f = self
            .evidence
            .outputs
            .iter()
            .find(|f| f.path == name)
            .expect("a deferred file is listed in evidence.json");
        let chunks = f
            .chunks
            .as_ref()
            .expect("only files with chunk digests are deferred");
        ChunkedFile::open_checked(
            &path,
            name,
            f.bytes,
            chunks.kind(),
            &chunks.blake3,
            self.mismatches.clone(),
        )
    }

    /// What reads of deferred files found not to match evidence.json, one
    /// line per chunk (empty: everything read so far matched).
    pub fn read_mismatches(&self) -> Vec<String> {
        self.mismatches
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// Hashes the files of an output folder that has evidence.json, checking
/// each against that record (a folder used as the input of another run).
/// A difference is an error: the chain of custody would be broken.
pub fn folder_inputs(dir: &Path, kind: &str) -> Result<Inputs> {
    check_folder(dir)?.as_input(dir, kind)
}

/// Whether `dir` is an output folder of kvtrail (scope, merge, notify): it
/// holds evidence.json, and is not a trace (no trace.json).
pub fn is_output_folder(dir: &Path) -> bool {
    dir.join(EVIDENCE_JSON).is_file() && !dir.join("trace.json").is_file()
}

/// Checks every output file of a folder against evidence.json and, when
/// `inputs` is set and the input roots are present, every input file too
/// (recursing into input folders that have their own evidence.json, at most
/// `MAX_NESTING` deep, never twice into one folder).
pub fn verify_folder(dir: &Path, inputs: bool) -> Result<FolderReport> {
    verify_nested(dir, inputs, &mut Vec::new())
}

fn verify_nested(dir: &Path, inputs: bool, stack: &mut Vec<PathBuf>) -> Result<FolderReport> {
    let (ev, digest) = load_evidence(dir)?;
    verify_record(dir, &ev, digest, inputs, None, stack)
}

/// `verify_nested` against a record already read (`digest`: its blake3).
/// With `defer`, output files that have chunk digests are checked for
/// presence and size only and named there (`check_folder_deferred`).
fn verify_record(
    dir: &Path,
    ev: &Evidence,
    digest: String,
    inputs: bool,
    mut defer: Option<&mut Vec<String>>,
    stack: &mut Vec<PathBuf>,
) -> Result<FolderReport> {
    let ev_path = dir.join(EVIDENCE_JSON);
    let here = std::fs::canonicalize(dir).map_err(|e| Error::io(dir, e))?;
    let mut problems = Vec::new();
    let listed: BTreeMap<&str, &FileDigest> =
        ev.outputs.iter().map(|f| (f.path.as_str(), f)).collect();
    // Contradictions in the record first, for every file it lists, read
    // or not, at hand or not.
    let inputs_listed = ev.inputs.iter().flat_map(|i| {
        i.files
            .iter()
            .map(move |f| ("input", shown_path(&i.root, &f.path), f))
    });
    let outputs_listed = ev.outputs.iter().map(|f| ("output", f.path.clone(), f));
    for (side, path, f) in outputs_listed.chain(inputs_listed) {
        if let Some(detail) = contradiction(f) {
            problems.push(FolderProblem {
                side: side.into(),
                path,
                kind: "modified".into(),
                detail,
            });
        }
    }
    for f in &ev.outputs {
        let deferred = defer.is_some() && f.chunks.is_some();
        if check_file(dir, f, "output", "", deferred, &mut problems)?
            && let Some(d) = defer.as_deref_mut()
        {
            d.push(f.path.clone());
        }
    }
    for r in list_files(dir)? {
        if !is_folder_record(&r) && !listed.contains_key(r.as_str()) {
            problems.push(FolderProblem {
                side: "output".into(),
                path: r,
                kind: "extra".into(),
                detail: "file is not listed in evidence.json".into(),
            });
        }
    }
    let mut inputs_checked = 0;
    let mut unavailable = Vec::new();
    let mut nested = Vec::new();
    let mut recorded = Vec::new();
    for (n, inp) in ev.inputs.iter().enumerate() {
        recorded.extend(inp.problems.iter().map(|p| format!("{}: {p}", inp.kind)));
        let root_buf = dir.join(&inp.root);
        let root = root_buf.as_path();
        let key = format!("inputs[{n}].root");
        let found = std::fs::canonicalize(root).ok();
        if let Some(c) = &found {
            // A folder is never its own input, nor inside one of its
            // inputs' folders (a config file's folder excepted: it may
            // hold the output folder).
            if c.starts_with(&here) || (inp.kind != "config" && here.starts_with(c)) {
                return Err(bad_record(
                    &ev_path,
                    &key,
                    format!(
                        "{:?} names this folder or a folder that holds it; a folder cannot be its own evidence",
                        inp.root
                    ),
                ));
            }
        }
        if !inputs {
            continue;
        }
        if !root.is_dir() {
            unavailable.push(inp.root.clone());
            continue;
        }
        for f in &inp.files {
            inputs_checked += 1;
            check_file(root, f, "input", &inp.root, false, &mut problems)?;
        }
        if inp.kind == "scope" && root.join(EVIDENCE_JSON).is_file() {
            // An input folder's record that is no longer one is a failed
            // check of this folder (its digest is listed above), not an
            // error: the chain is broken there.
            if let Err(e) = load_evidence(root) {
                problems.push(FolderProblem {
                    side: "input".into(),
                    path: format!("{}/{EVIDENCE_JSON}", inp.root.trim_end_matches('/')),
                    kind: "modified".into(),
                    detail: format!("not a valid evidence record: {e}"),
                });
                continue;
            }
            let c = found.unwrap_or_else(|| root.to_path_buf());
            if c == here || stack.contains(&c) {
                return Err(bad_record(
                    &ev_path,
                    &key,
                    format!(
                        "{:?} leads back to a folder already being verified: the folder cites itself through its inputs",
                        inp.root
                    ),
                ));
            }
            if stack.len() + 1 >= MAX_NESTING {
                return Err(bad_record(
                    &ev_path,
                    &key,
                    format!(
                        "input folders nest more than {MAX_NESTING} deep; kvtrail's own folders nest at most 3 deep"
                    ),
                ));
            }
            stack.push(here.clone());
            let r = verify_nested(root, true, stack);
            stack.pop();
            nested.push(r?);
        }
    }
    // What the folder's summary.json claims about its evidence, against
    // what can be re-derived cheaply: from the trace (seq holes, files the
    // readers skip or miss, capture state), or for a merged folder from
    // its shards' own claims. A folder that hides a hole does not pass.
    if inputs && ev.kind == "scope" && dir.join(SUMMARY_JSON).is_file() {
        let claims = read_claims(&dir.join(SUMMARY_JSON));
        for inp in &ev.inputs {
            let root = dir.join(&inp.root);
            if !root.is_dir() {
                continue;
            }
            let derived = match inp.kind.as_str() {
                "trace" => derive_from_trace(&root),
                "scope" if root.join(SUMMARY_JSON).is_file() => {
                    read_claims(&root.join(SUMMARY_JSON)).map(|c| c.as_derived())
                }
                _ => continue,
            };
            match (&claims, &derived) {
                (Ok(c), Ok(d)) => compare_claims(c, d, &inp.root, &mut problems),
                (Err(e), _) | (_, Err(e)) => problems.push(FolderProblem {
                    side: "output".into(),
                    path: SUMMARY_JSON.into(),
                    kind: "unverifiable".into(),
                    detail: format!(
                        "its claims about the evidence cannot be checked against {}: {e}",
                        inp.root
                    ),
                }),
            }
        }
    }
    problems.sort();
    let ok = problems.is_empty() && nested.iter().all(|n| n.ok);
    Ok(FolderReport {
        ok,
        kind: ev.kind.clone(),
        evidence_blake3: digest,
        outputs_checked: ev.outputs.len(),
        inputs_checked,
        inputs_unavailable: unavailable,
        recorded_input_problems: recorded,
        problems,
        nested,
    })
}

/// Where a file's record contradicts itself (`manifest_blake3` against
/// `matches_manifest`), what. Checked for every file a record lists,
/// whether or not the file is read or at hand (`verify_record`), so that
/// `verify` and a look-up find it alike. (Chunk digests that do not make
/// up the file's blake3 are the other contradiction: `check_file`.)
fn contradiction(f: &FileDigest) -> Option<String> {
    let (Some(m), Some(matched)) = (&f.manifest_blake3, f.matches_manifest) else {
        return None;
    };
    ((*m == f.blake3) != matched).then(|| {
        format!(
            "evidence.json contradicts itself: manifest_blake3 {} and blake3 {} with matches_manifest {matched}",
            m.get(..16).unwrap_or(m),
            f.blake3.get(..16).unwrap_or(&f.blake3)
        )
    })
}

/// A listed file as problems name it: inputs prefixed with their root.
fn shown_path(prefix: &str, path: &str) -> String {
    if prefix.is_empty() {
        path.to_string()
    } else {
        format!("{}/{}", prefix.trim_end_matches('/'), path)
    }
}

/// Checks one listed file, adding what differs to `out`: the one check of a
/// file against its record, for `verify` and a look-up alike. With
/// `defer`, a file whose chunk digests make up its recorded blake3
/// (`chunked::binds`) and that is there with its recorded size is not
/// hashed, and the result is true (its bytes are checked as they are read,
/// so what is read is what `verify` would find); a record whose chunk
/// digests do not make up its blake3 contradicts itself and is a problem
/// (a look-up then checks the folder whole); a file with chunk digests of
/// an earlier version's kind (bound to nothing) is hashed whole.
fn check_file(
    root: &Path,
    f: &FileDigest,
    side: &str,
    prefix: &str,
    defer: bool,
    out: &mut Vec<FolderProblem>,
) -> Result<bool> {
    let p = root.join(&f.path);
    let shown = shown_path(prefix, &f.path);
    // Outputs are the folder's own files: never followed through a link.
    if side == "output" && std::fs::symlink_metadata(&p).is_ok_and(|m| m.file_type().is_symlink()) {
        out.push(FolderProblem {
            side: side.into(),
            path: shown,
            kind: "modified".into(),
            detail: "a symbolic link where evidence.json lists a file (not followed)".into(),
        });
        return Ok(false);
    }
    if !p.is_file() {
        out.push(FolderProblem {
            side: side.into(),
            path: shown,
            kind: "missing".into(),
            detail: "file listed in evidence.json is missing".into(),
        });
        return Ok(false);
    }
    let kind = f.chunks.as_ref().map(Chunks::kind);
    if defer
        && let Some(c) = f
            .chunks
            .as_ref()
            .filter(|c| c.kind() == ChunkDigest::Subtree)
    {
        if !chunked::binds(&c.blake3, f.bytes, &f.blake3) {
            out.push(FolderProblem {
                side: side.into(),
                path: shown,
                kind: "modified".into(),
                detail: format!(
                    "evidence.json contradicts itself: its chunk digests do not make up the blake3 {} it records for the file (the record was edited)",
                    f.blake3.get(..16).unwrap_or(&f.blake3)
                ),
            });
            return Ok(false);
        }
        let b = std::fs::metadata(&p).map_err(|e| Error::io(&p, e))?.len();
        if b == f.bytes {
            return Ok(true);
        }
        out.push(FolderProblem {
            side: side.into(),
            path: shown,
            kind: "modified".into(),
            detail: format!("{b} bytes, where evidence.json records {}", f.bytes),
        });
        return Ok(false);
    }
    let (h, b, chunks) = match kind {
        Some(k) => chunked::digest_file(&p, k)?,
        None => {
            let (h, b) = hash_file(&p)?;
            (h, b, None)
        }
    };
    let whole = h == f.blake3 && b == f.bytes;
    let rec = f.chunks.as_ref().map(|c| &c.blake3);
    let same_chunks = rec.is_some() && chunks.as_ref() == rec;
    if whole
        && let Some(rec) = rec
        && !same_chunks
    {
        let first = chunks
            .iter()
            .flatten()
            .zip(rec)
            .position(|(a, b)| a != b)
            .unwrap_or(0);
        out.push(FolderProblem {
            side: side.into(),
            path: shown,
            kind: "modified".into(),
            detail: format!(
                "the file matches its blake3 but not evidence.json's chunk digests (chunk {first} differs): the record was edited"
            ),
        });
        return Ok(false);
    }
    if !whole && same_chunks {
        out.push(FolderProblem {
            side: side.into(),
            path: shown,
            kind: "modified".into(),
            detail: format!(
                "the file matches evidence.json's chunk digests but not the blake3 {} it records: the record contradicts itself (it was edited)",
                f.blake3.get(..16).unwrap_or(&f.blake3)
            ),
        });
        return Ok(false);
    }
    if !whole {
        // A record of kvtrail's chunk digests that do not make up its own
        // blake3 was edited as well: said, as a look-up says it.
        let unbound = f.chunks.as_ref().is_some_and(|c| {
            c.kind() == ChunkDigest::Subtree && !chunked::binds(&c.blake3, f.bytes, &f.blake3)
        });
        out.push(FolderProblem {
            side: side.into(),
            path: shown,
            kind: "modified".into(),
            detail: format!(
                "blake3 {} ({} bytes) differs from evidence.json {} ({} bytes){}",
                &h[..16],
                b,
                f.blake3.get(..16).unwrap_or(&f.blake3),
                f.bytes,
                if unbound {
                    "; evidence.json also contradicts itself: its chunk digests do not make up that blake3 (the record was edited)"
                } else {
                    ""
                }
            ),
        });
    }
    Ok(false)
}
