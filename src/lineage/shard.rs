//! Sharding the replay by pool (`scope --pools LIST`): a shard replays the
//! pools it reports plus, transitively, the pools their copies read from
//! (replayed but not reported), so its findings on its own pools equal
//! those of a full run. `scope::merge` recombines shards. `plan_shards`
//! splits a trace into such shards for a fan-out (`kvtrail fleet`), by the
//! same closure (`replayed`).
//!
//! Nothing here changes the engine: the plan is restricted before the
//! scheduler starts, and `Reported` wraps the backend so that read runs and
//! counters of the source-only pools are dropped.

use std::collections::{BTreeMap, BTreeSet};

use super::backend::{Backend, Counters, Payload, ReadRun};
use super::input::{Plan, RunSource};
use crate::error::{Error, Result};
use crate::schema::KvEvent;
use crate::trace::read::Trace;

/// The pools a shard reporting `pools` replays: those pools and,
/// transitively, every pool their copies read from (`edges`: source pool,
/// destination pool). The one rule of what a shard needs.
pub fn replayed(
    edges: impl IntoIterator<Item = (u16, u16)>,
    pools: impl IntoIterator<Item = u16>,
) -> BTreeSet<u16> {
    let mut sources: BTreeMap<u16, BTreeSet<u16>> = BTreeMap::new();
    for (src, dst) in edges {
        sources.entry(dst).or_default().insert(src);
    }
    let mut needed: BTreeSet<u16> = pools.into_iter().collect();
    let mut stack: Vec<u16> = needed.iter().copied().collect();
    while let Some(p) = stack.pop() {
        for &s in sources.get(&p).into_iter().flatten() {
            if needed.insert(s) {
                stack.push(s);
            }
        }
    }
    needed
}

/// One shard of a fan-out: the pools it reports (`scope --pools`) and the
/// pools it replays for them, with their events.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShardGroup {
    pub pools: Vec<u16>,
    pub replays: Vec<u16>,
    pub events: u64,
}

/// Splits `pools` into shards whose reported pools are disjoint and cover
/// them all. Pools that copy into each other (a device pool and its
/// `cache` tier) are one unit, as every shard of either would replay both;
/// each unit that no other unit's copies read from (a decode pool, a pool
/// without copies) is a shard, and each other unit (a prefill pool) rides
/// along with the first shard, by lowest pool id, that replays it anyway.
/// So no shard replays more than its own pools need, and the number of
/// shards is the number of such sinks. `events` counts the replayed pools'
/// events (`events_of`). Deterministic: shards sorted by lowest pool id.
pub fn groups(
    pools: &[u16],
    edges: &[(u16, u16)],
    events_of: impl Fn(u16) -> u64,
) -> Vec<ShardGroup> {
    let all: BTreeSet<u16> = pools.iter().copied().collect();
    let up: BTreeMap<u16, BTreeSet<u16>> = all
        .iter()
        .map(|&p| (p, replayed(edges.iter().copied(), [p])))
        .collect();
    // Units: pools that reach each other through copies.
    let mut unit_of: BTreeMap<u16, usize> = BTreeMap::new();
    let mut units: Vec<BTreeSet<u16>> = Vec::new();
    for &p in &all {
        if unit_of.contains_key(&p) {
            continue;
        }
        let unit: BTreeSet<u16> = up[&p]
            .iter()
            .copied()
            .filter(|q| up.get(q).is_some_and(|u| u.contains(&p)))
            .collect();
        for &q in &unit {
            unit_of.insert(q, units.len());
        }
        units.push(unit);
    }
    // A sink: no copy leaves the unit.
    let sink: Vec<bool> = units
        .iter()
        .map(|u| {
            !edges
                .iter()
                .any(|(s, d)| u.contains(s) && !u.contains(d) && all.contains(d))
        })
        .collect();
    let mut out: Vec<(BTreeSet<u16>, BTreeSet<u16>)> = units
        .iter()
        .zip(&sink)
        .filter(|(_, s)| **s)
        .map(|(u, _)| {
            let reps = replayed(edges.iter().copied(), u.iter().copied());
            (u.clone(), reps.intersection(&all).copied().collect())
        })
        .collect();
    for (u, _) in units.iter().zip(&sink).filter(|(_, s)| !**s) {
        let first = u.iter().next().copied().unwrap_or_default();
        if let Some(g) = out.iter_mut().find(|(_, reps)| reps.contains(&first)) {
            g.0.extend(u.iter().copied());
        } else {
            // Unreachable for a finite graph (every unit reaches a sink);
            // kept as a shard of its own rather than lost.
            let reps = replayed(edges.iter().copied(), u.iter().copied());
            out.push((u.clone(), reps.intersection(&all).copied().collect()));
        }
    }
    let mut out: Vec<ShardGroup> = out
        .into_iter()
        .map(|(p, r)| ShardGroup {
            events: r
                .iter()
                .map(|&q| events_of(q))
                .fold(0u64, u64::saturating_add),
            pools: p.into_iter().collect(),
            replays: r.into_iter().collect(),
        })
        .collect();
    out.sort_by_key(|g| g.pools.first().copied());
    out
}

/// The shards of `trace` ([`groups`] over its pools and copies), from the
/// light pass that `verify` and `inspect` make (the pool, seq and src
/// columns; the trace-wide checks), so a trace that cannot be replayed is
/// refused here, before any shard starts.
pub fn plan_shards(trace: &Trace) -> Result<Vec<ShardGroup>> {
    let checked = crate::trace::check::check_kv(trace, None, None)?;
    let pools: Vec<u16> = trace.deployment().pools.iter().map(|p| p.id).collect();
    let edges: Vec<(u16, u16)> = checked.edges.keys().copied().collect();
    let events: BTreeMap<u16, u64> = checked.pools.iter().map(|p| (p.pool, p.events)).collect();
    Ok(groups(&pools, &edges, |p| {
        events.get(&p).copied().unwrap_or(0)
    }))
}

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
    let needed = replayed(plan.copies.edges(), pools.iter().copied());
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
    fn limit_grants(&mut self, grants: usize) {
        self.inner.limit_grants(grants)
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
        payload: &Payload,
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
        out: &mut Payload,
    ) -> Result<()> {
        self.inner.capture(pool, slot_start, count, uncertain, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(pools: &[u16], edges: &[(u16, u16)]) -> Vec<(Vec<u16>, Vec<u16>, u64)> {
        groups(pools, edges, |p| 10 + p as u64)
            .into_iter()
            .map(|g| (g.pools, g.replays, g.events))
            .collect()
    }

    #[test]
    fn one_shard_per_decode_pool_and_the_prefill_pool_rides_along() {
        // Prefill 0 feeds decode 1 and 2; 3 has no copies.
        assert_eq!(
            plan(&[0, 1, 2, 3], &[(0, 1), (0, 2)]),
            vec![
                (vec![0, 1], vec![0, 1], 21),
                (vec![2], vec![0, 2], 22),
                (vec![3], vec![3], 13),
            ]
        );
    }

    #[test]
    fn pools_that_copy_into_each_other_travel_together() {
        // Device 1 and its cache tier 4 copy both ways; 0 feeds 1; 1 feeds 2;
        // 3 feeds 2 and is reported by the first shard replaying it.
        let g = plan(&[0, 1, 2, 3, 4], &[(0, 1), (1, 4), (4, 1), (1, 2), (3, 2)]);
        assert_eq!(g, vec![(vec![0, 1, 2, 3, 4], vec![0, 1, 2, 3, 4], 60)]);
        // A tier pair as the sink: one shard with both.
        let g = plan(&[0, 1, 2], &[(0, 1), (1, 2), (2, 1)]);
        assert_eq!(g, vec![(vec![0, 1, 2], vec![0, 1, 2], 33)]);
        // Two decode pools each with their tier.
        let g = plan(
            &[0, 1, 2, 3, 4],
            &[(0, 1), (0, 2), (1, 3), (3, 1), (2, 4), (4, 2)],
        );
        assert_eq!(
            g,
            vec![
                (vec![0, 1, 3], vec![0, 1, 3], 34),
                (vec![2, 4], vec![0, 2, 4], 36),
            ]
        );
    }

    #[test]
    fn every_pool_is_reported_exactly_once() {
        // Chains and fans over 12 pools: the shards partition them, and each
        // replays exactly the closure of what it reports.
        let edges: Vec<(u16, u16)> = vec![
            (0, 3),
            (1, 3),
            (3, 6),
            (2, 7),
            (7, 8),
            (8, 7),
            (6, 9),
            (6, 10),
            (5, 10),
        ];
        let pools: Vec<u16> = (0..12).collect();
        let g = groups(&pools, &edges, |_| 1);
        let mut seen: Vec<u16> = g.iter().flat_map(|s| s.pools.clone()).collect();
        seen.sort_unstable();
        assert_eq!(seen, pools);
        for s in &g {
            let want: Vec<u16> = replayed(edges.iter().copied(), s.pools.iter().copied())
                .into_iter()
                .collect();
            assert_eq!(s.replays, want, "{s:?}");
        }
        assert_eq!(
            replayed(edges.iter().copied(), [10])
                .into_iter()
                .collect::<Vec<_>>(),
            vec![0, 1, 3, 5, 6, 10]
        );
    }
}
