//! Trace-wide checks: the contract rules no single row breaks alone, in one
//! place for every command, so `verify`, `inspect` and `scope` give a trace
//! the same verdict (`verify` lists a failure as a problem, the others stop
//! on it, exit 2):
//! - every pool id of the kv table is in the deployment;
//! - a pool's seqs are unique ("strictly increasing per pool", whatever the
//!   row order or the split into files);
//! - copies between pools form a DAG (a pool never copies, directly or
//!   through others, from itself).
//!
//! (Request ids are unique and request pool ids known: `request_keys.rs`.)
//!
//! The same pass finds each pool's seq holes. Memory: per (file, pool) one
//! run summary (min, max, count, order, the first holes); holes between runs
//! come from sorting runs. Only a pool whose seqs are out of order inside a
//! file, or whose files' seq ranges overlap, is sorted: its (seq, file, row)
//! triples, in chunks of [`SORT_CHUNK`] spilled to temporary files and
//! merged back (`crate::spill`), so memory never grows with the trace and any seq range
//! (up to 2^64) is fine.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::error::{Error, Location, Result};
use crate::schema::kv_col;
use crate::spill::{Place, Sorter};
use crate::trace::read::{KvScanBatch, Trace};

/// Holes listed per pool (all are counted).
pub const MAX_HOLES_LISTED: usize = 20;
/// (seq, file, row) triples sorted in memory before a chunk is spilled
/// (24 MiB).
pub const SORT_CHUNK: usize = 1 << 20;

/// A run of missing seqs: every seq strictly between `after_seq` and
/// `before_seq` is absent (`after_seq` is `None` for a gap before the
/// pool's first event: seqs start at 0).
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct Hole {
    pub after_seq: Option<u64>,
    pub before_seq: u64,
    pub missing: u64,
}

/// The error for two events with the same seq in one pool.
pub fn duplicate(pool: u16, seq: u64, f1: &Path, r1: u64, f2: &Path, r2: u64) -> Error {
    Error::invalid(
        Location::file(f2).row(r2).column(kv_col::SEQ),
        format!(
            "pool {pool} has two events with seq {seq}: {} row {r1} and {} row {r2}",
            f1.display(),
            f2.display()
        ),
        "seq must be unique and strictly increasing within a pool; remove the duplicated rows (a file copied twice?)",
    )
}

/// One pool's rows in one file, as streamed.
#[derive(Debug, Clone)]
pub struct Run {
    pub min: u64,
    pub max: u64,
    pub rows: u64,
    /// Seqs came in increasing order.
    pub sorted: bool,
    /// Row of the pool's first event in the file (for messages).
    pub first_row: u64,
    /// Seq of that first event.
    first: u64,
    last: u64,
    last_row: u64,
    holes: Vec<Hole>,
    holes_total: u64,
    missing: u64,
}

impl Run {
    fn new(seq: u64, row: u64) -> Run {
        Run {
            min: seq,
            max: seq,
            rows: 1,
            sorted: true,
            first_row: row,
            first: seq,
            last: seq,
            last_row: row,
            holes: Vec::new(),
            holes_total: 0,
            missing: 0,
        }
    }

    /// Rows with seqs `seqs`, from row `row` on, in order: a stretch of
    /// consecutive seqs after the last one in one step, else row by row.
    fn push_all(&mut self, seqs: &[u64], row: u64, pool: u16, path: &Path) -> Result<()> {
        if let (true, Some(&last)) = (self.sorted, seqs.last()) {
            // seqs are at most 2^64 - 2 (the reader checks), so no wrap.
            let next = self.last.wrapping_add(1);
            if seqs
                .iter()
                .enumerate()
                .all(|(k, &s)| s == next.wrapping_add(k as u64))
            {
                self.max = self.max.max(last);
                self.min = self.min.min(seqs[0]);
                self.rows += seqs.len() as u64;
                self.last = last;
                self.last_row = row + seqs.len() as u64 - 1;
                return Ok(());
            }
        }
        for (k, &seq) in seqs.iter().enumerate() {
            self.push(seq, row + k as u64, pool, path)?;
        }
        Ok(())
    }

    fn push(&mut self, seq: u64, row: u64, pool: u16, path: &Path) -> Result<()> {
        self.min = self.min.min(seq);
        self.max = self.max.max(seq);
        self.rows += 1;
        if !self.order(seq, row, pool, path)? {
            return Ok(());
        }
        self.last = seq;
        self.last_row = row;
        Ok(())
    }

    /// The order check of `seq` at `row` after the run's last seq: an
    /// equal seq is an error, a lower one ends the run's order, a higher
    /// one past the next counts a hole. False when the run is (now) out
    /// of order.
    #[inline]
    fn order(&mut self, seq: u64, row: u64, pool: u16, path: &Path) -> Result<bool> {
        if !self.sorted {
            return Ok(false);
        }
        if seq == self.last {
            return Err(duplicate(pool, seq, path, self.last_row, path, row));
        }
        if seq < self.last {
            self.sorted = false;
            return Ok(false);
        }
        if seq > self.last + 1 {
            self.hole(Hole {
                after_seq: Some(self.last),
                before_seq: seq,
                missing: seq - self.last - 1,
            });
        }
        Ok(true)
    }

    fn hole(&mut self, h: Hole) {
        self.holes_total += 1;
        self.missing += h.missing;
        if self.holes.len() <= MAX_HOLES_LISTED {
            self.holes.push(h);
        }
    }

    /// Appends `b`, the run of the same pool in the rows that follow this
    /// run's (a later part of the file, scanned apart): the very run one
    /// pass over both parts gives, when `b`'s part had no error. An error
    /// is the one that pass meets at `b`'s first row.
    fn append(&mut self, b: Run, pool: u16, path: &Path) -> Result<()> {
        self.min = self.min.min(b.min);
        self.max = self.max.max(b.max);
        self.rows += b.rows;
        if !self.order(b.first, b.first_row, pool, path)? {
            return Ok(());
        }
        // `b` went on from its first seq as this run would have.
        self.sorted = b.sorted;
        self.last = b.last;
        self.last_row = b.last_row;
        self.holes_total += b.holes_total;
        self.missing += b.missing;
        for h in b.holes {
            if self.holes.len() > MAX_HOLES_LISTED {
                break;
            }
            self.holes.push(h);
        }
        Ok(())
    }

    /// Whether `b` (as in `append`) meets this run's last seq again: the
    /// row of the error one pass would stop at.
    fn clash(&self, b: &Run) -> Option<u64> {
        (self.sorted && b.first == self.last).then_some(b.first_row)
    }
}

/// What one kv file holds, per pool, and the copies it makes.
#[derive(Debug, Clone)]
pub struct FileRuns {
    path: PathBuf,
    /// Runs by pool id, sorted by id (a file holds one pool or a few).
    runs: Vec<(u16, Run)>,
    /// Index in `runs` of the last pool pushed (rows of one pool come in
    /// stretches: one lookup per stretch, not per row).
    last: usize,
    /// (src_pool, dst_pool) -> row of the first such copy.
    pub edges: BTreeMap<(u16, u16), u64>,
}

impl FileRuns {
    pub fn new(path: &Path) -> FileRuns {
        FileRuns {
            path: path.to_path_buf(),
            runs: Vec::new(),
            last: 0,
            edges: BTreeMap::new(),
        }
    }

    /// Appends `b`, the runs of the rows that follow this part's in the
    /// same file (scanned apart, without an error): the runs one pass over
    /// both parts gives, or the error it stops at first.
    pub fn append(&mut self, b: FileRuns) -> Result<()> {
        // The first row at which a pool's seq repeats across the parts.
        let clash = b
            .runs
            .iter()
            .filter_map(|(p, r)| {
                let i = self.runs.binary_search_by_key(p, |(q, _)| *q).ok()?;
                Some((self.runs[i].1.clash(r)?, *p, i))
            })
            .min();
        if let Some((_, pool, i)) = clash {
            let b_run = b.runs.iter().find(|(p, _)| *p == pool).expect("clash");
            let r = &self.runs[i].1;
            return Err(duplicate(
                pool,
                r.last,
                &self.path,
                r.last_row,
                &self.path,
                b_run.1.first_row,
            ));
        }
        let last_pool = b.runs.get(b.last).map(|(p, _)| *p);
        for (pool, run) in b.runs {
            match self.runs.binary_search_by_key(&pool, |(p, _)| *p) {
                Ok(i) => self.runs[i].1.append(run, pool, &self.path)?,
                Err(i) => self.runs.insert(i, (pool, run)),
            }
        }
        for (edge, row) in b.edges {
            self.edges.entry(edge).or_insert(row);
        }
        if let Some(p) = last_pool {
            self.last = self.runs.binary_search_by_key(&p, |(q, _)| *q).unwrap_or(0);
        }
        Ok(())
    }

    /// Each pool's run in this file, by pool id.
    pub fn pools(&self) -> impl Iterator<Item = (u16, &Run)> {
        self.runs.iter().map(|(p, r)| (*p, r))
    }

    /// One event, in file order: a seq equal to the previous one of its pool
    /// in the file is an error at once.
    #[inline]
    pub fn push(&mut self, pool: u16, seq: u64, src_pool: Option<u16>, row: u64) -> Result<()> {
        match self.runs.get_mut(self.last) {
            Some((p, r)) if *p == pool => r.push(seq, row, pool, &self.path)?,
            _ => match self.runs.binary_search_by_key(&pool, |(p, _)| *p) {
                Ok(i) => {
                    self.last = i;
                    self.runs[i].1.push(seq, row, pool, &self.path)?;
                }
                Err(i) => {
                    self.runs.insert(i, (pool, Run::new(seq, row)));
                    self.last = i;
                }
            },
        }
        if let Some(sp) = src_pool {
            self.edges.entry((sp, pool)).or_insert(row);
        }
        Ok(())
    }

    /// Adds one batch of the light reader: a stretch of one pool's rows at
    /// a time (the same checks, in the same row order, as [`push`]).
    ///
    /// [`push`]: Self::push
    pub fn push_batch(&mut self, b: &KvScanBatch) -> Result<()> {
        let n = b.pool.len().min(b.seq.len());
        let mut i = 0;
        while i < n {
            let pool = b.pool[i];
            let j = i + b.pool[i..n]
                .iter()
                .position(|&p| p != pool)
                .unwrap_or(n - i);
            let row = b.first_row + i as u64;
            let mut seqs = &b.seq[i..j];
            let k = if self.runs.get(self.last).is_some_and(|(p, _)| *p == pool) {
                self.last
            } else {
                match self.runs.binary_search_by_key(&pool, |(p, _)| *p) {
                    Ok(k) => k,
                    Err(k) => {
                        self.runs.insert(k, (pool, Run::new(seqs[0], row)));
                        seqs = &seqs[1..];
                        k
                    }
                }
            };
            self.last = k;
            let first = row + (j - i - seqs.len()) as u64;
            self.runs[k].1.push_all(seqs, first, pool, &self.path)?;
            i = j;
        }
        for &(ci, src, _) in &b.copies {
            if let Some(&pool) = b.pool.get(ci as usize) {
                self.edges
                    .entry((src.pool, pool))
                    .or_insert(b.first_row + ci as u64);
            }
        }
        Ok(())
    }
}

/// Reads one kv file's planning columns into its runs, handing every batch
/// to `each` too (replay collects its copies there).
pub fn scan_file(
    trace: &Trace,
    path: &Path,
    mut each: impl FnMut(&KvScanBatch) -> Result<()>,
) -> Result<FileRuns> {
    let mut runs = FileRuns::new(path);
    for batch in trace.kv_scan(path)? {
        let b = batch?;
        runs.push_batch(&b)?;
        each(&b)?;
    }
    Ok(runs)
}

/// Pools a stretch of [`scan_file_split`] may hold runs of: each part
/// holds a run (and up to `MAX_HOLES_LISTED` holes) per pool it meets, so
/// a file of many pools is read in one pass, whose memory is one run per
/// pool, not one per pool and part.
pub const MAX_PART_POOLS: usize = 64;

/// As [`scan_file`], reading the file in up to `parts` stretches of row
/// groups at once (on the rayon pool) and joining their runs in file
/// order (`FileRuns::append`): the same runs, and `each` sees every batch
/// once, in no set order. None when a part met an error, held more than
/// [`MAX_PART_POOLS`] pools, or read other rows than the footer says its
/// row groups hold (row numbers would be off): which error one pass meets
/// first, and where, is then for [`scan_file`] to say (the caller starts
/// again, as `each` saw some batches).
pub fn scan_file_split(
    trace: &Trace,
    path: &Path,
    parts: usize,
    each: impl Fn(&KvScanBatch) -> Result<()> + Sync,
) -> Result<Option<FileRuns>> {
    use rayon::prelude::*;
    let rows = crate::trace::read::KvScanReader::row_groups(&trace.root, path)?;
    let groups = rows.len();
    let parts = parts.min(groups).max(1);
    let ranges: Vec<std::ops::Range<usize>> = (0..parts)
        .map(|k| groups * k / parts..groups * (k + 1) / parts)
        .collect();
    let sum = |g: &[u64]| g.iter().fold(0u64, |a, &n| a.saturating_add(n));
    let scanned: Vec<Option<FileRuns>> = ranges
        .into_par_iter()
        .map(|g| {
            let (mut row, end) = (sum(&rows[..g.start]), sum(&rows[..g.end]));
            let mut runs = FileRuns::new(path);
            let reader = crate::trace::read::KvScanReader::open_groups(
                &trace.root,
                path,
                trace.deployment(),
                Some(g),
            )
            .ok()?;
            for batch in reader {
                let b = batch.ok()?;
                if b.first_row != row || runs.runs.len() > MAX_PART_POOLS {
                    return None;
                }
                row = row.saturating_add(b.seq.len() as u64);
                runs.push_batch(&b).ok()?;
                each(&b).ok()?;
            }
            (row == end && runs.runs.len() <= MAX_PART_POOLS).then_some(runs)
        })
        .collect();
    // Every part read cleanly: the only errors left are seqs repeated at
    // the seams, met in file order as one pass meets them.
    let Some(scanned) = scanned.into_iter().collect::<Option<Vec<FileRuns>>>() else {
        return Ok(None);
    };
    let mut joined: Option<FileRuns> = None;
    for part in scanned {
        match &mut joined {
            None => joined = Some(part),
            Some(j) => j.append(part)?,
        }
    }
    Ok(Some(joined.unwrap_or_else(|| FileRuns::new(path))))
}

/// How a pool's seqs were checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqCheck {
    /// Every (file, pool) run in order and runs disjoint: no sort needed.
    Runs,
    /// Out of order within a file, or runs overlapping: sorted.
    Sort,
}

impl SeqCheck {
    pub fn as_str(self) -> &'static str {
        match self {
            SeqCheck::Runs => "runs",
            SeqCheck::Sort => "sort",
        }
    }
}

/// One pool's seqs: range and holes (duplicates are errors).
#[derive(Debug, Clone, PartialEq)]
pub struct PoolSeqs {
    pub pool: u16,
    pub events: u64,
    pub first_seq: Option<u64>,
    pub last_seq: Option<u64>,
    pub holes: u64,
    pub missing_events: u64,
    /// The first holes in seq order.
    pub holes_listed: Vec<Hole>,
    pub check: SeqCheck,
}

/// The trace-wide checks passed: per pool (deployment order) its seqs, and
/// the pools in copy order.
#[derive(Debug, Clone)]
pub struct KvCheck {
    pub pools: Vec<PoolSeqs>,
    /// Pools sorted so every copy's source comes before its destination.
    pub order: Vec<u16>,
    /// (source pool, destination pool) -> (file, row) of its first copy.
    pub edges: BTreeMap<(u16, u16), (u32, u64)>,
}

/// Runs every check of this module on `trace` (a light pass over the
/// pool, seq and src columns of every kv file). `spill_root` and `chunk`
/// as for [`finish`].
pub fn check_kv(trace: &Trace, spill_root: Option<&Path>, chunk: Option<usize>) -> Result<KvCheck> {
    let runs = trace
        .kv_files
        .iter()
        .map(|f| scan_file(trace, f, |_| Ok(())))
        .collect::<Result<Vec<_>>>()?;
    finish(trace, &runs, spill_root, chunk)
}

/// The checks on the runs of every kv file (`runs[i]` of
/// `trace.kv_files[i]`). A pool that must be sorted is sorted in chunks of
/// `chunk` entries (default [`SORT_CHUNK`]) spilled under `spill_root`
/// (default: the system's temporary folder).
pub fn finish(
    trace: &Trace,
    runs: &[FileRuns],
    spill_root: Option<&Path>,
    chunk: Option<usize>,
) -> Result<KvCheck> {
    let chunk = chunk.unwrap_or(SORT_CHUNK).max(1);
    let dep = trace.deployment();
    let mut edges: BTreeMap<(u16, u16), (u32, u64)> = BTreeMap::new();
    let mut per_pool: BTreeMap<u16, Vec<(u32, &Run)>> = BTreeMap::new();
    for (fi, fr) in runs.iter().enumerate() {
        for (pool, run) in fr.pools() {
            if dep.pool(pool).is_none() {
                return Err(Error::invalid(
                    Location::file(&fr.path)
                        .row(run.first_row)
                        .column(kv_col::POOL),
                    format!("unknown pool id {pool}"),
                    "every pool id must be listed in trace.json deployment.pools",
                ));
            }
            per_pool.entry(pool).or_default().push((fi as u32, run));
        }
        for (&(src, dst), &row) in &fr.edges {
            let loc = || Location::file(&fr.path).row(row).column(kv_col::SRC_POOL);
            if dep.pool(src).is_none() {
                return Err(Error::invalid(
                    loc(),
                    format!("unknown src_pool id {src}"),
                    "every pool id must be listed in trace.json deployment.pools",
                ));
            }
            // A copy inside one pool (src == dst) is checked per row
            // (`values::check_same_pool_copy`): it reads an earlier state.
            edges.entry((src, dst)).or_insert((fi as u32, row));
        }
    }
    let files: Vec<PathBuf> = runs.iter().map(|r| r.path.clone()).collect();
    let order = topo_order(dep.pools.iter().map(|p| p.id).collect(), &edges);
    let mut pools = Vec::with_capacity(dep.pools.len());
    for p in &dep.pools {
        let mut rs = per_pool.remove(&p.id).unwrap_or_default();
        rs.sort_by_key(|(fi, r)| (r.min, r.max, *fi));
        let overlap = rs.windows(2).any(|w| w[1].1.min <= w[0].1.max);
        let mut ps = PoolSeqs {
            pool: p.id,
            events: rs.iter().map(|(_, r)| r.rows).sum(),
            first_seq: rs.iter().map(|(_, r)| r.min).min(),
            last_seq: rs.iter().map(|(_, r)| r.max).max(),
            holes: 0,
            missing_events: 0,
            holes_listed: Vec::new(),
            check: SeqCheck::Runs,
        };
        if overlap || rs.iter().any(|(_, r)| !r.sorted) {
            ps.check = SeqCheck::Sort;
            let fis: Vec<u32> = rs.iter().map(|(fi, _)| *fi).collect();
            sorted_walk(trace, p.id, &files, &fis, spill_root, chunk, &mut ps)?;
        } else {
            merge_runs(&rs, &mut ps);
        }
        pools.push(ps);
    }
    Ok(KvCheck {
        pools,
        order,
        edges,
    })
}

fn add_hole(ps: &mut PoolSeqs, h: Hole, listing: bool) {
    ps.holes += 1;
    ps.missing_events = ps.missing_events.saturating_add(h.missing);
    if listing && ps.holes_listed.len() < MAX_HOLES_LISTED {
        ps.holes_listed.push(h);
    }
}

/// Holes of a pool whose runs are each increasing and do not overlap
/// (`runs` sorted by min).
fn merge_runs(runs: &[(u32, &Run)], ps: &mut PoolSeqs) {
    let mut listing = true;
    if let Some((_, first)) = runs.first()
        && first.min > 0
    {
        let h = Hole {
            after_seq: None,
            before_seq: first.min,
            missing: first.min,
        };
        add_hole(ps, h, listing);
    }
    let mut prev_max: Option<u64> = None;
    for (_, r) in runs {
        if let Some(p) = prev_max
            && r.min > p.saturating_add(1)
        {
            let h = Hole {
                after_seq: Some(p),
                before_seq: r.min,
                missing: r.min - p - 1,
            };
            add_hole(ps, h, listing);
        }
        ps.holes += r.holes_total;
        ps.missing_events = ps.missing_events.saturating_add(r.missing);
        for h in &r.holes {
            if listing && ps.holes_listed.len() < MAX_HOLES_LISTED {
                ps.holes_listed.push(*h);
            }
        }
        if r.holes.len() as u64 != r.holes_total {
            // The run's own list was capped: later holes would be listed
            // out of order, so stop listing (counting goes on).
            listing = false;
        }
        prev_max = Some(r.max);
    }
}

/// (seq, file, row), as sorted and spilled.
type Key = (u64, u32, u64);

/// Sorts pool `pool`'s seqs from files `fis` (externally past `chunk`)
/// and walks them in order: a repeated seq is an error naming both rows;
/// gaps are holes.
fn sorted_walk(
    trace: &Trace,
    pool: u16,
    files: &[PathBuf],
    fis: &[u32],
    spill_root: Option<&Path>,
    chunk: usize,
    ps: &mut PoolSeqs,
) -> Result<()> {
    let mut keys: Sorter<Key> = Sorter::new(Place::unnamed(spill_root, "seq check"), chunk);
    for &fi in fis {
        let path = &files[fi as usize];
        for batch in trace.kv_scan(path)? {
            let b = batch?;
            for (i, (&p, &seq)) in b.pool.iter().zip(&b.seq).enumerate() {
                if p == pool {
                    keys.push((seq, fi, b.first_row + i as u64))?;
                }
            }
        }
    }
    let mut prev: Option<Key> = None;
    for k in keys.finish()? {
        let k = k?;
        let (seq, file, row) = k;
        match prev {
            Some((ps_, pf, pr)) if seq == ps_ => {
                return Err(duplicate(
                    pool,
                    seq,
                    &files[pf as usize],
                    pr,
                    &files[file as usize],
                    row,
                ));
            }
            Some((ps_, _, _)) if seq > ps_.saturating_add(1) => add_hole(
                ps,
                Hole {
                    after_seq: Some(ps_),
                    before_seq: seq,
                    missing: seq - ps_ - 1,
                },
                true,
            ),
            None if seq > 0 => add_hole(
                ps,
                Hole {
                    after_seq: None,
                    before_seq: seq,
                    missing: seq,
                },
                true,
            ),
            _ => {}
        }
        prev = Some(k);
    }
    Ok(())
}

/// Pools sorted so every copy's source comes before its destination where
/// copies go one way. Pools that copy to each other in both directions (a
/// device pool and its host `cache` tier) cannot be sorted: among those the
/// lowest id goes first. Whether such copies are causal (each copy's source
/// event precedes it) is decided by the replay, which merges the pools'
/// streams and refuses copies that wait on each other, naming both rows.
pub fn topo_order(mut pools: Vec<u16>, edges: &BTreeMap<(u16, u16), (u32, u64)>) -> Vec<u16> {
    pools.sort_unstable();
    pools.dedup();
    let mut indeg: BTreeMap<u16, usize> = pools.iter().map(|&p| (p, 0)).collect();
    let mut out: BTreeMap<u16, Vec<u16>> = BTreeMap::new();
    for &(s, d) in edges.keys() {
        if s == d {
            // A copy inside one pool reads an earlier state of that pool:
            // no order between pools follows from it.
            indeg.entry(s).or_default();
            continue;
        }
        *indeg.entry(d).or_default() += 1;
        indeg.entry(s).or_default();
        out.entry(s).or_default().push(d);
    }
    let mut left: BTreeSet<u16> = indeg.keys().copied().collect();
    let mut ready: BTreeSet<u16> = indeg
        .iter()
        .filter(|(_, d)| **d == 0)
        .map(|(p, _)| *p)
        .collect();
    let mut order = Vec::with_capacity(left.len());
    // the lowest ready pool, else (a cycle) the lowest pool left
    while let Some(p) = ready.pop_first().or_else(|| left.first().copied()) {
        left.remove(&p);
        order.push(p);
        for d in out.get(&p).into_iter().flatten() {
            if left.contains(d) {
                let e = indeg.get_mut(d).expect("pool known");
                *e = e.saturating_sub(1);
                if *e == 0 {
                    ready.insert(*d);
                }
            }
        }
    }
    order
}
