//! The baseline of `bench_scope`: the CPU replay backend as it was before
//! the paged slot table, with flat per-slot arrays allocated for each
//! pool's whole declared capacity (17 bytes a slot). Only the paging
//! differs from `kvtrail::lineage::cpu`: events go through the same slot
//! rule (`lineage::rule::PoolState::apply`) and reads are classified by
//! `lineage::state::classify`, so replaying the same trace with both
//! measures what paging costs.

use std::collections::HashMap;

use kvtrail::error::{Error, Result};
use kvtrail::lineage::backend::{Backend, Counters, NEVER, Payload, ReadKind, ReadRun, SlotVal};
use kvtrail::lineage::grants::Grants;
use kvtrail::lineage::rule::{PoolState, SlotData};
use kvtrail::lineage::state::{Grant, classify};
use kvtrail::schema::{KvEvent, Op};

struct FlatPool {
    slots: Flat,
    rule: PoolState,
}

/// A pool's slots in flat arrays (`rule::SlotData`), with where a batch's
/// read runs and counts go.
struct Flat {
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
    out: Vec<ReadRun>,
    c: Counters,
}

impl Flat {
    fn uncertain(&self, s: usize) -> bool {
        self.flags[s] != 0 || self.wseq1[s] < self.gap_mark
    }
}

impl SlotData for Flat {
    #[inline]
    fn set(&mut self, e: &KvEvent, a: u64, b: u64, owner: u64) -> Result<()> {
        let (a, b) = (a as usize, b as usize);
        self.owner[a..b].fill(owner);
        self.wseq1[a..b].fill(e.seq + 1);
        self.flags[a..b].fill(0);
        Ok(())
    }

    #[inline]
    fn copy(&mut self, e: &KvEvent, a: u64, b: u64, v: SlotVal) -> Result<()> {
        let (a, b) = (a as usize, b as usize);
        self.owner[a..b].fill(v.owner);
        self.wseq1[a..b].fill(e.seq + 1);
        self.flags[a..b].fill(v.uncertain as u8);
        Ok(())
    }

    #[inline]
    fn read(&mut self, e: &KvEvent, a: u64, b: u64, grants: &mut Grants) -> Result<()> {
        read(self, e, a as usize, b as usize, grants)
    }

    fn alive(&self, g: &Grant) -> bool {
        self.wseq1[g.start() as usize..g.end() as usize]
            .iter()
            .any(|&w| w <= g.seq)
    }
}

/// The flat-array CPU backend.
#[derive(Default)]
pub struct FlatCpuBackend {
    pools: Vec<FlatPool>,
    /// pool id -> index in `pools`.
    index: HashMap<u16, usize>,
}

impl FlatCpuBackend {
    pub fn new() -> Self {
        Self::default()
    }

    fn pool(&mut self, id: u16) -> Result<&mut FlatPool> {
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
        self.pools.push(FlatPool {
            slots: Flat {
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
                out: Vec::new(),
                c: Counters::default(),
            },
            rule: PoolState::new(capacity, Grants::default()),
        });
        Ok(())
    }

    fn mark_gap(&mut self, pool: u16, before_seq: u64) {
        if let Ok(p) = self.pool(pool) {
            p.slots.gap_mark = p.slots.gap_mark.max(before_seq + 1);
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
        debug_assert!(events.iter().all(|e| e.pool == p.slots.id));
        std::mem::swap(&mut p.slots.out, out);
        for e in events {
            c.events += 1;
            c.slot_touches += e.slot_count as u64;
            if e.op == Op::Read {
                c.read_events += 1;
                c.read_slots += e.slot_count as u64;
            }
            p.rule
                .apply(&mut p.slots, e, e.slot_start as u64, e.slot_end())?;
        }
        std::mem::swap(&mut p.slots.out, out);
        c.own_slots += std::mem::take(&mut p.slots.c.own_slots);
        c.shared_slots += std::mem::take(&mut p.slots.c.shared_slots);
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
        p.rule.copy_payload(&mut p.slots, e, a as u64, payload)
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
        let f = &p.slots;
        out.extend((a..a + count as usize).map(|s| SlotVal {
            owner: f.owner[s],
            uncertain: uncertain || f.uncertain(s),
            stale: p.rule.stale.is_stale(s as u64),
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
fn read(p: &mut Flat, e: &KvEvent, a: usize, b: usize, grants: &mut Grants) -> Result<()> {
    let r = e.request_id;
    let gap_mark = p.gap_mark;
    // Whole-extent fast path (the common case): every slot is the reader's
    // own, certain content. Three vectorizable passes, no branches per slot.
    if all_eq(&p.owner[a..b], r)
        && p.flags[a..b].iter().fold(0u8, |acc, &f| acc | f) == 0
        && (gap_mark == 0 || p.wseq1[a..b].iter().fold(u64::MAX, |m, &w| m.min(w)) >= gap_mark)
    {
        p.c.own_slots += (b - a) as u64;
        return Ok(());
    }
    let grants: &[Grant] = grants.lookup(r)?;
    let cls = |p: &Flat, s: usize| {
        classify(
            p.owner[s],
            p.wseq1[s],
            p.uncertain(s),
            s as u64,
            r,
            grants,
            p.never_kind,
        )
    };
    let (mut own, mut shared) = (0u64, 0u64);
    let mut s = a;
    while s < b {
        // Fast path: a run of own, certain slots.
        if p.owner[s] == r && p.flags[s] == 0 && p.wseq1[s] >= gap_mark {
            own += 1;
            s += 1;
            continue;
        }
        match cls(p, s) {
            None => {
                own += 1;
                s += 1;
            }
            Some(k) => {
                let start = s;
                s += 1;
                while s < b && cls(p, s) == Some(k) {
                    s += 1;
                }
                if k.0 == ReadKind::Shared {
                    shared += (s - start) as u64;
                }
                p.out.push(ReadRun {
                    reader: r,
                    pool: p.id,
                    slot_start: start as u32,
                    count: (s - start) as u32,
                    kind: k.0,
                    source: k.1,
                    uncertain: k.2,
                    seq: e.seq,
                    ts_ns: e.ts_ns,
                });
            }
        }
    }
    p.c.own_slots += own;
    p.c.shared_slots += shared;
    Ok(())
}
