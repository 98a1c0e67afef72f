//! The CPU replay backend: per-slot state in pages allocated on first
//! write (`slots`), reads classified slice by slice with an own-read fast
//! path.
//!
//! Threads (`with_threads`): a pool's pages are dealt to `n` shards (page
//! `i` to shard `i % n`), each with its own slot pages, stale bits and
//! share grants. A batch is applied by every shard at once, each to the
//! slots of its own pages, so each slot sees the same operations in the
//! same order as with one thread; the shards' read runs are merged back
//! into slot order and joined where they meet, which gives the very runs
//! one thread emits. The touched-slot budget is checked for the whole
//! batch before any shard starts, so the refusal names the same event.
//!
//! Memory is proportional to the slots the trace writes (17 bytes a slot,
//! in pages of `slots::PAGE` slots, or of the whole pool when it is
//! smaller) plus at most `state::GRANTS_IN_MEMORY` share grants per shard
//! of a pool (the rest spilled to disk), never to the number of events or
//! to a pool's declared capacity. A copy's source is captured as runs of
//! equal slots (`state::Payload`) and applied a run at a time.

use super::backend::{Backend, Counters, Payload, ReadKind, ReadRun, SlotVal};
use super::grants::{GRANTS_IN_MEMORY, Grants};
use super::rule::{PoolState, SlotData};
use super::slots::{PAGE, PAGE_BITS, Pages, page_len, segments};
use super::state::{self, Class, Grant, NEVER};
use crate::error::{Error, Result};
use crate::schema::{KvEvent, Op};

/// The state of the slots of one page (`slots::page_len` of them).
struct Page {
    /// Content owner per slot (`NEVER`, `SCRUBBED` or a request id).
    owner: Box<[u64]>,
    /// seq + 1 of the event that last set the slot's content; 0 = never.
    wseq1: Box<[u64]>,
    /// 1 = content came from an uncertain copy.
    flags: Box<[u8]>,
}

impl Page {
    fn blank(n: usize) -> Box<Page> {
        Box::new(Page {
            owner: vec![NEVER; n].into_boxed_slice(),
            wseq1: vec![0; n].into_boxed_slice(),
            flags: vec![0; n].into_boxed_slice(),
        })
    }

    #[inline]
    fn view(&self) -> View<'_> {
        View {
            owner: &self.owner,
            wseq1: &self.wseq1,
            flags: &self.flags,
        }
    }
}

/// A page as reads see it: a written page, or `BLANK`.
#[derive(Clone, Copy)]
struct View<'a> {
    owner: &'a [u64],
    wseq1: &'a [u64],
    flags: &'a [u8],
}

static NEVER_OWNERS: [u64; PAGE] = [NEVER; PAGE];
static ZERO_SEQS: [u64; PAGE] = [0; PAGE];
static ZERO_FLAGS: [u8; PAGE] = [0; PAGE];

/// What every slot of a page never written holds.
const BLANK: View<'static> = View {
    owner: &NEVER_OWNERS,
    wseq1: &ZERO_SEQS,
    flags: &ZERO_FLAGS,
};

/// What a shard knows of its pool, and which pages are its own.
#[derive(Clone, Copy)]
struct Ctx {
    id: u16,
    capacity: u64,
    /// Content set with `wseq1 < gap_mark` predates a hole: uncertain.
    gap_mark: u64,
    never_kind: ReadKind,
    /// This shard's number and the number of shards: it owns page `i`
    /// when `i % n == k`.
    k: usize,
    n: usize,
}

impl Ctx {
    /// The pieces of slots `a..b` on this shard's pages, as slot ranges:
    /// `a..b` itself with one shard.
    #[inline]
    fn owned(self, a: u64, b: u64) -> impl Iterator<Item = (u64, u64)> {
        let whole = (self.n == 1 && a < b).then_some((a, b));
        let pieces = (self.n > 1).then(move || {
            segments(a, b)
                .filter(move |&(pi, _, _)| pi % self.n == self.k)
                .map(|(pi, lo, hi)| {
                    let base = (pi as u64) << PAGE_BITS;
                    (base + lo as u64, base + hi as u64)
                })
        });
        whole.into_iter().chain(pieces.into_iter().flatten())
    }
}

/// One shard of a pool: the state of the slots on its pages.
struct Shard {
    pages: Pages<Page>,
    /// The rule's state of those slots: stale bits and share grants.
    rule: PoolState,
}

impl Shard {
    #[inline]
    fn page(&self, page: usize) -> View<'_> {
        self.pages.get(page).map_or(BLANK, Page::view)
    }

    /// Applies `events` to this shard's slots: the budget is taken here
    /// (one shard) or was checked for the batch beforehand (`None`).
    fn apply(
        &mut self,
        cx: Ctx,
        events: &[KvEvent],
        budget: Option<&mut Budget>,
        out: &mut Vec<ReadRun>,
        c: &mut Counters,
    ) -> Result<()> {
        let Shard { pages, rule } = self;
        let mut slots = ShardSlots {
            pages,
            cx,
            budget,
            at: 0,
            out,
            c,
        };
        for (at, e) in events.iter().enumerate() {
            slots.at = at;
            for (x, y) in cx.owned(e.slot_start as u64, e.slot_end()) {
                rule.apply(&mut slots, e, x, y)?;
            }
        }
        Ok(())
    }
}

/// A shard's slot pages as the rule sees them (`rule::SlotData`), with
/// what a batch needs on the way: the budget (one shard), the index of
/// the event being applied, and where read runs and counts go.
struct ShardSlots<'a> {
    pages: &'a mut Pages<Page>,
    cx: Ctx,
    budget: Option<&'a mut Budget>,
    at: usize,
    out: &'a mut Vec<ReadRun>,
    c: &'a mut Counters,
}

impl ShardSlots<'_> {
    #[inline]
    fn page_mut(&mut self, page: usize) -> &mut Page {
        let n = page_len(self.cx.capacity, page);
        self.pages.get_or_insert_with(page, || Page::blank(n))
    }
}

impl SlotData for ShardSlots<'_> {
    #[inline]
    fn set(&mut self, e: &KvEvent, a: u64, b: u64, owner: u64) -> Result<()> {
        if let Some(bu) = self.budget.as_deref_mut() {
            let pages = &*self.pages;
            bu.take(|pi| pages.get(pi).is_some(), e, self.at, a, b)?;
        }
        for (pi, lo, hi) in segments(a, b) {
            let pg = self.page_mut(pi);
            pg.owner[lo..hi].fill(owner);
            pg.wseq1[lo..hi].fill(e.seq + 1);
            pg.flags[lo..hi].fill(0);
        }
        Ok(())
    }

    #[inline]
    fn copy(&mut self, e: &KvEvent, a: u64, b: u64, v: SlotVal) -> Result<()> {
        for (pi, lo, hi) in segments(a, b) {
            let pg = self.page_mut(pi);
            pg.owner[lo..hi].fill(v.owner);
            pg.wseq1[lo..hi].fill(e.seq + 1);
            pg.flags[lo..hi].fill(v.uncertain as u8);
        }
        Ok(())
    }

    #[inline]
    fn read(&mut self, e: &KvEvent, a: u64, b: u64, grants: &mut Grants) -> Result<()> {
        read(self.cx, self.pages, grants, e, a, b, self.out, self.c)
    }

    /// Some slot of the grant was not rewritten since it was given.
    fn alive(&self, g: &Grant) -> bool {
        segments(g.start(), g.end()).any(|(pi, lo, hi)| {
            self.pages.get(pi).map_or(BLANK, Page::view).wseq1[lo..hi]
                .iter()
                .any(|&w| w <= g.seq)
        })
    }
}

#[inline]
fn uncertain(gap_mark: u64, pg: View, o: usize) -> bool {
    pg.flags[o] != 0 || pg.wseq1[o] < gap_mark
}

/// A placeholder value (never applied: a run of 0 slots).
const BLANK_VAL: SlotVal = SlotVal {
    owner: NEVER,
    uncertain: false,
    stale: false,
};

/// Captures slots `lo..hi` of page `pi` (on shard `sh`) into `out`, a run
/// at a time: a stretch of one owner whose flags, generations and stale
/// bits are alike is one run, checked in bulk; anything else slot by slot.
fn capture_segment(
    sh: &Shard,
    gap_mark: u64,
    pi: usize,
    lo: usize,
    hi: usize,
    uncertain: bool,
    out: &mut Payload,
) {
    let pg = sh.page(pi);
    let base = (pi as u64) << PAGE_BITS;
    let slot = |o: usize| SlotVal {
        owner: pg.owner[o],
        uncertain: uncertain || self::uncertain(gap_mark, pg, o),
        stale: sh.rule.stale.is_stale(base + o as u64),
    };
    let mut o = lo;
    while o < hi {
        let owner = pg.owner[o];
        let end = o + pg.owner[o..hi]
            .iter()
            .position(|&w| w != owner)
            .unwrap_or(hi - o);
        let unc = if uncertain {
            Some(true)
        } else if pg.flags[o..end].iter().fold(0u8, |acc, &f| acc | f) != 0 {
            None
        } else if gap_mark == 0 {
            Some(false)
        } else {
            let min = pg.wseq1[o..end].iter().fold(u64::MAX, |m, &w| m.min(w));
            let max = pg.wseq1[o..end].iter().fold(0, |m, &w| m.max(w));
            if min >= gap_mark {
                Some(false)
            } else if max < gap_mark {
                Some(true)
            } else {
                None
            }
        };
        let stale = sh.rule.stale.uniform(base + o as u64, base + end as u64);
        match (unc, stale) {
            (Some(uncertain), Some(stale)) => out.push_run(
                end - o,
                SlotVal {
                    owner,
                    uncertain,
                    stale,
                },
            ),
            _ => out.extend((o..end).map(slot)),
        }
        o = end;
    }
}

/// Classification of slot `s` (offset `o` of page `pg`) read by `r`.
#[inline]
fn classify(cx: Ctx, pg: View, o: usize, s: u64, r: u64, grants: &[Grant]) -> Class {
    let unc = uncertain(cx.gap_mark, pg, o);
    state::classify(pg.owner[o], pg.wseq1[o], unc, s, r, grants, cx.never_kind)
}

struct CpuPool {
    id: u16,
    capacity: u64,
    /// Content set with `wseq1 < gap_mark` predates a hole: uncertain.
    gap_mark: u64,
    never_kind: ReadKind,
    /// Shard `k` holds the pages `i` with `i % shards.len() == k`.
    shards: Vec<Shard>,
}

impl CpuPool {
    #[inline]
    fn cx(&self, k: usize) -> Ctx {
        Ctx {
            id: self.id,
            capacity: self.capacity,
            gap_mark: self.gap_mark,
            never_kind: self.never_kind,
            k,
            n: self.shards.len(),
        }
    }

    #[inline]
    fn shard_of(&self, page: usize) -> usize {
        page % self.shards.len()
    }

    #[inline]
    fn allocated(&self, page: usize) -> bool {
        self.shards[self.shard_of(page)].pages.get(page).is_some()
    }
}

/// The most slots the CPU backend holds state for, summed over pools
/// (docs/limits.md): 2^27 slots, about 2.2 GB of slot pages (17 bytes a
/// slot). A trace that writes more distinct slots is refused (exit 2)
/// before the memory is taken; `KVTRAIL_MAX_TOUCHED_SLOTS` raises or
/// lowers it for a machine with more or less memory.
pub const DEFAULT_MAX_TOUCHED_SLOTS: u64 = 1 << 27;

/// The touched-slot limit in force: `KVTRAIL_MAX_TOUCHED_SLOTS` when set to
/// a number, else `DEFAULT_MAX_TOUCHED_SLOTS`.
pub fn max_touched_slots() -> u64 {
    std::env::var("KVTRAIL_MAX_TOUCHED_SLOTS")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(DEFAULT_MAX_TOUCHED_SLOTS)
}

/// Pages of state the backend has allocated, and the limit in slots. The
/// count is shared by the backends `forks` makes (one budget per replay).
struct Budget {
    used: std::sync::Arc<std::sync::atomic::AtomicU64>,
    max: u64,
}

impl Default for Budget {
    fn default() -> Self {
        Budget {
            used: Default::default(),
            max: max_touched_slots(),
        }
    }
}

impl Budget {
    /// Takes the pages a store to slots `a..b` would allocate (those for
    /// which `allocated` is false), or refuses (an `Invalid` error whose
    /// `row` is `at`, the event's index in its batch: the scheduler puts
    /// the file and row there).
    fn take(
        &mut self,
        allocated: impl Fn(usize) -> bool,
        e: &KvEvent,
        at: usize,
        a: u64,
        b: u64,
    ) -> Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        let new = segments(a, b).filter(|&(pi, _, _)| !allocated(pi)).count() as u64;
        if new == 0 {
            return Ok(());
        }
        let used = self.used.fetch_add(new, Relaxed).saturating_add(new);
        if used.saturating_mul(PAGE as u64) > self.max {
            self.used.fetch_sub(new, Relaxed);
            return Err(over_budget(e, at, self.max));
        }
        Ok(())
    }
}

/// The refusal of an event whose slots would take the replay past `max`
/// touched slots.
pub(crate) fn over_budget(e: &KvEvent, at: usize, max: u64) -> Error {
    Error::Invalid {
        loc: crate::error::Location {
            file: None,
            row: Some(at as u64),
            column: Some("slot_count".into()),
        },
        what: format!(
            "pool {} seq {} stores {} slots: the replay would hold state for more than {max} \
             distinct slots, kvtrail's limit for one run (about 17 bytes a slot)",
            e.pool, e.seq, e.slot_count
        ),
        hint: "check the trace's extents (slot_start, slot_count); on a machine with more memory \
               raise the limit with KVTRAIL_MAX_TOUCHED_SLOTS=N (docs/limits.md)"
            .into(),
    }
}

/// Touched slots in a batch from which its shards apply it in parallel
/// (below, one thread applies them in turn: less work than waking others).
pub const PAR_MIN_TOUCHES: u64 = 1 << 14;

/// The CPU backend.
pub struct CpuBackend {
    pools: Vec<CpuPool>,
    /// pool id -> index in `pools`.
    index: super::backend::PoolMap<usize>,
    budget: Budget,
    /// Shards per pool (the threads); 1: no pool of threads.
    threads: usize,
    workers: Option<rayon::ThreadPool>,
    /// Slot touches from which a batch's shards run in parallel.
    par_min: u64,
    /// Each shard's read runs of the batch being applied.
    scratch: Vec<Vec<ReadRun>>,
    /// Pages a batch allocates (the budget check of a sharded batch).
    fresh: std::collections::HashSet<usize>,
    /// Share grants each shard of a pool holds in memory before spilling.
    grant_limit: usize,
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend {
            pools: Vec::new(),
            index: Default::default(),
            budget: Budget::default(),
            threads: 1,
            workers: None,
            par_min: PAR_MIN_TOUCHES,
            scratch: Vec::new(),
            fresh: Default::default(),
            grant_limit: GRANTS_IN_MEMORY,
        }
    }
}

impl CpuBackend {
    /// The backend on one thread.
    pub fn new() -> Self {
        Self::default()
    }

    /// The backend applying each batch on `threads` threads (1: on the
    /// caller's). The output does not depend on the number of threads.
    pub fn with_threads(threads: usize) -> Result<Self> {
        let threads = threads.max(1);
        let workers = if threads > 1 {
            Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(|i| format!("kvtrail-replay-{i}"))
                    .build()
                    .map_err(|e| {
                        Error::Other(format!("replay: cannot start {threads} threads: {e}"))
                    })?,
            )
        } else {
            None
        };
        Ok(CpuBackend {
            threads,
            workers,
            scratch: (0..threads).map(|_| Vec::new()).collect(),
            ..Self::default()
        })
    }

    /// A backend that holds state for at most `max` touched slots.
    pub fn with_max_touched_slots(max: u64) -> Self {
        let mut b = Self::default();
        b.budget.max = max;
        b
    }

    /// Applies batches of at least `touches` slot touches on the threads
    /// (default `PAR_MIN_TOUCHES`; smaller batches are applied shard after
    /// shard on the caller's thread). Changes speed only, never output.
    pub fn parallel_from(mut self, touches: u64) -> Self {
        self.par_min = touches;
        self
    }

    fn pool(&mut self, id: u16) -> Result<&mut CpuPool> {
        match self.index.get(&id) {
            Some(&i) => Ok(&mut self.pools[i]),
            None => Err(Error::Other(format!("replay: pool {id} was not declared"))),
        }
    }

    /// Slot pages allocated over all pools (each holds `slots::PAGE` slots).
    pub fn pages_allocated(&self) -> usize {
        self.pools
            .iter()
            .flat_map(|p| &p.shards)
            .map(|s| s.pages.allocated())
            .sum()
    }
}

/// Checks the budget for a whole batch before its shards apply it: the
/// pages its writes and scrubs allocate, event by event, so the refusal
/// names the event one thread would have stopped at.
fn take_batch(
    budget: &mut Budget,
    fresh: &mut std::collections::HashSet<usize>,
    p: &CpuPool,
    events: &[KvEvent],
) -> Result<()> {
    fresh.clear();
    for (at, e) in events.iter().enumerate() {
        if !matches!(e.op, Op::Write | Op::Scrub) {
            continue;
        }
        let (a, b) = (e.slot_start as u64, e.slot_end());
        budget.take(|pi| p.allocated(pi) || fresh.contains(&pi), e, at, a, b)?;
        fresh.extend(
            segments(a, b)
                .map(|(pi, _, _)| pi)
                .filter(|&pi| !p.allocated(pi)),
        );
    }
    Ok(())
}

/// Merges the shards' read runs of one batch (each sorted by seq, then
/// slot) into `out` in that order, joining runs that meet: the maximal
/// runs one thread emits.
fn merge_runs(parts: &mut [Vec<ReadRun>], out: &mut Vec<ReadRun>) {
    let first = out.len();
    let mut pos = vec![0usize; parts.len()];
    loop {
        let mut best: Option<(usize, (u64, u32))> = None;
        for (k, part) in parts.iter().enumerate() {
            if let Some(r) = part.get(pos[k]) {
                let key = (r.seq, r.slot_start);
                if best.is_none_or(|(_, b)| key < b) {
                    best = Some((k, key));
                }
            }
        }
        let Some((k, _)) = best else { break };
        let r = parts[k][pos[k]];
        pos[k] += 1;
        let joined = out.len() > first;
        match out.last_mut() {
            Some(l)
                if joined
                    && l.seq == r.seq
                    && l.pool == r.pool
                    && l.slot_start as u64 + l.count as u64 == r.slot_start as u64
                    && (l.kind, l.source, l.uncertain) == (r.kind, r.source, r.uncertain) =>
            {
                l.count += r.count;
            }
            _ => out.push(r),
        }
    }
    for part in parts {
        part.clear();
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn threads(&self) -> usize {
        self.threads
    }

    fn forks(&self, n: usize, threads: usize) -> Option<Vec<Box<dyn Backend + Send>>> {
        let budget = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        (0..n)
            .map(|_| {
                let mut b = CpuBackend::with_threads(threads)
                    .ok()?
                    .parallel_from(self.par_min);
                b.grant_limit = self.grant_limit;
                b.budget = Budget {
                    used: budget.clone(),
                    max: self.budget.max,
                };
                Some(Box::new(b) as Box<dyn Backend + Send>)
            })
            .collect()
    }

    fn limit_grants(&mut self, grants: usize) {
        self.grant_limit = grants;
        for p in &mut self.pools {
            for sh in &mut p.shards {
                sh.rule.grants.set_limit(grants);
            }
        }
    }

    fn add_pool(&mut self, pool: u16, capacity: u64, from_engine_start: bool) -> Result<()> {
        self.index.insert(pool, self.pools.len());
        self.pools.push(CpuPool {
            id: pool,
            capacity,
            gap_mark: 0,
            never_kind: if from_engine_start {
                ReadKind::Blank
            } else {
                ReadKind::Unknown
            },
            shards: (0..self.threads)
                .map(|_| Shard {
                    pages: Pages::new(),
                    rule: PoolState::new(capacity, Grants::spilling(self.grant_limit)),
                })
                .collect(),
        });
        Ok(())
    }

    fn mark_gap(&mut self, pool: u16, before_seq: u64) {
        if let Ok(p) = self.pool(pool) {
            p.gap_mark = p.gap_mark.max(before_seq + 1);
        }
    }

    fn apply(
        &mut self,
        pool: u16,
        events: &[KvEvent],
        out: &mut Vec<ReadRun>,
        c: &mut Counters,
    ) -> Result<()> {
        let i = *self
            .index
            .get(&pool)
            .ok_or_else(|| Error::Other(format!("replay: pool {pool} was not declared")))?;
        let p = &mut self.pools[i];
        debug_assert!(events.iter().all(|e| e.pool == p.id));
        let mut touches = 0u64;
        for e in events {
            c.events += 1;
            c.slot_touches += e.slot_count as u64;
            touches += e.slot_count as u64;
            if e.op == Op::Read {
                c.read_events += 1;
                c.read_slots += e.slot_count as u64;
            }
        }
        if p.shards.len() == 1 {
            let cx = p.cx(0);
            return p.shards[0].apply(cx, events, Some(&mut self.budget), out, c);
        }
        take_batch(&mut self.budget, &mut self.fresh, p, events)?;
        let cxs: Vec<Ctx> = (0..p.shards.len()).map(|k| p.cx(k)).collect();
        let work = |(k, (sh, part)): (usize, (&mut Shard, &mut Vec<ReadRun>))| {
            let mut cc = Counters::default();
            sh.apply(cxs[k], events, None, part, &mut cc).map(|()| cc)
        };
        let parts: Vec<Result<Counters>> = match &self.workers {
            Some(w) if touches >= self.par_min => w.install(|| {
                use rayon::prelude::*;
                p.shards
                    .par_iter_mut()
                    .zip(self.scratch.par_iter_mut())
                    .enumerate()
                    .map(work)
                    .collect()
            }),
            _ => p
                .shards
                .iter_mut()
                .zip(self.scratch.iter_mut())
                .enumerate()
                .map(work)
                .collect(),
        };
        for part in parts {
            let cc = part?;
            c.own_slots += cc.own_slots;
            c.shared_slots += cc.shared_slots;
        }
        merge_runs(&mut self.scratch, out);
        Ok(())
    }

    fn apply_copy(
        &mut self,
        pool: u16,
        e: &KvEvent,
        payload: &Payload,
        c: &mut Counters,
    ) -> Result<()> {
        let i = *self
            .index
            .get(&pool)
            .ok_or_else(|| Error::Other(format!("replay: pool {pool} was not declared")))?;
        let (p, budget) = (&mut self.pools[i], &mut self.budget);
        let (a, b) = (e.slot_start as u64, e.slot_end());
        budget.take(|pi| p.allocated(pi), e, 0, a, b)?;
        if payload.len() as u64 != b - a {
            return Err(Error::Other(format!(
                "replay: copy payload of {} slots for an extent of {}",
                payload.len(),
                b - a
            )));
        }
        c.events += 1;
        c.slot_touches += e.slot_count as u64;
        // The payload's runs, cut where pages end, each piece applied by
        // the rule on the shard that holds its page.
        let mut runs = payload.runs().iter().map(|&(n, v)| (n as u64, v));
        let mut cur = (0u64, BLANK_VAL);
        let (mut none, mut nc) = (Vec::new(), Counters::default());
        for (pi, lo, hi) in segments(a, b) {
            let base = (pi as u64) << PAGE_BITS;
            let k = p.shard_of(pi);
            let cx = p.cx(k);
            let Shard { pages, rule } = &mut p.shards[k];
            let mut slots = ShardSlots {
                pages,
                cx,
                budget: None,
                at: 0,
                out: &mut none,
                c: &mut nc,
            };
            let (mut s, end) = (base + lo as u64, base + hi as u64);
            while s < end {
                if cur.0 == 0 {
                    cur = runs.next().expect("payload length checked");
                }
                let n = cur.0.min(end - s);
                rule.copy(&mut slots, e, s, s + n, cur.1)?;
                s += n;
                cur.0 -= n;
            }
        }
        Ok(())
    }

    fn capture(
        &mut self,
        pool: u16,
        slot_start: u32,
        count: u32,
        uncertain: bool,
        out: &mut Payload,
    ) -> Result<()> {
        if u64::from(count) > self.budget.max {
            return Err(Error::Invalid {
                loc: crate::error::Location {
                    file: None,
                    row: None,
                    column: Some("slot_count".into()),
                },
                what: format!(
                    "a copy reads {count} slots of pool {pool} from slot {slot_start}: more than \
                     the {} slots one replay run holds state for",
                    self.budget.max
                ),
                hint: "check the copy's extent (slot_start, slot_count, src_slot_start); on a \
                       machine with more memory raise the limit with KVTRAIL_MAX_TOUCHED_SLOTS=N \
                       (docs/limits.md)"
                    .into(),
            });
        }
        let p = self.pool(pool)?;
        let a = slot_start as u64;
        out.clear();
        for (pi, lo, hi) in segments(a, a + count as u64) {
            let sh = &p.shards[p.shard_of(pi)];
            capture_segment(sh, p.gap_mark, pi, lo, hi, uncertain, out);
        }
        Ok(())
    }
}

/// Whether every value equals `r`: branch-free over chunks so it
/// vectorizes, with an early exit between chunks.
#[inline]
fn all_eq(v: &[u64], r: u64) -> bool {
    let mut chunks = v.chunks_exact(32);
    for c in &mut chunks {
        if !c.iter().fold(true, |acc, &o| acc & (o == r)) {
            return false;
        }
    }
    chunks.remainder().iter().all(|&o| o == r)
}

/// Whether slots `lo..hi` of `pg` are all `r`'s own, certain content.
#[inline]
fn all_own(pg: View, lo: usize, hi: usize, r: u64, gap_mark: u64) -> bool {
    all_eq(&pg.owner[lo..hi], r)
        && pg.flags[lo..hi].iter().fold(0u8, |acc, &f| acc | f) == 0
        && (gap_mark == 0 || pg.wseq1[lo..hi].iter().fold(u64::MAX, |m, &w| m.min(w)) >= gap_mark)
}

/// Classifies the slots `a..b` (on shard `p`'s pages) read by
/// `e.request_id`.
#[inline]
#[allow(clippy::too_many_arguments)]
fn read(
    cx: Ctx,
    pages: &Pages<Page>,
    grants: &mut Grants,
    e: &KvEvent,
    a: u64,
    b: u64,
    out: &mut Vec<ReadRun>,
    c: &mut Counters,
) -> Result<()> {
    let r = e.request_id;
    let gap_mark = cx.gap_mark;
    // Whole-extent fast path (the common case): every slot is the reader's
    // own, certain content. Three vectorizable passes, no branches per slot.
    let page = |pi: usize| pages.get(pi).map_or(BLANK, Page::view);
    if segments(a, b).all(|(pi, lo, hi)| all_own(page(pi), lo, hi, r, gap_mark)) {
        c.own_slots += b - a;
        return Ok(());
    }
    let grants: &[Grant] = grants.lookup(r)?;
    let mut own = 0u64;
    let mut shared = 0u64;
    // The run being built: its first slot and classification.
    let mut run: Option<(u64, (ReadKind, u64, bool))> = None;
    let mut emit = |start: u64, end: u64, cls: (ReadKind, u64, bool)| {
        out.push(ReadRun {
            reader: r,
            pool: cx.id,
            slot_start: start as u32,
            count: (end - start) as u32,
            kind: cls.0,
            source: cls.1,
            uncertain: cls.2,
            seq: e.seq,
            ts_ns: e.ts_ns,
        })
    };
    for (pi, lo, hi) in segments(a, b) {
        let base = (pi as u64) << PAGE_BITS;
        let Some(pg) = pages.get(pi).map(Page::view) else {
            // Never written: every slot classifies alike (the owner is
            // NEVER, so grants do not matter), one step for the page.
            let s = base + lo as u64;
            let cls = classify(cx, BLANK, 0, s, r, grants);
            if run.map(|(_, k)| k) != cls {
                if let Some((start, k)) = run.take() {
                    emit(start, s, k);
                }
                run = cls.map(|k| (s, k));
            }
            continue;
        };
        for o in lo..hi {
            let s = base + o as u64;
            let cls = if pg.owner[o] == r && pg.flags[o] == 0 && pg.wseq1[o] >= gap_mark {
                // own, certain
                own += 1;
                None
            } else {
                let cls = classify(cx, pg, o, s, r, grants);
                if matches!(cls, Some((ReadKind::Shared, ..))) {
                    shared += 1;
                }
                cls
            };
            if run.map(|(_, k)| k) != cls {
                if let Some((start, k)) = run.take() {
                    emit(start, s, k);
                }
                run = cls.map(|k| (s, k));
            }
        }
    }
    if let Some((start, k)) = run {
        emit(start, b, k);
    }
    c.own_slots += own;
    c.shared_slots += shared;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::CopySrc;

    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n.max(1)
        }
    }

    fn event(pool: u16, seq: u64, rid: u64, op: Op, start: u32, count: u32) -> KvEvent {
        KvEvent {
            pool,
            seq,
            ts_ns: seq as i64,
            request_id: rid,
            op,
            slot_start: start,
            slot_count: count,
            token_pos: None,
            src: None,
        }
    }

    /// Everything a backend answers for a random workload of two pools
    /// (batches, gaps, copies between them, captures), call by call.
    fn replay(b: &mut CpuBackend, seed: u64) -> Vec<String> {
        const CAP: u64 = 9 * PAGE as u64 + 77;
        let mut rng = Rng(seed | 1);
        let mut log = Vec::new();
        b.add_pool(0, CAP, seed % 2 == 0).unwrap();
        b.add_pool(1, CAP, true).unwrap();
        let mut seq = [0u64; 2];
        let ops = [
            Op::Alloc,
            Op::Write,
            Op::Write,
            Op::Read,
            Op::Read,
            Op::Share,
            Op::Scrub,
            Op::Free,
        ];
        for round in 0..60 {
            let pool = (round % 2) as u16;
            let n = 1 + rng.below(40) as usize;
            let mut batch = Vec::new();
            for _ in 0..n {
                let op = ops[rng.below(ops.len() as u64) as usize];
                let long = rng.below(4) == 0;
                let count = 1 + rng.below(if long { 3 * PAGE as u64 } else { 40 });
                let start = rng.below(CAP - count);
                let rid = 1 + rng.below(4);
                batch.push(event(
                    pool,
                    seq[pool as usize],
                    rid,
                    op,
                    start as u32,
                    count as u32,
                ));
                seq[pool as usize] += 1;
            }
            let (mut out, mut c) = (Vec::new(), Counters::default());
            let r = b.apply(pool, &batch, &mut out, &mut c);
            log.push(format!("apply {pool}: {r:?} {out:?} {c:?}"));
            if rng.below(7) == 0 {
                b.mark_gap(pool, seq[pool as usize]);
                seq[pool as usize] += 1 + rng.below(3);
            }
            // a copy from the other pool
            let (src, count) = (1 - pool, 1 + rng.below(2 * PAGE as u64) as u32);
            let ss = rng.below(CAP - count as u64) as u32;
            let ds = rng.below(CAP - count as u64) as u32;
            let mut payload = Payload::default();
            let unc = rng.below(5) == 0;
            let r = b.capture(src, ss, count, unc, &mut payload);
            log.push(format!("capture {src}: {r:?} {payload:?}"));
            let rid = 1 + rng.below(4);
            let mut e = event(pool, seq[pool as usize], rid, Op::Write, ds, count);
            e.src = Some(CopySrc {
                pool: src,
                slot_start: ss,
                seq: seq[src as usize].saturating_sub(1),
            });
            seq[pool as usize] += 1;
            let mut c = Counters::default();
            let r = b.apply_copy(pool, &e, &payload, &mut c);
            log.push(format!("copy {pool}: {r:?} {c:?}"));
        }
        for pool in 0..2u16 {
            let mut all = Payload::default();
            let r = b.capture(pool, 0, CAP as u32, false, &mut all);
            log.push(format!("final {pool}: {r:?} {all:?}"));
        }
        log
    }

    #[test]
    fn sharded_batches_answer_exactly_as_one_thread() {
        for seed in 1..25u64 {
            let want = replay(&mut CpuBackend::new(), seed);
            for threads in [2, 3] {
                for par in [0, PAR_MIN_TOUCHES] {
                    let mut b = CpuBackend::with_threads(threads)
                        .unwrap()
                        .parallel_from(par);
                    let got = replay(&mut b, seed);
                    assert_eq!(got.len(), want.len());
                    for (g, w) in got.iter().zip(&want) {
                        assert_eq!(g, w, "seed {seed}, {threads} threads, parallel from {par}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_sharded_batch_over_the_budget_names_the_same_event() {
        let batch: Vec<KvEvent> = (0..6)
            .map(|i| event(0, i, 1, Op::Write, (i as u32) * 700, 600))
            .collect();
        let refusal = |mut b: CpuBackend| {
            b.budget.max = 3 * PAGE as u64;
            b.add_pool(0, 1 << 20, true).unwrap();
            let (mut out, mut c) = (Vec::new(), Counters::default());
            format!("{:?}", b.apply(0, &batch, &mut out, &mut c).unwrap_err())
        };
        let one = refusal(CpuBackend::new());
        assert!(one.contains("row: Some(4)"), "{one}");
        assert_eq!(
            refusal(CpuBackend::with_threads(2).unwrap().parallel_from(0)),
            one
        );
        assert_eq!(refusal(CpuBackend::with_threads(3).unwrap()), one);
    }

    /// `rule::changes_content` agrees with the transition: an event it
    /// says leaves the content alone captures the same before and after,
    /// on random state (gaps and stale bits included), one event at a time.
    #[test]
    fn what_changes_content_is_what_the_rule_changes() {
        use crate::lineage::rule::changes_content;
        const CAP: u64 = 3 * PAGE as u64 + 11;
        let ops = [
            Op::Alloc,
            Op::Write,
            Op::Read,
            Op::Share,
            Op::Scrub,
            Op::Free,
        ];
        let mut changed = std::collections::BTreeSet::new();
        for seed in 1..40u64 {
            let mut rng = Rng((seed * 7919) | 1);
            let mut b = CpuBackend::new();
            b.add_pool(0, CAP, seed % 2 == 0).unwrap();
            for seq in 0..400u64 {
                let op = ops[rng.below(ops.len() as u64) as usize];
                let long = rng.below(4) == 0;
                let count = 1 + rng.below(if long { 2 * PAGE as u64 } else { 30 });
                let start = rng.below(CAP - count);
                let e = event(0, seq, 1 + rng.below(3), op, start as u32, count as u32);
                let (mut before, mut after) = (Payload::default(), Payload::default());
                b.capture(0, e.slot_start, e.slot_count, false, &mut before)
                    .unwrap();
                let (mut out, mut c) = (Vec::new(), Counters::default());
                b.apply(0, &[e], &mut out, &mut c).unwrap();
                b.capture(0, e.slot_start, e.slot_count, false, &mut after)
                    .unwrap();
                if before != after {
                    assert!(
                        changes_content(op),
                        "{op:?} changed {before:?} to {after:?}"
                    );
                    changed.insert(format!("{op:?}"));
                }
                if rng.below(50) == 0 {
                    b.mark_gap(0, seq + 1);
                }
            }
        }
        // Each op the predicate names does change content somewhere.
        let named: std::collections::BTreeSet<String> = ops
            .iter()
            .filter(|&&o| changes_content(o))
            .map(|o| format!("{o:?}"))
            .collect();
        assert_eq!(changed, named);
    }
}
