//! The live replay: the lineage rule applied to events as the sidecar
//! writes them, with the scheduler's discipline (`lineage::sched`) made
//! incremental.
//!
//! Every pool's events wait in a short queue (`holdback`, at most
//! `max_held` events) before the CPU backend (`lineage::cpu`, the backend
//! scope uses, through `lineage::Backend`: one slot rule, one read
//! classification) applies them. The wait is what lets a copy be exact: a
//! copy (a `write` with src) needs its source pool's state just after
//! `src_seq`. A copy that has arrived registers its source; the source
//! pool stops before the first event past that `src_seq` and captures
//! the slots first (as `sched::finish_captures` does), and a copy whose
//! source has not reached `src_seq` pulls it forward or waits.
//!
//! A copy whose source had already moved past `src_seq` when it arrived
//! (engines on other hosts, connections read at different speeds) is
//! rebuilt exactly from the source pool's history: every content-changing
//! event applied (`rule::changes_content`, and copies) keeps what its
//! slots held before it, at most `history` events per pool, so the source
//! as of `src_seq` is its current content with the later events undone
//! (`copies_rebuilt`). One that is older than the history, or with a hole
//! in its source after `src_seq` (`copies_late`), or that waited past
//! `copy_wait` or `max_held` (`copies_timed_out`), takes the source's
//! current content marked uncertain: counted, never a silent guess.
//!
//! Seq holes are marked exactly as the scheduler marks them (a first event
//! above seq 0, a jump), so reads after a hole are uncertain as in scope.
//!
//! Where the live view's uncertainty is its own (the trace is exact), the
//! slots are tainted: the destination of a copy taken from its source's
//! current content, every slot of a pool when the live queue dropped
//! events inside a hole the view marks (`view_dropped`), and a copy's
//! destination when its source slots were tainted. A `write` or `scrub`
//! clears its slots (their content is the event's), a copy sets or clears
//! its destination by its source. A read of tainted slots is
//! view-suspect: the detector does not alert on its uncertain foreign
//! runs (it counts them), but still alerts on its certain ones. Every
//! other uncertain read is alerted as scope would report it.
//! Memory: the backend's touched slots, the queues (bounded), the captured
//! copies in flight and the exposure sets; never the trace's length.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::error::Result;
use crate::lineage::backend::{Backend, Counters, Payload, ReadRun, SlotVal};
use crate::lineage::cpu::CpuBackend;
use crate::lineage::rule::changes_content;
use crate::lineage::{Exposures, Gap, LineageOutcome};
use crate::schema::{KvEvent, Op};
use crate::trace::manifest::Deployment;

use super::taint::Taint;

/// Bounds of the live replay.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// How long an event waits before it is applied (unless a copy pulls
    /// its pool forward first).
    pub holdback: Duration,
    /// Events one pool's queue holds at most; past it the oldest are
    /// applied at once.
    pub max_held: usize,
    /// How long a copy waits for its source pool to reach `src_seq`.
    pub copy_wait: Duration,
    /// Content-changing events per pool whose prior content is kept, so a
    /// copy that arrives after its source moved on is rebuilt exactly; 0
    /// keeps none.
    pub history: usize,
}

impl Default for Bounds {
    fn default() -> Self {
        Bounds {
            holdback: Duration::from_millis(200),
            max_held: 1 << 18,
            copy_wait: Duration::from_secs(5),
            history: 1 << 16,
        }
    }
}

#[derive(Default)]
struct PoolLive {
    held: VecDeque<(KvEvent, Instant)>,
    /// seq of the last applied event.
    last: Option<u64>,
    /// Since when the head (a copy) has waited for its source.
    wait_since: Option<Instant>,
    /// Its head copy is pulling its source forward (a cycle check).
    pulling: bool,
    /// before_seq of the latest hole marked.
    last_gap: Option<u64>,
    history: History,
    /// Slots whose content the live view may have wrong where the trace
    /// has it right (the module's doc).
    tainted: Taint,
    /// Seq ranges (inclusive) the live queue dropped, not yet passed.
    view_holes: VecDeque<(u64, u64)>,
    capacity: u64,
}

/// Seq ranges of dropped events a pool keeps at most; past it the last
/// two merge (a wider range only taints more).
const VIEW_HOLES_KEPT: usize = 1024;

/// What one pool's latest content-changing events found in their slots,
/// oldest first: an entry per event, its prior content as runs of equal
/// slot values in a shared queue.
#[derive(Default)]
struct History {
    /// (seq, slot_start, slot_count, runs, whether some of its slots were
    /// tainted just before it).
    entries: VecDeque<(u64, u32, u32, u32, bool)>,
    runs: VecDeque<(u32, SlotVal)>,
    /// Every content-changing event after this seq is in `entries` (None:
    /// since the pool's first event).
    after: Option<u64>,
}

impl History {
    /// Keeps event `e`'s prior content `prior` (and whether it was
    /// tainted), dropping the oldest past `max` entries (or four runs an
    /// entry).
    fn push(&mut self, e: &KvEvent, prior: &Payload, tainted: bool, max: usize) {
        let runs = prior.runs();
        self.entries.push_back((
            e.seq,
            e.slot_start,
            e.slot_count,
            runs.len() as u32,
            tainted,
        ));
        self.runs.extend(runs.iter().copied());
        while self.entries.len() > max || self.runs.len() > 4 * max {
            let Some((seq, _, _, n, _)) = self.entries.pop_front() else {
                break;
            };
            self.runs.drain(..n as usize);
            self.after = Some(seq);
        }
    }

    /// Undoes, in `vals` (the current content of slots `a..a + vals.len()`),
    /// every kept event after `seq`, newest first: None when the history
    /// does not reach back to `seq`, else whether an undone event's slots
    /// were tainted before it.
    fn undo_after(&self, seq: u64, a: u64, vals: &mut [SlotVal]) -> Option<bool> {
        if self.after.is_some_and(|after| seq < after) {
            return None;
        }
        let mut tainted = false;
        let b = a + vals.len() as u64;
        let from = self.entries.partition_point(|x| x.0 <= seq);
        let mut end = self.runs.len();
        for k in (0..self.entries.len()).rev() {
            let (_, start, count, n, was_tainted) = self.entries[k];
            let first = end - n as usize;
            if k >= from && (start as u64) < b && a < start as u64 + count as u64 {
                tainted |= was_tainted;
                let mut s = start as u64;
                for i in first..end {
                    let (len, v) = self.runs[i];
                    let (x, y) = (s.max(a), (s + len as u64).min(b));
                    if x < y {
                        vals[(x - a) as usize..(y - a) as usize].fill(v);
                    }
                    s += len as u64;
                }
            }
            if k < from {
                break;
            }
            end = first;
        }
        Some(tainted)
    }
}

/// A piece of tainted slots a read event read: (pool, seq, start, end).
pub type Suspect = (u16, u64, u64, u64);

/// Takes a batch's unclean read runs and the tainted pieces its read
/// events read (in seq order).
pub type OnRuns<'a> = dyn FnMut(&[ReadRun], &[Suspect]) + 'a;

/// A copy that arrived, waiting for its source to be captured:
/// (src_seq, dst_pool, dst_seq) -> (src_slot_start, slot_count).
type Caps = BTreeMap<(u64, u16, u64), (u32, u32)>;

/// The live replay of one capture.
pub struct Engine {
    backend: CpuBackend,
    pools: BTreeMap<u16, PoolLive>,
    /// Per source pool: the copies from it not yet captured.
    caps: HashMap<u16, Caps>,
    /// Captured copies: (dst_pool, dst_seq) -> the source content.
    payloads: HashMap<(u16, u64), Payload>,
    pub exposures: Exposures,
    pub counters: Counters,
    pub gaps: Vec<Gap>,
    pub late_sources: BTreeMap<u16, (u64, u64)>,
    /// Copies whose source had applied past src_seq when they arrived,
    /// rebuilt from its history (exact), and not (uncertain).
    pub copies_rebuilt: u64,
    pub copies_late: u64,
    /// Copies that waited past the bound for their source.
    pub copies_timed_out: u64,
    /// Events of pools the deployment does not declare (never written by
    /// the recorder; counted defensively).
    pub unknown_pool_events: u64,
    /// Why the replay stopped, if it did (a backend refusal: over the
    /// touched-slot limit); events after it are counted, not applied.
    pub stopped: Option<String>,
    pub events_unapplied: u64,
    bounds: Bounds,
    runs: Vec<ReadRun>,
    scratch: Payload,
    /// The content-changing extents of the batch being split (start ->
    /// end, disjoint).
    touched: BTreeMap<u64, u64>,
    vals: Vec<SlotVal>,
    /// Captured copies whose source slots were tainted: (dst_pool, dst_seq).
    tainted_payloads: BTreeSet<(u16, u64)>,
    /// The tainted pieces the read events of the batch just applied read,
    /// in seq order.
    suspect: Vec<Suspect>,
    pieces: Vec<(u64, u64)>,
}

impl Engine {
    pub fn new(deployment: &Deployment, from_engine_start: bool, bounds: Bounds) -> Result<Self> {
        let mut backend = CpuBackend::new();
        let mut pools = BTreeMap::new();
        for p in &deployment.pools {
            backend.add_pool(p.id, p.capacity_tokens, from_engine_start)?;
            pools.insert(
                p.id,
                PoolLive {
                    capacity: p.capacity_tokens,
                    ..PoolLive::default()
                },
            );
        }
        Ok(Engine {
            backend,
            pools,
            caps: HashMap::new(),
            payloads: HashMap::new(),
            exposures: Exposures::default(),
            counters: Counters::default(),
            gaps: Vec::new(),
            late_sources: BTreeMap::new(),
            copies_rebuilt: 0,
            copies_late: 0,
            copies_timed_out: 0,
            unknown_pool_events: 0,
            stopped: None,
            events_unapplied: 0,
            bounds,
            runs: Vec::new(),
            scratch: Payload::default(),
            touched: BTreeMap::new(),
            vals: Vec::new(),
            tainted_payloads: BTreeSet::new(),
            suspect: Vec::new(),
            pieces: Vec::new(),
        })
    }

    /// Events waiting in the queues, and copies waiting for their source.
    pub fn held(&self) -> (u64, u64) {
        let held = self.pools.values().map(|p| p.held.len() as u64).sum();
        let waiting = self
            .pools
            .values()
            .filter(|p| p.wait_since.is_some())
            .count() as u64;
        (held, waiting)
    }

    /// When the oldest event still held arrived.
    pub fn oldest(&self) -> Option<Instant> {
        self.pools
            .values()
            .filter_map(|p| p.held.front().map(|h| h.1))
            .min()
    }

    /// An event as written (its seq assigned), arrived at `at`.
    pub fn push(&mut self, e: KvEvent, at: Instant) {
        if self.stopped.is_some() {
            self.events_unapplied += 1;
            return;
        }
        let Some(p) = self.pools.get_mut(&e.pool) else {
            self.unknown_pool_events += 1;
            return;
        };
        p.held.push_back((e, at));
        if let Some(src) = e.src {
            let late = self
                .pools
                .get(&src.pool)
                .and_then(|q| q.last)
                .is_some_and(|l| l > src.seq);
            if !late {
                self.caps
                    .entry(src.pool)
                    .or_default()
                    .insert((src.seq, e.pool, e.seq), (src.slot_start, e.slot_count));
            }
        }
    }

    /// The live queue dropped pool `pool`'s events with seqs `lo..=hi`
    /// (the trace has them). The hole the view marks over them taints
    /// every slot of the pool: call before pushing the events after them.
    pub fn view_dropped(&mut self, pool: u16, lo: u64, hi: u64) {
        let Some(p) = self.pools.get_mut(&pool) else {
            return;
        };
        match p.view_holes.back_mut() {
            Some(last) if lo <= last.1.saturating_add(1) => last.1 = last.1.max(hi),
            _ => p.view_holes.push_back((lo, hi)),
        }
        if p.view_holes.len() > VIEW_HOLES_KEPT {
            let (_, hi) = p.view_holes.pop_back().expect("over the bound");
            let last = p.view_holes.back_mut().expect("over the bound");
            last.1 = last.1.max(hi);
        }
    }

    /// Slots of pool `pool` the view holds tainted (tests, metrics).
    pub fn tainted_slots(&self, pool: u16) -> u64 {
        self.pools.get(&pool).map_or(0, |p| p.tainted.len())
    }

    /// Applies what is ripe (older than the holdback, or over the queue
    /// bound; everything when `closing`), handing each batch's unclean
    /// read runs to `on_runs` with the tainted pieces its reads read.
    pub fn pump(&mut self, now: Instant, closing: bool, on_runs: &mut OnRuns) {
        if self.stopped.is_some() {
            return;
        }
        if let Err(e) = self.pump_inner(now, closing, on_runs) {
            let n: u64 = self.pools.values().map(|p| p.held.len() as u64).sum();
            self.events_unapplied += n;
            for p in self.pools.values_mut() {
                p.held.clear();
            }
            self.stopped = Some(e.to_string().replace('\n', " "));
        }
    }

    fn pump_inner(&mut self, now: Instant, closing: bool, on_runs: &mut OnRuns) -> Result<()> {
        let ids: Vec<u16> = self.pools.keys().copied().collect();
        loop {
            let mut moved = false;
            for &id in &ids {
                moved |= self.advance(id, None, now, closing, on_runs)?;
            }
            if moved {
                continue;
            }
            if !closing {
                return Ok(());
            }
            // Closing and stuck: copies waiting on each other (the trace
            // would be refused by scope). The first one takes its source
            // as it is, uncertain.
            let Some(&id) = ids.iter().find(|id| !self.pools[id].held.is_empty()) else {
                break;
            };
            self.give_up_head(id)?;
        }
        // Every stream has ended: copies still waiting to be captured
        // read their source's final state (late sources, as scope).
        let srcs: Vec<u16> = self.caps.keys().copied().collect();
        for q in srcs {
            self.finish_captures(q, u64::MAX, true)?;
        }
        self.payloads.clear();
        self.tainted_payloads.clear();
        self.gaps
            .sort_by_key(|g| (g.pool, g.after_seq, g.before_seq));
        Ok(())
    }

    fn ripe(&self, id: u16, now: Instant, closing: bool) -> bool {
        let p = &self.pools[&id];
        match p.held.front() {
            None => false,
            Some((_, at)) => {
                closing
                    || p.held.len() > self.bounds.max_held
                    || now.saturating_duration_since(*at) >= self.bounds.holdback
            }
        }
    }

    /// Marks a hole before `seq` of pool `id` when there is one.
    fn gap_before(&mut self, id: u16, seq: u64) {
        let last = self.pools[&id].last;
        let gap = match last {
            Some(l) if seq > l + 1 => Some(Some(l)),
            None if seq > 0 => Some(None),
            _ => None,
        };
        let p = self.pools.get_mut(&id).expect("declared");
        // Dropped ranges this hole passes: a hole over one is the view's.
        let from = last.map_or(0, |l| l + 1);
        let mut dropped = false;
        while let Some(&(lo, hi)) = p.view_holes.front() {
            if lo >= seq {
                break;
            }
            dropped |= gap.is_some() && hi >= from;
            if hi > seq {
                // A merged range spans this seq: what lies after it stays
                // (holes in it are the queue's, on the safe side).
                p.view_holes.front_mut().expect("the front").0 = seq + 1;
                break;
            }
            p.view_holes.pop_front();
        }
        if dropped {
            let cap = p.capacity;
            p.tainted.insert(0, cap);
        }
        if let Some(after_seq) = gap {
            p.last_gap = Some(seq);
            self.gaps.push(Gap {
                pool: id,
                after_seq,
                before_seq: seq,
            });
            self.backend.mark_gap(id, seq);
        }
    }

    /// The lowest src_seq of a registered copy from pool `id`.
    fn next_cap(&self, id: u16) -> u64 {
        self.caps
            .get(&id)
            .and_then(|c| c.keys().next())
            .map_or(u64::MAX, |k| k.0)
    }

    /// Captures every registered copy from pool `q` with src_seq <
    /// `before`; `done`: the pool's stream has ended (late sources).
    fn finish_captures(&mut self, q: u16, before: u64, done: bool) -> Result<()> {
        loop {
            let Some(caps) = self.caps.get_mut(&q) else {
                return Ok(());
            };
            let Some((&(src_seq, dst_pool, dst_seq), &(start, count))) = caps.iter().next() else {
                self.caps.remove(&q);
                return Ok(());
            };
            if src_seq >= before {
                return Ok(());
            }
            caps.remove(&(src_seq, dst_pool, dst_seq));
            let last = self.pools[&q].last;
            let lost = last != Some(src_seq);
            if done && last.is_none_or(|l| src_seq > l) {
                let e = self.late_sources.entry(q).or_insert((src_seq, src_seq));
                e.0 = e.0.min(src_seq);
                e.1 = e.1.max(src_seq);
            }
            self.backend
                .capture(q, start, count, lost, &mut self.scratch)?;
            self.payloads
                .insert((dst_pool, dst_seq), std::mem::take(&mut self.scratch));
            // Captured across a hole the live queue made (the view marks
            // it just after), or from tainted slots: the copy is tainted.
            let p = &self.pools[&q];
            let view_hole = lost
                && p.view_holes
                    .iter()
                    .any(|&(lo, hi)| lo <= src_seq && last.is_none_or(|l| hi > l));
            if view_hole
                || p.tainted
                    .intersects(u64::from(start), u64::from(start) + u64::from(count))
            {
                self.tainted_payloads.insert((dst_pool, dst_seq));
            }
        }
    }

    /// Copy `e` into pool `id` applies: its destination is tainted when
    /// its payload is, and given exact content otherwise.
    fn taint_copy(&mut self, id: u16, e: &KvEvent) {
        let tainted = self.tainted_payloads.remove(&(id, e.seq));
        let p = self.pools.get_mut(&id).expect("declared");
        let (a, b) = (u64::from(e.slot_start), e.slot_end());
        if tainted {
            p.tainted.insert(a, b);
        } else {
            p.tainted.remove(a, b);
        }
    }

    /// Applies pool `id`'s queued events (ripe ones, or all with seq <=
    /// `until` when pulled forward by a copy). Whether anything moved.
    fn advance(
        &mut self,
        id: u16,
        until: Option<u64>,
        now: Instant,
        closing: bool,
        on_runs: &mut OnRuns,
    ) -> Result<bool> {
        let mut moved = false;
        loop {
            let Some(&(head, _)) = self.pools[&id].held.front() else {
                return Ok(moved);
            };
            if let Some(u) = until {
                if head.seq > u {
                    return Ok(moved);
                }
            } else if !self.ripe(id, now, closing) {
                return Ok(moved);
            }
            if head.seq > self.next_cap(id) {
                self.finish_captures(id, head.seq, false)?;
                continue;
            }
            if head.src.is_some() {
                if !self.copy(id, head, now, closing, on_runs)? {
                    return Ok(moved);
                }
                moved = true;
                continue;
            }
            // A batch of plain events: up to a copy, a hole after the
            // first, a registered capture point, or what is not ripe.
            let cap = self.next_cap(id);
            let p = &self.pools[&id];
            let (holdback, max_held) = (self.bounds.holdback, self.bounds.max_held);
            let over = p.held.len().saturating_sub(max_held);
            let mut n = 0;
            let mut prev = p.last;
            for (k, (e, at)) in p.held.iter().enumerate() {
                let hole = match prev {
                    Some(l) => e.seq > l + 1,
                    None => e.seq > 0,
                };
                let ok = e.src.is_none()
                    && (k == 0 || !hole)
                    && (k == 0 || e.seq <= cap)
                    && match until {
                        Some(u) => e.seq <= u,
                        None => {
                            closing || k < over || now.saturating_duration_since(*at) >= holdback
                        }
                    };
                if !ok {
                    break;
                }
                prev = Some(e.seq);
                n += 1;
            }
            self.gap_before(id, head.seq);
            let batch: Vec<KvEvent> = self
                .pools
                .get_mut(&id)
                .expect("declared")
                .held
                .drain(..n)
                .map(|(e, _)| e)
                .collect();
            self.apply_kept(id, &batch)?;
            self.pools.get_mut(&id).expect("declared").last = prev;
            if !self.runs.is_empty() {
                self.exposures.add_runs(&self.runs);
                on_runs(&self.runs, &self.suspect);
                self.runs.clear();
            }
            self.suspect.clear();
            moved = true;
        }
    }

    /// Applies the copy at the head of pool `id` if its source content is
    /// known (captured, or capturable now); false when it must wait.
    fn copy(
        &mut self,
        id: u16,
        e: KvEvent,
        now: Instant,
        closing: bool,
        on_runs: &mut OnRuns,
    ) -> Result<bool> {
        let src = e.src.expect("a copy");
        let key = (id, e.seq);
        if !self.payloads.contains_key(&key) {
            let registered = self
                .caps
                .get(&src.pool)
                .is_some_and(|c| c.contains_key(&(src.seq, id, e.seq)));
            if !registered || !self.pools.contains_key(&src.pool) {
                // The source had moved past src_seq when the copy arrived.
                if self.rebuild(e)? {
                    self.copies_rebuilt += 1;
                } else {
                    self.copies_late += 1;
                    self.take_current(id, e)?;
                }
            } else if src.pool != id && !self.pools[&src.pool].pulling {
                self.pools.get_mut(&id).expect("declared").pulling = true;
                let pulled = self.advance(src.pool, Some(src.seq), now, closing, on_runs);
                self.pools.get_mut(&id).expect("declared").pulling = false;
                pulled?;
                let q = &self.pools[&src.pool];
                let reached =
                    q.last == Some(src.seq) || q.held.front().is_some_and(|(h, _)| h.seq > src.seq);
                if reached {
                    self.finish_captures(src.pool, src.seq.saturating_add(1), false)?;
                } else if closing && q.held.is_empty() {
                    self.finish_captures(src.pool, src.seq.saturating_add(1), true)?;
                }
            }
        }
        if !self.payloads.contains_key(&key) {
            let p = self.pools.get_mut(&id).expect("declared");
            let since = *p.wait_since.get_or_insert(now);
            let waited = now.saturating_duration_since(since) >= self.bounds.copy_wait;
            if !(waited || p.held.len() > self.bounds.max_held) {
                return Ok(false);
            }
            self.copies_timed_out += 1;
            self.drop_cap(&e);
            self.take_current(id, e)?;
        }
        let payload = self.payloads.remove(&key).expect("captured above");
        self.gap_before(id, e.seq);
        self.keep_prior(id, &e, self.dst_tainted(id, &e))?;
        self.taint_copy(id, &e);
        self.backend
            .apply_copy(id, &e, &payload, &mut self.counters)?;
        let p = self.pools.get_mut(&id).expect("declared");
        p.held.pop_front();
        p.last = Some(e.seq);
        p.wait_since = None;
        Ok(true)
    }

    /// Stops copy `e` waiting: its registration goes.
    fn drop_cap(&mut self, e: &KvEvent) {
        let src = e.src.expect("a copy");
        if let Some(c) = self.caps.get_mut(&src.pool) {
            c.remove(&(src.seq, e.pool, e.seq));
        }
    }

    /// Applies a batch of plain events of pool `id`, keeping each
    /// content-changing event's prior content: the batch is cut before an
    /// event whose extent overlaps an earlier one's, so what is kept is
    /// what the slots held just before that event. Follows the taint in
    /// the batch's order: a read of tainted slots is view-suspect, a
    /// `write` or `scrub` clears its slots.
    fn apply_kept(&mut self, id: u16, batch: &[KvEvent]) -> Result<()> {
        let history = self.bounds.history > 0;
        if !history && self.pools[&id].tainted.is_empty() {
            return self
                .backend
                .apply(id, batch, &mut self.runs, &mut self.counters);
        }
        self.touched.clear();
        let mut from = 0;
        // A plain batch only clears taint: none now, none in the batch.
        let mut any_taint = !self.pools[&id].tainted.is_empty();
        for (k, e) in batch.iter().enumerate() {
            let (a, b) = (u64::from(e.slot_start), e.slot_end());
            let mut tainted = false;
            if any_taint {
                let p = self.pools.get_mut(&id).expect("declared");
                tainted = p.tainted.intersects(a, b);
                match e.op {
                    Op::Read if tainted => {
                        self.pieces.clear();
                        p.tainted.within(a, b, &mut self.pieces);
                        self.suspect
                            .extend(self.pieces.iter().map(|&(x, y)| (id, e.seq, x, y)));
                    }
                    Op::Write | Op::Scrub if tainted => p.tainted.remove(a, b),
                    _ => {}
                }
                any_taint = !p.tainted.is_empty();
            }
            if !history || !changes_content(e.op) || e.slot_count == 0 {
                continue;
            }
            let overlaps = self
                .touched
                .range(..b)
                .next_back()
                .is_some_and(|(_, &end)| end > a);
            if overlaps {
                self.backend
                    .apply(id, &batch[from..k], &mut self.runs, &mut self.counters)?;
                from = k;
                self.touched.clear();
            }
            self.keep_prior(id, e, tainted)?;
            self.touched.insert(a, b);
        }
        self.backend
            .apply(id, &batch[from..], &mut self.runs, &mut self.counters)
    }

    /// Keeps what event `e`'s slots of pool `id` hold before it applies,
    /// and whether they were tainted (`tainted`).
    fn keep_prior(&mut self, id: u16, e: &KvEvent, tainted: bool) -> Result<()> {
        if self.bounds.history == 0 || e.slot_count == 0 {
            return Ok(());
        }
        self.backend
            .capture(id, e.slot_start, e.slot_count, false, &mut self.scratch)?;
        let max = self.bounds.history;
        let p = self.pools.get_mut(&id).expect("declared");
        p.history.push(e, &self.scratch, tainted, max);
        Ok(())
    }

    /// Whether any of copy `e`'s destination slots are tainted now.
    fn dst_tainted(&self, id: u16, e: &KvEvent) -> bool {
        self.pools[&id]
            .tainted
            .intersects(u64::from(e.slot_start), e.slot_end())
    }

    /// The copy `e`, whose source pool had moved past `src_seq` when it
    /// arrived: its source as of `src_seq`, rebuilt from the pool's
    /// history, into `payloads`. False when the history does not reach
    /// back, or a hole after `src_seq` changed what the source's content
    /// is known as since.
    fn rebuild(&mut self, e: KvEvent) -> Result<bool> {
        let src = e.src.expect("a copy");
        let Some(p) = self.pools.get(&src.pool) else {
            return Ok(false);
        };
        if self.bounds.history == 0
            || p.last.is_none_or(|l| l < src.seq)
            || p.last_gap.is_some_and(|g| g > src.seq)
        {
            return Ok(false);
        }
        self.backend.capture(
            src.pool,
            src.slot_start,
            e.slot_count,
            false,
            &mut self.scratch,
        )?;
        self.vals.clear();
        self.vals.extend(self.scratch.iter());
        let p = &self.pools[&src.pool];
        let Some(undone_tainted) =
            p.history
                .undo_after(src.seq, u64::from(src.slot_start), &mut self.vals)
        else {
            return Ok(false);
        };
        self.scratch.clear();
        self.scratch.extend(self.vals.iter().copied());
        self.payloads
            .insert((e.pool, e.seq), std::mem::take(&mut self.scratch));
        // Tainted as of src_seq: an undone event's slots were, or the
        // slots are now (those changed since only add to it).
        let a = u64::from(src.slot_start);
        if undone_tainted || p.tainted.intersects(a, a + u64::from(e.slot_count)) {
            self.tainted_payloads.insert((e.pool, e.seq));
        }
        Ok(true)
    }

    /// The copy `e` into pool `id` takes its source's current content,
    /// uncertain (the state as of src_seq cannot be seen any more).
    fn take_current(&mut self, id: u16, e: KvEvent) -> Result<()> {
        let src = e.src.expect("a copy");
        self.backend.capture(
            src.pool,
            src.slot_start,
            e.slot_count,
            true,
            &mut self.scratch,
        )?;
        self.payloads
            .insert((id, e.seq), std::mem::take(&mut self.scratch));
        self.tainted_payloads.insert((id, e.seq));
        Ok(())
    }

    /// Closing with copies waiting on each other: the head copy of `id`
    /// (or whatever blocks it) goes ahead, uncertain.
    fn give_up_head(&mut self, id: u16) -> Result<()> {
        let Some(&(e, _)) = self.pools[&id].held.front() else {
            return Ok(());
        };
        if e.src.is_none() {
            return Ok(());
        }
        self.copies_timed_out += 1;
        self.drop_cap(&e);
        if !self.payloads.contains_key(&(id, e.seq)) {
            self.take_current(id, e)?;
        }
        let payload = self.payloads.remove(&(id, e.seq)).expect("captured");
        self.gap_before(id, e.seq);
        self.keep_prior(id, &e, self.dst_tainted(id, &e))?;
        self.taint_copy(id, &e);
        self.backend
            .apply_copy(id, &e, &payload, &mut self.counters)?;
        let p = self.pools.get_mut(&id).expect("declared");
        p.held.pop_front();
        p.last = Some(e.seq);
        p.wait_since = None;
        Ok(())
    }

    /// The replay's outcome, as `lineage::run_with` gives scope.
    pub fn outcome(&self) -> LineageOutcome {
        LineageOutcome {
            backend: "cpu",
            exposures: self.exposures.clone(),
            counters: self.counters,
            gaps: self.gaps.clone(),
            late_sources: self.late_sources.clone(),
            spilled_events: 0,
            spilled_copies: 0,
            kv_files: 0,
        }
    }

    /// Pools with events applied.
    pub fn pools_seen(&self) -> BTreeSet<u16> {
        self.pools
            .iter()
            .filter(|(_, p)| p.last.is_some())
            .map(|(&id, _)| id)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::CopySrc;

    fn ev(pool: u16, seq: u64, rid: u64, op: Op, start: u32, count: u32) -> KvEvent {
        KvEvent {
            pool,
            seq,
            ts_ns: seq as i64,
            request_id: rid,
            op,
            slot_start: start,
            slot_count: count,
            src: None,
            token_pos: None,
        }
    }

    fn engine() -> Engine {
        let d: Deployment = serde_json::from_value(serde_json::json!({
            "name": "t", "engine": "test", "context_window": 4096,
            "pools": [
                {"id": 0, "role": "prefill", "capacity_tokens": 16, "page_size": 1},
                {"id": 1, "role": "decode", "capacity_tokens": 16, "page_size": 1}
            ]
        }))
        .unwrap();
        let bounds = Bounds {
            holdback: Duration::ZERO,
            ..Bounds::default()
        };
        Engine::new(&d, true, bounds).unwrap()
    }

    type Reads = Vec<(u16, u64)>;

    /// Pumps, returning the read events (pool, seq) that read tainted
    /// slots and those with uncertain foreign runs.
    fn pump(e: &mut Engine, closing: bool) -> (Reads, Reads) {
        let (mut suspect, mut uncertain) = (Vec::new(), Vec::new());
        e.pump(Instant::now(), closing, &mut |runs, s| {
            suspect.extend(s.iter().map(|x| (x.0, x.1)));
            suspect.dedup();
            uncertain.extend(
                runs.iter()
                    .filter(|r| r.kind == crate::lineage::ReadKind::Foreign && r.uncertain)
                    .map(|r| (r.pool, r.seq)),
            );
        });
        uncertain.dedup();
        (suspect, uncertain)
    }

    /// Pool 0's seq 2 was dropped by the live queue: its hole taints the
    /// pool; request 4's write clears slots 0..4. A copy of those slots
    /// as of seq 3 that arrives after pool 0 moved on is rebuilt from the
    /// history, and the history kept that they were tainted then: the
    /// copy's read is view-suspect. The same trace with seq 2 lost in the
    /// trace (no drop) is a real hole: the read is uncertain, not suspect.
    #[test]
    fn a_rebuilt_copy_carries_the_taint_its_source_had_at_src_seq() {
        for dropped in [true, false] {
            let mut e = engine();
            if dropped {
                e.view_dropped(0, 2, 2);
            }
            let at = Instant::now();
            for x in [
                ev(0, 0, 1, Op::Alloc, 0, 4),
                ev(0, 1, 1, Op::Write, 0, 4),
                ev(0, 3, 3, Op::Alloc, 0, 4),
                ev(0, 4, 4, Op::Write, 0, 8),
            ] {
                e.push(x, at);
            }
            assert_eq!(pump(&mut e, false), (vec![], vec![]));
            assert_eq!(e.tainted_slots(0), if dropped { 8 } else { 0 });
            let copy = KvEvent {
                src: Some(CopySrc {
                    pool: 0,
                    slot_start: 0,
                    seq: 3,
                }),
                ..ev(1, 1, 5, Op::Write, 0, 4)
            };
            for x in [
                ev(1, 0, 5, Op::Alloc, 0, 4),
                copy,
                ev(1, 2, 5, Op::Read, 0, 4),
            ] {
                e.push(x, at);
            }
            let (suspect, uncertain) = pump(&mut e, true);
            assert_eq!(e.copies_rebuilt, 1);
            assert_eq!(uncertain, vec![(1, 2)], "request 1's KV after a hole");
            let want: Vec<(u16, u64)> = if dropped { vec![(1, 2)] } else { vec![] };
            assert_eq!(suspect, want, "dropped {dropped}");
            assert_eq!(e.tainted_slots(1), if dropped { 4 } else { 0 });
        }
    }

    /// A late copy (no history) is tainted; a later exact copy over the
    /// same destination clears it, and a write clears what it writes.
    #[test]
    fn copies_set_and_clear_their_destinations_taint() {
        let mut e = Engine::new(
            &serde_json::from_value(serde_json::json!({
                "name": "t", "engine": "test", "context_window": 4096,
                "pools": [
                    {"id": 0, "role": "prefill", "capacity_tokens": 16, "page_size": 1},
                    {"id": 1, "role": "decode", "capacity_tokens": 16, "page_size": 1}
                ]
            }))
            .unwrap(),
            true,
            Bounds {
                holdback: Duration::ZERO,
                history: 0,
                ..Bounds::default()
            },
        )
        .unwrap();
        let at = Instant::now();
        for x in [
            ev(0, 0, 1, Op::Alloc, 0, 4),
            ev(0, 1, 1, Op::Write, 0, 4),
            ev(0, 2, 2, Op::Write, 0, 4),
        ] {
            e.push(x, at);
        }
        pump(&mut e, false);
        let copy = |seq, src_seq| KvEvent {
            src: Some(CopySrc {
                pool: 0,
                slot_start: 0,
                seq: src_seq,
            }),
            ..ev(1, seq, 1, Op::Write, 0, 4)
        };
        e.push(copy(0, 1), at);
        pump(&mut e, false);
        assert_eq!((e.copies_late, e.tainted_slots(1)), (1, 4));
        // Registered before its source gets there: exact.
        e.push(copy(1, 3), at);
        e.push(ev(0, 3, 3, Op::Write, 0, 4), at);
        pump(&mut e, false);
        assert_eq!((e.copies_late, e.tainted_slots(1)), (1, 0));
        e.push(copy(2, 1), at);
        pump(&mut e, false);
        assert_eq!((e.copies_late, e.tainted_slots(1)), (2, 4));
        e.push(ev(1, 3, 1, Op::Write, 1, 2), at);
        pump(&mut e, true);
        assert_eq!(e.tainted_slots(1), 2);
    }

    /// More than VIEW_HOLES_KEPT dropped ranges pile up for a pool before
    /// it applies (holdback, a head copy waiting): the last two merge, so
    /// the last range spans seqs the view took. A hole inside the span is
    /// still the queue's: the range is kept past each seq taken inside it.
    #[test]
    fn a_merged_dropped_range_outlives_the_seqs_taken_inside_it() {
        let mut e = engine();
        let at = Instant::now();
        for k in 0..=1025u64 {
            e.view_dropped(0, 2 * k + 1, 2 * k + 1);
        }
        e.push(ev(0, 0, 1, Op::Alloc, 0, 4), at);
        for s in (2..=2046).step_by(2) {
            e.push(ev(0, s, 9, Op::Free, 15, 1), at);
        }
        // 2048: request 1 writes slots 0..4 (clears their taint);
        // 2049 (dropped by the queue, in the trace): request 2 writes them;
        // 2050: request 2 reads its own KV. Clean in the trace.
        e.push(ev(0, 2048, 1, Op::Write, 0, 4), at);
        e.push(ev(0, 2050, 2, Op::Read, 0, 4), at);
        let (suspect, uncertain) = pump(&mut e, false);
        assert_eq!(uncertain, vec![(0, 2050)]);
        assert_eq!(
            suspect,
            vec![(0, 2050)],
            "a view-made hole read as a real one"
        );
    }
}
