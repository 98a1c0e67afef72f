//! Writing seals. [`Sealer`] runs on its own thread beside a trace's
//! writer: the writer hands it, at each interval, what it has written
//! ([`SealJob`]: the files completed so far, the open part files flushed
//! to a row-group boundary, the pools' counts) and goes on at once. The
//! sealer reads the new bytes back, once each (each open part keeps a
//! running sha256 and blake3, so a file is read once however many seals
//! cover it), writes the seal and signs it. [`seal_trace`] seals a
//! finished trace in one final seal (the offline writers, `ingest` and
//! `simulate`).

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Sender, channel};
use std::thread::JoinHandle;

use sha2::Digest;

use super::format::{Digests, PoolSeal, SEAL_FORMAT, Seal, SealedFile, SealedPart, Window};
use super::format::{NAMESPACE, SEALS_DIR, hex, new_capture_id, seal_name, sha256_hex};
use crate::custody::keys::SigningKey;
use crate::custody::private::{create_private_dir, write_private_atomic};
use crate::error::{Error, Location, Result};
use crate::trace::manifest::{FileEntry, Manifest};
use crate::trace::write::OpenPartState;

/// One pool's counts at a seal (the offline writers know the events only).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolCounts {
    pub pool: u16,
    pub events: u64,
    pub next_seq: Option<u64>,
    pub lost: Option<u64>,
    pub holes: Option<u64>,
}

/// What the writer has written when it asks for a seal.
#[derive(Debug, Clone, Default)]
pub struct SealJob {
    /// The window's end (ns since the epoch).
    pub at_ns: i64,
    /// Every data file completed so far (the sealer seals the new ones).
    pub files: Vec<FileEntry>,
    pub open: Vec<OpenPartState>,
    pub pools: Vec<PoolCounts>,
    pub connections: Option<BTreeMap<String, u64>>,
}

/// A running sha256 and blake3 over a file's first `offset` bytes.
#[derive(Clone)]
struct Running {
    offset: u64,
    sha: sha2::Sha256,
    b3: blake3::Hasher,
    row_groups: u64,
}

impl Running {
    fn new() -> Running {
        Running {
            offset: 0,
            sha: sha2::Sha256::new(),
            b3: blake3::Hasher::new(),
            row_groups: 0,
        }
    }

    /// Reads `path` from `offset` up to `to` bytes (to its end when None).
    fn read_to(&mut self, path: &Path, to: Option<u64>) -> Result<()> {
        let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        f.seek(SeekFrom::Start(self.offset))
            .map_err(|e| Error::io(path, e))?;
        let mut left = to.map(|t| t.saturating_sub(self.offset));
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let want = left.map_or(buf.len(), |l| (l as usize).min(buf.len()));
            if want == 0 {
                break;
            }
            let n = f.read(&mut buf[..want]).map_err(|e| Error::io(path, e))?;
            if n == 0 {
                if left.is_some_and(|l| l > 0) {
                    return Err(Error::invalid(
                        Location::file(path),
                        format!(
                            "shorter than the {} bytes written to it",
                            to.unwrap_or_default()
                        ),
                        "something else truncated a trace file while it was recorded",
                    ));
                }
                break;
            }
            self.sha.update(&buf[..n]);
            self.b3.update(&buf[..n]);
            self.offset += n as u64;
            if let Some(l) = &mut left {
                *l -= n as u64;
            }
        }
        Ok(())
    }

    fn digests(&self) -> (String, String) {
        (
            hex(&self.sha.clone().finalize()),
            self.b3.finalize().to_hex().to_string(),
        )
    }
}

/// What the sealing thread keeps between seals.
struct State {
    dir: PathBuf,
    key: Arc<SigningKey>,
    capture_id: String,
    writer: String,
    index: u64,
    previous: Option<String>,
    from_ns: i64,
    /// Open parts (by final path): what earlier seals covered.
    parts: HashMap<String, Running>,
    /// Completed files sealed: their blake3 as written.
    sealed: HashMap<String, String>,
    /// Per pool: (events, next seq) at the last seal.
    pools: HashMap<u16, (u64, u64)>,
}

impl State {
    fn new(dir: &Path, key: Arc<SigningKey>, writer: &str, started_ns: i64) -> Result<State> {
        let seals = dir.join(SEALS_DIR);
        if seals.exists() {
            return Err(Error::invalid(
                Location::file(&seals),
                "the trace is sealed already",
                "a trace is sealed once, by the writer that wrote it",
            ));
        }
        create_private_dir(&seals)?;
        Ok(State {
            dir: dir.to_path_buf(),
            key,
            capture_id: new_capture_id(),
            writer: writer.into(),
            index: 0,
            previous: None,
            from_ns: started_ns,
            parts: HashMap::new(),
            sealed: HashMap::new(),
            pools: HashMap::new(),
        })
    }

    /// A completed file: continues its running digests (or starts over
    /// when it was rewritten) to its end.
    fn file(&mut self, f: &FileEntry, problems: &mut Vec<String>) -> Result<SealedFile> {
        let path = self.dir.join(&f.path);
        let rewritten = self.sealed.contains_key(&f.path);
        let mut run = match self.parts.remove(&f.path) {
            Some(r) if !rewritten => r,
            _ => Running::new(),
        };
        let bytes_from = run.offset;
        run.read_to(&path, None)?;
        let mut rewritten = rewritten;
        if run.b3.finalize().to_hex().as_str() != f.blake3 && bytes_from > 0 {
            // Rewritten after a seal covered its first bytes.
            run = Running::new();
            run.read_to(&path, None)?;
            rewritten = true;
        }
        let (sha256, blake3) = run.digests();
        if blake3 != f.blake3 {
            problems.push(format!(
                "{} does not match the digest it was written with (written {}, read back {blake3})",
                f.path, f.blake3
            ));
        }
        self.sealed.insert(f.path.clone(), f.blake3.clone());
        Ok(SealedFile {
            path: f.path.clone(),
            rows: f.rows,
            bytes: run.offset,
            bytes_from: if rewritten { 0 } else { bytes_from },
            sha256,
            blake3,
            rewritten,
        })
    }

    /// An open part: its running digests carried to `p.bytes`.
    fn part(&mut self, p: &OpenPartState) -> Result<SealedPart> {
        let run = self
            .parts
            .entry(p.path.clone())
            .or_insert_with(Running::new);
        let bytes_from = run.offset;
        let row_groups_from = run.row_groups;
        if p.bytes > run.offset {
            // Renamed once finished: the same bytes under the final name.
            let at = if p.writing.exists() {
                p.writing.clone()
            } else {
                self.dir.join(&p.path)
            };
            run.read_to(&at, Some(p.bytes))?;
        }
        run.row_groups = p.row_groups as u64;
        let (sha256, blake3) = run.digests();
        Ok(SealedPart {
            path: p.path.clone(),
            rows: p.rows,
            row_groups: p.row_groups as u64,
            row_groups_from,
            bytes: run.offset,
            bytes_from,
            sha256,
            blake3,
        })
    }

    /// Writes the next seal over `job`.
    fn seal(&mut self, job: &SealJob, last: bool) -> Result<()> {
        let mut problems = Vec::new();
        let mut files = Vec::new();
        let mut todo: Vec<&FileEntry> = job
            .files
            .iter()
            .filter(|f| self.sealed.get(&f.path) != Some(&f.blake3))
            .collect();
        todo.sort_by(|a, b| a.path.cmp(&b.path));
        for f in todo {
            files.push(self.file(f, &mut problems)?);
        }
        let mut open_parts = Vec::new();
        for p in &job.open {
            open_parts.push(self.part(p)?);
        }
        open_parts.sort_by(|a, b| a.path.cmp(&b.path));
        let mut pools = Vec::new();
        for c in &job.pools {
            let (events0, seq0) = self.pools.get(&c.pool).copied().unwrap_or((0, 0));
            pools.push(PoolSeal {
                pool: c.pool,
                events: c.events,
                events_in_window: c.events.saturating_sub(events0),
                seq_from: c.next_seq.map(|_| seq0),
                seq_to: c.next_seq,
                lost_events: c.lost,
                holes: c.holes,
            });
            self.pools
                .insert(c.pool, (c.events, c.next_seq.unwrap_or_default()));
        }
        pools.sort_by_key(|p| p.pool);
        let sum = |f: fn(&PoolCounts) -> Option<u64>| -> Option<u64> {
            job.pools.iter().map(f).sum::<Option<u64>>()
        };
        let trace_json = if last {
            let p = self.dir.join("trace.json");
            let mut r = Running::new();
            r.read_to(&p, None)?;
            let (sha256, blake3) = r.digests();
            Some(Digests {
                bytes: r.offset,
                sha256,
                blake3,
            })
        } else {
            None
        };
        let to_ns = job.at_ns.max(self.from_ns);
        let seal = Seal {
            format: SEAL_FORMAT.into(),
            version: 1,
            capture_id: self.capture_id.clone(),
            index: self.index,
            last,
            window: Window {
                from_ns: self.from_ns,
                to_ns,
            },
            previous_sha256: self.previous.clone(),
            signer: self.key.fingerprint(),
            writer: self.writer.clone(),
            files,
            open_parts,
            pools,
            lost_events: sum(|c| c.lost),
            holes: sum(|c| c.holes),
            connections: job.connections.clone(),
            trace_json,
            problems,
        };
        let mut text = serde_json::to_string_pretty(&seal).expect("a seal serializes");
        text.push('\n');
        let sig = self.key.sign(NAMESPACE, text.as_bytes())?;
        let p = self.dir.join(SEALS_DIR).join(seal_name(self.index));
        write_private_atomic(&p, text.as_bytes())?;
        let mut s = p.into_os_string();
        s.push(".sig");
        write_private_atomic(Path::new(&s), sig.as_bytes())?;
        self.previous = Some(sha256_hex(text.as_bytes()));
        self.index += 1;
        self.from_ns = to_ns;
        Ok(())
    }
}

enum Msg {
    Seal(SealJob),
    Final(SealJob),
}

/// The sealing thread of one trace. [`Sealer::seal`] never waits;
/// [`Sealer::finish`] writes the final seal and says how many were
/// written, or the error that stopped the thread.
pub struct Sealer {
    tx: Sender<Msg>,
    handle: JoinHandle<Result<Sealed>>,
    capture_id: String,
}

/// What a sealing thread did: the seals written (the final one included)
/// and the CPU time it used (user and system), which is what sealing
/// costs a capture beside the writer's hand-over.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Sealed {
    pub seals: u64,
    pub cpu_s: f64,
}

/// CPU time (user and system) the calling thread has used, in seconds.
#[cfg(unix)]
pub fn thread_cpu_s() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the struct it is given.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } != 0 {
        return 0.0;
    }
    t.tv_sec as f64 + t.tv_nsec as f64 / 1e9
}

/// CPU time the calling thread has used: not measured here (0).
#[cfg(not(unix))]
pub fn thread_cpu_s() -> f64 {
    0.0
}

impl Sealer {
    /// Creates `seals/` in the trace `dir` and starts the thread; seal 0's
    /// window starts at `started_ns`.
    pub fn start(
        dir: &Path,
        key: Arc<SigningKey>,
        writer: &str,
        started_ns: i64,
    ) -> Result<Sealer> {
        let mut st = State::new(dir, key, writer, started_ns)?;
        let capture_id = st.capture_id.clone();
        let (tx, rx) = channel::<Msg>();
        let handle = std::thread::Builder::new()
            .name("kvtrail-sealer".into())
            .spawn(move || -> Result<Sealed> {
                while let Ok(m) = rx.recv() {
                    match m {
                        Msg::Seal(job) => st.seal(&job, false)?,
                        Msg::Final(job) => {
                            st.seal(&job, true)?;
                            break;
                        }
                    }
                }
                Ok(Sealed {
                    seals: st.index,
                    cpu_s: thread_cpu_s(),
                })
            })
            .map_err(|e| Error::Other(format!("cannot start the sealing thread: {e}")))?;
        Ok(Sealer {
            tx,
            handle,
            capture_id,
        })
    }

    /// The capture id every seal names.
    pub fn capture_id(&self) -> &str {
        &self.capture_id
    }

    /// Queues a seal; false when the thread has stopped (its error is what
    /// [`Sealer::finish`] returns).
    pub fn seal(&self, job: SealJob) -> bool {
        self.tx.send(Msg::Seal(job)).is_ok() && !self.handle.is_finished()
    }

    /// Writes the final seal over `job` (the trace closed) and waits for
    /// the thread.
    pub fn finish(self, job: SealJob) -> Result<Sealed> {
        let _ = self.tx.send(Msg::Final(job));
        drop(self.tx);
        self.handle
            .join()
            .unwrap_or_else(|_| Err(Error::Other("the sealing thread panicked".into())))
    }
}

/// Seals a finished trace in one final seal covering every file (the
/// offline writers). Returns the capture id.
pub fn seal_trace(dir: &Path, key: Arc<SigningKey>, writer: &str) -> Result<String> {
    let m = Manifest::load(dir)?;
    let files = m.files.clone().unwrap_or_default();
    let pools = m
        .deployment
        .pools
        .iter()
        .map(|p| {
            let prefix = format!("kv/pool={}/", p.id);
            PoolCounts {
                pool: p.id,
                events: files
                    .iter()
                    .filter(|f| f.path.starts_with(&prefix))
                    .map(|f| f.rows)
                    .sum(),
                ..Default::default()
            }
        })
        .collect();
    let mut st = State::new(dir, key, writer, m.capture.started_ns)?;
    let job = SealJob {
        at_ns: wall_ns().max(m.capture.ended_ns),
        files,
        open: Vec::new(),
        pools,
        connections: None,
    };
    st.seal(&job, true)?;
    Ok(st.capture_id)
}

/// Now, in ns since the epoch.
pub fn wall_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}
