//! Chain of custody for output folders: evidence.json records the tool
//! version, the exact command line, the blake3 of every input file (for a
//! trace: re-hashed and compared with the digests in trace.json) and the
//! blake3 of every output file. `verify_folder` re-hashes both sides and
//! names every file that changed, went missing or appeared.
//!
//! The digest of a folder's evidence.json ("evidence digest") is what
//! notification packs and look-up answers cite: it pins the outputs and,
//! through them, the inputs. evidence.json is written last and lists every
//! other file in the folder (recursively), so nothing can be added, changed
//! or removed without `verify_folder` noticing.
//!
//! evidence.json is input like any other when it is read back: `load_evidence`
//! refuses a record whose digests are not blake3 hex, whose file paths are
//! absolute, contain `..` or name evidence.json itself, or whose input roots
//! do not lead out of the folder (a root must begin with `..`: an input is
//! never inside the output; a trace in object storage is recorded by its
//! URL, which `verify_folder` lists as not re-read). `verify_folder` follows input folders at most
//! `MAX_NESTING` deep, and refuses a root that names the folder itself, a
//! folder holding it, or one already being verified (a cycle).
//!
//! Output folders: `prepare_out` is the one rule for every command that
//! writes a folder (never inside its input, never over unrelated files;
//! an earlier output of the same kind and input only with `--force`);
//! `prepare_trace_out` the same for commands writing a trace (no
//! `--force`: a trace is only ever written into a new or empty folder), and
//! `create_private_dir` / `write_private` / `make_private` make everything
//! owner-only (folders 0700, files 0600) whatever the umask.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Location, Result};
use crate::trace::chunked::{self, ChunkDigest, ChunkedFile, MismatchLog};
use crate::trace::manifest::Manifest;

/// File name of the custody record inside an output folder.
pub const EVIDENCE_JSON: &str = "evidence.json";

/// How many input folders deep `verify_folder` follows evidence.json
/// records (a notify folder of a merged scope folder of shards of a trace
/// is 3 deep).
pub const MAX_NESTING: usize = 8;

/// The largest evidence.json read back (a record lists every file of its
/// folder once, with at most `trace::chunked::MAX_CHUNKS` chunk digests
/// per file).
pub const MAX_EVIDENCE_BYTES: u64 = 256 << 20;

/// The input kinds an evidence record may name.
const INPUT_KINDS: [&str; 3] = ["trace", "scope", "config"];

/// One hashed file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileDigest {
    /// Relative to the folder's root, `/`-separated.
    pub path: String,
    pub bytes: u64,
    pub blake3: String,
    /// For trace data files: the digest trace.json lists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest_blake3: Option<String>,
    /// For trace data files: whether the file matched trace.json when the
    /// folder was written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matches_manifest: Option<bool>,
    /// For output files of at least `trace::chunked::CHUNKED_FROM` bytes:
    /// the blake3 of every chunk, so that a reader of a few rows checks
    /// only the chunks it reads (`CheckedFolder::open_file`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunks: Option<Chunks>,
}

/// The chunk digests of one file (`trace::chunked`): chunk `i` is bytes
/// `i*chunk_bytes .. (i+1)*chunk_bytes` (the last one shorter).
/// `chunk_bytes` follows from the file's size
/// (`trace::chunked::chunk_bytes_for`); it is recorded so the record
/// reads on its own. `digest` says what the digests are: `blake3-subtree`
/// (what kvtrail writes), each chunk's chaining value in the file's BLAKE3
/// tree, so that they make up the file's `blake3` and a record that
/// contradicts itself is found without reading the file; absent (records
/// of earlier versions), the plain blake3 of each chunk, bound to nothing,
/// so such a file is always checked whole.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Chunks {
    pub chunk_bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    pub blake3: Vec<String>,
}

impl Chunks {
    /// What the digests are (`check_record` refuses any other `digest`).
    pub fn kind(&self) -> ChunkDigest {
        match self.digest.as_deref() {
            Some(ChunkDigest::SUBTREE) => ChunkDigest::Subtree,
            _ => ChunkDigest::Plain,
        }
    }
}

/// The inputs of a run, under one root directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Inputs {
    /// trace | scope | config
    pub kind: String,
    /// Where the input files were, relative to the output folder that
    /// records them (absolute while hashing, and when no relative path
    /// exists).
    pub root: String,
    pub files: Vec<FileDigest>,
    /// Problems found when the inputs were hashed (e.g. a trace file that
    /// does not match trace.json).
    #[serde(default)]
    pub problems: Vec<String>,
}

/// evidence.json.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Evidence {
    pub format: String,
    pub version: u32,
    /// scope | notify
    pub kind: String,
    pub tool: String,
    pub tool_version: String,
    /// The command line exactly as given (argv).
    pub command: Vec<String>,
    pub inputs: Vec<Inputs>,
    pub outputs: Vec<FileDigest>,
}

/// Creates `dir` (and missing parents) and makes it owner-only (0700).
pub fn create_private_dir(dir: &Path) -> Result<()> {
    let mut b = std::fs::DirBuilder::new();
    b.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
    b.create(dir).map_err(|e| Error::io(dir, e))?;
    set_mode(dir, 0o700)
}

/// Writes a file owner-only (0600), replacing any earlier one.
pub fn write_private(path: &Path, bytes: impl AsRef<[u8]>) -> Result<()> {
    use std::io::Write as _;
    let mut f = create_private(path)?;
    f.write_all(bytes.as_ref())
        .and_then(|_| f.flush())
        .map_err(|e| Error::io(path, e))
}

/// Creates (or truncates) a file owner-only (0600) for streaming writes.
pub fn create_private(path: &Path) -> Result<std::fs::File> {
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
    let f = o.open(path).map_err(|e| Error::io(path, e))?;
    set_mode(path, 0o600)?;
    Ok(f)
}

/// Writes a file owner-only (0600) all at once: a temporary file in the
/// same folder, renamed over `path` only when every byte is written, so a
/// failure leaves no half-written file.
pub fn write_private_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write as _;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    // tempfile creates the file 0600.
    let mut t = tempfile::Builder::new()
        .prefix(".kvtrail-")
        .suffix(".tmp")
        .tempfile_in(parent)
        .map_err(|e| Error::io(path, e))?;
    t.write_all(bytes)
        .and_then(|_| t.flush())
        .map_err(|e| Error::io(path, e))?;
    t.persist(path).map_err(|e| Error::io(path, e.error))?;
    set_mode(path, 0o600)
}

/// Makes a file written by another writer (Parquet) owner-only (0600).
pub fn make_private(path: &Path) -> Result<()> {
    set_mode(path, 0o600)
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .map_err(|e| Error::io(path, e))?;
    }
    let _ = (path, mode);
    Ok(())
}

/// `p` made absolute without requiring it to exist: its longest existing
/// ancestor canonicalised (links resolved), the rest appended.
fn resolve(p: &Path) -> PathBuf {
    let p = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir().unwrap_or_default().join(p)
    };
    let mut rest = Vec::new();
    let mut cur = p.as_path();
    loop {
        if let Ok(c) = std::fs::canonicalize(cur) {
            let mut out = c;
            for r in rest.iter().rev() {
                out.push(r);
            }
            return out;
        }
        match (cur.parent(), cur.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                cur = parent;
            }
            _ => return p,
        }
    }
}

/// Checks the output folder of a command that writes a trace (`ingest`,
/// `simulate`, `replay`, `record`) before anything is written: never
/// inside (or equal to) an input trace, never a folder that holds anything
/// (a trace is never mixed with other files, and there is no `--force`: an
/// earlier trace is removed by hand). A new or empty folder is fine.
pub fn prepare_trace_out(out: &Path, inputs: &[&Path]) -> Result<()> {
    if out_is_empty(out, inputs)? {
        return Ok(());
    }
    Err(Error::invalid(
        Location::file(out),
        "the output folder exists and is not empty",
        "pass a new or empty folder for the trace (remove an earlier trace yourself if it is no longer needed)",
    ))
}

/// The checks shared by every output folder: `out` is not, and does not
/// lie inside, any of `inputs`; it is new, or an existing folder. Returns
/// whether it is new or empty.
fn out_is_empty(out: &Path, inputs: &[&Path]) -> Result<bool> {
    let at = resolve(out);
    for inp in inputs {
        let inp_at = resolve(inp);
        if at.starts_with(&inp_at) {
            return Err(Error::invalid(
                Location::file(out),
                format!(
                    "the output folder is inside the input {} (writing there would change the evidence being read)",
                    inp.display()
                ),
                "pass an output folder outside the input folder",
            ));
        }
    }
    if !out.exists() {
        return Ok(true);
    }
    if !out.is_dir() {
        return Err(Error::invalid(
            Location::file(out),
            "the output path exists and is not a folder",
            "pass a new or empty folder",
        ));
    }
    let any = std::fs::read_dir(out)
        .map_err(|e| Error::io(out, e))?
        .next()
        .is_some();
    Ok(!any)
}

/// Removes everything inside `dir` (best effort; links are removed, not
/// followed): what a failed run wrote into a folder [`prepare_out`] found
/// new or empty.
pub fn empty_folder(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let _ = match e.file_type() {
            Ok(t) if t.is_dir() => std::fs::remove_dir_all(&p),
            _ => std::fs::remove_file(&p),
        };
    }
}

/// Checks and readies the output folder of a command before anything is
/// written. `kind` is what the command records in evidence.json (scope,
/// notify) or another name for commands without one (merge); `inputs` are
/// the folders it reads, `inputs[0]` the one evidence.json records.
///
/// - `out` must not be, or lie inside, any input folder (writing there
///   would change the evidence being read, or make the trace unreadable);
/// - a new or empty folder is used as it is;
/// - a non-empty folder is refused, unless `force` is set and it is an
///   earlier output of the same `kind` from the same `inputs[0]` that holds
///   nothing but the files its evidence.json lists: those are removed first,
///   so no older file can end up certified by the new evidence.json.
pub fn prepare_out(out: &Path, kind: &str, inputs: &[&Path], force: bool) -> Result<()> {
    if out_is_empty(out, inputs)? {
        return Ok(());
    }
    let entries = list_files(out)?;
    let refuse = |what: String| {
        Error::invalid(
            Location::file(out),
            what,
            format!(
                "pass a new or empty folder; --force replaces only an earlier `kvtrail {kind}` output of the same input, holding nothing else"
            ),
        )
    };
    if !force {
        return Err(refuse(
            "the output folder exists and is not empty".to_string(),
        ));
    }
    if !out.join(EVIDENCE_JSON).is_file() {
        return Err(refuse(format!(
            "the output folder is not empty and is not an earlier `kvtrail {kind}` output (no evidence.json)"
        )));
    }
    let (ev, _) = load_evidence(out)?;
    let same_input = ev.inputs.first().is_some_and(|i| {
        inputs
            .first()
            .is_some_and(|want| resolve(&out.join(&i.root)) == resolve(want))
    });
    if ev.kind != kind || !same_input {
        return Err(refuse(format!(
            "the output folder is an earlier `kvtrail {}` output of another input; --force only replaces one of `kvtrail {kind}` on {}",
            ev.kind,
            inputs
                .first()
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        )));
    }
    let listed: std::collections::BTreeSet<&str> =
        ev.outputs.iter().map(|f| f.path.as_str()).collect();
    if let Some(extra) = entries
        .iter()
        .find(|r| r.as_str() != EVIDENCE_JSON && !listed.contains(r.as_str()))
    {
        return Err(refuse(format!(
            "the output folder holds {extra}, which its evidence.json does not list; refusing to delete or certify it"
        )));
    }
    for r in entries {
        let p = out.join(&r);
        std::fs::remove_file(&p).map_err(|e| Error::io(&p, e))?;
    }
    remove_empty_dirs(out)
}

/// Removes the empty folders under `dir` (not `dir` itself).
fn remove_empty_dirs(dir: &Path) -> Result<()> {
    for e in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let p = e.map_err(|e| Error::io(dir, e))?.path();
        if p.is_dir() && !p.is_symlink() {
            remove_empty_dirs(&p)?;
            std::fs::remove_dir(&p).map_err(|e| Error::io(&p, e))?;
        }
    }
    Ok(())
}

/// Bytes of a file hashed at once (on every thread, `update_rayon`).
const HASH_BLOCK: usize = 8 << 20;

/// blake3 and size (the bytes hashed) of a file, read in blocks of
/// [`HASH_BLOCK`]: memory stays one block per file hashed at once, where a
/// memory map would keep every page of the file resident while it is
/// hashed (a 450 MB trace hashed by files in parallel held as much).
pub fn hash_file(path: &Path) -> Result<(String, u64)> {
    if crate::trace::files::is_remote(path) {
        return crate::trace::files::hash_remote(path);
    }
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut h = blake3::Hasher::new();
    let len = f.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut buf = vec![0u8; (len as usize).clamp(1, HASH_BLOCK)];
    let mut bytes = 0u64;
    loop {
        let n =
            crate::trace::chunked::read_full(&mut f, &mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        h.update_rayon(&buf[..n]);
        bytes += n as u64;
    }
    Ok((h.finalize().to_hex().to_string(), bytes))
}

fn abs(p: &Path) -> String {
    std::fs::canonicalize(p)
        .unwrap_or_else(|_| p.to_path_buf())
        .to_string_lossy()
        .into_owned()
}

fn rel(root: &Path, p: &Path) -> String {
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
pub fn trace_inputs(trace_dir: &Path) -> Result<Inputs> {
    let m = Manifest::load(trace_dir)?;
    let (h, b) = hash_file(&trace_dir.join("trace.json"))?;
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
    let mut on_disk: Vec<PathBuf> = crate::trace::read::list_parquet(&trace_dir.join("requests"))?;
    on_disk.extend(crate::trace::read::list_parquet(&trace_dir.join("kv"))?);
    let mut seen = std::collections::BTreeSet::new();
    for p in &on_disk {
        let r = rel(trace_dir, p);
        let (h, b) = hash_file(p)?;
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

/// Hashes the files of an output folder that has evidence.json, checking
/// each against that record (a folder used as the input of another run).
/// A difference is an error: the chain of custody would be broken.
pub fn folder_inputs(dir: &Path, kind: &str) -> Result<Inputs> {
    check_folder(dir)?.as_input(dir, kind)
}

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

/// Writes evidence.json last, over every other file now in `dir`. Returns
/// the evidence digest (blake3 of evidence.json).
pub fn write_evidence(
    dir: &Path,
    kind: &str,
    command: &[String],
    inputs: Vec<Inputs>,
) -> Result<String> {
    let mut outputs = Vec::new();
    for r in list_files(dir)? {
        if r == EVIDENCE_JSON {
            continue;
        }
        let (h, b, chunks) = chunked::digest_file(&dir.join(&r), ChunkDigest::Subtree)?;
        outputs.push(FileDigest {
            path: r,
            bytes: b,
            blake3: h,
            manifest_blake3: None,
            matches_manifest: None,
            chunks: chunks.map(|blake3| Chunks {
                chunk_bytes: chunked::chunk_bytes_for(b),
                digest: Some(ChunkDigest::SUBTREE.into()),
                blake3,
            }),
        });
    }
    let here = std::fs::canonicalize(dir).map_err(|e| Error::io(dir, e))?;
    let inputs = inputs
        .into_iter()
        .map(|mut i| {
            i.root = relative_to(&here, Path::new(&i.root));
            i
        })
        .collect();
    let ev = Evidence {
        format: "kvtrail-evidence".into(),
        version: 1,
        kind: kind.into(),
        tool: "kvtrail".into(),
        tool_version: env!("CARGO_PKG_VERSION").into(),
        command: command.to_vec(),
        inputs,
        outputs,
    };
    let mut text = serde_json::to_string_pretty(&ev).expect("evidence serializes");
    text.push('\n');
    let p = dir.join(EVIDENCE_JSON);
    write_private(&p, &text)?;
    Ok(blake3::hash(text.as_bytes()).to_hex().to_string())
}

/// `to` (absolute) as a path relative to the directory `from` (absolute),
/// with `/` separators: evidence.json then reads the same wherever the
/// folders are, as long as they keep their relative places.
fn relative_to(from: &Path, to: &Path) -> String {
    let a: Vec<_> = from.components().collect();
    let b: Vec<_> = to.components().collect();
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    if common == 0 {
        return to.to_string_lossy().into_owned();
    }
    let mut parts: Vec<String> = vec!["..".into(); a.len() - common];
    parts.extend(
        b[common..]
            .iter()
            .map(|c| c.as_os_str().to_string_lossy().into_owned()),
    );
    if parts.is_empty() {
        ".".into()
    } else {
        parts.join("/")
    }
}

/// Reads a folder's evidence.json; returns it and its digest.
pub fn load_evidence(dir: &Path) -> Result<(Evidence, String)> {
    read_evidence(dir).map(|(ev, digest, _)| (ev, digest))
}

/// `load_evidence`, plus the size of the bytes read.
fn read_evidence(dir: &Path) -> Result<(Evidence, String, u64)> {
    let p = dir.join(EVIDENCE_JSON);
    let bytes = crate::trace::files::read_limited(&p, MAX_EVIDENCE_BYTES, "an evidence record")?;
    let ev: Evidence = serde_json::from_slice(&bytes).map_err(|e| {
        Error::invalid(
            Location::file(&p),
            format!("not a kvtrail evidence record: {e}"),
            "evidence.json is written by `kvtrail scope --out` and `kvtrail notify`; re-create the folder",
        )
    })?;
    if ev.format != "kvtrail-evidence" || ev.version != 1 {
        return Err(Error::invalid(
            Location::file(&p),
            format!(
                "unsupported evidence format {:?} version {}",
                ev.format, ev.version
            ),
            "use the kvtrail version that wrote the folder",
        ));
    }
    check_record(&ev, &p)?;
    Ok((
        ev,
        blake3::hash(&bytes).to_hex().to_string(),
        bytes.len() as u64,
    ))
}

fn bad_record(p: &Path, key: &str, what: String) -> Error {
    Error::invalid(
        Location::file(p).column(key),
        what,
        "evidence.json is written by kvtrail and never edited; re-create the folder from its input with the command it records",
    )
}

/// Whether `s` is a blake3 digest as kvtrail writes it (64 hex digits).
fn is_digest(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A file path inside its root: relative, `/`-separated names only (no
/// `..`, `.`, empty or absolute part).
fn is_inner_path(s: &str) -> bool {
    !s.is_empty()
        && s.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
        && Path::new(s)
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)))
}

/// An input root: relative and leading out of the folder (`..` first, then
/// `..` or names).
fn is_input_root(s: &str) -> bool {
    let parts: Vec<&str> = s.split('/').collect();
    parts.first() == Some(&"..")
        && parts.iter().all(|c| !c.is_empty() && *c != ".")
        && !Path::new(s).is_absolute()
}

/// The shape rules of an evidence record read back from disk; the key of
/// the first violation is named.
fn check_record(ev: &Evidence, p: &Path) -> Result<()> {
    let files = |key: &str, files: &[FileDigest], outputs: bool| -> Result<()> {
        let mut seen = std::collections::BTreeSet::new();
        for (i, f) in files.iter().enumerate() {
            if !is_inner_path(&f.path) {
                return Err(bad_record(
                    p,
                    &format!("{key}[{i}].path"),
                    format!(
                        "{:?} is not a path inside the folder (absolute paths, `..` and `.` are refused; nothing outside the folder is opened)",
                        f.path
                    ),
                ));
            }
            if outputs && f.path == EVIDENCE_JSON {
                return Err(bad_record(
                    p,
                    &format!("{key}[{i}].path"),
                    "evidence.json cannot list itself".into(),
                ));
            }
            if !seen.insert(f.path.as_str()) {
                return Err(bad_record(
                    p,
                    &format!("{key}[{i}].path"),
                    format!("{:?} is listed twice", f.path),
                ));
            }
            if !is_digest(&f.blake3) {
                return Err(bad_record(
                    p,
                    &format!("{key}[{i}].blake3"),
                    "not a blake3 digest (64 hex digits)".into(),
                ));
            }
            if let Some(c) = &f.chunks {
                let key = format!("{key}[{i}].chunks");
                let chunk = chunked::chunk_bytes_for(f.bytes);
                if !outputs || f.bytes < chunked::CHUNKED_FROM || c.chunk_bytes != chunk {
                    return Err(bad_record(
                        p,
                        &format!("{key}.chunk_bytes"),
                        format!(
                            "chunk digests of {} bytes for a file of {} bytes; kvtrail writes chunks of {chunk} bytes for output files of at least {} bytes only",
                            c.chunk_bytes,
                            f.bytes,
                            chunked::CHUNKED_FROM
                        ),
                    ));
                }
                if c.blake3.len() as u64 != chunked::chunk_count(f.bytes) {
                    return Err(bad_record(
                        p,
                        &format!("{key}.blake3"),
                        format!(
                            "{} chunk digests for {} bytes, expected {}",
                            c.blake3.len(),
                            f.bytes,
                            chunked::chunk_count(f.bytes)
                        ),
                    ));
                }
                if let Some(d) = c.digest.as_deref().filter(|d| *d != ChunkDigest::SUBTREE) {
                    return Err(bad_record(
                        p,
                        &format!("{key}.digest"),
                        format!(
                            "unknown chunk digest {d:?} (kvtrail writes {:?}; records without it hold plain blake3 digests)",
                            ChunkDigest::SUBTREE
                        ),
                    ));
                }
                if let Some(j) = c.blake3.iter().position(|d| !is_digest(d)) {
                    return Err(bad_record(
                        p,
                        &format!("{key}.blake3[{j}]"),
                        "not a blake3 digest (64 hex digits)".into(),
                    ));
                }
            }
        }
        Ok(())
    };
    files("outputs", &ev.outputs, true)?;
    for (n, inp) in ev.inputs.iter().enumerate() {
        if !INPUT_KINDS.contains(&inp.kind.as_str()) {
            return Err(bad_record(
                p,
                &format!("inputs[{n}].kind"),
                format!(
                    "unknown input kind {:?} (expected one of {INPUT_KINDS:?})",
                    inp.kind
                ),
            ));
        }
        // A trace in object storage is recorded by its URL.
        let remote_trace =
            inp.kind == "trace" && crate::trace::files::is_remote(Path::new(&inp.root));
        if !is_input_root(&inp.root) && !remote_trace {
            return Err(bad_record(
                p,
                &format!("inputs[{n}].root"),
                format!(
                    "{:?} does not lead out of the folder (an input root is relative and begins with `..`, or a trace's object-store URL; an input is never the folder itself or inside it)",
                    inp.root
                ),
            ));
        }
        files(&format!("inputs[{n}].files"), &inp.files, false)?;
    }
    Ok(())
}

/// One difference found by `verify_folder`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct FolderProblem {
    /// output | input
    pub side: String,
    /// The file, relative to its root (inputs: prefixed with the root).
    pub path: String,
    /// modified | missing | extra | unavailable | contradicts | unverifiable
    pub kind: String,
    pub detail: String,
}

/// Result of checking an output folder against its evidence.json.
#[derive(Debug, Clone, Serialize)]
pub struct FolderReport {
    pub ok: bool,
    /// scope | notify
    pub kind: String,
    pub evidence_blake3: String,
    pub outputs_checked: usize,
    pub inputs_checked: usize,
    /// Input roots that are not on this machine (not checked; not a failure).
    pub inputs_unavailable: Vec<String>,
    /// Problems recorded when the folder was written (e.g. trace files that
    /// did not match trace.json then).
    pub recorded_input_problems: Vec<String>,
    pub problems: Vec<FolderProblem>,
    /// Nested checks of input folders that carry their own evidence.json.
    pub nested: Vec<FolderReport>,
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
        if r != EVIDENCE_JSON && !listed.contains_key(r.as_str()) {
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

/// The report a scope folder holds its coverage in.
const SUMMARY_JSON: &str = "summary.json";

/// What a scope folder's summary.json says about its evidence
/// (`coverage`), read without the scope types (custody sits below scope).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ClaimedCoverage {
    complete: bool,
    capture_complete: bool,
    gaps: Vec<ClaimedGap>,
    files_unread: Vec<String>,
    files_missing: Vec<String>,
    no_kv_events: bool,
    shard_pools: Option<Vec<u16>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
struct ClaimedGap {
    pool: u16,
    after_seq: Option<u64>,
    before_seq: u64,
}

impl ClaimedGap {
    fn missing(&self) -> u64 {
        self.before_seq
            .saturating_sub(self.after_seq.map_or(0, |a| a.saturating_add(1)))
    }
}

#[derive(Deserialize)]
struct ClaimedSummary {
    coverage: ClaimedCoverage,
}

/// What the evidence is, re-derived (from a trace, or a shard's claims).
#[derive(Debug, Default)]
struct DerivedEvidence {
    capture_complete: bool,
    /// Per pool: seq holes and events lost.
    holes: BTreeMap<u16, (u64, u64)>,
    /// Pools the derivation speaks for (None: every pool of the trace).
    pools: Option<Vec<u16>>,
    files_unread: Vec<String>,
    files_missing: Vec<String>,
    no_kv_events: bool,
    /// Anything that makes the evidence incomplete.
    incomplete: bool,
}

impl ClaimedCoverage {
    /// A shard's claims as evidence for the folder merged from it.
    fn as_derived(&self) -> DerivedEvidence {
        let mut holes: BTreeMap<u16, (u64, u64)> = BTreeMap::new();
        for g in &self.gaps {
            let e = holes.entry(g.pool).or_default();
            e.0 += 1;
            e.1 = e.1.saturating_add(g.missing());
        }
        DerivedEvidence {
            capture_complete: self.capture_complete,
            pools: Some(holes.keys().copied().collect()),
            holes,
            files_unread: self.files_unread.clone(),
            files_missing: self.files_missing.clone(),
            // A shard without events says nothing of the merged trace's.
            no_kv_events: false,
            incomplete: !self.gaps.is_empty()
                || !self.files_unread.is_empty()
                || !self.files_missing.is_empty()
                || !self.capture_complete,
        }
    }
}

/// Reads the coverage a summary.json claims, streaming (a summary of many
/// findings is never held whole).
fn read_claims(path: &Path) -> Result<ClaimedCoverage> {
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let s: ClaimedSummary = serde_json::from_reader(std::io::BufReader::new(f)).map_err(|e| {
        Error::invalid(
            Location::file(path),
            format!("not a scope summary: {e}"),
            "summary.json is written by `kvtrail scope --out`; restore the folder as written",
        )
    })?;
    Ok(s.coverage)
}

/// Re-derives from the trace what a scope run must say about it: seq
/// holes per pool (the structural check `verify` runs), the files the
/// readers skip or miss ([`crate::trace::files::reader_skips`]), the
/// capture state and whether there are KV events at all. No replay.
fn derive_from_trace(root: &Path) -> Result<DerivedEvidence> {
    use crate::trace::files::reader_skips;
    use crate::trace::read::{Trace, rel_path};
    let (trace, refused) = Trace::scan(root)?;
    if let Some(e) = refused.into_iter().next() {
        return Err(e);
    }
    let m = &trace.manifest;
    let kv = crate::trace::check::check_kv(&trace, None, None)?;
    let mut d = DerivedEvidence {
        capture_complete: m.capture.complete,
        ..Default::default()
    };
    let mut events = 0u64;
    for p in &kv.pools {
        events = events.saturating_add(p.events);
        d.holes.insert(p.pool, (p.holes, p.missing_events));
    }
    d.no_kv_events = events == 0;
    let on_disk: std::collections::BTreeSet<String> = trace
        .request_files
        .iter()
        .chain(&trace.kv_files)
        .map(|p| rel_path(root, p))
        .collect();
    for sub in ["requests", "kv"] {
        for (p, _) in crate::trace::verify::unread_files(&root.join(sub)) {
            d.files_unread.push(rel_path(root, &p));
        }
    }
    for f in m.files.iter().flatten() {
        if on_disk.contains(&f.path) {
            continue;
        }
        if reader_skips(&f.path).is_some() {
            d.files_unread.push(f.path.clone());
        } else {
            d.files_missing.push(f.path.clone());
        }
    }
    d.files_unread.sort();
    d.files_unread.dedup();
    d.incomplete = !d.capture_complete
        || d.no_kv_events
        || m.files.is_none()
        || !d.files_unread.is_empty()
        || !d.files_missing.is_empty();
    Ok(d)
}

/// Names every way the claims `c` of a folder hide what `d` (re-derived
/// from input `from`) shows.
fn compare_claims(
    c: &ClaimedCoverage,
    d: &DerivedEvidence,
    from: &str,
    out: &mut Vec<FolderProblem>,
) {
    let mut push = |detail: String| {
        out.push(FolderProblem {
            side: "output".into(),
            path: SUMMARY_JSON.into(),
            kind: "contradicts".into(),
            detail: format!(
                "{detail} (re-derived from {from}): the folder does not say what its evidence holds"
            ),
        })
    };
    let mut claimed: BTreeMap<u16, (u64, u64)> = BTreeMap::new();
    for g in &c.gaps {
        let e = claimed.entry(g.pool).or_default();
        e.0 += 1;
        e.1 = e.1.saturating_add(g.missing());
    }
    // The pools the folder reports: a shard's own, or all.
    let reported = |pool: u16| c.shard_pools.as_ref().is_none_or(|s| s.contains(&pool));
    let mut hidden_holes = false;
    for (&pool, &(holes, lost)) in &d.holes {
        if !reported(pool) || d.pools.as_ref().is_some_and(|p| !p.contains(&pool)) {
            continue;
        }
        let (ch, cl) = claimed.get(&pool).copied().unwrap_or((0, 0));
        if (ch, cl) != (holes, lost) {
            hidden_holes |= ch < holes || cl < lost;
            push(format!(
                "pool {pool}: summary.json lists {ch} seq holes ({cl} events lost), the evidence holds {holes} ({lost} lost)"
            ));
        }
    }
    for f in &d.files_unread {
        if !c.files_unread.contains(f) {
            push(format!(
                "{f} may hold rows no reader reads, and summary.json does not list it as unread"
            ));
        }
    }
    for f in &d.files_missing {
        if !c.files_missing.contains(f) {
            push(format!(
                "{f} is listed in trace.json but missing, and summary.json does not say so"
            ));
        }
    }
    if c.capture_complete && !d.capture_complete {
        push("summary.json says the capture closed cleanly, the evidence says it did not".into());
    }
    if d.no_kv_events && !c.no_kv_events {
        push("the trace holds no KV events, and summary.json does not say so".into());
    }
    if c.complete && (d.incomplete || hidden_holes) {
        push("summary.json calls the evidence complete, and it is not".into());
    }
}
