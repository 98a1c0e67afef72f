//! Replay input: plans the merge of the kv files into one seq-ordered stream
//! per pool, and collects the copies so their source states can be captured.
//!
//! A light index pass (projected columns: pool, seq, slot_count, src_*)
//! finds, per file and pool, whether the rows are sorted by seq. Sorted runs
//! are merged straight from their files (opened lazily, in seq order, so
//! part files that follow each other are read one at a time). Unsorted runs
//! are sorted externally: cut into chunks of bounded size, each sorted and
//! spilled to a temporary directory, then merged like the others. Memory is
//! bounded by the chunk size and the number of runs open at once, never by
//! the trace. A file that holds many pools is split once (each pool's rows
//! copied to a file of their own) instead of being decoded once per pool.
//! The streams share the plan's file list and deployment (no copy per
//! pool), so thousands of pools cost time linear in their count.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rayon::prelude::*;

use super::copies::{CopyReq, CopySpiller, temp_dir};
use crate::error::{Error, Result};
use crate::schema::{CopySrc, KvEvent, Op};
use crate::trace::check::{self, FileRuns};
use crate::trace::read::{KvFileReader, KvIndexBatch, Trace};
use crate::trace::{Deployment, TraceRoot};

/// Events per spilled chunk of an unsorted file (about 72 MB in memory).
pub const SPILL_CHUNK_EVENTS: usize = 1 << 20;
/// Events handed out per merged batch.
pub const MERGE_BATCH: usize = 16 * 1024;
/// A kv file holding more pools than this is split once into one file per
/// pool rather than decoded once per pool.
pub const SPLIT_POOLS: usize = 4;

/// An event with where it came from (for error messages).
#[derive(Debug, Clone, Copy)]
pub struct Ev {
    pub ev: KvEvent,
    pub file: u32,
    pub row: u64,
}

/// One seq-sorted run of one pool's events.
#[derive(Debug, Clone)]
pub struct RunSpec {
    pub pool: u16,
    pub min_seq: u64,
    pub max_seq: u64,
    pub rows: u64,
    pub source: RunSource,
}

#[derive(Debug, Clone)]
pub enum RunSource {
    /// The rows of `pool` in trace file number `file` (already sorted).
    File(u32),
    /// A sorted chunk spilled to disk.
    Spill(PathBuf),
    /// The rows (already sorted) of one pool of a many-pool file, copied
    /// to a file of their own in the spill format (not counted as spilled:
    /// nothing was sorted).
    Split(PathBuf),
}

/// The replay plan.
pub struct Plan {
    /// The kv files, shared by every pool's stream.
    pub files: Arc<[PathBuf]>,
    /// The deployment the files are checked against, shared likewise.
    pub deployment: Arc<Deployment>,
    /// Where the files are read from (the trace's root).
    pub root: TraceRoot,
    /// Runs per pool, sorted by min_seq.
    pub runs: BTreeMap<u16, Vec<RunSpec>>,
    /// Copies per source pool (streamed in src_seq order).
    pub copies: super::copies::CopyPlan,
    /// Pools in topological order of copies (sources first).
    pub order: Vec<u16>,
    /// (source pool, destination pool) of every kind of copy.
    pub edges: Vec<(u16, u16)>,
    pub total_events: u64,
    pub spilled_events: u64,
    /// Holds the spill files; removed when the plan is dropped.
    pub spill_dir: Option<tempfile::TempDir>,
}

/// Adds one batch's copies to the copy index.
fn push_copies(b: &KvIndexBatch, spiller: &std::sync::Mutex<CopySpiller>) -> Result<()> {
    if b.copies.is_empty() {
        return Ok(());
    }
    let mut sp = spiller
        .lock()
        .map_err(|_| Error::Other("replay: copy index lock poisoned".into()))?;
    for &(i, src, count) in &b.copies {
        let i = i as usize;
        sp.push(
            src.pool,
            CopyReq {
                src_seq: src.seq,
                dst_pool: b.pool[i],
                dst_seq: b.seq[i],
                src_start: src.slot_start,
                count,
            },
        )?;
    }
    Ok(())
}

pub use crate::trace::check::duplicate;

impl Plan {
    /// Indexes every kv file, spills unsorted runs, orders the pools.
    /// `chunk` bounds the events (external sort) and copies (copy index)
    /// held in memory before spilling.
    pub fn build(trace: &Trace, spill_root: Option<&Path>, chunk: Option<usize>) -> Result<Plan> {
        let files: Arc<[PathBuf]> = trace.kv_files.clone().into();
        let spiller = std::sync::Mutex::new(CopySpiller::new(
            spill_root,
            chunk.unwrap_or(super::copies::COPY_CHUNK),
        ));
        let indexes: Vec<FileRuns> = files
            .par_iter()
            .map(|f| check::scan_file(trace, f, |b| push_copies(b, &spiller)))
            .collect::<Result<Vec<_>>>()?;
        let copies = spiller
            .into_inner()
            .map_err(|_| Error::Other("replay: copy index lock poisoned".into()))?
            .finish();
        // The trace-wide rules (known pools, unique seqs, copies a DAG),
        // checked as verify and inspect check them.
        let checked = check::finish(trace, &indexes, spill_root, chunk)?;
        let mut runs: BTreeMap<u16, Vec<RunSpec>> = BTreeMap::new();
        let mut total = 0u64;
        // Per file, the pools to read into files of their own: (pool, sorted).
        let mut unsorted: Vec<(u32, Vec<(u16, bool)>)> = Vec::new();
        for (fi, idx) in indexes.iter().enumerate() {
            let mut uns = Vec::new();
            let split = idx.pools().count() > SPLIT_POOLS;
            for (pool, st) in idx.pools() {
                total += st.rows;
                if split {
                    uns.push((pool, st.sorted));
                } else if st.sorted {
                    runs.entry(pool).or_default().push(RunSpec {
                        pool,
                        min_seq: st.min,
                        max_seq: st.max,
                        rows: st.rows,
                        source: RunSource::File(fi as u32),
                    });
                } else {
                    uns.push((pool, false));
                }
            }
            if !uns.is_empty() {
                unsorted.push((fi as u32, uns));
            }
        }
        let mut spill_dir = None;
        let mut spilled = 0u64;
        if !unsorted.is_empty() {
            let dir = temp_dir(spill_root, "kvtrail-spill-")?;
            let mut n = 0usize;
            let limit = chunk.unwrap_or(SPILL_CHUNK_EVENTS).max(1);
            for (fi, pools) in &unsorted {
                spilled += spill_file(
                    trace,
                    &files,
                    *fi,
                    pools,
                    dir.path(),
                    &mut n,
                    limit,
                    &mut runs,
                )?;
            }
            spill_dir = Some(dir);
        }
        for v in runs.values_mut() {
            v.sort_by_key(|r| (r.min_seq, r.max_seq));
        }
        Ok(Plan {
            files,
            deployment: Arc::new(trace.manifest.deployment.clone()),
            root: trace.root.clone(),
            runs,
            copies,
            order: checked.order,
            edges: checked.edges.keys().copied().collect(),
            total_events: total,
            spilled_events: spilled,
            spill_dir,
        })
    }
}

const REC: usize = 72;

fn encode(e: &Ev, b: &mut [u8; REC]) {
    let v = &e.ev;
    b[0..2].copy_from_slice(&v.pool.to_le_bytes());
    b[2] = v.op as u8;
    b[3] = (v.token_pos.is_some() as u8) | ((v.src.is_some() as u8) << 1);
    b[4..8].copy_from_slice(&v.slot_start.to_le_bytes());
    b[8..12].copy_from_slice(&v.slot_count.to_le_bytes());
    b[12..16].copy_from_slice(&v.token_pos.unwrap_or(0).to_le_bytes());
    let src = v.src.unwrap_or(CopySrc {
        pool: 0,
        slot_start: 0,
        seq: 0,
    });
    b[16..18].copy_from_slice(&src.pool.to_le_bytes());
    b[18..20].copy_from_slice(&[0, 0]);
    b[20..24].copy_from_slice(&src.slot_start.to_le_bytes());
    b[24..32].copy_from_slice(&v.seq.to_le_bytes());
    b[32..40].copy_from_slice(&v.ts_ns.to_le_bytes());
    b[40..48].copy_from_slice(&v.request_id.to_le_bytes());
    b[48..56].copy_from_slice(&src.seq.to_le_bytes());
    b[56..60].copy_from_slice(&e.file.to_le_bytes());
    b[60..68].copy_from_slice(&e.row.to_le_bytes());
    b[68..72].copy_from_slice(&[0; 4]);
}

fn decode(b: &[u8]) -> Ev {
    let u16_ = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
    let u32_ = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
    let u64_ = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    let op = Op::ALL[b[2] as usize % Op::ALL.len()];
    Ev {
        ev: KvEvent {
            pool: u16_(0),
            seq: u64_(24),
            ts_ns: u64_(32) as i64,
            request_id: u64_(40),
            op,
            slot_start: u32_(4),
            slot_count: u32_(8),
            token_pos: (b[3] & 1 != 0).then(|| u32_(12)),
            src: (b[3] & 2 != 0).then(|| CopySrc {
                pool: u16_(16),
                slot_start: u32_(20),
                seq: u64_(48),
            }),
        },
        file: u32_(56),
        row: u64_(60),
    }
}

/// One pool's rows of a file being split.
struct SplitBuf {
    pool: u16,
    /// Rows already in seq order: appended to one file (one run).
    sorted: bool,
    buf: Vec<Ev>,
    /// The run file of a sorted pool, once created: (path, min, max, rows).
    run: Option<(PathBuf, u64, u64, u64)>,
}

/// Reads file `fi` once and writes the rows of each of `pools` to files
/// of their own under `dir`: a sorted pool's rows to one file (one run),
/// an unsorted pool's in sorted chunks (one run each). At most `limit`
/// events are held at once, over all pools (the largest buffer is written
/// out first). Returns the events sorted externally (the unsorted pools').
#[allow(clippy::too_many_arguments)]
fn spill_file(
    trace: &Trace,
    files: &[PathBuf],
    fi: u32,
    pools: &[(u16, bool)],
    dir: &Path,
    n: &mut usize,
    limit: usize,
    runs: &mut BTreeMap<u16, Vec<RunSpec>>,
) -> Result<u64> {
    let mut slot: HashMap<u16, usize> = HashMap::with_capacity(pools.len());
    let mut bufs: Vec<SplitBuf> = Vec::with_capacity(pools.len());
    for &(pool, sorted) in pools {
        slot.insert(pool, bufs.len());
        bufs.push(SplitBuf {
            pool,
            sorted,
            buf: Vec::new(),
            run: None,
        });
    }
    let mut spilled = 0u64;
    let mut held = 0usize;
    let mut flush = |b: &mut SplitBuf, n: &mut usize| -> Result<()> {
        if b.buf.is_empty() {
            return Ok(());
        }
        let (path, append) = match (&b.run, b.sorted) {
            (Some((p, ..)), true) => (p.clone(), true),
            _ => {
                let p = dir.join(format!("run-{:06}.bin", *n));
                *n += 1;
                (p, false)
            }
        };
        if !b.sorted {
            b.buf.sort_by_key(|e| e.ev.seq);
        }
        let f = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(&path)
            .map_err(|e| Error::io(&path, e))?;
        let mut w = BufWriter::with_capacity(1 << 16, f);
        let mut rec = [0u8; REC];
        for e in b.buf.iter() {
            encode(e, &mut rec);
            w.write_all(&rec).map_err(|e| Error::io(&path, e))?;
        }
        w.flush().map_err(|e| Error::io(&path, e))?;
        let (lo, hi, rows) = (
            b.buf[0].ev.seq,
            b.buf[b.buf.len() - 1].ev.seq,
            b.buf.len() as u64,
        );
        if b.sorted {
            match &mut b.run {
                Some((_, _, max, r)) => {
                    *max = hi;
                    *r += rows;
                }
                None => b.run = Some((path, lo, hi, rows)),
            }
        } else {
            runs.entry(b.pool).or_default().push(RunSpec {
                pool: b.pool,
                min_seq: lo,
                max_seq: hi,
                rows,
                source: RunSource::Spill(path),
            });
            spilled += rows;
        }
        b.buf.clear();
        Ok(())
    };
    for chunk in trace.kv_file(&files[fi as usize])? {
        let chunk = chunk?;
        for (i, ev) in chunk.events.iter().enumerate() {
            if let Some(&k) = slot.get(&ev.pool) {
                bufs[k].buf.push(Ev {
                    ev: *ev,
                    file: fi,
                    row: chunk.first_row + i as u64,
                });
                held += 1;
                if held >= limit {
                    let big = (0..bufs.len())
                        .max_by_key(|&j| bufs[j].buf.len())
                        .expect("a pool");
                    held -= bufs[big].buf.len();
                    flush(&mut bufs[big], n)?;
                }
            }
        }
    }
    bufs.sort_by_key(|b| b.pool);
    for b in &mut bufs {
        flush(b, n)?;
    }
    for b in bufs {
        if let Some((path, min_seq, max_seq, rows)) = b.run {
            runs.entry(b.pool).or_default().push(RunSpec {
                pool: b.pool,
                min_seq,
                max_seq,
                rows,
                source: RunSource::Split(path),
            });
        }
    }
    Ok(spilled)
}

/// An open run: yields its events in batches.
enum OpenRun {
    File {
        pool: u16,
        fi: u32,
        reader: KvFileReader,
    },
    Spill {
        path: PathBuf,
        reader: BufReader<File>,
    },
}

impl OpenRun {
    fn open(
        spec: &RunSpec,
        root: &TraceRoot,
        deployment: &Deployment,
        files: &[PathBuf],
    ) -> Result<OpenRun> {
        Ok(match &spec.source {
            RunSource::File(fi) => OpenRun::File {
                pool: spec.pool,
                fi: *fi,
                reader: KvFileReader::open(root, &files[*fi as usize], deployment)?,
            },
            RunSource::Spill(p) | RunSource::Split(p) => OpenRun::Spill {
                path: p.clone(),
                reader: BufReader::with_capacity(
                    1 << 20,
                    File::open(p).map_err(|e| Error::io(p, e))?,
                ),
            },
        })
    }

    /// Next non-empty batch, or an empty one at the end.
    fn next_batch(&mut self, out: &mut Batch) -> Result<()> {
        out.events.clear();
        out.locs.clear();
        match self {
            OpenRun::File { pool, fi, reader } => {
                while let Some(chunk) = reader.next() {
                    let chunk = chunk?;
                    let r0 = chunk.first_row;
                    if chunk.events.iter().all(|e| e.pool == *pool) {
                        // the usual layout (one pool per file): no filtering
                        out.locs
                            .extend((0..chunk.events.len() as u64).map(|i| (*fi, r0 + i)));
                        let used = std::mem::replace(&mut out.events, chunk.events);
                        reader.recycle(used);
                    } else {
                        for (i, e) in chunk.events.iter().enumerate() {
                            if e.pool == *pool {
                                out.events.push(*e);
                                out.locs.push((*fi, r0 + i as u64));
                            }
                        }
                        reader.recycle(chunk.events);
                    }
                    if !out.events.is_empty() {
                        break;
                    }
                }
            }
            OpenRun::Spill { path, reader } => {
                let mut rec = [0u8; REC];
                while out.events.len() < MERGE_BATCH {
                    match reader.read_exact(&mut rec) {
                        Ok(()) => {
                            let e = decode(&rec);
                            out.events.push(e.ev);
                            out.locs.push((e.file, e.row));
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
                        Err(e) => return Err(Error::io(path, e)),
                    }
                }
            }
        }
        Ok(())
    }
}

struct Active {
    run: OpenRun,
    buf: Batch,
    pos: usize,
}

impl Active {
    fn head(&self) -> u64 {
        self.buf.events[self.pos].seq
    }
}

/// The merge state of one pool: a lazy k-way merge of its runs.
struct Merge {
    root: TraceRoot,
    deployment: Arc<Deployment>,
    files: Arc<[PathBuf]>,
    pending: std::collections::VecDeque<RunSpec>,
    active: Vec<Active>,
}

/// Batches decoded ahead per pool (bounds the prefetch memory).
const PREFETCH_BATCHES: usize = 2;

/// The seq-ordered stream of one pool. Decoding and merging run on their
/// own thread, a few batches ahead of the replay (so Parquet decoding
/// overlaps the slot work); the batches are the same either way.
/// A batch of one pool's events in seq order, with where each came from.
#[derive(Debug, Default)]
pub struct Batch {
    pub events: Vec<KvEvent>,
    /// (file number, row) per event.
    pub locs: Vec<(u32, u64)>,
}

pub struct PoolStream {
    rx: Option<std::sync::mpsc::Receiver<Result<Batch>>>,
    /// Used batches go back to the reader thread for reuse (no allocation
    /// per batch, no frees across threads).
    recycle: std::sync::mpsc::SyncSender<Batch>,
    thread: Option<std::thread::JoinHandle<()>>,
    done: bool,
}

impl PoolStream {
    /// The stream of `runs` (one pool's, from `plan`).
    pub fn new(plan: &Plan, runs: Vec<RunSpec>) -> PoolStream {
        let mut m = Merge {
            root: plan.root.clone(),
            deployment: Arc::clone(&plan.deployment),
            files: Arc::clone(&plan.files),
            pending: runs.into(),
            active: Vec::new(),
        };
        let (tx, rx) = std::sync::mpsc::sync_channel(PREFETCH_BATCHES);
        let (recycle, reuse) = std::sync::mpsc::sync_channel::<Batch>(PREFETCH_BATCHES + 2);
        let thread = std::thread::spawn(move || {
            loop {
                let mut b = reuse.try_recv().unwrap_or_default();
                let res = m.next_batch(&mut b).map(|()| b);
                let end = res.as_ref().map_or(true, |b| b.events.is_empty());
                if tx.send(res).is_err() || end {
                    return;
                }
            }
        });
        PoolStream {
            rx: Some(rx),
            recycle,
            thread: Some(thread),
            done: false,
        }
    }

    /// Hands a used batch back for reuse.
    pub fn recycle(&self, b: Batch) {
        let _ = self.recycle.try_send(b);
    }

    /// The next events in seq order; an empty batch at the end.
    pub fn next_batch(&mut self) -> Result<Batch> {
        if self.done {
            return Ok(Batch::default());
        }
        let got = self.rx.as_ref().and_then(|rx| rx.recv().ok());
        match got {
            Some(Ok(b)) => {
                if b.events.is_empty() {
                    self.done = true;
                }
                Ok(b)
            }
            Some(Err(e)) => {
                self.done = true;
                Err(e)
            }
            None => {
                self.done = true;
                Err(Error::Other(
                    "replay: the reader thread of a pool stopped".into(),
                ))
            }
        }
    }
}

impl Drop for PoolStream {
    fn drop(&mut self) {
        self.rx.take(); // unblocks the thread's send
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Merge {
    /// Fills `out` with the next events in seq order (at most
    /// `MERGE_BATCH`); empty at the end of the stream.
    fn next_batch(&mut self, out: &mut Batch) -> Result<()> {
        out.events.clear();
        out.locs.clear();
        while out.events.len() < MERGE_BATCH {
            // Admit runs that start before every active head.
            let head_min = self.active.iter().map(Active::head).min();
            while let Some(r) = self.pending.front() {
                if head_min.is_some_and(|h| r.min_seq > h) {
                    break;
                }
                let spec = self.pending.pop_front().expect("front");
                let mut run = OpenRun::open(&spec, &self.root, &self.deployment, &self.files)?;
                let mut buf = Batch::default();
                run.next_batch(&mut buf)?;
                if !buf.events.is_empty() {
                    self.active.push(Active { run, buf, pos: 0 });
                }
                if head_min.is_none() {
                    break;
                }
            }
            if self.active.is_empty() {
                if self.pending.is_empty() {
                    break;
                }
                continue;
            }
            // The active run with the smallest head, and the bound it may run to.
            let mut best = 0;
            for i in 1..self.active.len() {
                let (a, b) = (&self.active[i], &self.active[best]);
                if a.head() < b.head() {
                    best = i;
                }
            }
            let mut bound = self.pending.front().map(|r| r.min_seq).unwrap_or(u64::MAX);
            for (i, a) in self.active.iter().enumerate() {
                if i != best {
                    bound = bound.min(a.head());
                }
            }
            let a = &mut self.active[best];
            let ev = &a.buf.events;
            let len = ev.len();
            if out.events.is_empty() && a.pos == 0 && ev[len - 1].seq < bound {
                // The whole buffered batch goes out as it is (one run, or
                // runs that do not overlap): hand it over without copying.
                std::mem::swap(out, &mut a.buf);
                a.buf.events.clear();
                a.buf.locs.clear();
                a.pos = 0; // empty: refilled below
            } else {
                let room = MERGE_BATCH.saturating_sub(out.events.len()).max(1);
                let mut end = a.pos + 1; // at least one event (ties: one each)
                while end < len && end - a.pos < room && ev[end].seq < bound {
                    end += 1;
                }
                out.events.extend_from_slice(&ev[a.pos..end]);
                out.locs.extend_from_slice(&a.buf.locs[a.pos..end]);
                a.pos = end;
            }
            if a.pos == a.buf.events.len() {
                a.run.next_batch(&mut a.buf)?;
                a.pos = 0;
                if a.buf.events.is_empty() {
                    self.active.swap_remove(best);
                }
            }
        }
        Ok(())
    }
}
