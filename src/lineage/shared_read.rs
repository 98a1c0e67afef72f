//! One decode of a kv file that holds a few pools (a PD trace's prefill and
//! decode pools in one file), shared by those pools' streams.
//!
//! Each pool's stream used to decode the whole file and keep its own rows:
//! a file of two pools was decompressed and decoded twice. Here the
//! streams of the file's pools share one `KvFileReader`: whichever stream
//! runs out of rows decodes the next chunk (under the decoder's lock) and
//! deals its rows to every pool's queue, its own included. No extra thread,
//! and the batches each stream hands out are the rows it would have kept
//! itself, in the same order, with the same (file, row) locations.
//!
//! Memory stays bounded: a pool whose queue is full (`QUEUE_EVENTS`) holds
//! the decoding stream back while it takes batches; one that takes none
//! for `STALL` (it waits on the decoding pool's copies, has not started,
//! or the file was written pool after pool) is detached.
//! Its queue is dropped and it reads the file on its own from the first
//! row it has not been given, exactly as before sharing. A decode error
//! detaches every pool likewise, so each stream meets the error itself, at
//! the same file, row and column as a reader of its own reports.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use super::ahead::{Ahead, Decoder};
use crate::error::{Error, Result};
use crate::schema::KvEvent;
use crate::trace::read::KvFileReader;
use crate::trace::{Deployment, TraceRoot};

/// A batch of one pool's events in seq order, with where each came from.
#[derive(Debug, Default)]
pub struct Batch {
    pub events: Vec<KvEvent>,
    /// (file number, row) per event.
    pub locs: Vec<(u32, u64)>,
}

/// Events a pool's queue may hold before the pool is detached (about
/// 24 MB of events and locations).
pub const QUEUE_EVENTS: usize = 256 * 1024;

/// How long a full queue may take no batch before its pool is detached.
const STALL: Duration = Duration::from_millis(100);

#[derive(Default)]
struct PoolQ {
    batches: VecDeque<Batch>,
    held: usize,
    /// Detached: the row it reads on its own from.
    detached: Option<u64>,
    /// A stream reads here (once per pool: a pool replayed again, for a
    /// replay's error, reads on its own; so does one whose rows ended).
    claimed: bool,
}

#[derive(Default)]
struct Queues {
    pools: HashMap<u16, PoolQ>,
    /// Rows before this one were dealt.
    dealt: u64,
    ended: bool,
    /// Used batches, for the next chunk's split.
    spare: Vec<Batch>,
}

/// One kv file decoded once for several pools.
pub struct SharedFile {
    fi: u32,
    path: PathBuf,
    root: TraceRoot,
    deployment: Arc<Deployment>,
    limit: usize,
    decoder: Mutex<Option<Decoder>>,
    /// The plan's decoded-ahead first file: taken, when it is this one,
    /// as the decoder.
    ahead: Ahead,
    queues: Mutex<Queues>,
    /// Signalled when a stream takes a batch (a dealer may wait for room).
    taken: Condvar,
    /// Signalled when rows are dealt (a stream may wait for its own).
    dealt_cv: Condvar,
}

/// What a pool's stream gets from the shared file.
pub enum Next {
    /// Its next rows.
    Rows,
    /// The file has no more rows of it.
    End,
    /// Read on your own from this row.
    Detached(u64),
}

fn poisoned() -> Error {
    Error::Other("replay: a shared kv file reader failed on another thread".into())
}

impl SharedFile {
    /// The file number `fi` of the plan, for `pools` (the pools whose
    /// streams read it).
    pub fn new(
        fi: u32,
        path: PathBuf,
        root: TraceRoot,
        deployment: Arc<Deployment>,
        pools: &[u16],
        limit: usize,
    ) -> SharedFile {
        let queues = Queues {
            pools: pools.iter().map(|&p| (p, PoolQ::default())).collect(),
            ..Default::default()
        };
        SharedFile {
            fi,
            path,
            root,
            deployment,
            limit: limit.max(1),
            decoder: Mutex::new(None),
            ahead: Ahead::default(),
            queues: Mutex::new(queues),
            taken: Condvar::new(),
            dealt_cv: Condvar::new(),
        }
    }

    /// Takes the plan's decoded-ahead first file (`ahead`) as this
    /// file's decoder when it is this file.
    pub fn with_ahead(mut self, ahead: Ahead) -> SharedFile {
        self.ahead = ahead;
        self
    }

    /// A reader of the file of its own (a detached pool's).
    pub fn own_reader(&self) -> Result<KvFileReader> {
        KvFileReader::open(&self.root, &self.path, &self.deployment)
    }

    /// Whether `pool`'s stream may read here: once per pool.
    pub fn claim(&self, pool: u16) -> bool {
        let Ok(mut q) = self.queues.lock() else {
            return false;
        };
        match q.pools.get_mut(&pool) {
            Some(pq) if !pq.claimed => {
                pq.claimed = true;
                true
            }
            _ => false,
        }
    }

    fn queues(&self) -> Result<MutexGuard<'_, Queues>> {
        self.queues.lock().map_err(|_| poisoned())
    }

    /// Takes `pool`'s next rows into `out` (its used buffers kept for
    /// the next split), decoding chunks as needed.
    pub fn next(&self, pool: u16, out: &mut Batch) -> Result<Next> {
        loop {
            if let Some(n) = self.take(pool, out)? {
                return Ok(n);
            }
            // Another stream decoding (perhaps waiting for this one to
            // take its rows): wait for rows rather than for the decoder.
            let mut dec = match self.decoder.try_lock() {
                Ok(d) => d,
                Err(TryLockError::WouldBlock) => {
                    let q = self.queues()?;
                    let _ = self
                        .dealt_cv
                        .wait_timeout(q, Duration::from_millis(1))
                        .map_err(|_| poisoned())?;
                    continue;
                }
                Err(TryLockError::Poisoned(_)) => return Err(poisoned()),
            };
            // Another stream may have dealt rows meanwhile.
            if let Some(n) = self.take(pool, out)? {
                return Ok(n);
            }
            if dec.is_none() {
                match self
                    .ahead
                    .open(self.fi, &self.root, &self.path, &self.deployment)
                {
                    Ok(r) => *dec = Some(r),
                    Err(_) => {
                        // Every stream opens it itself and meets the error.
                        self.detach_all()?;
                        continue;
                    }
                }
            }
            let reader = dec.as_mut().expect("opened above");
            match reader.next_chunk() {
                None => self.queues()?.ended = true,
                Some(Err(_)) => self.detach_all()?,
                Some(Ok(chunk)) => {
                    self.deal(pool, chunk.first_row, &chunk.events)?;
                    reader.recycle(chunk.events);
                }
            }
        }
    }

    /// `pool`'s next queued batch, or what it should do instead; None
    /// when it must wait for the next chunk.
    fn take(&self, pool: u16, out: &mut Batch) -> Result<Option<Next>> {
        let mut q = self.queues()?;
        let q = &mut *q;
        let Some(pq) = q.pools.get_mut(&pool) else {
            return Ok(Some(Next::End));
        };
        if let Some(row) = pq.detached {
            return Ok(Some(Next::Detached(row)));
        }
        if let Some(b) = pq.batches.pop_front() {
            pq.held -= b.events.len();
            self.taken.notify_all();
            let used = std::mem::replace(out, b);
            if q.spare.len() < 8 {
                q.spare.push(used);
            }
            return Ok(Some(Next::Rows));
        }
        if q.ended {
            q.pools.remove(&pool);
            return Ok(Some(Next::End));
        }
        Ok(None)
    }

    /// Deals one chunk's rows to the pools' queues; a pool (other than
    /// `reader`, which is about to take its rows) whose queue would pass
    /// the limit is detached.
    fn deal(&self, reader: u16, first_row: u64, events: &[KvEvent]) -> Result<()> {
        let mut guard = self.queues()?;
        let q = &mut *guard;
        // The pools still reading here (a shared file has a few): a
        // linear look-up per row, the last hit first, no hashing.
        let pools: Vec<u16> = q
            .pools
            .iter()
            .filter(|(_, pq)| pq.detached.is_none())
            .map(|(&p, _)| p)
            .collect();
        let mut split: Vec<Option<Batch>> = pools.iter().map(|_| None).collect();
        let mut last = 0;
        for (i, e) in events.iter().enumerate() {
            if pools.get(last) != Some(&e.pool) {
                match pools.iter().position(|&p| p == e.pool) {
                    Some(k) => last = k,
                    None => continue,
                }
            }
            let b = split[last].get_or_insert_with(|| {
                let mut b = q.spare.pop().unwrap_or_default();
                b.events.clear();
                b.locs.clear();
                b
            });
            b.events.push(*e);
            b.locs.push((self.fi, first_row + i as u64));
        }
        drop(guard);
        for (pool, b) in pools
            .into_iter()
            .zip(split)
            .filter_map(|(p, b)| Some((p, b?)))
        {
            let mut q = self.queues()?;
            // A full queue: wait while its stream takes batches; detach
            // it once it takes none for `STALL` (it waits on this pool,
            // or has not started).
            let mut since = Instant::now();
            let mut held = q.pools.get(&pool).map_or(0, |p| p.held);
            while pool != reader && held + b.events.len() > self.limit {
                let left = STALL.saturating_sub(since.elapsed());
                if left.is_zero() {
                    break;
                }
                q = self.taken.wait_timeout(q, left).map_err(|_| poisoned())?.0;
                let now = q.pools.get(&pool).map_or(0, |p| p.held);
                if now < held {
                    since = Instant::now();
                }
                held = now;
            }
            let Some(pq) = q.pools.get_mut(&pool) else {
                continue;
            };
            if pool != reader && pq.held + b.events.len() > self.limit {
                let from = pq
                    .batches
                    .front()
                    .map(|f| f.locs[0].1)
                    .unwrap_or(b.locs[0].1);
                pq.batches.clear();
                pq.held = 0;
                pq.detached = Some(from);
                continue;
            }
            pq.held += b.events.len();
            pq.batches.push_back(b);
            self.dealt_cv.notify_all();
        }
        self.queues()?.dealt = first_row + events.len() as u64;
        Ok(())
    }

    /// Detaches every pool still reading here (a decode error): each
    /// reads on its own from its first row not handed out.
    fn detach_all(&self) -> Result<()> {
        let mut q = self.queues()?;
        let dealt = q.dealt;
        for pq in q.pools.values_mut() {
            if pq.detached.is_none() {
                let from = pq.batches.front().map(|f| f.locs[0].1).unwrap_or(dealt);
                pq.batches.clear();
                pq.held = 0;
                pq.detached = Some(from);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::{KvEvent, Op};
    use crate::trace::{Pool, Role};

    /// Rows of the test file: several read batches (`READ_BATCH_ROWS`).
    const ROWS: u32 = 300_000;

    struct File {
        _dir: tempfile::TempDir,
        root: TraceRoot,
        path: PathBuf,
        dep: Deployment,
    }

    /// One kv file holding pools 0 and 1 (rows interleaved, pool 1 with
    /// twice pool 0's rows).
    fn file() -> File {
        let pool = |id, role| Pool {
            id,
            name: format!("p{id}"),
            role,
            capacity_tokens: 1024,
            page_size: 4,
            extra: Default::default(),
        };
        let dep = Deployment {
            name: "shared".into(),
            engine: "test".into(),
            context_window: 1024,
            pools: vec![pool(0, Role::Prefill), pool(1, Role::Decode)],
            prefix_cache_scope: None,
            extra: Default::default(),
        };
        let mut seq = [0u64; 2];
        let events: Vec<KvEvent> = (0..ROWS)
            .map(|i| {
                let p = u16::from(i % 3 != 0);
                seq[p as usize] += 1;
                KvEvent {
                    pool: p,
                    seq: seq[p as usize] - 1,
                    ts_ns: 1000 + i as i64,
                    request_id: 1 + (i / 3) as u64,
                    op: Op::Write,
                    slot_start: i % 200,
                    slot_count: 1 + i % 7,
                    token_pos: Some(0),
                    src: None,
                }
            })
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kv/part-00000.parquet");
        let batches: Vec<_> = events
            .chunks(64 * 1024)
            .map(crate::trace::write::kv_batch)
            .collect();
        crate::trace::write::write_single_file(&path, &batches).unwrap();
        let root = TraceRoot::open(dir.path()).unwrap();
        File {
            _dir: dir,
            root,
            path,
            dep,
        }
    }

    /// The rows of `pool` from row `from` on, as a reader of its own
    /// sees them.
    fn alone(f: &File, pool: u16, from: u64) -> Vec<(KvEvent, u64)> {
        let r = KvFileReader::open(&f.root, &f.path, &f.dep).unwrap();
        let mut out = Vec::new();
        for c in r {
            let c = c.unwrap();
            for (i, e) in c.events.iter().enumerate() {
                let row = c.first_row + i as u64;
                if e.pool == pool && row >= from {
                    out.push((*e, row));
                }
            }
        }
        out
    }

    fn shared(f: &File, limit: usize) -> SharedFile {
        SharedFile::new(
            0,
            f.path.clone(),
            f.root.clone(),
            Arc::new(f.dep.clone()),
            &[0, 1],
            limit,
        )
    }

    fn rows(b: &Batch) -> Vec<(KvEvent, u64)> {
        b.events
            .iter()
            .copied()
            .zip(b.locs.iter().map(|l| l.1))
            .collect()
    }

    /// What `pool`'s stream reads from `sf` (after `first`), following a
    /// detach as the replay's run does: a reader of its own, from the row
    /// it is given. Also whether it was detached.
    fn read(f: &File, sf: &SharedFile, pool: u16) -> (Vec<(KvEvent, u64)>, bool) {
        let mut out = Vec::new();
        let mut b = Batch::default();
        loop {
            match sf.next(pool, &mut b).unwrap() {
                Next::Rows => {
                    assert!(!b.events.is_empty());
                    assert!(b.locs.iter().all(|l| l.0 == 0));
                    out.extend(rows(&b));
                }
                Next::End => return (out, false),
                Next::Detached(from) => {
                    out.extend(alone(f, pool, from));
                    return (out, true);
                }
            }
        }
    }

    fn same(a: &[(KvEvent, u64)], b: &[(KvEvent, u64)]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert_eq!(x.1, y.1);
            assert_eq!(
                (x.0.seq, x.0.pool, x.0.slot_start, x.0.slot_count),
                (y.0.seq, y.0.pool, y.0.slot_start, y.0.slot_count)
            );
        }
    }

    #[test]
    fn each_pool_gets_exactly_its_rows_in_order_once() {
        let f = file();
        let sf = shared(&f, QUEUE_EVENTS);
        // One stream reads its pool to the end before the other starts:
        // the other's rows wait in its queue (under the limit).
        assert!(sf.claim(1) && sf.claim(0));
        let (a, da) = read(&f, &sf, 1);
        let (b, db) = read(&f, &sf, 0);
        assert!(!da && !db, "nothing passed the limit");
        same(&a, &alone(&f, 1, 0));
        same(&b, &alone(&f, 0, 0));
        assert_eq!(a.len() + b.len(), ROWS as usize);
        // A pool claims its rows once: a second stream reads on its own.
        assert!(!sf.claim(0));
        // A pool the file was not shared for is not claimed.
        assert!(!sf.claim(7));
    }

    #[test]
    fn a_stalled_pool_is_detached_and_resumes_at_its_first_row_not_taken() {
        let f = file();
        // Room for one read batch's pool-1 rows, not two.
        let sf = shared(&f, 50_000);
        assert!(sf.claim(0) && sf.claim(1));
        let mut b = Batch::default();
        assert!(matches!(sf.next(1, &mut b).unwrap(), Next::Rows));
        let mut first = rows(&b);
        // Pool 1 stalls while pool 0 reads to the end.
        let (a, _) = read(&f, &sf, 0);
        same(&a, &alone(&f, 0, 0));
        let (rest, detached) = read(&f, &sf, 1);
        assert!(detached, "pool 1's queue passed the limit");
        assert!(rest[0].1 > first.last().unwrap().1);
        first.extend(rest);
        same(&first, &alone(&f, 1, 0));
    }

    #[test]
    fn two_streams_on_two_threads_read_every_row() {
        let f = file();
        for limit in [1, 30_000, QUEUE_EVENTS] {
            let sf = shared(&f, limit);
            assert!(sf.claim(0) && sf.claim(1));
            let (a, b) = std::thread::scope(|s| {
                let a = s.spawn(|| read(&f, &sf, 0).0);
                let b = s.spawn(|| read(&f, &sf, 1).0);
                (a.join().unwrap(), b.join().unwrap())
            });
            same(&a, &alone(&f, 0, 0));
            same(&b, &alone(&f, 1, 0));
        }
    }
}
