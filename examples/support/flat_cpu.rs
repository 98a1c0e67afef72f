//! The baseline of `bench_scope`: the CPU replay backend as it was before
//! the paged slot table, with flat per-slot arrays allocated for each
//! pool's whole declared capacity (17 bytes a slot). Only the paging
//! differs from `kvtrail::lineage::cpu`, so replaying the same trace with
//! both measures what paging costs. It keeps revision 1's rule (no stale
//! bits, shared reads not reported): on traces without `alloc` events and
//! shares of another request's KV, as bench_scope's, the findings agree.

use std::collections::HashMap;

use kvtrail::error::{Error, Result};
use kvtrail::lineage::backend::{
    Backend, Counters, NEVER, Payload, ReadKind, ReadRun, SCRUBBED, SlotVal,
};
use kvtrail::schema::{KvEvent, Op};

/// A share grant: slots `start..end`, granted at `seq`.
#[derive(Debug, Clone, Copy)]
struct Grant {
    start: u32,
    end: u32,
    seq: u64,
}

struct PoolState {
    id: u16,
    /// Content owner per slot (`NEVER`, `SCRUBBED` or a request id).
    owner: Vec<u64>,
    /// seq + 1 of the event that last set the slot's content; 0 = never.
    wseq1: Vec<u64>,
    /// 1 = content came from an uncertain copy.
    flags: Vec<u8>,
    /// Content set with `wseq1 < gap_mark` predates a hole: uncertain.
    gap_mark: u64,
    never_kind: ReadKind,
    grants: HashMap<u64, Vec<Grant>>,
    /// Number of grants held, and the count at which to sweep dead ones.
    n_grants: usize,
    sweep_at: usize,
}

impl PoolState {
    #[inline]
    /// Drops grants whose every slot was rewritten since (they can never
    /// make a read shared again), so grants stay bounded by live sharing.
    fn sweep_grants(&mut self) {
        let wseq1 = &self.wseq1;
        let mut n = 0;
        self.grants.retain(|_, v| {
            v.retain(|g| {
                wseq1[g.start as usize..g.end as usize]
                    .iter()
                    .any(|&w| w <= g.seq)
            });
            n += v.len();
            !v.is_empty()
        });
        self.n_grants = n;
        self.sweep_at = (2 * n).max(GRANT_SWEEP_MIN);
    }

    fn uncertain(&self, s: usize) -> bool {
        self.flags[s] != 0 || self.wseq1[s] < self.gap_mark
    }

    /// Classification of slot `s` read by `r`: None for a clean own/shared read.
    #[inline]
    fn classify(&self, s: usize, r: u64, grants: &[Grant]) -> Option<(ReadKind, u64, bool)> {
        let o = self.owner[s];
        let unc = self.uncertain(s);
        let kind = if o == NEVER {
            self.never_kind
        } else if o == SCRUBBED {
            ReadKind::Blank
        } else if o == r
            || grants
                .iter()
                .any(|g| (g.start as usize) <= s && s < g.end as usize && self.wseq1[s] <= g.seq)
        {
            // own, or shared under a grant the slot was not rewritten since
            return unc.then_some((ReadKind::Uncertain, 0, true));
        } else {
            return Some((ReadKind::Foreign, o, unc));
        };
        match kind {
            ReadKind::Blank if unc => Some((ReadKind::Uncertain, 0, true)),
            ReadKind::Unknown => Some((ReadKind::Unknown, 0, unc)),
            k => Some((k, 0, false)),
        }
    }
}

/// Grants held before the first sweep of dead grants.
const GRANT_SWEEP_MIN: usize = 1 << 16;

/// The flat-array CPU backend.
#[derive(Default)]
pub struct FlatCpuBackend {
    pools: Vec<PoolState>,
    /// pool id -> index in `pools`.
    index: HashMap<u16, usize>,
}

impl FlatCpuBackend {
    pub fn new() -> Self {
        Self::default()
    }

    fn pool(&mut self, id: u16) -> Result<&mut PoolState> {
        match self.index.get(&id) {
            Some(&i) => Ok(&mut self.pools[i]),
            None => Err(Error::Other(format!("replay: pool {id} was not declared"))),
        }
    }
}

impl Backend for FlatCpuBackend {
    fn name(&self) -> &'static str {
        "cpu-flat"
    }

    fn add_pool(&mut self, pool: u16, capacity: u64, from_engine_start: bool) -> Result<()> {
        let n = capacity as usize;
        self.index.insert(pool, self.pools.len());
        self.pools.push(PoolState {
            id: pool,
            owner: vec![NEVER; n],
            wseq1: vec![0; n],
            flags: vec![0; n],
            gap_mark: 0,
            never_kind: if from_engine_start {
                ReadKind::Blank
            } else {
                ReadKind::Unknown
            },
            grants: HashMap::new(),
            n_grants: 0,
            sweep_at: GRANT_SWEEP_MIN,
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
        let p = self.pool(pool)?;
        debug_assert!(events.iter().all(|e| e.pool == p.id));
        for e in events {
            let a = e.slot_start as usize;
            let b = a + e.slot_count as usize;
            c.events += 1;
            c.slot_touches += e.slot_count as u64;
            match e.op {
                Op::Alloc | Op::Free => {}
                Op::Write => {
                    debug_assert!(e.src.is_none(), "copies go through apply_copy");
                    p.owner[a..b].fill(e.request_id);
                    p.wseq1[a..b].fill(e.seq + 1);
                    p.flags[a..b].fill(0);
                }
                Op::Scrub => {
                    p.owner[a..b].fill(SCRUBBED);
                    p.wseq1[a..b].fill(e.seq + 1);
                    p.flags[a..b].fill(0);
                }
                Op::Share => {
                    p.grants.entry(e.request_id).or_default().push(Grant {
                        start: a as u32,
                        end: b as u32,
                        seq: e.seq,
                    });
                    p.n_grants += 1;
                    if p.n_grants >= p.sweep_at {
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
        payload: &Payload,
        c: &mut Counters,
    ) -> Result<()> {
        let p = self.pool(pool)?;
        let a = e.slot_start as usize;
        let b = a + e.slot_count as usize;
        if payload.len() != b - a {
            return Err(Error::Other(format!(
                "replay: copy payload of {} slots for an extent of {}",
                payload.len(),
                b - a
            )));
        }
        c.events += 1;
        c.slot_touches += e.slot_count as u64;
        for (i, v) in payload.iter().enumerate() {
            p.owner[a + i] = v.owner;
            p.flags[a + i] = v.uncertain as u8;
        }
        p.wseq1[a..b].fill(e.seq + 1);
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
        let p = self.pool(pool)?;
        let a = slot_start as usize;
        out.clear();
        out.extend((a..a + count as usize).map(|s| SlotVal {
            owner: p.owner[s],
            uncertain: uncertain || p.uncertain(s),
            stale: false,
        }));
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

/// Classifies the slots `a..b` read by `e.request_id`.
#[inline]
fn read(p: &PoolState, e: &KvEvent, a: usize, b: usize, out: &mut Vec<ReadRun>, c: &mut Counters) {
    let r = e.request_id;
    let gap_mark = p.gap_mark;
    let owner = &p.owner[..b];
    let wseq1 = &p.wseq1[..b];
    let flags = &p.flags[..b];
    let grants: &[Grant] = p.grants.get(&r).map(|v| &v[..]).unwrap_or(&[]);
    // Whole-extent fast path (the common case): every slot is the reader's
    // own, certain content. Three vectorizable passes, no branches per slot.
    if all_eq(&owner[a..b], r)
        && flags[a..b].iter().fold(0u8, |acc, &f| acc | f) == 0
        && (gap_mark == 0 || wseq1[a..b].iter().fold(u64::MAX, |m, &w| m.min(w)) >= gap_mark)
    {
        c.own_slots += (b - a) as u64;
        return;
    }
    let mut s = a;
    let mut own = 0u64;
    let mut clean = 0u64;
    while s < b {
        // Fast path: a run of own, certain slots.
        if owner[s] == r && flags[s] == 0 && wseq1[s] >= gap_mark {
            own += 1;
            s += 1;
            continue;
        }
        match p.classify(s, r, grants) {
            None => {
                clean += 1;
                s += 1;
            }
            Some(cls) => {
                let start = s;
                s += 1;
                while s < b && p.classify(s, r, grants) == Some(cls) {
                    s += 1;
                }
                out.push(ReadRun {
                    reader: r,
                    pool: p.id,
                    slot_start: start as u32,
                    count: (s - start) as u32,
                    kind: cls.0,
                    source: cls.1,
                    uncertain: cls.2,
                    seq: e.seq,
                    ts_ns: e.ts_ns,
                });
            }
        }
    }
    c.own_slots += own;
    c.shared_slots += clean;
}
