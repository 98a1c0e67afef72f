//! Spilled share grants: past a spilling [`Grants`](super::grants::Grants)'s
//! limit, the grants of the readers granted longest ago are written to
//! sorted runs in unnamed temporary files and read back by reader. A run
//! keeps every `SPILL_INDEX_EVERY`-th record's reader in memory and a Bloom
//! filter of its readers, so a reader costs one short read, or none when it
//! is not in the run. Runs are merged (dropping dead grants) when they are
//! more than `SPILL_MAX_RUNS`.

use crate::error::Result;

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
    file: std::fs::File,
    pub(super) records: u64,
    index: Vec<u64>,
    /// The readers in the run, as a Bloom filter (10 bits a record, 1%
    /// false positives): a reader not in the run costs no read.
    readers: Bloom,
    /// The last reader in the run (the first is `index[0]`).
    last: u64,
}

/// A spilled record: reader, start, last, seq (little-endian).
const SPILL_REC: usize = 24;
const SPILL_INDEX_EVERY: usize = 128;
/// Runs kept before they are merged into one (dropping dead grants).
pub(super) const SPILL_MAX_RUNS: usize = 8;

fn spill_err(e: std::io::Error) -> crate::error::Error {
    crate::error::Error::io(
        std::path::Path::new("$TMPDIR (replay: spilled share grants)"),
        e,
    )
}

fn encode(reader: u64, g: &Grant, out: &mut Vec<u8>) {
    out.extend_from_slice(&reader.to_le_bytes());
    out.extend_from_slice(&g.start.to_le_bytes());
    out.extend_from_slice(&g.last.to_le_bytes());
    out.extend_from_slice(&g.seq.to_le_bytes());
}

fn decode(b: &[u8]) -> (u64, Grant) {
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
    (
        u64_at(0),
        Grant {
            start: u32_at(8),
            last: u32_at(12),
            seq: u64_at(16),
        },
    )
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
        use std::io::Write;
        let file = tempfile::tempfile().map_err(spill_err)?;
        let mut w = std::io::BufWriter::with_capacity(1 << 16, file);
        let (mut records, mut index, mut buf) = (0u64, Vec::new(), Vec::with_capacity(SPILL_REC));
        let mut readers = Bloom::new(expect);
        let mut last = None;
        for (r, g) in grants {
            if records % SPILL_INDEX_EVERY as u64 == 0 {
                index.push(r);
            }
            if last != Some(r) {
                readers.insert(r);
                last = Some(r);
            }
            buf.clear();
            encode(r, &g, &mut buf);
            w.write_all(&buf).map_err(spill_err)?;
            records += 1;
        }
        let file = w.into_inner().map_err(|e| spill_err(e.into_error()))?;
        Ok(SpillRun {
            file,
            records,
            index,
            readers,
            last: last.unwrap_or(0),
        })
    }

    /// Appends `reader`'s grants in this run to `out`.
    pub(super) fn find(&mut self, reader: u64, out: &mut Vec<Grant>) -> Result<()> {
        use std::io::{Read, Seek, SeekFrom};
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
        let mut bytes = vec![0u8; ((hi - lo) as usize) * SPILL_REC];
        self.file
            .seek(SeekFrom::Start(lo * SPILL_REC as u64))
            .map_err(spill_err)?;
        self.file.read_exact(&mut bytes).map_err(spill_err)?;
        out.extend(
            bytes
                .chunks_exact(SPILL_REC)
                .map(decode)
                .filter(|(r, _)| *r == reader)
                .map(|(_, g)| g),
        );
        Ok(())
    }

    /// One run of the live grants of `runs`, merged a record at a time
    /// (one buffer per run in memory), copies of one grant written once.
    pub(super) fn merge(
        runs: &mut [SpillRun],
        alive: &mut impl FnMut(&Grant) -> bool,
    ) -> Result<SpillRun> {
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        let key = |r: u64, g: &Grant| (r, g.seq, g.start, g.last);
        let expect = runs.iter().map(|r| r.records).sum();
        let mut readers = Vec::with_capacity(runs.len());
        for run in runs.iter_mut() {
            readers.push(run.reader()?);
        }
        let mut heap = BinaryHeap::new();
        for (k, rd) in readers.iter_mut().enumerate() {
            if let Some(rec) = rd.next() {
                let (r, g) = rec?;
                heap.push(Reverse((key(r, &g), k)));
            }
        }
        let mut err = None;
        let mut last = None;
        let out = std::iter::from_fn(|| {
            while let Some(Reverse(((r, seq, start, last_slot), k))) = heap.pop() {
                match readers[k].next() {
                    Some(Ok((r2, g2))) => heap.push(Reverse((key(r2, &g2), k))),
                    Some(Err(e)) => {
                        err = Some(e);
                        return None;
                    }
                    None => {}
                }
                let g = Grant {
                    start,
                    last: last_slot,
                    seq,
                };
                if last == Some((r, seq, start, last_slot)) || !alive(&g) {
                    continue;
                }
                last = Some((r, seq, start, last_slot));
                return Some((r, g));
            }
            None
        });
        let run = SpillRun::write(out, expect)?;
        match err {
            Some(e) => Err(e),
            None => Ok(run),
        }
    }

    /// Every record, in order.
    fn reader(&mut self) -> Result<impl Iterator<Item = Result<(u64, Grant)>> + '_> {
        use std::io::{Read, Seek, SeekFrom};
        self.file.seek(SeekFrom::Start(0)).map_err(spill_err)?;
        let mut r = std::io::BufReader::with_capacity(1 << 16, &self.file);
        let mut left = self.records;
        Ok(std::iter::from_fn(move || {
            if left == 0 {
                return None;
            }
            left -= 1;
            let mut b = [0u8; SPILL_REC];
            Some(r.read_exact(&mut b).map(|()| decode(&b)).map_err(spill_err))
        }))
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
