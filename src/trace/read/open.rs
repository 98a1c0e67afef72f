//! Opening a trace: its root, trace.json and the data files it holds.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::schema::RequestRecord;
use crate::trace::files::TableFile;
use crate::trace::manifest::{Deployment, Manifest};
use crate::trace::read::kv::{KvChunk, KvFileReader};
use crate::trace::read::kv_scan::KvScanReader;
use crate::trace::read::parquet_file::footer_rows;
use crate::trace::read::requests::RequestFileReader;
use crate::trace::root::TraceRoot;

/// An opened trace: where it lives, its manifest and data files (paths
/// sorted).
#[derive(Debug, Clone)]
pub struct Trace {
    /// The trace as it was named (a folder, or a URL).
    pub dir: PathBuf,
    /// Where it lives, decided when it was opened: every file of the trace
    /// is read through it.
    pub root: TraceRoot,
    pub manifest: Manifest,
    pub request_files: Vec<PathBuf>,
    pub kv_files: Vec<PathBuf>,
}

impl Trace {
    /// Opens a trace directory (or URL): reads trace.json and lists data
    /// files. Anything under `requests/` or `kv/` that leads out of the
    /// trace or is not a regular file is an error naming it (see
    /// [`crate::trace::files`]).
    pub fn open(dir: &Path) -> Result<Trace> {
        Self::open_at(TraceRoot::open(dir)?, dir)
    }

    /// [`Trace::open`] of the trace at `root`, opened before as `dir`.
    pub fn open_at(root: TraceRoot, dir: &Path) -> Result<Trace> {
        let (trace, refused) = Trace::scan_at(root, dir)?;
        match refused.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(trace),
        }
    }

    /// Like [`Trace::open`], but hands the refused entries back instead of
    /// failing on the first (`verify` lists them all as problems).
    pub fn scan(dir: &Path) -> Result<(Trace, Vec<Error>)> {
        Self::scan_at(TraceRoot::open(dir)?, dir)
    }

    /// [`Trace::scan`] of the trace at `root`, opened before as `dir`.
    pub fn scan_at(root: TraceRoot, dir: &Path) -> Result<(Trace, Vec<Error>)> {
        let manifest = Manifest::load_at(&root, dir)?;
        let listed = manifest
            .files
            .as_ref()
            .map(|f| f.iter().map(|e| e.path.as_str()).collect());
        root.discover(dir, listed)?;
        let requests = root.walk(&dir.join("requests"));
        let kv = root.walk(&dir.join("kv"));
        let trace = Trace {
            dir: dir.to_path_buf(),
            root,
            manifest,
            request_files: requests.data_files(),
            kv_files: kv.data_files(),
        };
        let refused = requests.refused.into_iter().chain(kv.refused).collect();
        Ok((trace, refused))
    }

    pub fn deployment(&self) -> &Deployment {
        &self.manifest.deployment
    }

    /// Path of a data file relative to the trace root, with `/` separators.
    pub fn rel(&self, path: &Path) -> String {
        rel_path(&self.dir, path)
    }

    /// Streams the requests table, file by file, batch by batch.
    pub fn requests(&self) -> impl Iterator<Item = Result<Vec<RequestRecord>>> + '_ {
        self.request_files
            .iter()
            .flat_map(move |f| match self.request_file(f) {
                Ok(r) => Box::new(r) as Box<dyn Iterator<Item = Result<Vec<RequestRecord>>>>,
                Err(e) => Box::new(std::iter::once(Err(e))),
            })
    }

    /// Opens one requests file for streaming.
    pub fn request_file(&self, path: &Path) -> Result<RequestFileReader> {
        RequestFileReader::open_at(&self.root, path)
    }

    /// Opens one kv file for streaming.
    pub fn kv_file(&self, path: &Path) -> Result<KvFileReader> {
        KvFileReader::open(&self.root, path, &self.manifest.deployment)
    }

    /// Opens the planning columns of one kv file.
    pub fn kv_scan(&self, path: &Path) -> Result<KvScanReader> {
        KvScanReader::open(&self.root, path, &self.manifest.deployment)
    }

    /// Rows a data file of the trace holds, from its footer alone.
    pub fn footer_rows(&self, path: &Path) -> Result<u64> {
        footer_rows(&self.root, path)
    }

    /// Streams every kv event of the trace, file by file (no global order).
    pub fn kv_chunks(&self) -> impl Iterator<Item = Result<KvChunk>> + '_ {
        self.kv_files
            .iter()
            .flat_map(move |f| match self.kv_file(f) {
                Ok(r) => Box::new(r) as Box<dyn Iterator<Item = Result<KvChunk>>>,
                Err(e) => Box::new(std::iter::once(Err(e))),
            })
    }

    /// Files under `sub` (`requests` or `kv`) that the readers do not take
    /// but that may hold rows, with what each is
    /// ([`crate::trace::files::table_file`]): part files left open
    /// (`*.parquet.inprogress`), `*.parquet` files under a name starting
    /// with `_` or `.`, and names that look like data files but are not
    /// `*.parquet` exactly (`x.PARQUET`). Refused entries are reported
    /// where the trace is opened.
    pub fn unread_files(&self, sub: &str) -> Vec<(PathBuf, TableFile)> {
        self.root
            .walk(&self.dir.join(sub))
            .files
            .into_iter()
            .filter(|(_, k)| *k != TableFile::Data)
            .collect()
    }
}

/// Relative path with forward slashes.
pub fn rel_path(root: &Path, path: &Path) -> String {
    let rel = path.strip_prefix(root).unwrap_or(path);
    rel.components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join("/")
}

/// Every `*.parquet` file under `dir` (`requests/` or `kv/` of a trace) at
/// any depth, sorted, except hidden names (`.`/`_`: `_SUCCESS`, `.crc`,
/// `_temporary/`). A missing directory is an empty table. An entry that
/// leads out of the trace (`dir`'s parent) or is not a regular file is an
/// error naming it.
pub fn list_parquet(dir: &Path) -> Result<Vec<PathBuf>> {
    let parent = dir.parent().unwrap_or(Path::new("."));
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let mut walk = TraceRoot::open(parent)?.walk(dir);
    if !walk.refused.is_empty() {
        return Err(walk.refused.swap_remove(0));
    }
    Ok(walk.data_files())
}
