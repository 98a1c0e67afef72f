//! The copy index: for every source pool, the copies that will read it,
//! sorted by src_seq, so the source can capture each copy's content just
//! before it moves past that seq.
//!
//! The index is built during the index pass and kept in memory up to a
//! bound; past it, sorted chunks are spilled (`crate::spill`) and merged
//! back while replaying, so memory never grows with the number of copies
//! in the trace. Runs are kept in tiers ([`spill::FAN`] runs of one size
//! merged into one of the next), so a pool streams from at most `FAN - 1`
//! runs per tier: a number that grows with the logarithm of the copies.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use crate::error::Result;
use crate::spill::{Merge, Part, Place, Record, Run, Tiers, le};

/// A copy whose source state must be captured: `count` slots of the source
/// pool from `src_start`, just after `src_seq`, for event `dst_seq` of
/// `dst_pool`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct CopyReq {
    pub src_seq: u64,
    pub dst_pool: u16,
    pub dst_seq: u64,
    pub src_start: u32,
    pub count: u32,
}

/// Copies kept in memory before the index spills (2 MB).
pub const COPY_CHUNK: usize = 1 << 16;

impl Record for CopyReq {
    const SIZE: usize = 32;
    fn put(&self, b: &mut [u8]) {
        le::put_u64(b, 0, self.src_seq);
        le::put_u16(b, 8, self.dst_pool);
        b[10..16].fill(0);
        le::put_u64(b, 16, self.dst_seq);
        le::put_u32(b, 24, self.src_start);
        le::put_u32(b, 28, self.count);
    }
    fn get(b: &[u8]) -> Self {
        CopyReq {
            src_seq: le::u64_at(b, 0),
            dst_pool: le::u16_at(b, 8),
            dst_seq: le::u64_at(b, 16),
            src_start: le::u32_at(b, 24),
            count: le::u32_at(b, 28),
        }
    }
}

/// Collects copies, spilling sorted chunks past `limit` entries (over all
/// pools) into each source pool's [`Tiers`] of runs.
pub struct CopySpiller {
    place: Place,
    limit: usize,
    mem: BTreeMap<u16, Vec<CopyReq>>,
    /// Copy edges (src pool, dst pool) seen, spilled or not.
    edges: BTreeSet<(u16, u16)>,
    n: usize,
    /// Per source pool: its runs.
    runs: BTreeMap<u16, Tiers<CopyReq>>,
    pub spilled: u64,
}

impl CopySpiller {
    pub fn new(root: Option<&Path>, limit: usize) -> Self {
        CopySpiller {
            // named: a trace may have many source pools, each with runs;
            // a run holds no file open until it is streamed
            place: Place::named(root, "kvtrail-copies-"),
            limit: limit.max(1),
            mem: BTreeMap::new(),
            edges: Default::default(),
            n: 0,
            runs: BTreeMap::new(),
            spilled: 0,
        }
    }

    pub fn push(&mut self, src_pool: u16, c: CopyReq) -> Result<()> {
        self.edges.insert((src_pool, c.dst_pool));
        self.mem.entry(src_pool).or_default().push(c);
        self.n += 1;
        if self.n >= self.limit {
            self.spill()?;
        }
        Ok(())
    }

    fn spill(&mut self) -> Result<()> {
        for (pool, mut v) in std::mem::take(&mut self.mem) {
            if v.is_empty() {
                continue;
            }
            v.sort_unstable();
            self.spilled += v.len() as u64;
            let run = Run::write(&mut self.place, v)?;
            self.runs
                .entry(pool)
                .or_default()
                .add(&mut self.place, run)?;
        }
        self.n = 0;
        Ok(())
    }

    /// Ends collection: what stays in memory is sorted.
    pub fn finish(mut self) -> CopyPlan {
        for v in self.mem.values_mut() {
            v.sort_unstable();
        }
        CopyPlan {
            mem: self.mem,
            edges: self.edges,
            dst_filter: None,
            runs: self
                .runs
                .into_iter()
                .map(|(pool, t)| (pool, t.runs().cloned().collect()))
                .collect(),
            spilled: self.spilled,
            _place: self.place,
        }
    }
}

/// The finished copy index.
pub struct CopyPlan {
    mem: BTreeMap<u16, Vec<CopyReq>>,
    edges: BTreeSet<(u16, u16)>,
    /// When set (a shard), only copies into these pools are streamed.
    dst_filter: Option<BTreeSet<u16>>,
    runs: BTreeMap<u16, Vec<Run<CopyReq>>>,
    pub spilled: u64,
    /// Holds the runs' folder.
    _place: Place,
}

impl CopyPlan {
    /// Every (src pool, dst pool) pair some copy connects.
    pub fn edges(&self) -> impl Iterator<Item = (u16, u16)> + '_ {
        self.edges.iter().copied()
    }

    /// Keeps only copies between `pools` (a shard's replayed pools); copies
    /// spilled to disk are filtered as they are streamed.
    pub fn restrict(&mut self, pools: &BTreeSet<u16>) {
        self.mem.retain(|p, _| pools.contains(p));
        self.runs.retain(|p, _| pools.contains(p));
        for v in self.mem.values_mut() {
            v.retain(|c| pools.contains(&c.dst_pool));
        }
        self.edges
            .retain(|(s, d)| pools.contains(s) && pools.contains(d));
        self.dst_filter = Some(pools.clone());
    }

    /// The copies reading `pool`, in src_seq order.
    pub fn stream(&self, pool: u16) -> Result<CopyStream> {
        let mut parts = vec![Part::Mem(
            self.mem.get(&pool).cloned().unwrap_or_default().into_iter(),
        )];
        for r in self.runs.get(&pool).into_iter().flatten() {
            parts.push(Part::Disk(r.reader()?));
        }
        let mut s = CopyStream {
            dst_filter: self.dst_filter.clone(),
            merge: Merge::new(parts)?,
            head: None,
        };
        s.pick()?;
        Ok(s)
    }

    /// All copies in memory (for tests and small traces).
    pub fn in_memory(&self) -> usize {
        self.mem.values().map(Vec::len).sum()
    }
}

/// The copies reading one pool, merged in src_seq order.
pub struct CopyStream {
    dst_filter: Option<BTreeSet<u16>>,
    merge: Merge<CopyReq, Part<CopyReq>>,
    head: Option<CopyReq>,
}

impl CopyStream {
    /// The next copy into a pool replayed (spilled copies into pools a
    /// shard does not replay are skipped here).
    fn pick(&mut self) -> Result<()> {
        self.head = loop {
            match self.merge.next_record()? {
                Some(c)
                    if self
                        .dst_filter
                        .as_ref()
                        .is_some_and(|f| !f.contains(&c.dst_pool)) => {}
                h => break h,
            }
        };
        Ok(())
    }

    /// The next copy, if any.
    pub fn peek(&self) -> Option<CopyReq> {
        self.head
    }

    /// Moves past the copy `peek` returned.
    pub fn pop(&mut self) -> Result<()> {
        if self.head.is_some() {
            self.pick()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(src_seq: u64, dst_pool: u16, dst_seq: u64) -> CopyReq {
        CopyReq {
            src_seq,
            dst_pool,
            dst_seq,
            src_start: (dst_seq % 7) as u32,
            count: 1 + (src_seq % 5) as u32,
        }
    }

    fn streamed(plan: &CopyPlan, pool: u16) -> Vec<CopyReq> {
        let mut s = plan.stream(pool).unwrap();
        let mut out = Vec::new();
        while let Some(c) = s.peek() {
            out.push(c);
            s.pop().unwrap();
        }
        out
    }

    #[test]
    fn tiered_runs_stream_every_copy_in_order() {
        // Copies of two source pools in a scrambled order, spilled every
        // `limit` copies: tiers merge, and each pool streams its copies
        // sorted, none lost or doubled, from few runs.
        for limit in [1, 2, 3, 7, 1000] {
            let mut sp = CopySpiller::new(None, limit);
            let mut want: BTreeMap<u16, Vec<CopyReq>> = BTreeMap::new();
            for i in 0..700u64 {
                let src = (i % 3 == 0) as u16;
                let c = copy((i * 7919) % 701, 2 + (i % 2) as u16, i);
                sp.push(src, c).unwrap();
                want.entry(src).or_default().push(c);
            }
            let most = sp.runs.values().map(Tiers::len).max().unwrap_or(0);
            let tiers = sp.runs.values().map(Tiers::depth).max().unwrap_or(0);
            assert!(
                most <= tiers * (crate::spill::FAN - 1),
                "limit {limit}: {most} runs"
            );
            let plan = sp.finish();
            for (pool, mut w) in want {
                w.sort_unstable();
                assert_eq!(streamed(&plan, pool), w, "limit {limit}, pool {pool}");
            }
        }
    }
}
