//! Hashing a run's inputs: a trace (each file compared with the digest
//! trace.json lists for it) or a single file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::custody::evidence::{FileDigest, Inputs};
use crate::error::{Error, Result};
use crate::trace::manifest::Manifest;
use crate::trace::read::Trace;

/// blake3 and size of a file on this machine, read in blocks: the one
/// local digest, shared with the trace's readers.
pub use crate::trace::files::hash_file;

pub(crate) fn abs(p: &Path) -> String {
    std::fs::canonicalize(p)
        .unwrap_or_else(|_| p.to_path_buf())
        .to_string_lossy()
        .into_owned()
}

pub(crate) fn rel(root: &Path, p: &Path) -> String {
    crate::trace::read::rel_path(root, p)
}

/// Every regular file under `dir`, recursively, sorted by relative path.
pub fn list_files(dir: &Path) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).map_err(|e| Error::io(&d, e))? {
            let e = e.map_err(|e| Error::io(&d, e))?;
            let p = e.path();
            let ft = e.file_type().map_err(|e| Error::io(&p, e))?;
            if ft.is_dir() {
                stack.push(p);
            } else {
                out.push(rel(dir, &p));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Hashes a trace's inputs: trace.json and every data file, each compared
/// with the digest trace.json lists for it.
/// trace.json is read again through the trace's root (a remote trace's
/// listing, so the same snapshot), and every file hashed through it.
pub fn trace_inputs(trace: &Trace) -> Result<Inputs> {
    let (root, trace_dir) = (&trace.root, trace.dir.as_path());
    let m = Manifest::load_at(root, trace_dir)?;
    let (h, b) = root.hash(&trace_dir.join("trace.json"))?;
    let mut files = vec![FileDigest {
        path: "trace.json".into(),
        bytes: b,
        blake3: h,
        manifest_blake3: None,
        matches_manifest: None,
        chunks: None,
    }];
    let mut problems = Vec::new();
    let listed: BTreeMap<String, String> = m
        .files
        .iter()
        .flatten()
        .map(|f| (f.path.clone(), f.blake3.clone()))
        .collect();
    if m.files.is_none() {
        problems.push(
            "trace.json has no `files` list: data files are hashed here but cannot be checked against the capture".into(),
        );
    }
    let mut on_disk: Vec<PathBuf> = Vec::new();
    for sub in ["requests", "kv"] {
        let mut walk = root.walk(&trace_dir.join(sub));
        if !walk.refused.is_empty() {
            return Err(walk.refused.swap_remove(0));
        }
        on_disk.extend(walk.data_files());
    }
    let mut seen = std::collections::BTreeSet::new();
    for p in &on_disk {
        let r = rel(trace_dir, p);
        let (h, b) = root.hash(p)?;
        let want = listed.get(&r).cloned();
        let ok = want.as_ref().map(|w| w.eq_ignore_ascii_case(&h));
        match ok {
            Some(false) => problems.push(format!("{r}: blake3 differs from trace.json")),
            None if m.files.is_some() => problems.push(format!("{r}: not listed in trace.json")),
            _ => {}
        }
        seen.insert(r.clone());
        files.push(FileDigest {
            path: r,
            bytes: b,
            blake3: h,
            manifest_blake3: want,
            matches_manifest: ok,
            chunks: None,
        });
    }
    for p in listed.keys() {
        if !seen.contains(p) {
            problems.push(format!("{p}: listed in trace.json but missing on disk"));
        }
    }
    files.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(Inputs {
        kind: "trace".into(),
        root: abs(trace_dir),
        files,
        problems,
    })
}

/// Hashes one file given on the command line (e.g. notify.toml).
pub fn file_input(path: &Path, kind: &str) -> Result<Inputs> {
    let (h, b) = hash_file(path)?;
    let parent = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok(Inputs {
        kind: kind.into(),
        root: abs(if parent.as_os_str().is_empty() {
            Path::new(".")
        } else {
            parent
        }),
        files: vec![FileDigest {
            path: name,
            bytes: b,
            blake3: h,
            manifest_blake3: None,
            matches_manifest: None,
            chunks: None,
        }],
        problems: Vec::new(),
    })
}
