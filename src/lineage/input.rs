//! Replay input: plans the merge of the kv files into one seq-ordered stream
//! per pool, and collects the copies so their source states can be captured.
//!
//! A light index pass (projected columns: pool, seq, slot_count, src_*)
//! finds, per file and pool, whether the rows are sorted by seq. Sorted runs
//! are merged straight from their files (opened lazily, in seq order, so
//! part files that follow each other are read one at a time). Unsorted runs
//! are sorted externally: cut into chunks of bounded size, each sorted and
//! spilled (`crate::spill`), then merged like the others. Memory is
//! bounded by the chunk size and the number of runs open at once, never by
//! the trace. A file that holds many pools is split once (each pool's rows
//! copied to a file of their own) instead of being decoded once per pool.
//! The streams share the plan's file list and deployment (no copy per
//! pool), so thousands of pools cost time linear in their count.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rayon::prelude::*;

use super::ahead::{Ahead, Decoder};
use super::copies::{CopyReq, CopySpiller};
pub use super::shared_read::Batch;
use super::shared_read::{Next, QUEUE_EVENTS, SharedFile};
use crate::error::{Error, Result};
use crate::schema::{CopySrc, KvEvent, Op};
use crate::spill::{Place, Record, Run, RunReader, le};
use crate::trace::check::{self, FileRuns};
use crate::trace::read::{KvScanBatch, Trace};
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
    Spill(Run<Ev>),
    /// Rows (already sorted) of one pool of a many-pool file, copied to a
    /// run of their own (not counted as spilled: nothing was sorted).
    Split(Run<Ev>),
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
    pub spill: Option<Place>,
    /// Files of a few pools each, decoded once for all of them
    /// (`shared_read`).
    shared: std::sync::Mutex<SharedReads>,
    /// The first kv file's rows decoded while this plan was built, for
    /// its first reader (`ahead`).
    pub ahead: Ahead,
}

/// The shared decodes of a replay: per (file, copy-connected group), the
/// decode its pools share (None: one pool of the group reads the file).
/// Only pools of one group share: a group replays on one scheduler or
/// each of its pools on a thread of its own, all at once, while groups
/// may replay one after another on one thread (a pool that would wait
/// for a later group's stream gains nothing from sharing).
#[derive(Default)]
struct SharedReads {
    group_of: Option<HashMap<u16, usize>>,
    files: HashMap<(u32, usize), Option<Arc<SharedFile>>>,
}

/// Adds one batch's copies to the copy index.
fn push_copies(b: &KvScanBatch, spiller: &std::sync::Mutex<CopySpiller>) -> Result<()> {
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
        let new_spiller = || {
            std::sync::Mutex::new(CopySpiller::new(
                spill_root,
                chunk.unwrap_or(super::copies::COPY_CHUNK),
            ))
        };
        // With more threads than files, each file is read in parts at once
        // (a PD trace's one kv file on every core); a part that meets an
        // error leaves the error to a pass over whole files.
        let parts = rayon::current_num_threads() / files.len().max(1);
        let mut spiller = new_spiller();
        let mut indexes: Option<Vec<FileRuns>> = None;
        if parts > 1 {
            indexes = files
                .par_iter()
                .map(|f| check::scan_file_split(trace, f, parts, |b| push_copies(b, &spiller)))
                .collect::<Result<Option<Vec<_>>>>()?;
        }
        let indexes: Vec<FileRuns> = match indexes {
            Some(i) => i,
            None => {
                spiller = new_spiller();
                files
                    .par_iter()
                    .map(|f| check::scan_file(trace, f, |b| push_copies(b, &spiller)))
                    .collect::<Result<Vec<_>>>()?
            }
        };
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
        let mut spill = None;
        let mut spilled = 0u64;
        if !unsorted.is_empty() {
            // named: runs may be many (a pool per run of a many-pool
            // file); a run holds no file open until it is streamed
            let mut place = Place::named(spill_root, "kvtrail-spill-");
            let limit = chunk.unwrap_or(SPILL_CHUNK_EVENTS).max(1);
            for (fi, pools) in &unsorted {
                spilled += spill_file(trace, &files, *fi, pools, &mut place, limit, &mut runs)?;
            }
            spill = Some(place);
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
            spill,
            shared: Default::default(),
            ahead: Ahead::default(),
        })
    }

    /// Whether some pool's stream reads kv file `fi` straight from the
    /// file (not a spilled or split copy of its rows).
    pub fn reads_file(&self, fi: u32) -> bool {
        self.runs
            .values()
            .flatten()
            .any(|r| matches!(r.source, RunSource::File(f) if f == fi))
    }

    /// The shared decode of file `fi` for `pool`'s stream, when the file
    /// holds sorted runs of several replayed pools and `pool` has not
    /// read from it yet (`SharedFile::claim`); else None: a reader of its
    /// own.
    fn shared_file(&self, fi: u32, pool: u16) -> Option<Arc<SharedFile>> {
        let mut m = self.shared.lock().ok()?;
        let m = &mut *m;
        let group_of = m.group_of.get_or_insert_with(|| {
            groups(self)
                .into_iter()
                .enumerate()
                .flat_map(|(g, pools)| pools.into_iter().map(move |p| (p, g)))
                .collect()
        });
        let group = *group_of.get(&pool)?;
        let sf = m.files.entry((fi, group)).or_insert_with(|| {
            let pools: Vec<u16> = self
                .runs
                .iter()
                .filter(|(p, v)| {
                    group_of.get(p) == Some(&group)
                        && v.iter()
                            .any(|r| matches!(r.source, RunSource::File(f) if f == fi))
                })
                .map(|(&p, _)| p)
                .collect();
            (pools.len() > 1).then(|| {
                Arc::new(
                    SharedFile::new(
                        fi,
                        self.files[fi as usize].clone(),
                        self.root.clone(),
                        Arc::clone(&self.deployment),
                        &pools,
                        QUEUE_EVENTS,
                    )
                    .with_ahead(self.ahead.clone()),
                )
            })
        });
        sf.as_ref().filter(|s| s.claim(pool)).cloned()
    }
}

impl Record for Ev {
    const SIZE: usize = 72;
    fn put(&self, b: &mut [u8]) {
        let v = &self.ev;
        le::put_u16(b, 0, v.pool);
        b[2] = v.op as u8;
        b[3] = (v.token_pos.is_some() as u8) | ((v.src.is_some() as u8) << 1);
        le::put_u32(b, 4, v.slot_start);
        le::put_u32(b, 8, v.slot_count);
        le::put_u32(b, 12, v.token_pos.unwrap_or(0));
        let src = v.src.unwrap_or(CopySrc {
            pool: 0,
            slot_start: 0,
            seq: 0,
        });
        le::put_u16(b, 16, src.pool);
        b[18..20].fill(0);
        le::put_u32(b, 20, src.slot_start);
        le::put_u64(b, 24, v.seq);
        le::put_u64(b, 32, v.ts_ns as u64);
        le::put_u64(b, 40, v.request_id);
        le::put_u64(b, 48, src.seq);
        le::put_u32(b, 56, self.file);
        le::put_u64(b, 60, self.row);
        b[68..72].fill(0);
    }

    fn get(b: &[u8]) -> Ev {
        let op = Op::ALL[b[2] as usize % Op::ALL.len()];
        Ev {
            ev: KvEvent {
                pool: le::u16_at(b, 0),
                seq: le::u64_at(b, 24),
                ts_ns: le::u64_at(b, 32) as i64,
                request_id: le::u64_at(b, 40),
                op,
                slot_start: le::u32_at(b, 4),
                slot_count: le::u32_at(b, 8),
                token_pos: (b[3] & 1 != 0).then(|| le::u32_at(b, 12)),
                src: (b[3] & 2 != 0).then(|| CopySrc {
                    pool: le::u16_at(b, 16),
                    slot_start: le::u32_at(b, 20),
                    seq: le::u64_at(b, 48),
                }),
            },
            file: le::u32_at(b, 56),
            row: le::u64_at(b, 60),
        }
    }
}

/// One pool's rows of a file being split.
struct SplitBuf {
    pool: u16,
    /// Rows already in seq order: each flush is a run that follows the
    /// last (copied, not counted as spilled).
    sorted: bool,
    buf: Vec<Ev>,
}

/// Reads file `fi` once and writes the rows of each of `pools` to runs of
/// their own at `place`: a sorted pool's rows as they come, an unsorted
/// pool's in sorted chunks. At most `limit` events are held at once, over
/// all pools (the largest buffer is written out first). Returns the
/// events sorted externally (the unsorted pools').
fn spill_file(
    trace: &Trace,
    files: &[PathBuf],
    fi: u32,
    pools: &[(u16, bool)],
    place: &mut Place,
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
        });
    }
    let mut spilled = 0u64;
    let mut held = 0usize;
    let mut flush = |b: &mut SplitBuf| -> Result<()> {
        if b.buf.is_empty() {
            return Ok(());
        }
        if !b.sorted {
            b.buf.sort_by_key(|e| e.ev.seq);
        }
        let (min_seq, max_seq, rows) = (
            b.buf[0].ev.seq,
            b.buf[b.buf.len() - 1].ev.seq,
            b.buf.len() as u64,
        );
        let run = Run::write(place, b.buf.drain(..))?;
        let source = if b.sorted {
            RunSource::Split(run)
        } else {
            spilled += rows;
            RunSource::Spill(run)
        };
        runs.entry(b.pool).or_default().push(RunSpec {
            pool: b.pool,
            min_seq,
            max_seq,
            rows,
            source,
        });
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
                    flush(&mut bufs[big])?;
                }
            }
        }
    }
    bufs.sort_by_key(|b| b.pool);
    for b in &mut bufs {
        flush(b)?;
    }
    Ok(spilled)
}

/// An open run: yields its events in batches.
enum OpenRun {
    File {
        pool: u16,
        fi: u32,
        reader: Box<Decoder>,
        /// Rows before this one were read elsewhere (a pool detached from
        /// a shared decode).
        skip: u64,
    },
    /// Rows from a decode shared with the file's other pools.
    Shared {
        pool: u16,
        fi: u32,
        file: Arc<SharedFile>,
    },
    Spill(RunReader<Ev>),
}

impl OpenRun {
    fn open(
        spec: &RunSpec,
        root: &TraceRoot,
        deployment: &Deployment,
        files: &[PathBuf],
        shared: &HashMap<u32, Arc<SharedFile>>,
        ahead: &Ahead,
    ) -> Result<OpenRun> {
        Ok(match &spec.source {
            RunSource::File(fi) => match shared.get(fi) {
                Some(file) => OpenRun::Shared {
                    pool: spec.pool,
                    fi: *fi,
                    file: Arc::clone(file),
                },
                None => OpenRun::File {
                    pool: spec.pool,
                    fi: *fi,
                    reader: Box::new(ahead.open(*fi, root, &files[*fi as usize], deployment)?),
                    skip: 0,
                },
            },
            RunSource::Spill(r) | RunSource::Split(r) => OpenRun::Spill(r.reader()?),
        })
    }

    /// Next non-empty batch, or an empty one at the end.
    fn next_batch(&mut self, out: &mut Batch) -> Result<()> {
        out.events.clear();
        out.locs.clear();
        match self {
            OpenRun::Shared { pool, fi, file } => match file.next(*pool, out)? {
                Next::Rows => {}
                Next::End => {
                    out.events.clear();
                    out.locs.clear();
                }
                Next::Detached(skip) => {
                    *self = OpenRun::File {
                        pool: *pool,
                        fi: *fi,
                        reader: Box::new(Decoder::fresh(file.own_reader()?)),
                        skip,
                    };
                    return self.next_batch(out);
                }
            },
            OpenRun::File {
                pool,
                fi,
                reader,
                skip,
            } => {
                while let Some(chunk) = reader.next_chunk() {
                    let chunk = chunk?;
                    let r0 = chunk.first_row;
                    let n = chunk.events.len() as u64;
                    if r0 + n <= *skip {
                        reader.recycle(chunk.events);
                        continue;
                    }
                    if r0 >= *skip && chunk.events.iter().all(|e| e.pool == *pool) {
                        // the usual layout (one pool per file): no filtering
                        out.locs
                            .extend((0..chunk.events.len() as u64).map(|i| (*fi, r0 + i)));
                        let used = std::mem::replace(&mut out.events, chunk.events);
                        reader.recycle(used);
                    } else {
                        // Sized once (a recycled batch keeps its room):
                        // no growth by doubling, copying as it goes.
                        let from = skip.saturating_sub(r0) as usize;
                        let rows = &chunk.events[from..];
                        let mine = rows.iter().filter(|e| e.pool == *pool).count();
                        out.events.reserve(mine);
                        out.locs.reserve(mine);
                        for (i, e) in rows.iter().enumerate() {
                            let i = i + from;
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
            OpenRun::Spill(reader) => {
                while out.events.len() < MERGE_BATCH {
                    let Some(e) = reader.next_record()? else {
                        break;
                    };
                    out.events.push(e.ev);
                    out.locs.push((e.file, e.row));
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
    /// The shared decodes this pool's file runs read from.
    shared: HashMap<u32, Arc<SharedFile>>,
    /// The plan's decoded-ahead first file.
    ahead: Ahead,
}

/// Batches decoded ahead per pool (bounds the prefetch memory).
const PREFETCH_BATCHES: usize = 2;

/// The seq-ordered stream of one pool. Decoding and merging run on their
/// own thread, a few batches ahead of the replay (so Parquet decoding
/// overlaps the slot work); the batches are the same either way.
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
        let shared = runs
            .iter()
            .filter_map(|r| match r.source {
                RunSource::File(fi) => plan.shared_file(fi, r.pool).map(|s| (fi, s)),
                _ => None,
            })
            .collect();
        let mut m = Merge {
            shared,
            root: plan.root.clone(),
            deployment: Arc::clone(&plan.deployment),
            files: Arc::clone(&plan.files),
            pending: runs.into(),
            active: Vec::new(),
            ahead: plan.ahead.clone(),
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
                let mut run = OpenRun::open(
                    &spec,
                    &self.root,
                    &self.deployment,
                    &self.files,
                    &self.shared,
                    &self.ahead,
                )?;
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

/// The pools of the plan in groups no copy connects (connected parts of
/// the copy graph), each in the plan's order, the groups by their first
/// pool in that order. Groups share no state: each may replay apart.
pub fn groups(plan: &Plan) -> Vec<std::collections::BTreeSet<u16>> {
    let pos: HashMap<u16, usize> = plan
        .order
        .iter()
        .enumerate()
        .map(|(i, &p)| (p, i))
        .collect();
    let mut root: Vec<usize> = (0..plan.order.len()).collect();
    fn find(root: &mut [usize], mut i: usize) -> usize {
        while root[i] != i {
            root[i] = root[root[i]];
            i = root[i];
        }
        i
    }
    for (s, d) in &plan.edges {
        if let (Some(&a), Some(&b)) = (pos.get(s), pos.get(d)) {
            let (ra, rb) = (find(&mut root, a), find(&mut root, b));
            root[ra.max(rb)] = ra.min(rb);
        }
    }
    let mut by_root: BTreeMap<usize, std::collections::BTreeSet<u16>> = BTreeMap::new();
    for (i, &p) in plan.order.iter().enumerate() {
        let r = find(&mut root, i);
        by_root.entry(r).or_default().insert(p);
    }
    by_root.into_values().collect()
}
