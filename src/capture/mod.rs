//! capture::Recorder: the API an engine hook (or the simulator, or JSONL
//! import) calls to write a v1 trace.
//!
//! Events are buffered per pool, written as row groups, and part files are
//! rotated by size. The recorder assigns each pool's `seq`, hashes every
//! file as it is written, and keeps trace.json current: it is written with
//! `capture.complete = false` when the trace is created, rewritten each time a
//! part file is completed, and written with `complete = true` by `close`.
//!
//! What a crash loses at most: the rows still buffered in memory (up to
//! `row_group_rows` per pool and for requests) plus the part file each stream
//! had open (written as `*.parquet.inprogress`, which readers ignore). Every
//! completed part file stays readable and listed with its digest.
//!
//! `jsonl` turns the JSON-lines import format into recorder calls.

pub mod jsonl;

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::{Error, Location, Result};
use crate::schema::{KvEvent, Op, RequestRecord, kv_schema, requests_schema};
use crate::trace::manifest::{Capture, Deployment, FileEntry, Manifest};
use crate::trace::read::{Extent, SAME_POOL_COPY_HINT, check_extent, check_same_pool_copy};
use crate::trace::write::{OpenPartState, PartOptions, PartWriter, kv_batch, requests_batch};

/// How a recorder writes.
#[derive(Debug, Clone)]
pub struct RecorderOptions {
    pub part: PartOptions,
    /// Rows per row group (and the most a crash can lose per stream).
    pub row_group_rows: usize,
    /// Capture began with the engine's pools empty.
    pub from_engine_start: bool,
    /// When set, the capture's time range comes from the data (deterministic
    /// output for simulated traces) and starts here; otherwise wall clock.
    pub started_ns: Option<i64>,
    /// Value of capture.writer.
    pub writer: String,
}

impl Default for RecorderOptions {
    fn default() -> Self {
        RecorderOptions {
            part: PartOptions::default(),
            row_group_rows: 64 * 1024,
            from_engine_start: true,
            started_ns: None,
            writer: format!("kvtrail {}", env!("CARGO_PKG_VERSION")),
        }
    }
}

struct PoolStream {
    id: u16,
    capacity: u64,
    next_seq: u64,
    events: u64,
    /// seq values skipped (lost events) and the places they were skipped.
    lost: u64,
    holes: u64,
    buf: Vec<KvEvent>,
    writer: PartWriter,
}

/// Counters of what a recorder has written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecorderStats {
    pub requests: u64,
    pub kv_events: u64,
    /// seq values skipped on purpose (`lose`): holes in the trace.
    pub lost_events: u64,
    pub files: usize,
}

/// Writes one trace. See the module docs for crash behaviour.
pub struct Recorder {
    dir: PathBuf,
    manifest: Manifest,
    opts: RecorderOptions,
    pools: Vec<PoolStream>,
    /// pool id -> index into `pools` (u16 ids, so a flat table).
    pool_index: Vec<u32>,
    req_buf: Vec<RequestRecord>,
    req_writer: PartWriter,
    files: Vec<FileEntry>,
    stats: RecorderStats,
    max_ts: i64,
    /// Request ids whose rows are removed at close (see [`Recorder::unattribute`]).
    unattributed: std::collections::BTreeSet<u64>,
}

const NO_POOL: u32 = u32::MAX;

impl Recorder {
    /// Creates a new trace directory (it must not hold a trace already).
    pub fn create(dir: &Path, deployment: Deployment, opts: RecorderOptions) -> Result<Recorder> {
        deployment.validate(&dir.join("trace.json"))?;
        if dir.join("trace.json").exists() {
            return Err(Error::invalid(
                Location::file(dir),
                "a trace already exists here",
                "choose a new --out directory or remove the old trace first",
            ));
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let mut pool_index = vec![NO_POOL; u16::MAX as usize + 1];
        let mut pools = Vec::new();
        for (i, p) in deployment.pools.iter().enumerate() {
            pool_index[p.id as usize] = i as u32;
            pools.push(PoolStream {
                id: p.id,
                capacity: p.capacity_tokens,
                next_seq: 0,
                events: 0,
                lost: 0,
                holes: 0,
                buf: Vec::with_capacity(opts.row_group_rows.min(1 << 16)),
                writer: PartWriter::new(
                    dir,
                    &format!("kv/pool={}", p.id),
                    kv_schema(),
                    opts.part.clone(),
                ),
            });
        }
        let now = wall_ns();
        let capture = Capture {
            writer: opts.writer.clone(),
            started_ns: opts.started_ns.unwrap_or(now),
            ended_ns: 0,
            complete: false,
            from_engine_start: Some(opts.from_engine_start),
            extra: Default::default(),
        };
        let mut manifest = Manifest::new(deployment, capture);
        manifest.files = Some(Vec::new());
        manifest.store(dir)?;
        Ok(Recorder {
            dir: dir.to_path_buf(),
            req_writer: PartWriter::new(dir, "requests", requests_schema(), opts.part.clone()),
            max_ts: i64::MIN,
            unattributed: Default::default(),
            manifest,
            opts,
            pools,
            pool_index,
            req_buf: Vec::new(),
            files: Vec::new(),
            stats: RecorderStats::default(),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn deployment(&self) -> &Deployment {
        &self.manifest.deployment
    }

    pub fn stats(&self) -> RecorderStats {
        let mut s = self.stats.clone();
        s.files = self.files.len();
        s
    }

    fn stream(&self, pool: u16) -> Result<usize> {
        match self.pool_index[pool as usize] {
            NO_POOL => Err(Error::invalid(
                Location::default().column("pool"),
                format!("unknown pool id {pool}"),
                "record events only for pools listed in the deployment",
            )),
            i => Ok(i as usize),
        }
    }

    /// Checks `ev` against the contract; `seq` is the seq it will have.
    fn check(&self, ev: &KvEvent, seq: u64) -> Result<usize> {
        let i = self.stream(ev.pool)?;
        let bad = |col: &str, what: String| {
            Err(Error::invalid(
                Location::default().column(col),
                what,
                "the event is out of contract (docs/trace-format.md)",
            ))
        };
        if ev.slot_count == 0 {
            return bad("slot_count", "slot_count is 0".into());
        }
        check_extent(
            || Location::default().column("slot_start"),
            Extent::Slots,
            ev.pool,
            ev.slot_start,
            ev.slot_count,
            self.pools[i].capacity,
        )?;
        if let Some(src) = ev.src {
            if ev.op != Op::Write {
                return bad("src_pool", format!("src set on a `{}` event", ev.op));
            }
            let j = self.stream(src.pool)?;
            if let Err((col, what)) = check_same_pool_copy(
                ev.pool,
                Some(seq),
                Some((ev.slot_start, ev.slot_count)),
                src,
            ) {
                return Err(Error::invalid(
                    Location::default().column(col),
                    what,
                    SAME_POOL_COPY_HINT,
                ));
            }
            check_extent(
                || Location::default().column("src_slot_start"),
                Extent::Source,
                src.pool,
                src.slot_start,
                ev.slot_count,
                self.pools[j].capacity,
            )?;
        }
        Ok(i)
    }

    /// Records one event; the recorder assigns and returns its `seq` (the
    /// `seq` field of `ev` is ignored).
    pub fn kv(&mut self, mut ev: KvEvent) -> Result<u64> {
        let i = self.stream(ev.pool)?;
        let i = self.check(&ev, self.pools[i].next_seq)?;
        let s = &mut self.pools[i];
        if s.next_seq == u64::MAX {
            return Err(Error::invalid(
                Location::default().column("seq"),
                format!("pool {} has no seq left below u64::MAX", ev.pool),
                "seq counts events from 0",
            ));
        }
        ev.seq = s.next_seq;
        s.next_seq += 1;
        self.push(i, ev)?;
        Ok(ev.seq)
    }

    /// Records one event with the `seq` it already has (JSONL import, the
    /// record sidecar). Seqs must increase per pool; a jump leaves a hole.
    pub fn kv_with_seq(&mut self, ev: KvEvent) -> Result<()> {
        let i = self.check(&ev, ev.seq)?;
        let s = &mut self.pools[i];
        if ev.seq < s.next_seq {
            return Err(Error::invalid(
                Location::default().column("seq"),
                format!(
                    "seq {} of pool {} is not above the previous one ({})",
                    ev.seq,
                    ev.pool,
                    s.next_seq.wrapping_sub(1)
                ),
                "seq must be strictly increasing within each pool",
            ));
        }
        if ev.seq == u64::MAX {
            return Err(Error::invalid(
                Location::default().column("seq"),
                format!("seq {} of pool {} is u64::MAX", ev.seq, ev.pool),
                "seq counts events from 0; u64::MAX leaves no room for the next one",
            ));
        }
        self.stats.lost_events = self.stats.lost_events.saturating_add(ev.seq - s.next_seq);
        if ev.seq > s.next_seq {
            s.lost = s.lost.saturating_add(ev.seq - s.next_seq);
            s.holes += 1;
        }
        s.next_seq = ev.seq + 1;
        self.push(i, ev)
    }

    /// The seq the next event of `pool` will get.
    pub fn next_seq(&self, pool: u16) -> Result<u64> {
        Ok(self.pools[self.stream(pool)?].next_seq)
    }

    /// Marks `n` events of `pool` as lost: their seqs are skipped, leaving an
    /// explicit hole that replay reports (never a silent loss).
    pub fn lose(&mut self, pool: u16, n: u64) -> Result<()> {
        let i = self.stream(pool)?;
        self.pools[i].next_seq = self.pools[i].next_seq.checked_add(n).ok_or_else(|| {
            Error::invalid(
                Location::default().column("seq"),
                format!("losing {n} events would run pool {pool}'s seq past u64::MAX"),
                "seq counts events from 0",
            )
        })?;
        // Summed over pools, so it may exceed any one pool's seq space.
        self.stats.lost_events = self.stats.lost_events.saturating_add(n);
        if n > 0 {
            self.pools[i].lost = self.pools[i].lost.saturating_add(n);
            self.pools[i].holes += 1;
        }
        Ok(())
    }

    fn push(&mut self, i: usize, ev: KvEvent) -> Result<()> {
        self.max_ts = self.max_ts.max(ev.ts_ns);
        self.stats.kv_events += 1;
        let s = &mut self.pools[i];
        s.events += 1;
        s.buf.push(ev);
        if s.buf.len() >= self.opts.row_group_rows {
            self.flush_pool(i)?;
        }
        Ok(())
    }

    /// Records a batch of events (seqs assigned).
    pub fn kv_batch(&mut self, events: &[KvEvent]) -> Result<()> {
        for ev in events {
            self.kv(*ev)?;
        }
        Ok(())
    }

    /// Records one request row.
    pub fn request(&mut self, r: RequestRecord) -> Result<()> {
        if r.request_id == 0 {
            return Err(Error::invalid(
                Location::default().column("request_id"),
                "request_id 0 is reserved for the engine itself",
                "number requests from 1",
            ));
        }
        for p in [r.prefill_pool, r.decode_pool].into_iter().flatten() {
            self.stream(p)?;
        }
        self.max_ts = self
            .max_ts
            .max(r.arrival_ns)
            .max(r.finish_ns.unwrap_or(i64::MIN));
        self.stats.requests += 1;
        self.req_buf.push(r);
        if self.req_buf.len() >= self.opts.row_group_rows {
            self.flush_requests()?;
        }
        Ok(())
    }

    fn flush_pool(&mut self, i: usize) -> Result<()> {
        let s = &mut self.pools[i];
        if s.buf.is_empty() {
            return Ok(());
        }
        let batch = kv_batch(&s.buf);
        s.buf.clear();
        if let Some(f) = s.writer.write(&batch)? {
            self.completed(f)?;
        }
        Ok(())
    }

    fn flush_requests(&mut self) -> Result<()> {
        if self.req_buf.is_empty() {
            return Ok(());
        }
        let batch = requests_batch(&self.req_buf);
        self.req_buf.clear();
        if let Some(f) = self.req_writer.write(&batch)? {
            self.completed(f)?;
        }
        Ok(())
    }

    fn completed(&mut self, f: FileEntry) -> Result<()> {
        self.files.push(f);
        self.store_manifest(false)
    }

    fn store_manifest(&mut self, complete: bool) -> Result<()> {
        let mut files = self.files.clone();
        files.sort_by(|a, b| a.path.cmp(&b.path));
        self.manifest.files = Some(files);
        self.manifest.capture.complete = complete;
        self.manifest.capture.ended_ns = if self.opts.started_ns.is_some() {
            self.max_ts.max(self.manifest.capture.started_ns)
        } else {
            wall_ns()
        };
        self.manifest.store(&self.dir)
    }

    /// Writes everything buffered as row groups (part files stay open).
    pub fn flush(&mut self) -> Result<()> {
        for i in 0..self.pools.len() {
            self.flush_pool(i)?;
        }
        self.flush_requests()
    }

    /// Flushes, closes every part file and writes trace.json with
    /// `capture.complete = true`.
    pub fn close(mut self) -> Result<Manifest> {
        self.close_with(true)
    }

    /// Closes the files but marks the capture unclean (e.g. the engine
    /// stream ended without a clean shutdown).
    pub fn close_unclean(mut self) -> Result<Manifest> {
        self.close_with(false)
    }

    fn close_with(&mut self, complete: bool) -> Result<Manifest> {
        self.flush()?;
        for i in 0..self.pools.len() {
            if let Some(f) = self.pools[i].writer.finish_part()? {
                self.files.push(f);
            }
        }
        if let Some(f) = self.req_writer.finish_part()? {
            self.files.push(f);
        }
        self.drop_unattributed()?;
        self.store_manifest(complete)?;
        Ok(self.manifest.clone())
    }

    /// Leaves a request unattributed: at close its rows are removed from
    /// the requests table (its KV events stay, as events of a request with
    /// no row). For a request id two disagreeing requests reported: no row
    /// may speak for both.
    pub fn unattribute(&mut self, request_id: u64) {
        self.unattributed.insert(request_id);
    }

    /// Rewrites each completed requests file that holds an unattributed id
    /// without those rows (one file at a time), with its new digest.
    fn drop_unattributed(&mut self) -> Result<()> {
        if self.unattributed.is_empty() {
            return Ok(());
        }
        let ids = std::mem::take(&mut self.unattributed);
        for f in &mut self.files {
            if !f.path.starts_with("requests/") {
                continue;
            }
            let path = self.dir.join(&f.path);
            let batches = crate::trace::write::read_batches(&path)?;
            let mut kept = Vec::with_capacity(batches.len());
            let mut removed = 0u64;
            for b in batches {
                let keep = unattributed_filter(&b, &ids);
                removed += (b.num_rows() - keep.true_count()) as u64;
                kept.push(
                    arrow_select::filter::filter_record_batch(&b, &keep)
                        .map_err(|e| Error::Other(format!("{}: {e}", path.display())))?,
                );
            }
            if removed == 0 {
                continue;
            }
            let tmp = path.with_extension("parquet.inprogress");
            let digest = crate::trace::write::write_single_file(&tmp, &kept)?;
            std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
            f.rows -= removed;
            f.blake3 = digest;
            self.stats.requests = self.stats.requests.saturating_sub(removed);
        }
        Ok(())
    }

    /// Sets `capture.started_ns` (importers learn the first timestamp only
    /// from the data). Only meaningful with `RecorderOptions::started_ns`.
    pub fn set_started_ns(&mut self, ns: i64) {
        self.manifest.capture.started_ns = ns;
    }

    /// Records an extra key under `capture` in trace.json (e.g.
    /// `skipped_lines`); written with the next manifest update.
    pub fn set_capture_extra(&mut self, key: &str, value: serde_json::Value) {
        self.manifest.capture.extra.insert(key.to_string(), value);
    }

    /// Ids of pools and the number of events recorded for each.
    pub fn pool_counts(&self) -> Vec<(u16, u64)> {
        self.pools.iter().map(|p| (p.id, p.events)).collect()
    }

    /// Writes what is buffered as row groups, flushes the open part files
    /// to disk, and says what is written: what a seal covers
    /// (`custody::seal`). A part file may be completed by the flush.
    pub fn seal_state(&mut self) -> Result<SealState> {
        self.flush()?;
        let mut open = Vec::new();
        for p in &mut self.pools {
            open.extend(p.writer.sync_open()?);
        }
        open.extend(self.req_writer.sync_open()?);
        Ok(SealState {
            files: self.files.clone(),
            open,
            pools: self
                .pools
                .iter()
                .map(|p| PoolProgress {
                    pool: p.id,
                    events: p.events,
                    next_seq: p.next_seq,
                    lost: p.lost,
                    holes: p.holes,
                })
                .collect(),
        })
    }
}

/// What a recorder has written, at a row-group boundary
/// ([`Recorder::seal_state`]).
#[derive(Debug, Clone, Default)]
pub struct SealState {
    /// Every part file completed so far, with the digest it was written with.
    pub files: Vec<FileEntry>,
    /// The part files still open, flushed: their bytes so far are a prefix
    /// of the finished file.
    pub open: Vec<OpenPartState>,
    pub pools: Vec<PoolProgress>,
}

/// One pool's progress.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolProgress {
    pub pool: u16,
    /// Events recorded.
    pub events: u64,
    /// The seq the next event gets (events and lost events so far).
    pub next_seq: u64,
    /// seq values skipped: lost events.
    pub lost: u64,
    /// Places where seqs were skipped.
    pub holes: u64,
}

/// Rows of a requests batch whose id is not in `ids`.
fn unattributed_filter(
    b: &arrow_array::RecordBatch,
    ids: &std::collections::BTreeSet<u64>,
) -> arrow_array::BooleanArray {
    use arrow_array::{Array, UInt64Array};
    let col = b
        .column_by_name(crate::schema::req_col::REQUEST_ID)
        .and_then(|c| c.as_any().downcast_ref::<UInt64Array>());
    (0..b.num_rows())
        .map(|i| Some(col.is_none_or(|c| c.is_null(i) || !ids.contains(&c.value(i)))))
        .collect()
}

fn wall_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}
