//! Where a trace lives, decided once when it is opened: a folder on this
//! machine, or a prefix in object storage ([`crate::trace::store`]).
//!
//! [`TraceRoot::open`] is the one place a trace argument is told local from
//! remote ([`TraceRoot::names_url`]); the [`crate::trace::Trace`] it opens
//! carries the root, and every reader, check and digest of the trace's
//! files goes through it, so each runs one code path for both. A remote
//! root holds the trace's listing: the trace is listed once, and every
//! later read of it (a second pass, the evidence written at the end) reads
//! the same snapshot.
//!
//! The rules for files read as hostile input (links out of the trace,
//! FIFOs, devices) are in [`crate::trace::files`]; a remote trace's
//! objects hold no links, FIFOs or devices, are listed once, and are opened
//! for ranged reads.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Location, Result};
use crate::trace::files::{self, TableFile, Walk};
use crate::trace::store::{Remote, SCHEMES, Source};

/// Where a trace lives.
#[derive(Debug, Clone)]
pub enum TraceRoot {
    /// A folder on this machine, resolved (links followed): what every
    /// other path of the trace must stay under.
    Local(PathBuf),
    /// A prefix in object storage, listed when it was opened.
    Remote(Arc<Remote>),
}

impl TraceRoot {
    /// Whether `path` names a trace or file in object storage
    /// (`scheme://...` with a scheme of [`SCHEMES`]). A local folder whose
    /// name starts so is reached as `./s3://...`. The one test of a path's
    /// string: everything else asks the root the trace was opened with.
    pub fn names_url(path: &Path) -> bool {
        path.to_str()
            .and_then(|s| s.split_once("://"))
            .is_some_and(|(scheme, _)| SCHEMES.contains(&scheme.to_ascii_lowercase().as_str()))
    }

    /// Opens the trace at `dir`: a URL is listed (and refused when it
    /// holds no object); a local path must be a folder.
    pub fn open(dir: &Path) -> Result<TraceRoot> {
        match Self::open_remote(dir)? {
            Some(root) => Ok(root),
            None => Self::open_local(dir),
        }
    }

    /// The remote trace at `dir`, listed now; None when `dir` is a local
    /// path (nothing is checked then).
    pub(crate) fn open_remote(dir: &Path) -> Result<Option<TraceRoot>> {
        if !Self::names_url(dir) {
            return Ok(None);
        }
        let r = Remote::open(dir)?;
        if r.listable() && r.is_empty() {
            return Err(Error::invalid(
                Location::file(dir),
                "holds no objects: there is no trace under this prefix",
                "check the bucket and prefix (the one that holds trace.json, requests/ and kv/); docs/object-storage.md shows how to upload a trace",
            ));
        }
        Ok(Some(TraceRoot::Remote(r)))
    }

    fn open_local(dir: &Path) -> Result<TraceRoot> {
        let not_dir = || {
            Error::invalid(
                Location::file(dir),
                "not a trace directory",
                "pass the directory that holds trace.json, requests/ and kv/",
            )
        };
        match std::fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            _ => return Err(not_dir()),
        }
        std::fs::canonicalize(dir)
            .map(TraceRoot::Local)
            .map_err(|e| Error::io(dir, e))
    }

    /// Whether the trace is in object storage.
    pub fn is_remote(&self) -> bool {
        matches!(self, TraceRoot::Remote(_))
    }

    /// The remote trace and the path of `path` in it (`kv/pool=0/x.parquet`).
    fn object(&self, path: &Path) -> Option<Result<(&Arc<Remote>, String)>> {
        let TraceRoot::Remote(r) = self else {
            return None;
        };
        let s = path.to_str().unwrap_or_default();
        let rel = s.strip_prefix(r.url()).and_then(|rest| {
            if rest.is_empty() {
                Some("")
            } else {
                rest.strip_prefix('/')
            }
        });
        Some(match rel {
            Some(rel) => Ok((r, rel.trim_end_matches('/').to_string())),
            None => Err(Error::invalid(
                Location::file(path),
                format!("is not an object of the trace at {}", r.url()),
                "name files of a remote trace by the trace's URL joined with their path in it",
            )),
        })
    }

    /// `path` resolved; an error naming `path` when it leads out of the
    /// trace. Objects hold no links: a path below the trace's URL is inside.
    pub fn inside(&self, path: &Path) -> Result<PathBuf> {
        match self {
            TraceRoot::Local(root) => files::inside(root, path),
            TraceRoot::Remote(_) => Ok(path.to_path_buf()),
        }
    }

    /// Opens a file of the trace for reading: a local one as a regular
    /// file, never blocking ([`files::open_local`]); a remote one for
    /// ranged reads.
    pub fn open_file(&self, path: &Path) -> Result<Source> {
        match self.object(path) {
            Some(o) => {
                let (r, rel) = o?;
                Ok(Source::Remote(r.open_file(&rel)?))
            }
            None => files::open_local(path).map(Source::Local),
        }
    }

    /// Reads a file of the trace of at most `limit` bytes (`what` names
    /// the limit in the message). A remote object's size is known from its
    /// listing (or HEAD) before any of it is read: one without an ETag
    /// would be downloaded whole.
    pub fn read_limited(&self, path: &Path, limit: u64, what: &str) -> Result<Vec<u8>> {
        if let Some(o) = self.object(path) {
            let (r, rel) = o?;
            if let Some(meta) = r.meta(&rel)?
                && meta.size > limit
            {
                return Err(files::too_big(path, meta.size, limit, what));
            }
        }
        files::read_opened(path, self.open_file(path)?, limit, what)
    }

    /// Whether a file exists (local: `lstat` finds it; remote: listed or,
    /// over HTTP(S), answered by a HEAD). A local error other than "not
    /// found" is an error.
    pub fn exists(&self, path: &Path) -> Result<bool> {
        match self.object(path) {
            Some(o) => {
                let (r, rel) = o?;
                Ok(r.meta(&rel)?.is_some())
            }
            None => files::exists(path),
        }
    }

    /// Whether `path` is a regular file (links followed); every listed
    /// object of a remote trace is one.
    pub fn is_regular_file(&self, path: &Path) -> bool {
        match self.object(path) {
            Some(Ok((r, rel))) => r.meta(&rel).is_ok_and(|m| m.is_some()),
            Some(Err(_)) => false,
            None => std::fs::metadata(path).is_ok_and(|m| m.is_file()),
        }
    }

    /// Walks `dir` (a folder of the trace) at any depth
    /// ([`files::walk`]). A missing `dir` is empty.
    pub fn walk(&self, dir: &Path) -> Walk {
        let mut out = Walk::default();
        match self {
            TraceRoot::Local(root) => return files::walk(root, dir),
            TraceRoot::Remote(_) => match self.object(dir) {
                Some(Ok((r, sub))) => {
                    for rel in r.files(&sub) {
                        let below = &rel[sub.len() + 1..];
                        let kind = files::table_file(below);
                        if kind == TableFile::Other {
                            continue;
                        }
                        out.files.push((PathBuf::from(r.file_url(&rel)), kind));
                    }
                    out.files.sort();
                }
                Some(Err(e)) => out.refused.push(e),
                None => {}
            },
        }
        out
    }

    /// blake3 and length of a file of the trace: a local file read in
    /// blocks ([`files::hash_file`]); a remote object streamed front to
    /// back in ranged reads, once per trace (its digest is kept).
    pub fn hash(&self, path: &Path) -> Result<(String, u64)> {
        match self.object(path) {
            Some(o) => {
                let (r, rel) = o?;
                r.digest(&rel)
            }
            None => files::hash_file(path),
        }
    }

    /// After trace.json of a remote trace is read: over HTTP(S), which
    /// cannot list a folder, asks for each file trace.json lists
    /// (`listed`: their paths in the trace; None: no `files` list), so
    /// that walks see them. A trace.json without a `files` list cannot be
    /// read so. A local trace needs nothing.
    pub fn discover(&self, dir: &Path, listed: Option<Vec<&str>>) -> Result<()> {
        let TraceRoot::Remote(r) = self else {
            return Ok(());
        };
        if r.listable() {
            return Ok(());
        }
        let Some(files) = listed else {
            return Err(Error::invalid(
                Location::file(&dir.join("trace.json")),
                "has no `files` list, and an HTTP(S) server cannot list a folder: kvtrail cannot find the trace's data files",
                "serve the trace from object storage (s3://, gs://, az://), or copy it to a local folder",
            ));
        };
        r.discover(files.into_iter())
    }

    /// The first read of the trace's objects that failed (a change since
    /// the listing, a lost connection), if any. The readers return it in
    /// place of the Parquet reader's error it caused; `verify` fails on it
    /// where it would otherwise call a file damaged, since its report
    /// would rest on part of the trace.
    pub fn read_failure(&self) -> Option<Error> {
        match self {
            TraceRoot::Remote(r) => r.failure(),
            TraceRoot::Local(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_urls_are_told_from_local_paths() {
        for s in [
            "s3://b/t",
            "S3://b/t",
            "gs://b/t",
            "az://c/t",
            "https://h/t",
            "http://127.0.0.1:9/t",
        ] {
            assert!(TraceRoot::names_url(Path::new(s)), "{s}");
        }
        for s in [
            "./s3://b/t",
            "traces/t",
            "/tmp/s3:/b",
            "ftp://h/t",
            "s3:/b/t",
        ] {
            assert!(!TraceRoot::names_url(Path::new(s)), "{s}");
        }
    }
}
