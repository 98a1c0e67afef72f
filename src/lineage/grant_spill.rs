//! Spilled share grants: past a spilling [`Grants`](super::grants::Grants)'s
//! limit, the grants of the readers granted longest ago are written to
//! sorted runs (`crate::spill`, unnamed temporary files) and read back by
//! reader. A run keeps every `SPILL_INDEX_EVERY`-th record's reader in
//! memory and a Bloom filter of its readers, so a reader costs one short
//! read, or none when it is not in the run. Runs are merged (dropping dead
//! grants) when they are more than `SPILL_MAX_RUNS`.

use crate::error::Result;
use crate::spill::{Merge, Place, Record, Run, le};

use super::state::Grant;

/// Spilled grants: sorted runs, each in a file of its own.
pub(super) struct Spill {
    /// Grants held in memory before a spill.
    pub(super) limit: usize,
    pub(super) runs: Vec<SpillRun>,
}

/// One run: records sorted by (reader, seq, start), with every
/// `SPILL_INDEX_EVERY`-th record's reader in memory to find a reader's
/// records with one short read.
pub(super) struct SpillRun {
    run: Run<Rec>,
    pub(super) records: u64,
    index: Vec<u64>,
    /// The readers in the run, as a Bloom filter (10 bits a record, 1%
    /// false positives): a reader not in the run costs no read.
    readers: Bloom,
    /// The last reader in the run (the first is `index[0]`).
    last: u64,
}

/// A spilled record, in run order: reader, then [`grant_key`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Rec {
    reader: u64,
    seq: u64,
    start: u32,
    last: u32,
}

impl Rec {
    fn new(reader: u64, g: &Grant) -> Rec {
        Rec {
            reader,
            seq: g.seq,
            start: g.start,
            last: g.last,
        }
    }

    fn grant(&self) -> Grant {
        Grant {
            start: self.start,
            last: self.last,
            seq: self.seq,
        }
    }
}

impl Record for Rec {
    const SIZE: usize = 24;
    fn put(&self, b: &mut [u8]) {
        le::put_u64(b, 0, self.reader);
        le::put_u32(b, 8, self.start);
        le::put_u32(b, 12, self.last);
        le::put_u64(b, 16, self.seq);
    }
    fn get(b: &[u8]) -> Rec {
        Rec {
            reader: le::u64_at(b, 0),
            start: le::u32_at(b, 8),
            last: le::u32_at(b, 12),
            seq: le::u64_at(b, 16),
        }
    }
}

const SPILL_INDEX_EVERY: usize = 128;
/// Runs kept before they are merged into one (dropping dead grants).
pub(super) const SPILL_MAX_RUNS: usize = 8;

/// Where runs go: unnamed files in the system's temporary folder.
fn place() -> Place {
    Place::unnamed(None, "replay: spilled share grants")
}

/// The order of a reader's grants in a run and in memory: as given.
pub(super) fn grant_key(g: &Grant) -> (u64, u32, u32) {
    (g.seq, g.start, g.last)
}

/// A Bloom filter of u64 keys: 10 bits a key, 7 probes.
struct Bloom {
    bits: Vec<u64>,
}

impl Bloom {
    fn new(keys: u64) -> Bloom {
        let words = (keys.saturating_mul(10) / 64 + 1).min(1 << 32) as usize;
        Bloom {
            bits: vec![0; words],
        }
    }

    /// The probes of `key`: double hashing over a 64-bit mix.
    fn probes(&self, key: u64) -> impl Iterator<Item = usize> + use<> {
        let mut z = key.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let (h1, h2) = (z & 0xffff_ffff, (z >> 32) | 1);
        let m = self.bits.len() as u64 * 64;
        (0..7u64).map(move |i| (h1.wrapping_add(i.wrapping_mul(h2)) % m) as usize)
    }

    fn insert(&mut self, key: u64) {
        for b in self.probes(key) {
            self.bits[b / 64] |= 1 << (b % 64);
        }
    }

    fn may_hold(&self, key: u64) -> bool {
        self.probes(key)
            .all(|b| self.bits[b / 64] >> (b % 64) & 1 != 0)
    }
}

impl SpillRun {
    /// Writes `grants` (sorted by reader, then [`grant_key`]) as a run.
    /// `expect` is the most records it may hold (sizes its filter).
    pub(super) fn write(
        grants: impl Iterator<Item = (u64, Grant)>,
        expect: u64,
    ) -> Result<SpillRun> {
        Self::try_write(grants.map(Ok), expect)
    }

    fn try_write(
        grants: impl Iterator<Item = Result<(u64, Grant)>>,
        expect: u64,
    ) -> Result<SpillRun> {
        let (mut records, mut index) = (0u64, Vec::new());
        let mut readers = Bloom::new(expect);
        let mut last = None;
        let recs = grants.map(|g| {
            let (r, g) = g?;
            if records % SPILL_INDEX_EVERY as u64 == 0 {
                index.push(r);
            }
            if last != Some(r) {
                readers.insert(r);
                last = Some(r);
            }
            records += 1;
            Ok(Rec::new(r, &g))
        });
        let run = Run::try_write(&mut place(), recs)?;
        Ok(SpillRun {
            run,
            records,
            index,
            readers,
            last: last.unwrap_or(0),
        })
    }

    /// Appends `reader`'s grants in this run to `out`.
    pub(super) fn find(&mut self, reader: u64, out: &mut Vec<Grant>) -> Result<()> {
        if self.records == 0
            || reader < self.index[0]
            || reader > self.last
            || !self.readers.may_hold(reader)
        {
            return Ok(());
        }
        // Blocks that start below the reader may hold it at their end;
        // the first block that starts above it holds none of it.
        let first = self
            .index
            .partition_point(|&r| r < reader)
            .saturating_sub(1);
        let end = self.index.partition_point(|&r| r <= reader);
        let lo = (first * SPILL_INDEX_EVERY) as u64;
        let hi = ((end * SPILL_INDEX_EVERY) as u64).min(self.records);
        for rec in self.run.reader_range(lo, hi)? {
            let rec = rec?;
            if rec.reader == reader {
                out.push(rec.grant());
            }
        }
        Ok(())
    }

    /// One run of the live grants of `runs`, merged a record at a time
    /// (one buffer per run in memory), copies of one grant written once.
    pub(super) fn merge(
        runs: &mut [SpillRun],
        alive: &mut impl FnMut(&Grant) -> bool,
    ) -> Result<SpillRun> {
        let expect = runs.iter().map(|r| r.records).sum();
        let readers = runs
            .iter()
            .map(|r| r.run.reader())
            .collect::<Result<Vec<_>>>()?;
        let mut prev = None;
        let live = Merge::new(readers)?.filter_map(|rec| match rec {
            Err(e) => Some(Err(e)),
            Ok(rec) => {
                if prev == Some(rec) || !alive(&rec.grant()) {
                    return None;
                }
                prev = Some(rec);
                Some(Ok((rec.reader, rec.grant())))
            }
        });
        SpillRun::try_write(live, expect)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bloom_filter_holds_every_key_and_few_others() {
        let mut b = Bloom::new(10_000);
        for k in 0..10_000u64 {
            b.insert(k * 7919);
        }
        assert!((0..10_000u64).all(|k| b.may_hold(k * 7919)));
        let false_hits = (0..10_000u64).filter(|k| b.may_hold(k * 7919 + 1)).count();
        assert!(false_hits < 300, "{false_hits} false positives in 10,000");
        assert!(!Bloom::new(0).may_hold(5));
    }
}
