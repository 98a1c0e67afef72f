//! The files of a trace on disk, read as hostile input: walking `requests/`
//! and `kv/`, and opening trace.json and the data files.
//!
//! A trace folder may come from anyone, so two rules hold for every file
//! kvtrail reads or walks here:
//! - it resolves inside the trace folder: a link out of it (`kv -> /`, a
//!   listed data file linked to a file elsewhere) is refused, naming the
//!   link, so no command walks or hashes the host's files;
//! - it is a regular file (or, for the walk, a folder): a FIFO named
//!   `x.parquet` would block a reader forever and a device may act when
//!   opened. The type is checked with `stat` before anything is opened, and
//!   the open itself is non-blocking and checked again on the descriptor,
//!   so a file swapped for a FIFO in between is refused too.
//!
//! A link that stays inside the trace is followed; a folder reached twice
//! (a link loop, or a second path to the same files) is refused.
//!
//! A trace in object storage has none of these (its objects are listed
//! once and hold no links, FIFOs or devices): [`crate::trace::TraceRoot`]
//! sends a remote trace's files to [`crate::trace::store`] and a local
//! trace's here.
//!
//! Which files the readers take is decided here too, from a path alone
//! ([`table_file`], [`reader_skips`]), for local and remote traces alike;
//! and a local file's digest ([`hash_file`]).

use std::collections::HashSet;
use std::fs::{File, FileType, Metadata};
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::error::{Error, Location, Result};
use crate::trace::chunked::read_full;
use crate::trace::store::Source;

/// `path` resolved; an error naming `path` when it leads out of `root`.
pub fn inside(root: &Path, path: &Path) -> Result<PathBuf> {
    let real = std::fs::canonicalize(path).map_err(|e| Error::io(path, e))?;
    if !real.starts_with(root) {
        return Err(Error::invalid(
            Location::file(path),
            format!(
                "is a link to {}, outside the trace folder {}",
                real.display(),
                root.display()
            ),
            "a trace is self-contained: copy the file or folder into the trace instead of linking to it",
        ));
    }
    Ok(real)
}

fn kind(ft: &FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if ft.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if ft.is_socket() {
            return "a socket";
        }
        if ft.is_block_device() {
            return "a block device";
        }
        if ft.is_char_device() {
            return "a character device";
        }
    }
    if ft.is_dir() {
        return "a folder";
    }
    "not a regular file"
}

fn not_regular(path: &Path, md: &Metadata) -> Error {
    Error::invalid(
        Location::file(path),
        format!(
            "is {}, not a regular file; kvtrail does not open it",
            kind(&md.file_type())
        ),
        "a trace holds regular files only: replace it with the file itself",
    )
}

/// Opens a regular file for reading, never blocking: the type is checked
/// before the open (`stat`, links followed) and again on the open
/// descriptor (same file, still regular).
pub fn open_local(path: &Path) -> Result<File> {
    let before = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !before.is_file() {
        return Err(not_regular(path, &before));
    }
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.custom_flags(libc::O_NONBLOCK);
    }
    let file = opts.open(path).map_err(|e| Error::io(path, e))?;
    let after = file.metadata().map_err(|e| Error::io(path, e))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if (after.dev(), after.ino()) != (before.dev(), before.ino()) {
            return Err(Error::invalid(
                Location::file(path),
                "changed while it was being opened",
                "do not modify a trace while kvtrail reads it",
            ));
        }
    }
    if !after.is_file() {
        return Err(not_regular(path, &after));
    }
    Ok(file)
}

/// The error for a file of `n` bytes, over the `limit` kvtrail reads for
/// `what`.
pub(crate) fn too_big(path: &Path, n: u64, limit: u64, what: &str) -> Error {
    Error::invalid(
        Location::file(path),
        format!("is {n} bytes, more than the {limit} bytes kvtrail reads for {what}"),
        format!(
            "{what} is never this large: this is not one, or a damaged one; see docs/limits.md"
        ),
    )
}

/// Reads a regular file on this machine of at most `limit` bytes (`what`
/// names the limit in the message).
pub fn read_limited(path: &Path, limit: u64, what: &str) -> Result<Vec<u8>> {
    read_opened(path, Source::Local(open_local(path)?), limit, what)
}

/// Reads `file` (opened from `path`) whole, if it holds at most `limit`
/// bytes.
pub(crate) fn read_opened(path: &Path, file: Source, limit: u64, what: &str) -> Result<Vec<u8>> {
    let len = file.size().map_err(|e| Error::io(path, e))?;
    if len > limit {
        return Err(too_big(path, len, limit, what));
    }
    let mut buf = Vec::with_capacity(len as usize);
    file.take(limit + 1)
        .read_to_end(&mut buf)
        .map_err(|e| Error::io(path, e))?;
    if buf.len() as u64 > limit {
        return Err(too_big(path, buf.len() as u64, limit, what));
    }
    Ok(buf)
}

/// What the readers make of a file below `requests/` or `kv/`, decided by
/// [`table_file`] from its path alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum TableFile {
    /// A `*.parquet` file, no part of its path hidden: the readers read it.
    Data,
    /// A `*.parquet` file under a name (of the file or a folder above it)
    /// starting with `.` or `_`: skipped (Spark/Hadoop temporary files).
    Hidden,
    /// `*.parquet.inprogress`: a part file that never closed; skipped.
    InProgress,
    /// A name that looks like a data file but is not `*.parquet` exactly
    /// (`x.PARQUET`, `x.Parquet`, `x.parquet ` with a trailing space):
    /// skipped, although it may hold rows.
    NearMiss,
    /// Anything else (`x.parquet.bak`, `README`): not a data file.
    Other,
}

/// The one rule of which files the readers take: `below` is a file's path
/// below `requests/` or `kv/`, with `/` separators. Every reader
/// ([`walk`] and what lists through it), `verify`, `inspect` and `scope`
/// decide through this function (or [`reader_skips`], built on it).
pub fn table_file(below: &str) -> TableFile {
    let name = below.rsplit('/').next().unwrap_or_default();
    let hidden = below
        .split('/')
        .any(|c| c.starts_with('.') || c.starts_with('_'));
    if name.ends_with(".parquet.inprogress") {
        TableFile::InProgress
    } else if name.ends_with(".parquet") {
        if hidden {
            TableFile::Hidden
        } else {
            TableFile::Data
        }
    } else if name
        .trim_end()
        .to_ascii_lowercase()
        .trim_end_matches(".inprogress")
        .ends_with(".parquet")
    {
        TableFile::NearMiss
    } else {
        TableFile::Other
    }
}

/// Why the readers do not read the trace file at `rel` (relative to the
/// trace root, `/` separators, as trace.json's `files` spells it), or None
/// when they read it: [`table_file`] below `requests/` or `kv/`, and
/// nothing anywhere else.
pub fn reader_skips(rel: &str) -> Option<String> {
    let (table, below) = rel.split_once('/').unwrap_or((rel, ""));
    if (table != "requests" && table != "kv") || below.is_empty() {
        return Some("it lies outside requests/ and kv/, where the readers take data files".into());
    }
    match table_file(below) {
        TableFile::Data => None,
        TableFile::Hidden => Some(
            "a name on its path starts with `_` or `.` (Spark/Hadoop temporary or marker files), which the readers skip".into(),
        ),
        TableFile::InProgress => Some(
            "it is a part file left open (`*.parquet.inprogress`), which the readers skip".into(),
        ),
        TableFile::NearMiss | TableFile::Other => Some(format!(
            "its name {:?} does not end in `.parquet` (exactly, lower case), so the readers skip it",
            below.rsplit('/').next().unwrap_or_default()
        )),
    }
}

/// What a walk of `requests/` or `kv/` found.
#[derive(Debug, Default)]
pub struct Walk {
    /// Every file [`table_file`] does not call `Other`, with what it is.
    /// Sorted by path.
    pub files: Vec<(PathBuf, TableFile)>,
    /// Entries refused: links out of the trace, FIFOs, devices, sockets,
    /// folders reached twice, folders that cannot be listed.
    pub refused: Vec<Error>,
}

impl Walk {
    /// The data files the readers take ([`TableFile::Data`]).
    pub fn data_files(&self) -> Vec<PathBuf> {
        self.of(TableFile::Data)
    }

    /// The files of one kind.
    pub fn of(&self, kind: TableFile) -> Vec<PathBuf> {
        self.files
            .iter()
            .filter(|(_, k)| *k == kind)
            .map(|(p, _)| p.clone())
            .collect()
    }
}

/// Walks `dir` (a folder of the local trace `root`, which is resolved) at
/// any depth. A missing `dir` is empty.
pub fn walk(root: &Path, dir: &Path) -> Walk {
    let mut out = Walk::default();
    if std::fs::symlink_metadata(dir).is_err() {
        return out;
    }
    let real = match inside(root, dir) {
        Ok(r) => r,
        Err(e) => {
            out.refused.push(e);
            return out;
        }
    };
    match std::fs::metadata(dir) {
        Ok(md) if md.is_dir() => {}
        Ok(md) => {
            out.refused.push(not_regular_dir(dir, &md));
            return out;
        }
        Err(e) => {
            out.refused.push(Error::io(dir, e));
            return out;
        }
    }
    let mut seen: HashSet<PathBuf> = HashSet::from([real]);
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let rd = match std::fs::read_dir(&d) {
            Ok(rd) => rd,
            Err(e) => {
                out.refused.push(Error::io(&d, e));
                continue;
            }
        };
        for entry in rd {
            let entry = match entry {
                Ok(e) => e,
                Err(e) => {
                    out.refused.push(Error::io(&d, e));
                    continue;
                }
            };
            let p = entry.path();
            let below = p
                .strip_prefix(dir)
                .unwrap_or(&p)
                .components()
                .map(|c| c.as_os_str().to_string_lossy())
                .collect::<Vec<_>>()
                .join("/");
            let kind = table_file(&below);
            let data = kind != TableFile::Other;
            // lstat: the entry itself, a link not followed.
            let ft = match entry.file_type() {
                Ok(ft) => ft,
                Err(e) => {
                    out.refused.push(Error::io(&p, e));
                    continue;
                }
            };
            if ft.is_symlink() {
                // Only what would be walked or read matters; other links
                // (a README linked elsewhere) are never opened.
                let md = std::fs::metadata(&p);
                let is_dir = md.as_ref().is_ok_and(|m| m.is_dir());
                if !is_dir && !data {
                    continue;
                }
                if let Err(e) = inside(root, &p) {
                    out.refused.push(e);
                    continue;
                }
            }
            let md = match std::fs::metadata(&p) {
                Ok(md) => md,
                Err(e) if data => {
                    out.refused.push(Error::io(&p, e));
                    continue;
                }
                Err(_) => continue,
            };
            if md.is_dir() {
                match std::fs::canonicalize(&p) {
                    Ok(real) if seen.insert(real.clone()) => stack.push(p),
                    Ok(real) => out.refused.push(Error::invalid(
                        Location::file(&p),
                        format!(
                            "leads to {}, a folder already read (a link loop, or a second path to the same files)",
                            real.display()
                        ),
                        "remove the link: every file of a trace is reached by one path",
                    )),
                    Err(e) => out.refused.push(Error::io(&p, e)),
                }
            } else if data {
                if md.is_file() {
                    out.files.push((p, kind));
                } else {
                    out.refused.push(not_regular(&p, &md));
                }
            }
        }
    }
    out.files.sort();
    out
}

fn not_regular_dir(path: &Path, md: &Metadata) -> Error {
    Error::invalid(
        Location::file(path),
        format!("is {}, not a folder", kind(&md.file_type())),
        "requests/ and kv/ are folders of Parquet files (docs/trace-format.md)",
    )
}

/// Whether a file on this machine exists (`lstat` finds it). An error
/// other than "not found" is an error.
pub fn exists(path: &Path) -> Result<bool> {
    match std::fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io(path, e)),
    }
}

/// Bytes of a file hashed at once (on every thread, `update_rayon`).
const HASH_BLOCK: usize = 8 << 20;

/// blake3 and size (the bytes hashed) of a regular file on this machine
/// (opened as [`open_local`] opens it), read in blocks of [`HASH_BLOCK`]:
/// memory stays one block per file hashed at once, where a memory map
/// would keep every page of the file resident while it is hashed (a
/// 450 MB trace hashed by files in parallel held as much). A remote
/// object's digest is [`crate::trace::TraceRoot::hash`].
pub fn hash_file(path: &Path) -> Result<(String, u64)> {
    let f = open_local(path)?;
    let len = f.metadata().map_err(|e| Error::io(path, e))?.len();
    hash_open(f, len).map_err(|e| Error::io(path, e))
}

/// blake3 and size of what `f` holds (`len`: its size, for the buffer).
pub(crate) fn hash_open(mut f: File, len: u64) -> std::io::Result<(String, u64)> {
    let mut h = blake3::Hasher::new();
    let mut buf = vec![0u8; (len as usize).clamp(1, HASH_BLOCK)];
    let mut bytes = 0u64;
    loop {
        let n = read_full(&mut f, &mut buf)?;
        if n == 0 {
            break;
        }
        h.update_rayon(&buf[..n]);
        bytes += n as u64;
    }
    Ok((h.finalize().to_hex().to_string(), bytes))
}
