//! Sharding the replay by pool (`scope --pools LIST`): a shard replays the
//! pools it reports plus, transitively, the pools their copies read from
//! (replayed but not reported), so its findings on its own pools equal
//! those of a full run. `scope::merge` recombines shards.
//!
//! Nothing here changes the engine: the plan is restricted before the
//! scheduler starts, and `Reported` wraps the backend so that read runs and
//! counters of the source-only pools are dropped.

use std::collections::{BTreeMap, BTreeSet};

use super::backend::{Backend, Counters, ReadRun, SlotVal};
use super::input::{Plan, RunSource};
use crate::error::{Error, Result};
use crate::schema::KvEvent;

/// Restricts `plan` to `pools` and the pools their copies need; returns the
/// set of pools replayed. Errors on a pool the deployment does not have.
pub fn restrict(plan: &mut Plan, pools: &[u16]) -> Result<BTreeSet<u16>> {
    let known: BTreeSet<u16> = plan.order.iter().copied().collect();
    if let Some(p) = pools.iter().find(|p| !known.contains(p)) {
        return Err(Error::Other(format!(
            "--pools: pool {p} is not in the deployment (pools: {known:?})"
        )));
    }
    // Copy edges dst <- src, from the planned copies.
    let mut sources: BTreeMap<u16, BTreeSet<u16>> = BTreeMap::new();
    for (src, dst) in plan.copies.edges() {
        sources.entry(dst).or_default().insert(src);
    }
    let mut needed: BTreeSet<u16> = pools.iter().copied().collect();
    let mut stack: Vec<u16> = needed.iter().copied().collect();
    while let Some(p) = stack.pop() {
        for &s in sources.get(&p).into_iter().flatten() {
            if needed.insert(s) {
                stack.push(s);
            }
        }
    }
    plan.order.retain(|p| needed.contains(p));
    plan.runs.retain(|p, _| needed.contains(p));
    plan.copies.restrict(&needed);
    plan.total_events = plan.runs.values().flatten().map(|r| r.rows).sum();
    Ok(needed)
}

/// Events of the reported pools that went through the external sort.
pub fn spilled_events(plan: &Plan, reported: &BTreeSet<u16>) -> u64 {
    plan.runs
        .iter()
        .filter(|(p, _)| reported.contains(p))
        .flat_map(|(_, runs)| runs)
        .filter(|r| matches!(r.source, RunSource::Spill(_)))
        .map(|r| r.rows)
        .sum()
}

/// A backend that reports only the read runs and counters of `reported`
/// pools; the other pools are replayed for their copies' sake.
pub struct Reported<'a> {
    pub inner: &'a mut dyn Backend,
    pub reported: BTreeSet<u16>,
    scratch: Counters,
}

impl<'a> Reported<'a> {
    pub fn new(inner: &'a mut dyn Backend, reported: BTreeSet<u16>) -> Self {
        Reported {
            inner,
            reported,
            scratch: Counters::default(),
        }
    }
}

impl Backend for Reported<'_> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn add_pool(&mut self, pool: u16, capacity: u64, from_engine_start: bool) -> Result<()> {
        self.inner.add_pool(pool, capacity, from_engine_start)
    }
    fn slot_limit(&self) -> Option<u64> {
        self.inner.slot_limit()
    }
    fn mark_gap(&mut self, pool: u16, before_seq: u64) {
        self.inner.mark_gap(pool, before_seq)
    }
    fn apply(
        &mut self,
        pool: u16,
        events: &[KvEvent],
        out: &mut Vec<ReadRun>,
        counters: &mut Counters,
    ) -> Result<()> {
        if self.reported.contains(&pool) {
            return self.inner.apply(pool, events, out, counters);
        }
        let keep = out.len();
        let r = self.inner.apply(pool, events, out, &mut self.scratch);
        out.truncate(keep);
        r
    }
    fn apply_copy(
        &mut self,
        pool: u16,
        event: &KvEvent,
        payload: &[SlotVal],
        counters: &mut Counters,
    ) -> Result<()> {
        if self.reported.contains(&pool) {
            self.inner.apply_copy(pool, event, payload, counters)
        } else {
            self.inner
                .apply_copy(pool, event, payload, &mut self.scratch)
        }
    }
    fn capture(
        &mut self,
        pool: u16,
        slot_start: u32,
        count: u32,
        uncertain: bool,
        out: &mut Vec<SlotVal>,
    ) -> Result<()> {
        self.inner.capture(pool, slot_start, count, uncertain, out)
    }
}
