//! The guard's state: the engine's pools as this process's hook sees them,
//! kept by the lineage slot rule (`kvtrail::lineage::rule::PoolState`, the
//! same transition scope and record apply), with a slot type of its own
//! ([`Slots`]: the content owner per slot, its generation, and whether the
//! content came from a pool this process cannot see).
//!
//! A check is the rule's `read`: every slot a request is about to attend
//! over is classified by `lineage::state::classify`, and the answer is
//! `foreign` (another request's content without a grant covering it),
//! `unknown` (the owner depends on state this process cannot see: a
//! transfer from a remote pool, or a hook failure) or `ok` (own, shared
//! under a grant, or never written).

use std::collections::{HashMap, VecDeque};

use kvtrail::Result;
use kvtrail::lineage::grants::Grants;
use kvtrail::lineage::rule::{PoolState, SlotData};
use kvtrail::lineage::state::{Grant, NEVER, ReadKind, SlotVal, classify};
use kvtrail::record::wire::{PullRun, pull_copies};
use kvtrail::schema::{KvEvent, Op};

/// The rule's pools hold at most 2^32 slots; slot pages are allocated as
/// content is set, so the declared capacity costs nothing.
const CAPACITY: u64 = 1 << 32;
/// Slots per page of the guard's slot table (4096 x 24 bytes = 96 KiB):
/// memory grows with the pages a hook's events touch, never with the
/// highest slot index (a write to slot 2^32 - 1 costs one page, plus the
/// page table's 8 bytes per page up to it: at most 8 MiB).
const PAGE_BITS: u32 = 12;
const PAGE: usize = 1 << PAGE_BITS;
/// Sends held for a commit that never came (an aborted room): bounded.
const MAX_ROOMS: usize = 100_000;
/// Source request ids kept per check.
const MAX_SOURCES: usize = 16;

#[derive(Clone, Copy)]
struct Slot {
    owner: u64,
    /// seq + 1 of the event that set the content (0: never).
    wseq1: u64,
    /// The content arrived from a pool this process does not mirror: whose
    /// it is on that pool cannot be known here.
    remote: bool,
}

const EMPTY: Slot = Slot {
    owner: NEVER,
    wseq1: 0,
    remote: false,
};

/// What a check found, slot by slot.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tally {
    pub own: u64,
    pub shared: u64,
    pub blank: u64,
    pub unknown: u64,
    pub foreign: u64,
    /// The foreign slots' content owners (first few, distinct).
    pub sources: Vec<u64>,
}

impl Tally {
    pub fn verdict(&self) -> &'static str {
        if self.foreign > 0 {
            "foreign"
        } else if self.unknown > 0 {
            "unknown"
        } else {
            "ok"
        }
    }

    pub fn slots(&self) -> u64 {
        self.own + self.shared + self.blank + self.unknown + self.foreign
    }
}

/// Slot `s` of a page table (never written where its page is missing).
#[inline]
fn slot_at(pages: &[Option<Box<[Slot]>>], s: u64) -> Slot {
    match pages.get((s >> PAGE_BITS) as usize) {
        Some(Some(p)) => p[s as usize & (PAGE - 1)],
        _ => EMPTY,
    }
}

/// The guard's per-slot data for one pool.
#[derive(Default)]
struct Slots {
    /// Pages of [`PAGE`] slots, allocated when content is first set in
    /// them; a missing page reads as never written.
    pages: Vec<Option<Box<[Slot]>>>,
    /// Content set at or before this generation may have been changed by
    /// events the hook failed to report (`holed`).
    hole: u64,
    holed: bool,
    tally: Tally,
}

impl Slots {
    #[inline]
    fn get(&self, s: u64) -> Slot {
        slot_at(&self.pages, s)
    }

    /// Sets slots `a..b` to `x`, allocating only the pages they fall in.
    fn fill(&mut self, a: u64, b: u64, x: Slot) {
        let mut s = a;
        while s < b {
            let page = (s >> PAGE_BITS) as usize;
            let off = s as usize & (PAGE - 1);
            let n = (PAGE - off).min((b - s) as usize);
            if self.pages.len() <= page {
                self.pages.resize_with(page + 1, || None);
            }
            let p = self.pages[page].get_or_insert_with(|| vec![EMPTY; PAGE].into_boxed_slice());
            p[off..off + n].fill(x);
            s += n as u64;
        }
    }

    /// Slots allocated (the guard's memory is about 24 bytes each).
    fn allocated(&self) -> u64 {
        self.pages.iter().flatten().count() as u64 * PAGE as u64
    }

    fn val(&self, s: u64, stale: bool) -> SlotVal {
        let x = self.get(s);
        SlotVal {
            owner: x.owner,
            uncertain: x.remote || (self.holed && x.wseq1 <= self.hole),
            stale,
        }
    }
}

impl SlotData for Slots {
    fn set(&mut self, e: &KvEvent, a: u64, b: u64, owner: u64) -> Result<()> {
        let x = Slot {
            owner,
            wseq1: e.seq + 1,
            remote: false,
        };
        self.fill(a, b, x);
        Ok(())
    }

    fn copy(&mut self, e: &KvEvent, a: u64, b: u64, v: SlotVal) -> Result<()> {
        let x = Slot {
            owner: v.owner,
            wseq1: e.seq + 1,
            remote: v.uncertain,
        };
        self.fill(a, b, x);
        Ok(())
    }

    fn read(&mut self, e: &KvEvent, a: u64, b: u64, grants: &mut Grants) -> Result<()> {
        let reader = e.request_id;
        let g = grants.lookup(reader)?;
        let t = &mut self.tally;
        let pages = &self.pages;
        for s in a..b {
            let x = slot_at(pages, s);
            let holed = self.holed && x.wseq1 <= self.hole;
            match classify(
                x.owner,
                x.wseq1,
                x.remote || holed,
                s,
                reader,
                g,
                ReadKind::Blank,
            ) {
                None => t.own += 1,
                // Content set for another request: foreign, even when it
                // arrived from a remote pool (it was never the reader's),
                // unless a hole may have rewritten it as the reader's.
                Some((ReadKind::Foreign, src, _)) if !holed => {
                    t.foreign += 1;
                    if t.sources.len() < MAX_SOURCES && !t.sources.contains(&src) {
                        t.sources.push(src);
                    }
                }
                Some((ReadKind::Shared, _, _)) => t.shared += 1,
                Some((ReadKind::Blank, _, _)) => t.blank += 1,
                Some(_) => t.unknown += 1,
            }
        }
        Ok(())
    }

    fn alive(&self, g: &Grant) -> bool {
        (g.start()..g.end()).any(|s| self.get(s).wseq1 <= g.seq)
    }
}

struct Pool {
    rule: PoolState,
    slots: Slots,
    seq: u64,
}

impl Pool {
    fn new() -> Self {
        Pool {
            rule: PoolState::new(CAPACITY, Grants::default()),
            slots: Slots::default(),
            seq: 0,
        }
    }

    fn event(&mut self, rid: u64, op: Op, a: u64, b: u64) -> KvEvent {
        let e = KvEvent {
            pool: 0,
            seq: self.seq,
            ts_ns: 0,
            request_id: rid,
            op,
            slot_start: a as u32,
            slot_count: (b - a) as u32,
            token_pos: None,
            src: None,
        };
        self.seq += 1;
        e
    }

    fn apply(&mut self, rid: u64, op: Op, a: u64, b: u64) -> Result<()> {
        let e = self.event(rid, op, a, b);
        self.rule.apply(&mut self.slots, &e, a, b)
    }

    /// Copies `vals` (one per slot) into slots `a..`, a run of equal values
    /// at a time.
    fn copy_in(&mut self, rid: u64, a: u64, vals: &[SlotVal]) -> Result<()> {
        let e = self.event(rid, Op::Write, a, a + vals.len() as u64);
        let mut i = 0;
        while i < vals.len() {
            let mut j = i + 1;
            while j < vals.len() && vals[j] == vals[i] {
                j += 1;
            }
            let (s, t) = (a + i as u64, a + j as u64);
            self.rule.copy(&mut self.slots, &e, s, t, vals[i])?;
            i = j;
        }
        Ok(())
    }

    fn snapshot(&self, a: u64, b: u64, out: &mut Vec<SlotVal>) {
        for s in a..b {
            out.push(self.slots.val(s, self.rule.stale.is_stale(s)));
        }
    }
}

/// A send's chunk: where it lands in the commit's page list, and the
/// source content as it was when the send was reported (None: the source
/// pool's page size is not known here).
struct Chunk {
    dst_index: u64,
    vals: Option<Vec<SlotVal>>,
}

/// Counters, for the hooks' stats.
#[derive(Debug, Default, Clone)]
pub struct Counts {
    pub events: u64,
    pub copies_local: u64,
    pub copies_remote: u64,
    pub holes: u64,
    pub checks: u64,
    pub errors: u64,
}

/// The pools of one engine process, as its hook reports them.
#[derive(Default)]
pub struct Guard {
    pools: HashMap<u16, Pool>,
    page: HashMap<u16, u64>,
    sends: HashMap<u64, Vec<Chunk>>,
    rooms: VecDeque<u64>,
    pub counts: Counts,
}

/// A valid slot run `[a, b)` of a pool (slots below 2^32).
fn slot_run(a: u64, n: u64) -> Option<(u64, u64)> {
    let b = a.checked_add(n)?;
    (n > 0 && b <= CAPACITY).then_some((a, b))
}

impl Guard {
    /// Slots of every pool's slot table allocated so far.
    pub fn slots_allocated(&self) -> u64 {
        self.pools.values().map(|p| p.slots.allocated()).sum()
    }

    fn pool(&mut self, p: u16) -> &mut Pool {
        self.pools.entry(p).or_insert_with(Pool::new)
    }

    /// Whether this process reports events of pool `p`.
    pub fn sees(&self, p: u16) -> bool {
        self.pools.contains_key(&p)
    }

    pub fn set_page_size(&mut self, p: u16, ps: u64) {
        if ps > 0 {
            self.page.insert(p, ps);
        }
    }

    /// An `alloc` / `write` / `share` / `scrub` / `free` of slot runs
    /// (start, count) by `rid` (reads are checks, [`check`](Self::check)).
    pub fn kv(&mut self, p: u16, rid: u64, op: Op, runs: &[(u64, u64)]) -> Result<()> {
        // One event per run, as the hooks' lines count them.
        self.counts.events += runs.len() as u64;
        let pool = self.pool(p);
        for &(a, n) in runs {
            if let Some((a, b)) = slot_run(a, n) {
                pool.apply(rid, op, a, b)?;
            }
        }
        Ok(())
    }

    /// Lost events (a hook failure): whatever the pool holds now may have
    /// been changed by them.
    pub fn lost(&mut self, p: u16) {
        self.counts.holes += 1;
        let pool = self.pool(p);
        pool.slots.hole = pool.seq;
        pool.slots.holed = true;
    }

    /// A copy of runs (dst, src, count) from `src_pool` into `p` for `rid`:
    /// the source content as this process mirrors it, or, when it does not
    /// see the source pool, content received for `rid` whose owner there is
    /// unknown.
    pub fn copy(
        &mut self,
        p: u16,
        rid: u64,
        src_pool: u16,
        runs: &[(u64, u64, u64)],
    ) -> Result<()> {
        let mut vals = Vec::new();
        for &(d, s, n) in runs {
            let (Some(_), Some((s, t))) = (slot_run(d, n), slot_run(s, n)) else {
                continue;
            };
            vals.clear();
            match self.pools.get(&src_pool) {
                Some(src) => {
                    self.counts.copies_local += 1;
                    src.snapshot(s, t, &mut vals);
                }
                _ => {
                    self.counts.copies_remote += 1;
                    vals.resize(n as usize, remote(rid));
                }
            }
            self.pool(p).copy_in(rid, d, &vals)?;
        }
        Ok(())
    }

    /// A pull into `p` for `rid` (an `xfer_pull` item): the slot form's
    /// runs, or the block form's (`src_blocks`, `tail`) expanded with the
    /// source pool's page size as the sidecar expands them
    /// ([`pull_copies`]). A block form from a pool this process does not
    /// mirror needs no source slots (the content is received for `rid`);
    /// from a mirrored pool whose page size it was never told, or a run
    /// that names no source slots, it is a hole.
    pub fn pull(
        &mut self,
        p: u16,
        rid: u64,
        src_pool: u16,
        runs: &[PullRun],
        src_blocks: Option<&[u32]>,
        tail: Option<u32>,
    ) -> Result<()> {
        let copies: Vec<(u64, u64, u64)> = match (src_blocks, self.page.get(&src_pool)) {
            (Some(_), _) if !self.pools.contains_key(&src_pool) => runs
                .iter()
                .map(|&(d, _, n, _)| (d as u64, 0, n as u64))
                .collect(),
            (Some(_), None) => {
                self.lost(p);
                return Ok(());
            }
            (_, page) => {
                let ps = page.map_or(1, |&ps| u32::try_from(ps).unwrap_or(u32::MAX));
                let mut v = Vec::new();
                for c in pull_copies(runs, src_blocks, tail, ps) {
                    match c {
                        Ok((d, s, n, _)) => v.push((d, s, n)),
                        Err(_) => self.lost(p),
                    }
                }
                v
            }
        };
        self.copy(p, rid, src_pool, &copies)
    }

    /// A prefill send of `pages` of `src_pool` into the destination page
    /// list of `room` from index `dst_index` on: the content is taken now.
    pub fn send(&mut self, room: u64, src_pool: u16, dst_index: u64, pages: &[u64]) {
        self.counts.events += 1;
        let vals = self.page.get(&src_pool).copied().map(|ps| {
            let mut v = Vec::with_capacity(pages.len() * ps as usize);
            let src = self.pools.get(&src_pool);
            for &pg in pages {
                match (src, pg.checked_mul(ps).and_then(|a| slot_run(a, ps))) {
                    (Some(src), Some((a, b))) => src.snapshot(a, b, &mut v),
                    _ => v.resize(v.len() + ps as usize, remote(NEVER)),
                }
            }
            v
        });
        if !self.sends.contains_key(&room) {
            if self.rooms.len() >= MAX_ROOMS
                && let Some(old) = self.rooms.pop_front()
            {
                self.sends.remove(&old);
            }
            self.rooms.push_back(room);
        }
        self.sends
            .entry(room)
            .or_default()
            .push(Chunk { dst_index, vals });
    }

    /// A decode commit of `room` for `rid` into `pages` of pool `p`: the
    /// sends this process saw become copies (pages nothing was sent to
    /// keep what they held); without them, every page holds content
    /// received for `rid` from a pool this process cannot see.
    pub fn commit(&mut self, room: u64, p: u16, rid: u64, pages: &[u64]) -> Result<()> {
        self.counts.events += 1;
        let Some(ps) = self.page.get(&p).copied() else {
            // Without the page size the pages cannot be placed: a hole.
            self.lost(p);
            return Ok(());
        };
        let chunks = self.sends.remove(&room);
        if chunks.is_some() {
            self.rooms.retain(|&r| r != room);
        }
        let page_run = |pg: u64| pg.checked_mul(ps).and_then(|a| slot_run(a, ps));
        match chunks {
            Some(chunks) => {
                for ch in chunks {
                    let Some(vals) = ch.vals else {
                        self.lost(p);
                        continue;
                    };
                    self.counts.copies_local += 1;
                    for (k, page) in vals.chunks(ps as usize).enumerate() {
                        let i = ch.dst_index as usize + k;
                        let Some((a, _)) = pages.get(i).and_then(|&pg| page_run(pg)) else {
                            break;
                        };
                        self.pool(p).copy_in(rid, a, page)?;
                    }
                }
            }
            None => {
                self.counts.copies_remote += 1;
                let vals = vec![remote(rid); ps as usize];
                for &pg in pages {
                    if let Some((a, _)) = page_run(pg) {
                        self.pool(p).copy_in(rid, a, &vals)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// The rule's read of slot runs (start, count) of pool `p` by `rid`,
    /// classified slot by slot. A pool this process never saw: all unknown.
    pub fn check(&mut self, p: u16, rid: u64, runs: &[(u64, u64)]) -> Result<Tally> {
        self.counts.checks += 1;
        let Some(pool) = self.pools.get_mut(&p) else {
            let n = runs.iter().map(|r| r.1).sum();
            return Ok(Tally {
                unknown: n,
                ..Tally::default()
            });
        };
        pool.slots.tally = Tally::default();
        for &(a, n) in runs {
            if let Some((a, b)) = slot_run(a, n) {
                // A read changes nothing: no generation of its own.
                let e = pool.event(rid, Op::Read, a, b);
                pool.seq -= 1;
                pool.rule.apply(&mut pool.slots, &e, a, b)?;
            } else if n > 0 {
                pool.slots.tally.unknown += n;
            }
        }
        Ok(std::mem::take(&mut pool.slots.tally))
    }
}

/// Content received for `owner` from a pool this process cannot see.
fn remote(owner: u64) -> SlotVal {
    SlotVal {
        owner,
        uncertain: true,
        stale: false,
    }
}

/// Runs (start, count) of a slot list, in the list's order.
pub fn runs_of(idx: &[i64]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &x in idx {
        let Ok(x) = u64::try_from(x) else { continue };
        match out.last_mut() {
            Some((a, n)) if *a + *n == x => *n += 1,
            _ => out.push((x, 1)),
        }
    }
    out
}
