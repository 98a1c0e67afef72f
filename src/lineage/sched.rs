//! The scheduler: drives every pool's stream through a backend in seq
//! order, resolving copies across pools, and records seq holes as `Gap`s
//! (the backend marks content before a hole uncertain). `groups` splits
//! the pools into groups no copy connects, which replay apart
//! (`lineage::groups`).
//!
//! Pools are advanced in turns (sinks first, in reverse topological order).
//! A copy `write` on pool D with source (P, src_seq) pulls P forward until
//! it has applied every event up to src_seq; P captures the source slots of
//! every planned copy just before it moves past that copy's src_seq, and the
//! captured content waits in `payloads` until D applies the copy. Memory is
//! the slot state plus the captured payloads in flight (bounded by how far
//! the streams drift apart), never the trace.
//!
//! Pools may copy to each other in both directions (a device pool offloads
//! to a `cache` tier and loads back): the merge is causal, a pool waits
//! only while its next event is a copy whose source has not reached
//! src_seq. Two copies that wait on each other (each one's source lies at
//! or after the other) have no possible order: an error naming both rows.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use super::backend::{Backend, Counters, Payload, ReadRun};
use super::input::{Ev, Plan, PoolStream, duplicate};
use crate::error::{Error, Location, Result};
use crate::progress::Reporter;
use crate::trace::read::Trace;

/// A hole in one pool's seq stream: the events strictly between
/// `after_seq` and `before_seq` are missing (`after_seq` null: before the
/// first event recorded).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Gap {
    pub pool: u16,
    pub after_seq: Option<u64>,
    pub before_seq: u64,
}

impl Gap {
    /// Number of seq values missing.
    pub fn missing(&self) -> u64 {
        self.before_seq - self.after_seq.map(|a| a + 1).unwrap_or(0)
    }
}

pub use super::input::groups;

/// Cleared payloads a scheduler keeps for its next captures.
const SPARE_PAYLOADS: usize = 64;

/// Events a pool applies per turn before the next pool gets its turn.
const TURN_EVENTS: usize = 64 * 1024;
/// Applied events between two reports to the progress reporter.
const REPORT_EVERY: u64 = 64 * 1024;

struct PoolRt {
    id: u16,
    /// Opened when the pool first needs events and closed (its reader
    /// thread joined) at its end, so only pools in progress hold a reader.
    stream: Option<PoolStream>,
    /// Current batch: events and, in parallel, where each came from.
    buf: Vec<crate::schema::KvEvent>,
    locs: Vec<(u32, u64)>,
    pos: usize,
    /// Last applied event (seq, file, row).
    last: Option<(u64, u32, u64)>,
    done: bool,
    /// The pool's next event is a copy whose source is being pulled forward.
    waiting: bool,
    caps: super::copies::CopyStream,
}

/// The refusal of a deployment whose replayed pools declare more slots
/// than a backend that allocates every declared slot can hold.
fn over_slot_limit(trace: &Trace, backend: &str, i: usize, total: u64, limit: u64) -> Error {
    Error::invalid(
        Location::file(&trace.dir.join("trace.json"))
            .column(&format!("deployment.pools[{i}].capacity_tokens")),
        format!(
            "the replayed pools declare {total} slots up to this pool; the {backend} backend \
             allocates every declared slot and holds at most {limit}"
        ),
        "replay with --backend cpu: its slot table grows only with the slots the trace touches",
    )
}

/// A backend's refusal of one event of a batch (`Invalid` with no file and
/// `row` = the event's index in the batch) with the event's file and row.
fn at_event(err: Error, loc_of: impl FnOnce(usize) -> (std::path::PathBuf, u64)) -> Error {
    match err {
        Error::Invalid {
            mut loc,
            what,
            hint,
        } if loc.file.is_none() => {
            if let Some(k) = loc.row {
                let (file, row) = loc_of(k as usize);
                loc.file = Some(file);
                loc.row = Some(row);
            }
            Error::Invalid { loc, what, hint }
        }
        other => other,
    }
}

/// Output of the scheduler, before aggregation.
pub struct Sched<'a> {
    plan: &'a Plan,
    backend: &'a mut dyn Backend,
    pools: Vec<PoolRt>,
    index: super::backend::PoolMap<usize>,
    payloads: HashMap<(u16, u64), Payload>,
    scratch: Payload,
    /// Applied copies' payloads, cleared, for the next captures (a copy
    /// per request on a PD trace: no allocation per copy).
    spare: Vec<Payload>,
    /// An applied copy's payload for the exchange (its source replays on
    /// another thread), handed back with the next copy taken.
    handed_back: Option<Payload>,
    pub runs: Vec<ReadRun>,
    pub counters: Counters,
    pub gaps: Vec<Gap>,
    /// Copies whose source seq lies beyond the end of the source stream.
    pub late_sources: BTreeMap<u16, (u64, u64)>,
    /// Events applied so far (to see whether a round of turns moved).
    applied: u64,
    /// Events applied since the reporter was last told (it is told every
    /// `REPORT_EVERY`: an atomic add per batch or copy showed in profiles).
    unreported: u64,
    reporter: &'a dyn Reporter,
    sink: &'a mut dyn FnMut(&[ReadRun]),
    /// Copies to and from pools replayed on other threads.
    exchange: Option<&'a super::exchange::Exchange>,
}

impl<'a> Sched<'a> {
    pub fn new(
        trace: &'a Trace,
        plan: &'a Plan,
        backend: &'a mut dyn Backend,
        reporter: &'a dyn Reporter,
        sink: &'a mut dyn FnMut(&[ReadRun]),
    ) -> Result<Self> {
        Self::for_pools(trace, plan, None, backend, reporter, sink)
    }

    /// As `new`, replaying only `pools` of the plan (None: all), which
    /// must hold every source of their copies: a group `groups` found.
    pub fn for_pools(
        trace: &'a Trace,
        plan: &'a Plan,
        pools: Option<&std::collections::BTreeSet<u16>>,
        backend: &'a mut dyn Backend,
        reporter: &'a dyn Reporter,
        sink: &'a mut dyn FnMut(&[ReadRun]),
    ) -> Result<Self> {
        let order: Vec<u16> = plan
            .order
            .iter()
            .copied()
            .filter(|p| pools.is_none_or(|s| s.contains(p)))
            .collect();
        let from_start = trace.manifest.from_engine_start();
        // pool id -> (position in the manifest's list, capacity)
        let declared: HashMap<u16, (usize, u64)> = trace
            .deployment()
            .pools
            .iter()
            .enumerate()
            .map(|(i, p)| (p.id, (i, p.capacity_tokens)))
            .collect();
        let capacity = |id: u16| declared.get(&id).copied().unwrap_or((0, 0));
        if let Some(limit) = backend.slot_limit() {
            let mut total = 0u64;
            for &id in &order {
                let (i, cap) = capacity(id);
                total = total.saturating_add(cap);
                if total > limit {
                    return Err(over_slot_limit(trace, backend.name(), i, total, limit));
                }
            }
        }
        let mut pools = Vec::new();
        let mut index = super::backend::PoolMap::default();
        for &id in &order {
            backend.add_pool(id, capacity(id).1, from_start)?;
            index.insert(id, pools.len());
            pools.push(PoolRt {
                id,
                stream: None,
                buf: Vec::new(),
                locs: Vec::new(),
                pos: 0,
                last: None,
                done: false,
                waiting: false,
                caps: plan.copies.stream(id)?,
            });
        }
        Ok(Sched {
            plan,
            backend,
            pools,
            index,
            payloads: HashMap::new(),
            scratch: Payload::default(),
            spare: Vec::new(),
            handed_back: None,
            runs: Vec::new(),
            counters: Counters::default(),
            gaps: Vec::new(),
            late_sources: BTreeMap::new(),
            applied: 0,
            unreported: 0,
            reporter,
            sink,
            exchange: None,
        })
    }

    /// Copies whose source or destination pool is not among this
    /// scheduler's go through `exchange` (pools on other threads).
    pub fn with_exchange(mut self, exchange: &'a super::exchange::Exchange) -> Self {
        self.exchange = Some(exchange);
        self
    }

    /// Runs every pool to the end.
    ///
    /// Only pools whose consumers are all done take turns of their own; a
    /// source is otherwise advanced by its consumers' copies alone, so it
    /// never runs far ahead of them (which would hold captured copies in
    /// memory for the whole trace).
    pub fn run(&mut self) -> Result<()> {
        let r = self.run_turns();
        // The events applied since the last report, on every path out (an
        // error included): the reporter is told every event applied.
        self.reporter.advance(std::mem::take(&mut self.unreported));
        r
    }

    fn run_turns(&mut self) -> Result<()> {
        let order: Vec<usize> = (0..self.pools.len()).rev().collect();
        // One pass over the copy edges (not one per pool).
        let mut consumers: Vec<Vec<usize>> = vec![Vec::new(); self.pools.len()];
        for (src, dst) in &self.plan.edges {
            if let (Some(&s), Some(&d)) = (self.index.get(src), self.index.get(dst))
                && s != d
            {
                // A copy inside one pool captures its source as the pool
                // passes src_seq (its own turn), so it consumes no other.
                consumers[s].push(d);
            }
        }
        loop {
            let mut any = false;
            let (before, done_before) = (self.applied, self.done_pools());
            for &p in &order {
                if !self.pools[p].done {
                    any = true;
                    if consumers[p].iter().all(|&c| self.pools[c].done) {
                        self.advance(p, None, TURN_EVENTS)?;
                    }
                }
            }
            if !any {
                break;
            }
            if self.applied == before && self.done_pools() == done_before {
                // Pools that copy to each other both consume the other: the
                // first one left (sinks first) takes a turn; its copies pull
                // their sources forward as far as they need.
                if let Some(&p) = order.iter().find(|&&p| !self.pools[p].done) {
                    self.advance(p, None, TURN_EVENTS)?;
                }
            }
        }
        if let Some(((pool, seq), _)) = self.payloads.iter().next() {
            return Err(Error::Other(format!(
                "replay: the copy at pool {pool} seq {seq} was captured but never applied"
            )));
        }
        self.gaps
            .sort_by_key(|g| (g.pool, g.after_seq, g.before_seq));
        Ok(())
    }

    /// Counts `n` applied events toward the reporter.
    fn progress(&mut self, n: u64) {
        self.unreported += n;
        if self.unreported >= REPORT_EVERY {
            self.reporter.advance(std::mem::take(&mut self.unreported));
        }
    }

    fn done_pools(&self) -> usize {
        self.pools.iter().filter(|p| p.done).count()
    }

    /// The refusal of two copies that wait on each other: pool `p`'s next
    /// event copies from pool `q`, whose next event copies from `p`.
    fn deadlock(&self, p: usize, q: usize) -> Error {
        let row = |i: usize| {
            let pool = &self.pools[i];
            let (f, r) = pool.locs[pool.pos];
            let e = &pool.buf[pool.pos];
            let src = e.src.expect("a waiting pool's head is a copy");
            (
                self.plan.files[f as usize].clone(),
                r,
                e.pool,
                e.seq,
                src.pool,
                src.seq,
            )
        };
        let (fq, rq, pq, sq, qsp, qss) = row(q);
        let (fp, rp, pp, sp, psp, pss) = row(p);
        Error::invalid(
            Location::file(&fp).row(rp).column("src_seq"),
            format!(
                "copies wait on each other: this copy (pool {pp} seq {sp}) reads pool {psp} as of \
                 seq {pss}, but pool {qsp}'s copy at seq {sq} ({} row {rq}) reads pool {pq} as of \
                 seq {qss}, which is not before this copy; no order applies both",
                fq.display()
            ),
            "a copy's source event must precede it: check src_seq of both rows (the source \
             state a tier load or transfer read)",
        )
    }

    /// Ensures pool `p` has a current batch; false at the end of its stream.
    fn fill(&mut self, p: usize) -> Result<bool> {
        let pool = &mut self.pools[p];
        if pool.pos < pool.buf.len() {
            return Ok(true);
        }
        if pool.done {
            return Ok(false);
        }
        let plan = self.plan;
        let stream = pool.stream.get_or_insert_with(|| {
            PoolStream::new(plan, plan.runs.get(&pool.id).cloned().unwrap_or_default())
        });
        let b = stream.next_batch()?;
        let old = super::input::Batch {
            events: std::mem::replace(&mut pool.buf, b.events),
            locs: std::mem::replace(&mut pool.locs, b.locs),
        };
        stream.recycle(old);
        pool.pos = 0;
        if pool.buf.is_empty() {
            pool.done = true;
            pool.stream = None;
            self.finish_captures(p, u64::MAX)?;
            return Ok(false);
        }
        Ok(true)
    }

    /// Captures every planned copy of pool `p` with src_seq < `before`
    /// (the pool has applied everything up to, and nothing after, them).
    fn finish_captures(&mut self, p: usize, before: u64) -> Result<()> {
        loop {
            let pool = &self.pools[p];
            let Some(c) = pool.caps.peek() else {
                return Ok(());
            };
            if c.src_seq >= before {
                return Ok(());
            }
            let last = pool.last.map(|l| l.0);
            // The state just after src_seq is known only if src_seq itself
            // was applied; otherwise it lies in a hole (or past the end).
            let lost = last != Some(c.src_seq);
            if pool.done && last.is_none_or(|l| c.src_seq > l) {
                let e = self
                    .late_sources
                    .entry(pool.id)
                    .or_insert((c.src_seq, c.src_seq));
                e.0 = e.0.min(c.src_seq);
                e.1 = e.1.max(c.src_seq);
            }
            let id = pool.id;
            self.pools[p].caps.pop()?;
            self.backend
                .capture(id, c.src_start, c.count, lost, &mut self.scratch)?;
            let next = self.spare.pop().unwrap_or_default();
            let payload = std::mem::replace(&mut self.scratch, next);
            match self.exchange {
                Some(x) if !self.index.contains_key(&c.dst_pool) => {
                    if let Some(back) = x.put(c.dst_pool, c.dst_seq, payload)? {
                        self.recycle(back, id);
                    }
                }
                _ => {
                    self.payloads.insert((c.dst_pool, c.dst_seq), payload);
                }
            }
        }
    }

    /// Applies pool `p`'s events with seq <= `until` (all if None), at most
    /// `budget` of them.
    fn advance(&mut self, p: usize, until: Option<u64>, budget: usize) -> Result<()> {
        let mut left = budget;
        while left > 0 {
            if !self.fill(p)? {
                return Ok(());
            }
            let pool = &self.pools[p];
            let next_cap = pool.caps.peek().map(|c| c.src_seq).unwrap_or(u64::MAX);
            let start = pool.pos;
            let mut prev = pool.last;
            let mut i = start;
            let mut stop_gap = None;
            let limit = start.saturating_add(left).min(pool.buf.len());
            while i < limit {
                let e = &pool.buf[i];
                let seq = e.seq;
                if until.is_some_and(|u| seq > u) || seq > next_cap || e.src.is_some() {
                    break;
                }
                match prev {
                    Some((ps, pf, pr)) if seq <= ps => {
                        let files = &self.plan.files;
                        if seq == ps {
                            return Err(duplicate(
                                pool.id,
                                seq,
                                &files[pf as usize],
                                pr,
                                &files[pool.locs[i].0 as usize],
                                pool.locs[i].1,
                            ));
                        }
                        return Err(Error::Other(format!(
                            "replay: pool {} stream out of order at seq {seq} ({} row {})",
                            pool.id,
                            files[pool.locs[i].0 as usize].display(),
                            pool.locs[i].1
                        )));
                    }
                    Some((ps, _, _)) if seq > ps + 1 => {
                        if i > start {
                            break; // apply up to the gap first
                        }
                        stop_gap = Some((Some(ps), seq));
                    }
                    None if seq > 0 => {
                        stop_gap = Some((None, seq));
                    }
                    _ => {}
                }
                prev = Some((seq, pool.locs[i].0, pool.locs[i].1));
                i += 1;
                if stop_gap.is_some() {
                    break;
                }
            }
            let id = pool.id;
            if let Some((after, before)) = stop_gap {
                self.gaps.push(Gap {
                    pool: id,
                    after_seq: after,
                    before_seq: before,
                });
                self.backend.mark_gap(id, before);
            }
            if i > start {
                let pool = &mut self.pools[p];
                self.backend
                    .apply(id, &pool.buf[start..i], &mut self.runs, &mut self.counters)
                    .map_err(|err| {
                        at_event(err, |k| {
                            let (f, r) = pool.locs[start + k];
                            (self.plan.files[f as usize].clone(), r)
                        })
                    })?;
                pool.pos = i;
                pool.last = prev;
                left -= i - start;
                self.applied += (i - start) as u64;
                self.progress((i - start) as u64);
                self.flush_runs();
                continue;
            }
            // Nothing applied: the head needs a capture, a copy, or is past `until`.
            let ev = self.pools[p].buf[start];
            let (efile, erow) = self.pools[p].locs[start];
            let e = Ev {
                ev,
                file: efile,
                row: erow,
            };
            if until.is_some_and(|u| e.ev.seq > u) {
                return Ok(());
            }
            if e.ev.seq > next_cap {
                self.finish_captures(p, e.ev.seq)?;
                continue;
            }
            // A copy: make sure its source state is captured, then apply it.
            let src = e.ev.src.expect("copy");
            let key = (id, e.ev.seq);
            if !self.payloads.contains_key(&key)
                && let (None, Some(x)) = (self.index.get(&src.pool), self.exchange)
            {
                // The source replays on another thread.
                let payload = x.take(id, e.ev.seq, src.pool, self.handed_back.take())?;
                self.payloads.insert(key, payload);
            }
            if !self.payloads.contains_key(&key) {
                let q = *self.index.get(&src.pool).ok_or_else(|| {
                    Error::Other(format!("replay: unknown source pool {}", src.pool))
                })?;
                if self.pools[q].waiting {
                    return Err(self.deadlock(p, q));
                }
                self.pools[p].waiting = true;
                let pulled = self.advance(q, Some(src.seq), usize::MAX);
                self.pools[p].waiting = false;
                pulled?;
                // q has applied everything <= src.seq; capture what waits on it.
                let ready_before = src.seq.saturating_add(1);
                if !self.fill(q)? || self.pools[q].buf[self.pools[q].pos].seq >= ready_before {
                    self.finish_captures(q, ready_before)?;
                }
            }
            let payload = self.payloads.remove(&key).ok_or_else(|| {
                Error::Other(format!(
                    "replay: no captured source for the copy at pool {id} seq {}",
                    e.ev.seq
                ))
            })?;
            // ordering checks for the copy event itself
            if let Some((ps, pf, pr)) = self.pools[p].last {
                if e.ev.seq <= ps {
                    let files = &self.plan.files;
                    return Err(duplicate(
                        id,
                        e.ev.seq,
                        &files[pf as usize],
                        pr,
                        &files[e.file as usize],
                        e.row,
                    ));
                }
                if e.ev.seq > ps + 1 {
                    self.gaps.push(Gap {
                        pool: id,
                        after_seq: Some(ps),
                        before_seq: e.ev.seq,
                    });
                    self.backend.mark_gap(id, e.ev.seq);
                }
            } else if e.ev.seq > 0 {
                self.gaps.push(Gap {
                    pool: id,
                    after_seq: None,
                    before_seq: e.ev.seq,
                });
                self.backend.mark_gap(id, e.ev.seq);
            }
            self.backend
                .apply_copy(id, &e.ev, &payload, &mut self.counters)
                .map_err(|err| {
                    at_event(err, |_| (self.plan.files[e.file as usize].clone(), e.row))
                })?;
            self.recycle(payload, src.pool);
            let pool = &mut self.pools[p];
            pool.pos += 1;
            pool.last = Some((e.ev.seq, e.file, e.row));
            left -= 1;
            self.applied += 1;
            self.progress(1);
        }
        Ok(())
    }

    /// Keeps an applied copy's payload for a later capture: here when its
    /// source pool replays on this scheduler, else handed back to the
    /// exchange with the next copy taken from it (for the source's
    /// thread). Beyond `SPARE_PAYLOADS`, or when large, it is dropped.
    fn recycle(&mut self, mut payload: Payload, src_pool: u16) {
        if payload.bytes() > super::exchange::SPARE_MAX_BYTES {
            return;
        }
        payload.clear();
        if self.exchange.is_some() && !self.index.contains_key(&src_pool) {
            self.handed_back = Some(payload);
        } else if self.spare.len() < SPARE_PAYLOADS {
            self.spare.push(payload);
        }
    }

    fn flush_runs(&mut self) {
        if !self.runs.is_empty() {
            (self.sink)(&self.runs);
            self.runs.clear();
        }
    }
}
