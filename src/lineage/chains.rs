//! Copy chains as the data holds them: a replay (the scheduler of
//! `sched`, so copies are applied in the causal order scope uses) whose
//! only state per slot is how many copies deep its content is. Content set
//! by a write or a scrub (or never set) is 0 copies deep; a copy's content
//! is one deeper than the source slot's content just after `src_seq`, and
//! a copy of a never-written slot is 0 deep (it has no content to follow).
//! `kvtrail sql` sizes its pointer jumping from the longest chain
//! (`sql::levels_for_chain`), so no chain the trace holds is left
//! unresolved; the pool pairs that copied are kept for its comment.

use std::collections::{BTreeMap, BTreeSet};

use crate::error::{Error, Result};
use crate::progress::Reporter;
use crate::schema::{KvEvent, Op};
use crate::trace::read::Trace;

use super::backend::{Backend, Counters, Payload, ReadRun, SlotVal};
use super::slots::SlotVec;
use super::{LineageOptions, run_with};

/// The copies a trace holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CopyChains {
    /// The most copies any slot's content went through since it was last
    /// written (0: no copy of written content).
    pub longest: u64,
    /// (source pool, destination pool) of every copy.
    pub edges: BTreeSet<(u16, u16)>,
}

/// Replays `trace` and measures its copy chains (one thread; memory: four
/// bytes per slot the trace touches).
pub fn copy_chains(trace: &Trace, reporter: &dyn Reporter) -> Result<CopyChains> {
    let mut b = ChainBackend::default();
    let opts = LineageOptions {
        threads: 1,
        ..Default::default()
    };
    run_with(trace, &mut b, &opts, reporter)?;
    Ok(CopyChains {
        longest: u64::from(b.longest.saturating_sub(1)),
        edges: b.edges,
    })
}

/// A slot's depth as a payload value (in the owner field).
fn depth_val(d: u32) -> SlotVal {
    SlotVal {
        owner: u64::from(d),
        uncertain: false,
        stale: false,
    }
}

/// Per slot: 0 never written, else 1 + the copies its content went through.
#[derive(Default)]
struct ChainBackend {
    pools: BTreeMap<u16, SlotVec<u32>>,
    longest: u32,
    edges: BTreeSet<(u16, u16)>,
}

impl ChainBackend {
    fn pool(&mut self, pool: u16) -> Result<&mut SlotVec<u32>> {
        self.pools
            .get_mut(&pool)
            .ok_or_else(|| Error::Other(format!("replay: pool {pool} was not declared")))
    }
}

impl Backend for ChainBackend {
    fn name(&self) -> &'static str {
        "copy chains"
    }

    fn add_pool(&mut self, pool: u16, capacity: u64, _from_engine_start: bool) -> Result<()> {
        self.pools.insert(pool, SlotVec::new(capacity, 0));
        Ok(())
    }

    fn mark_gap(&mut self, _pool: u16, _before_seq: u64) {}

    fn apply(
        &mut self,
        pool: u16,
        events: &[KvEvent],
        _out: &mut Vec<ReadRun>,
        c: &mut Counters,
    ) -> Result<()> {
        let slots = self.pool(pool)?;
        for e in events {
            c.events += 1;
            c.slot_touches += u64::from(e.slot_count);
            if matches!(e.op, Op::Write | Op::Scrub) {
                slots.fill(u64::from(e.slot_start), e.slot_end(), 1);
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
        if let Some(src) = &e.src {
            self.edges.insert((src.pool, pool));
        }
        c.events += 1;
        c.slot_touches += u64::from(e.slot_count);
        let mut longest = self.longest;
        let slots = self.pool(pool)?;
        let mut s = u64::from(e.slot_start);
        for &(n, v) in payload.runs() {
            // A copy of never-written content has nothing to follow.
            let depth = if v.owner == 0 {
                1
            } else {
                (v.owner as u32).saturating_add(1)
            };
            longest = longest.max(depth);
            slots.fill(s, s + u64::from(n), depth);
            s += u64::from(n);
        }
        self.longest = longest;
        Ok(())
    }

    fn capture(
        &mut self,
        pool: u16,
        slot_start: u32,
        count: u32,
        _uncertain: bool,
        out: &mut Payload,
    ) -> Result<()> {
        let slots = self.pool(pool)?;
        let a = u64::from(slot_start);
        out.clear();
        let mut run: Option<(usize, u32)> = None;
        for v in slots.range(a, a + u64::from(count)) {
            run = match run {
                Some((n, d)) if d == v => Some((n + 1, d)),
                Some((n, d)) => {
                    out.push_run(n, depth_val(d));
                    Some((1, v))
                }
                None => Some((1, v)),
            };
        }
        if let Some((n, d)) = run {
            out.push_run(n, depth_val(d));
        }
        Ok(())
    }
}
