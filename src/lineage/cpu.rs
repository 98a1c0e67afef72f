//! The CPU replay backend: per-slot state in pages allocated on first
//! write (`slots`), reads classified slice by slice with an own-read fast
//! path.
//!
//! Memory is proportional to the slots the trace writes (17 bytes a slot,
//! in pages of `slots::PAGE` slots, or of the whole pool when it is
//! smaller) plus the share grants of requests, never to the number of
//! events or to a pool's declared capacity.

use std::collections::HashMap;

use super::backend::{Backend, Counters, ReadKind, ReadRun, SlotVal};
use super::slots::{PAGE, PAGE_BITS, Pages, page_len, segments};
use super::state::{self, Class, Grant, Grants, NEVER, SCRUBBED, StaleBits};
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

struct PoolState {
    id: u16,
    capacity: u64,
    pages: Pages<Page>,
    /// Content set with `wseq1 < gap_mark` predates a hole: uncertain.
    gap_mark: u64,
    never_kind: ReadKind,
    /// Which written slots hold content that predates their latest alloc.
    stale: StaleBits,
    grants: Grants,
}

impl PoolState {
    #[inline]
    fn page(&self, page: usize) -> View<'_> {
        self.pages.get(page).map_or(BLANK, Page::view)
    }

    #[inline]
    fn page_mut(&mut self, page: usize) -> &mut Page {
        let n = page_len(self.capacity, page);
        self.pages.get_or_insert_with(page, || Page::blank(n))
    }

    /// Sets the content of slots `a..b`.
    fn set(&mut self, a: u64, b: u64, owner: u64, seq1: u64) {
        for (pi, lo, hi) in segments(a, b) {
            let pg = self.page_mut(pi);
            pg.owner[lo..hi].fill(owner);
            pg.wseq1[lo..hi].fill(seq1);
            pg.flags[lo..hi].fill(0);
        }
        self.stale.set_current(a, b);
    }

    /// Drops grants whose every slot was rewritten since (they can never
    /// make a read shared again), so grants stay bounded by live sharing.
    fn sweep_grants(&mut self) {
        let pages = &self.pages;
        self.grants.sweep(|g| {
            segments(g.start, g.end).any(|(pi, lo, hi)| {
                pages.get(pi).map_or(BLANK, Page::view).wseq1[lo..hi]
                    .iter()
                    .any(|&w| w <= g.seq)
            })
        });
    }

    #[inline]
    fn uncertain(&self, pg: View, o: usize) -> bool {
        pg.flags[o] != 0 || pg.wseq1[o] < self.gap_mark
    }

    /// Classification of slot `s` (offset `o` of page `pg`) read by `r`.
    #[inline]
    fn classify(&self, pg: View, o: usize, s: u64, r: u64, grants: &[Grant]) -> Class {
        let unc = self.uncertain(pg, o);
        state::classify(pg.owner[o], pg.wseq1[o], unc, s, r, grants, self.never_kind)
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

/// Pages of state the backend has allocated, and the limit in slots.
struct Budget {
    used: u64,
    max: u64,
}

impl Default for Budget {
    fn default() -> Self {
        Budget {
            used: 0,
            max: max_touched_slots(),
        }
    }
}

impl Budget {
    /// Takes the pages a store to slots `a..b` of `p` would allocate, or
    /// refuses (an `Invalid` error whose `row` is `at`, the event's index
    /// in its batch: the scheduler puts the file and row there).
    fn take(&mut self, p: &PoolState, e: &KvEvent, at: usize, a: u64, b: u64) -> Result<()> {
        let new = segments(a, b)
            .filter(|&(pi, _, _)| p.pages.get(pi).is_none())
            .count() as u64;
        if new == 0 {
            return Ok(());
        }
        let used = self.used.saturating_add(new);
        if used.saturating_mul(PAGE as u64) > self.max {
            return Err(over_budget(e, at, self.max));
        }
        self.used = used;
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

/// The CPU backend.
#[derive(Default)]
pub struct CpuBackend {
    pools: Vec<PoolState>,
    /// pool id -> index in `pools`.
    index: HashMap<u16, usize>,
    budget: Budget,
}

impl CpuBackend {
    pub fn new() -> Self {
        Self::default()
    }

    /// A backend that holds state for at most `max` touched slots.
    pub fn with_max_touched_slots(max: u64) -> Self {
        let mut b = Self::default();
        b.budget.max = max;
        b
    }

    fn pool(&mut self, id: u16) -> Result<&mut PoolState> {
        match self.index.get(&id) {
            Some(&i) => Ok(&mut self.pools[i]),
            None => Err(Error::Other(format!("replay: pool {id} was not declared"))),
        }
    }

    /// Slot pages allocated over all pools (each holds `slots::PAGE` slots).
    pub fn pages_allocated(&self) -> usize {
        self.pools.iter().map(|p| p.pages.allocated()).sum()
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn add_pool(&mut self, pool: u16, capacity: u64, from_engine_start: bool) -> Result<()> {
        self.index.insert(pool, self.pools.len());
        self.pools.push(PoolState {
            id: pool,
            capacity,
            pages: Pages::new(),
            gap_mark: 0,
            never_kind: if from_engine_start {
                ReadKind::Blank
            } else {
                ReadKind::Unknown
            },
            stale: StaleBits::new(capacity),
            grants: Grants::default(),
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
        let (p, budget) = (&mut self.pools[i], &mut self.budget);
        debug_assert!(events.iter().all(|e| e.pool == p.id));
        for (at, e) in events.iter().enumerate() {
            let (a, b) = (e.slot_start as u64, e.slot_end());
            c.events += 1;
            c.slot_touches += e.slot_count as u64;
            match e.op {
                Op::Alloc => p.stale.alloc(a, b),
                Op::Free => {}
                Op::Write => {
                    debug_assert!(e.src.is_none(), "copies go through apply_copy");
                    budget.take(p, e, at, a, b)?;
                    p.set(a, b, e.request_id, e.seq + 1);
                }
                Op::Scrub => {
                    budget.take(p, e, at, a, b)?;
                    p.set(a, b, SCRUBBED, e.seq + 1)
                }
                Op::Share => {
                    if p.grants.share(&p.stale, e.request_id, a, b, e.seq) {
                        p.sweep_grants();
                    }
                }
                Op::Read => {
                    c.read_events += 1;
                    c.read_slots += e.slot_count as u64;
                    read(p, e, a, b, out, c);
                }
            }
        }
        Ok(())
    }

    fn apply_copy(
        &mut self,
        pool: u16,
        e: &KvEvent,
        payload: &[SlotVal],
        c: &mut Counters,
    ) -> Result<()> {
        let i = *self
            .index
            .get(&pool)
            .ok_or_else(|| Error::Other(format!("replay: pool {pool} was not declared")))?;
        let (p, budget) = (&mut self.pools[i], &mut self.budget);
        let (a, b) = (e.slot_start as u64, e.slot_end());
        budget.take(p, e, 0, a, b)?;
        if payload.len() as u64 != b - a {
            return Err(Error::Other(format!(
                "replay: copy payload of {} slots for an extent of {}",
                payload.len(),
                b - a
            )));
        }
        c.events += 1;
        c.slot_touches += e.slot_count as u64;
        let mut vals = payload.iter();
        for (pi, lo, hi) in segments(a, b) {
            let pg = p.page_mut(pi);
            for (o, v) in (lo..hi).zip(&mut vals) {
                pg.owner[o] = v.owner;
                pg.flags[o] = v.uncertain as u8;
            }
            pg.wseq1[lo..hi].fill(e.seq + 1);
        }
        p.stale.copy(a, b, |i| payload[i].stale);
        Ok(())
    }

    fn capture(
        &mut self,
        pool: u16,
        slot_start: u32,
        count: u32,
        uncertain: bool,
        out: &mut Vec<SlotVal>,
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
            let pg = p.page(pi);
            let base = (pi as u64) << PAGE_BITS;
            out.extend((lo..hi).map(|o| SlotVal {
                owner: pg.owner[o],
                uncertain: uncertain || p.uncertain(pg, o),
                stale: p.stale.is_stale(base + o as u64),
            }));
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

/// Classifies the slots `a..b` read by `e.request_id`.
#[inline]
fn read(p: &PoolState, e: &KvEvent, a: u64, b: u64, out: &mut Vec<ReadRun>, c: &mut Counters) {
    let r = e.request_id;
    let gap_mark = p.gap_mark;
    let grants: &[Grant] = p.grants.of(r);
    // Whole-extent fast path (the common case): every slot is the reader's
    // own, certain content. Three vectorizable passes, no branches per slot.
    if segments(a, b).all(|(pi, lo, hi)| all_own(p.page(pi), lo, hi, r, gap_mark)) {
        c.own_slots += b - a;
        return;
    }
    let mut own = 0u64;
    let mut shared = 0u64;
    // The run being built: its first slot and classification.
    let mut run: Option<(u64, (ReadKind, u64, bool))> = None;
    let mut emit = |start: u64, end: u64, cls: (ReadKind, u64, bool)| {
        out.push(ReadRun {
            reader: r,
            pool: p.id,
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
        let Some(pg) = p.pages.get(pi).map(Page::view) else {
            // Never written: every slot classifies alike (the owner is
            // NEVER, so grants do not matter), one step for the page.
            let s = base + lo as u64;
            let cls = p.classify(BLANK, 0, s, r, grants);
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
                let cls = p.classify(pg, o, s, r, grants);
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
}
