//! Slot state and share grants: the one home of the per-slot rule of the
//! trace semantics (docs/trace-format.md, "Semantics"). Every backend (CPU,
//! GPU, the audit's and the counterfactual's) keeps its slots with these
//! types and asks these functions, so a rule change is made here once.
//!
//! A slot has a content owner (`NEVER`, `SCRUBBED` or a request id), a
//! generation (`wseq1`: seq + 1 of the event that set the content, 0 =
//! never) and a current/stale bit ([`StaleBits`]): stale when the content
//! predates the slot's latest `alloc`. A share grant ([`Grants`]) covers
//! the slots whose content was current when it was granted, until they are
//! written again. The GPU kernels mirror [`classify`] (kernels/lineage.cu,
//! `kvt_classify`); grants and the stale bits stay on the host for every
//! backend, since only a share consults the bit and the grant keeps what it
//! saw.

use std::collections::HashMap;

use crate::error::Result;

use super::slots::{PAGE, PAGE_BITS, Pages, page_len, segments};

/// Owner value of a slot never written during the capture.
pub const NEVER: u64 = u64::MAX;
/// Owner value of a scrubbed slot (zeroed: no owner).
pub const SCRUBBED: u64 = u64::MAX - 1;

/// The content of one source slot as a copy sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotVal {
    /// Content owner, or `NEVER` / `SCRUBBED`.
    pub owner: u64,
    /// The value depends on state after a hole (or on an uncertain copy).
    pub uncertain: bool,
    /// The content predates the source slot's latest `alloc`: a copy
    /// carries the staleness to its destination.
    pub stale: bool,
}

/// The content of a copy's source slots, as runs of equal [`SlotVal`]s
/// (`len` slots each, in slot order): a source written by one request in
/// one go is one run, so capturing and applying a copy costs per run, not
/// per slot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Payload {
    runs: Vec<(u32, SlotVal)>,
    len: usize,
}

impl Payload {
    pub fn clear(&mut self) {
        self.runs.clear();
        self.len = 0;
    }

    /// Slots covered.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends `n` slots of value `v` (joined to the last run when equal).
    /// A payload covers one copy's extent, at most 2^32 - 1 slots.
    #[inline]
    pub fn push_run(&mut self, n: usize, v: SlotVal) {
        if n == 0 {
            return;
        }
        self.len += n;
        match self.runs.last_mut() {
            Some((k, last)) if *last == v => *k += n as u32,
            _ => {
                // Most payloads are one run: room for exactly one first.
                if self.runs.capacity() == 0 {
                    self.runs.reserve_exact(1);
                }
                self.runs.push((n as u32, v))
            }
        }
    }

    #[inline]
    pub fn push(&mut self, v: SlotVal) {
        self.push_run(1, v)
    }

    /// Keeps the first `n` slots.
    pub fn truncate(&mut self, n: usize) {
        if n >= self.len {
            return;
        }
        let (mut seen, mut keep) = (0usize, 0usize);
        for (k, _) in self.runs.iter_mut() {
            if seen >= n {
                break;
            }
            let take = (*k as usize).min(n - seen);
            *k = take as u32;
            seen += take;
            keep += 1;
        }
        self.runs.truncate(keep);
        self.len = n;
    }

    /// The runs: (slots, value), in slot order.
    #[inline]
    pub fn runs(&self) -> &[(u32, SlotVal)] {
        &self.runs
    }

    /// The value of every slot, in order.
    pub fn iter(&self) -> impl Iterator<Item = SlotVal> + '_ {
        self.runs
            .iter()
            .flat_map(|&(n, v)| std::iter::repeat_n(v, n as usize))
    }

    /// Bytes a payload in flight costs (for the exchange's limit): its
    /// runs' buffer, itself, and about 64 bytes of map entry and
    /// allocator overhead.
    pub fn bytes(&self) -> usize {
        self.runs.capacity() * std::mem::size_of::<(u32, SlotVal)>()
            + std::mem::size_of::<Self>()
            + 64
    }
}

impl Extend<SlotVal> for Payload {
    fn extend<I: IntoIterator<Item = SlotVal>>(&mut self, vals: I) {
        for v in vals {
            self.push(v);
        }
    }
}

impl FromIterator<SlotVal> for Payload {
    fn from_iter<I: IntoIterator<Item = SlotVal>>(vals: I) -> Self {
        let mut p = Payload::default();
        p.extend(vals);
        p
    }
}

/// What a read of a run of slots found, when it is not a clean own read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReadKind {
    /// The content owner is another request without a valid share grant.
    Foreign,
    /// Scrubbed, or never written in a capture that began with the engine.
    Blank,
    /// Never written in a capture that did not begin with the engine.
    Unknown,
    /// Would be own, shared or blank, but the slot's state depends on a
    /// hole in the seq stream: lost events may have changed it.
    Uncertain,
    /// Another request's content read under a valid share grant (a
    /// prefix-cache hit): clean, but the source is kept so that reports can
    /// list hits on another tenant's KV apart.
    Shared,
}

/// A classification: None for a clean own read; otherwise the kind, the
/// source request (`Foreign`, `Shared`) and whether it is uncertain.
pub type Class = Option<(ReadKind, u64, bool)>;

/// Classifies a read of slot `s` by `reader`: the slot holds `owner`'s
/// content set by the event with seq `wseq1 - 1`, `uncertain` when it
/// depends on a hole; `grants` are the reader's; `never` is `Blank` or
/// `Unknown` (whether the capture began with the engine).
#[inline]
pub fn classify(
    owner: u64,
    wseq1: u64,
    uncertain: bool,
    s: u64,
    reader: u64,
    grants: &[Grant],
    never: ReadKind,
) -> Class {
    if owner == NEVER {
        return Some(match never {
            ReadKind::Unknown => (ReadKind::Unknown, 0, uncertain),
            _ if uncertain => (ReadKind::Uncertain, 0, true),
            k => (k, 0, false),
        });
    }
    if owner == SCRUBBED {
        return Some(if uncertain {
            (ReadKind::Uncertain, 0, true)
        } else {
            (ReadKind::Blank, 0, false)
        });
    }
    if owner == reader {
        return uncertain.then_some((ReadKind::Uncertain, 0, true));
    }
    if grants.iter().any(|g| g.covers(s, wseq1)) {
        return Some(if uncertain {
            (ReadKind::Uncertain, 0, true)
        } else {
            (ReadKind::Shared, owner, false)
        });
    }
    Some((ReadKind::Foreign, owner, uncertain))
}

/// A share grant: slots `start..=last` (all current when granted),
/// granted at `seq`. 16 bytes: slots are below 2^32 (a pool holds at most
/// 2^32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    start: u32,
    last: u32,
    pub seq: u64,
}

impl Grant {
    /// The grant of slots `start..end` (non-empty, `end` at most 2^32).
    pub fn new(start: u64, end: u64, seq: u64) -> Self {
        debug_assert!(start < end && end <= 1 << 32);
        Grant {
            start: start as u32,
            last: (end - 1) as u32,
            seq,
        }
    }

    /// The first slot.
    #[inline]
    pub fn start(&self) -> u64 {
        self.start as u64
    }

    /// One past the last slot.
    #[inline]
    pub fn end(&self) -> u64 {
        self.last as u64 + 1
    }

    /// Whether the grant makes a read of slot `s` shared, the slot's
    /// content having been set by the event with seq `wseq1 - 1`: the slot
    /// is in the grant and was not written since it.
    #[inline]
    pub fn covers(&self, s: u64, wseq1: u64) -> bool {
        self.start() <= s && s <= self.last as u64 && wseq1 <= self.seq
    }
}

/// Grants held before the first sweep of dead grants.
const GRANT_SWEEP_MIN: usize = 1 << 16;

/// Grants a spilling [`Grants`] holds in memory (about 40 bytes each)
/// before it writes the older half to disk: live sharing beyond this costs
/// disk, not memory.
pub const GRANTS_IN_MEMORY: usize = 1 << 17;

/// The share grants of one pool, per request. Most readers hold one grant
/// (one prefix-cache hit): those are kept inline in a map of their own (24
/// bytes an entry), the others in a vector each. Grants live until every
/// slot of theirs is rewritten (a `free` does not end one), so they follow
/// live sharing: a prefix kept in the cache and hit by every request holds
/// one grant per request until it is evicted and rewritten.
///
/// A spilling set ([`Grants::spilling`]) bounds that: past its limit, the
/// grants of the readers granted longest ago go to sorted runs in
/// unnamed temporary files, and come back when such a reader reads
/// another request's slots or is granted again ([`Grants::lookup`]). A
/// grant never changes once given (whether it still covers a slot is
/// decided by the slot's generation), so a spilled grant means what it
/// meant in memory. Invariant: a reader with an entry in memory has all
/// its grants there.
pub struct Grants {
    one: HashMap<u64, Grant>,
    many: HashMap<u64, Vec<Grant>>,
    /// Number of grants held in memory, and the count at which to sweep
    /// dead ones.
    n: usize,
    sweep_at: usize,
    /// Readers known to hold no grant at all (empty entries in `many`,
    /// kept so that a reader without grants is looked up once).
    empty: usize,
    spill: Option<Spill>,
}

impl Default for Grants {
    fn default() -> Self {
        Grants {
            one: HashMap::new(),
            many: HashMap::new(),
            n: 0,
            sweep_at: GRANT_SWEEP_MIN,
            empty: 0,
            spill: None,
        }
    }
}

/// Spilled grants: sorted runs, each in a file of its own.
struct Spill {
    /// Grants held in memory before a spill.
    limit: usize,
    runs: Vec<SpillRun>,
}

/// One run: records sorted by (reader, seq, start), with every
/// `SPILL_INDEX_EVERY`-th record's reader in memory to find a reader's
/// records with one short read.
struct SpillRun {
    file: std::fs::File,
    records: u64,
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
const SPILL_MAX_RUNS: usize = 8;

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
fn grant_key(g: &Grant) -> (u64, u32, u32) {
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
    fn write(grants: impl Iterator<Item = (u64, Grant)>, expect: u64) -> Result<SpillRun> {
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
    fn find(&mut self, reader: u64, out: &mut Vec<Grant>) -> Result<()> {
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
    fn merge(runs: &mut [SpillRun], alive: &mut impl FnMut(&Grant) -> bool) -> Result<SpillRun> {
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

impl Grants {
    /// A set that holds at most about `limit` grants in memory and spills
    /// the rest (see the type's docs).
    pub fn spilling(limit: usize) -> Self {
        let mut g = Grants {
            spill: Some(Spill {
                limit: limit.max(1),
                runs: Vec::new(),
            }),
            ..Self::default()
        };
        g.sweep_at = g.next_sweep();
        g
    }

    /// Changes the limit of a spilling set (no effect on one that does not
    /// spill).
    pub fn set_limit(&mut self, limit: usize) {
        if let Some(sp) = self.spill.as_mut() {
            sp.limit = limit.max(1);
        }
        self.sweep_at = self.next_sweep();
    }

    /// Grants in memory, and grants written to disk (counting copies of
    /// grants that were read back and spilled again).
    #[cfg(test)]
    fn held(&self) -> (usize, u64) {
        let on_disk = self
            .spill
            .as_ref()
            .map_or(0, |s| s.runs.iter().map(|r| r.records).sum());
        (self.n, on_disk)
    }

    fn push(&mut self, reader: u64, g: Grant) {
        if let Some(v) = self.many.get_mut(&reader) {
            if v.is_empty() {
                self.empty -= 1;
            }
            v.push(g);
        } else if let Some(first) = self.one.remove(&reader) {
            self.many.insert(reader, vec![first, g]);
        } else {
            self.one.insert(reader, g);
        }
        self.n += 1;
    }

    /// A `share` of slots `a..b` to `reader` at `seq`: one grant per run of
    /// slots whose content is current (a grant on stale content covers
    /// nothing: the cache handed out pages their holder never wrote).
    /// Returns true when enough grants piled up that the caller should
    /// [`sweep`](Self::sweep) the dead ones.
    pub fn share(
        &mut self,
        stale: &StaleBits,
        reader: u64,
        a: u64,
        b: u64,
        seq: u64,
    ) -> Result<bool> {
        // The reader's spilled grants come back first (the invariant).
        self.lookup(reader)?;
        for (start, end) in stale.current_runs(a, b) {
            self.push(reader, Grant::new(start, end, seq));
        }
        Ok(self.n >= self.sweep_at)
    }

    /// The grants `reader` holds in memory, in the order they were given:
    /// all of them unless this set spills (then use [`lookup`]).
    ///
    /// [`lookup`]: Self::lookup
    #[inline]
    pub fn of(&self, reader: u64) -> &[Grant] {
        if self.n == 0 {
            return &[];
        }
        if let Some(g) = self.one.get(&reader) {
            return std::slice::from_ref(g);
        }
        self.many.get(&reader).map(|v| &v[..]).unwrap_or(&[])
    }

    /// Every grant `reader` holds, reading back what was spilled.
    pub fn lookup(&mut self, reader: u64) -> Result<&[Grant]> {
        // Nothing on disk (the usual case, and every set that does not
        // spill): what memory holds is all.
        if self.spill.as_ref().is_none_or(|s| s.runs.is_empty()) {
            return Ok(self.of(reader));
        }
        let in_memory = self.one.contains_key(&reader) || self.many.contains_key(&reader);
        if !in_memory && let Some(sp) = self.spill.as_mut() {
            let mut got = Vec::new();
            for run in &mut sp.runs {
                run.find(reader, &mut got)?;
            }
            got.sort_unstable_by_key(grant_key);
            got.dedup();
            self.n += got.len();
            match got.len() {
                0 => {
                    // Looked up once: a reader without grants stays cheap,
                    // within bounds (empty entries go at the next spill,
                    // or all at once when they outnumber the limit).
                    if self.empty >= sp.limit {
                        self.many.retain(|_, v| !v.is_empty());
                        self.empty = 0;
                    }
                    self.many.insert(reader, got);
                    self.empty += 1;
                }
                1 => {
                    self.one.insert(reader, got[0]);
                }
                _ => {
                    self.many.insert(reader, got);
                }
            }
        }
        Ok(self.of(reader))
    }

    /// Whether `reader` may read slot `s` (content generation `wseq1`) as
    /// shared.
    pub fn covered(&self, reader: u64, s: u64, wseq1: u64) -> bool {
        self.of(reader).iter().any(|g| g.covers(s, wseq1))
    }

    /// Puts a reader's grants back where they belong after some were
    /// dropped (none: no entry; one: inline).
    fn settle(&mut self, reader: u64) {
        if let Some(v) = self.many.get(&reader)
            && v.len() <= 1
        {
            let v = self.many.remove(&reader).expect("present");
            if let Some(&g) = v.first() {
                self.one.insert(reader, g);
            }
        }
    }

    /// Keeps only the grants `alive` says can still make a read shared (a
    /// slot of it was not rewritten since), so grants stay bounded by live
    /// sharing. A spilling set then writes the older half of its readers'
    /// grants to disk if it holds more than its limit, and merges its runs
    /// (dropping dead grants) when they are many.
    pub fn sweep(&mut self, mut alive: impl FnMut(&Grant) -> bool) -> Result<()> {
        self.one.retain(|_, g| alive(g));
        let mut moved = Vec::new();
        let mut empty = 0;
        self.many.retain(|&r, v| {
            let was_empty = v.is_empty();
            v.retain(&mut alive);
            match v.len() {
                0 if was_empty => {
                    // a reader known to hold no grant: kept
                    empty += 1;
                    true
                }
                0 => false,
                1 => {
                    moved.push((r, v[0]));
                    false
                }
                _ => {
                    v.shrink_to_fit();
                    true
                }
            }
        });
        self.empty = empty;
        self.one.extend(moved);
        self.recount();
        if let Some(limit) = self.spill.as_ref().map(|s| s.limit)
            && self.n > limit
        {
            self.spill_older_half()?;
        }
        if let Some(sp) = self.spill.as_mut()
            && sp.runs.len() > SPILL_MAX_RUNS
        {
            let mut runs = std::mem::take(&mut sp.runs);
            sp.runs.push(SpillRun::merge(&mut runs, &mut alive)?);
        }
        self.one.shrink_to_fit();
        self.many.shrink_to_fit();
        self.sweep_at = self.next_sweep();
        Ok(())
    }

    /// When to sweep next: at twice the grants held (at least
    /// GRANT_SWEEP_MIN); a spilling set past its limit, or after half its
    /// limit more when it could not get below it (one reader's grants).
    fn next_sweep(&self) -> usize {
        let base = (2 * self.n).max(GRANT_SWEEP_MIN);
        match &self.spill {
            // still over the limit after a spill: one reader's grants
            Some(sp) if self.n > sp.limit => self.n + 1 + sp.limit / 2,
            Some(sp) => base.min(sp.limit + 1),
            None => base,
        }
    }

    fn recount(&mut self) {
        self.n = self.one.len() + self.many.values().map(Vec::len).sum::<usize>();
    }

    /// Writes the grants of the older half of the readers in memory (by
    /// their latest grant) to a new run and drops them from memory, with
    /// the entries of readers known to hold none.
    fn spill_older_half(&mut self) -> Result<()> {
        let mut newest: Vec<(u64, u64)> = self
            .one
            .iter()
            .map(|(&r, g)| (g.seq, r))
            .chain(
                self.many
                    .iter()
                    .filter(|(_, v)| !v.is_empty())
                    .map(|(&r, v)| (v.iter().map(|g| g.seq).max().unwrap_or(0), r)),
            )
            .collect();
        let half = newest.len() / 2;
        if half == 0 {
            return Ok(());
        }
        newest.select_nth_unstable(half);
        let mut victims: Vec<u64> = newest[..half].iter().map(|&(_, r)| r).collect();
        drop(newest);
        victims.sort_unstable();
        let mut out: Vec<(u64, Grant)> = Vec::new();
        for &r in &victims {
            if let Some(g) = self.one.remove(&r) {
                out.push((r, g));
            } else if let Some(mut v) = self.many.remove(&r) {
                v.sort_unstable_by_key(grant_key);
                out.extend(v.into_iter().map(|g| (r, g)));
            }
        }
        self.many.retain(|_, v| !v.is_empty());
        self.empty = 0;
        let n = out.len() as u64;
        let run = SpillRun::write(out.into_iter(), n)?;
        self.spill.as_mut().expect("spilling").runs.push(run);
        self.recount();
        Ok(())
    }

    /// Drops `reader`'s grants that overlap slots `a..b` (the reader freed
    /// them). Only for a set that does not spill: a spilled copy of the
    /// grant would come back.
    pub fn release(&mut self, reader: u64, a: u64, b: u64) {
        debug_assert!(self.spill.is_none(), "release on a spilling grant set");
        let off = |g: &Grant| g.end() <= a || g.start() >= b;
        if let Some(g) = self.one.get(&reader) {
            if !off(g) {
                self.one.remove(&reader);
                self.n -= 1;
            }
        } else if let Some(v) = self.many.get_mut(&reader) {
            let before = v.len();
            v.retain(off);
            self.n -= before - v.len();
            self.settle(reader);
        }
    }
}

/// Which slots of a pool hold stale content, one bit a slot in pages
/// allocated when content is first set in them. A slot whose page was
/// never set holds no content (never written), so its staleness does not
/// matter and `alloc` skips it: memory follows the slots written.
pub struct StaleBits {
    pages: Pages<[u64]>,
    capacity: u64,
}

impl StaleBits {
    pub fn new(capacity: u64) -> Self {
        StaleBits {
            pages: Pages::new(),
            capacity,
        }
    }

    fn page_mut(&mut self, pi: usize) -> &mut [u64] {
        let words = page_len(self.capacity, pi).div_ceil(64);
        self.pages
            .get_or_insert_with(pi, || vec![0u64; words].into_boxed_slice())
    }

    /// `alloc` of slots `a..b`: their content (where they have any) is now
    /// stale for the new holder.
    pub fn alloc(&mut self, a: u64, b: u64) {
        for (pi, lo, hi) in segments(a, b) {
            if self.pages.get(pi).is_some() {
                set_bits(self.page_mut(pi), lo, hi, true);
            }
        }
    }

    /// A write or scrub of slots `a..b`: the content is current.
    pub fn set_current(&mut self, a: u64, b: u64) {
        for (pi, lo, hi) in segments(a, b) {
            set_bits(self.page_mut(pi), lo, hi, false);
        }
    }

    /// A copy into slots `a..a + payload.len()`: each slot takes the
    /// staleness of its source slot.
    pub fn copy(&mut self, a: u64, payload: &Payload) {
        let mut s = a;
        for &(n, v) in payload.runs() {
            self.set_range(s, s + n as u64, v.stale);
            s += n as u64;
        }
    }

    /// Sets slots `a..b` stale or current (their pages allocated).
    pub fn set_range(&mut self, a: u64, b: u64, stale: bool) {
        for (pi, lo, hi) in segments(a, b) {
            set_bits(self.page_mut(pi), lo, hi, stale);
        }
    }

    /// Whether slots `a..b` are all stale (Some(true)), all current
    /// (Some(false)) or mixed (None).
    pub fn uniform(&self, a: u64, b: u64) -> Option<bool> {
        let mut seen: Option<bool> = None;
        for (pi, lo, hi) in segments(a, b) {
            let v = match self.pages.get(pi) {
                None => Some(false),
                Some(page) => bits_uniform(page, lo, hi),
            }?;
            if seen.is_some_and(|x| x != v) {
                return None;
            }
            seen = Some(v);
        }
        seen
    }

    /// Whether slot `s`'s content is stale.
    #[inline]
    pub fn is_stale(&self, s: u64) -> bool {
        let o = s as usize & (PAGE - 1);
        self.pages
            .get((s >> PAGE_BITS) as usize)
            .is_some_and(|p| p[o / 64] >> (o % 64) & 1 != 0)
    }

    /// The maximal runs `(start, end)` of current slots in `a..b`, in order.
    pub fn current_runs(&self, a: u64, b: u64) -> Vec<(u64, u64)> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut push = |s: u64, e: u64| match runs.last_mut() {
            Some(last) if last.1 == s => last.1 = e,
            _ => runs.push((s, e)),
        };
        for (pi, lo, hi) in segments(a, b) {
            let base = (pi as u64) << PAGE_BITS;
            let Some(page) = self.pages.get(pi) else {
                push(base + lo as u64, base + hi as u64);
                continue;
            };
            if (lo..hi).all(|o| page[o / 64] >> (o % 64) & 1 == 0) {
                push(base + lo as u64, base + hi as u64);
                continue;
            }
            let mut o = lo;
            while o < hi {
                let stale = page[o / 64] >> (o % 64) & 1 != 0;
                let start = o;
                while o < hi && (page[o / 64] >> (o % 64) & 1 != 0) == stale {
                    o += 1;
                }
                if !stale {
                    push(base + start as u64, base + o as u64);
                }
            }
        }
        runs
    }
}

/// The words that bits `lo..hi` of a page fall in, each with the mask of
/// those bits.
fn word_masks(lo: usize, hi: usize) -> impl Iterator<Item = (usize, u64)> {
    let mut o = lo;
    std::iter::from_fn(move || {
        (o < hi).then(|| {
            let (w, b) = (o / 64, o % 64);
            let n = (64 - b).min(hi - o);
            o += n;
            let mask = if n == 64 {
                u64::MAX
            } else {
                ((1u64 << n) - 1) << b
            };
            (w, mask)
        })
    })
}

/// Whether bits `lo..hi` (non-empty) of a page's words are all set
/// (Some(true)), all clear (Some(false)) or mixed.
fn bits_uniform(words: &[u64], lo: usize, hi: usize) -> Option<bool> {
    let first = words[lo / 64] >> (lo % 64) & 1 != 0;
    word_masks(lo, hi)
        .all(|(w, m)| words[w] & m == if first { m } else { 0 })
        .then_some(first)
}

/// Sets or clears bits `lo..hi` of a page's words.
fn set_bits(words: &mut [u64], lo: usize, hi: usize, on: bool) {
    for (w, m) in word_masks(lo, hi) {
        if on {
            words[w] |= m;
        } else {
            words[w] &= !m;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_marks_only_slots_with_content_stale_and_writes_make_them_current() {
        let mut st = StaleBits::new(1 << 32);
        st.alloc(0, 3000); // nothing written yet: no page, nothing stale
        assert_eq!(st.pages.allocated(), 0);
        st.set_current(10, 20);
        st.alloc(0, 3000);
        assert!(st.is_stale(10) && st.is_stale(19) && st.is_stale(500));
        assert!(!st.is_stale(2000)); // page never set: no content
        st.set_current(12, 14);
        assert_eq!(st.current_runs(8, 22), vec![(12, 14)]);
        assert_eq!(st.current_runs(1020, 1030), vec![(1024, 1030)]);
        let top = 1u64 << 32;
        st.set_current(top - 70, top);
        st.alloc(top - 65, top - 1);
        assert_eq!(
            st.current_runs(top - 70, top),
            vec![(top - 70, top - 65), (top - 1, top)]
        );
    }

    #[test]
    fn a_copy_carries_staleness_slot_by_slot() {
        let mut st = StaleBits::new(4096);
        let vals: Payload = (0..10)
            .map(|i| SlotVal {
                owner: 1,
                uncertain: false,
                stale: i % 3 == 0,
            })
            .collect();
        assert_eq!(vals.runs().len(), 7);
        st.copy(1020, &vals);
        assert_eq!(st.uniform(1021, 1023), Some(false));
        assert_eq!(st.uniform(1020, 1022), None);
        assert_eq!(st.uniform(4000, 4096), Some(false));
        let got: Vec<bool> = (1020..1030).map(|s| st.is_stale(s)).collect();
        let want: Vec<bool> = (0..10).map(|i| i % 3 == 0).collect();
        assert_eq!(got, want);
        assert_eq!(
            st.current_runs(1020, 1030),
            vec![(1021, 1023), (1024, 1026), (1027, 1029)]
        );
    }

    #[test]
    fn a_share_grants_only_current_content_until_it_is_rewritten() {
        let mut st = StaleBits::new(64);
        st.set_current(0, 8);
        st.alloc(4, 6);
        let mut g = Grants::default();
        g.share(&st, 7, 0, 8, 10).unwrap();
        assert_eq!(g.of(7).len(), 2);
        assert!(g.covered(7, 3, 5)); // written at seq 4, granted at 10
        assert!(!g.covered(7, 4, 5)); // stale when granted
        assert!(!g.covered(7, 3, 12)); // rewritten after the grant
        assert!(!g.covered(8, 3, 5)); // another reader
        g.release(7, 0, 2);
        assert_eq!(g.of(7), &[Grant::new(6, 8, 10)]);
        assert!(g.one.contains_key(&7) && g.many.is_empty());
        // A second and third grant, then a sweep that keeps one: inline
        // again; the last slot of a 2^32-slot pool fits.
        g.share(&st, 7, 1, 3, 11).unwrap();
        let top = Grant::new((1 << 32) - 1, 1 << 32, 12);
        g.push(7, top);
        assert_eq!(g.of(7).len(), 3);
        assert!(g.covered(7, (1 << 32) - 1, 12));
        g.sweep(|x| x.seq == 12).unwrap();
        assert_eq!(g.of(7), &[top]);
        assert!(g.many.is_empty() && g.n == 1);
        g.sweep(|_| false).unwrap();
        assert!(g.of(7).is_empty() && g.n == 0);
    }

    #[test]
    fn a_payload_keeps_equal_slots_as_one_run() {
        let v = |owner, stale| SlotVal {
            owner,
            uncertain: false,
            stale,
        };
        let mut p = Payload::default();
        p.push_run(5, v(1, false));
        p.push(v(1, false));
        p.push_run(0, v(9, false));
        p.push_run(3, v(2, true));
        p.push(v(1, false));
        assert_eq!(p.len(), 10);
        assert_eq!(
            p.runs(),
            &[(6, v(1, false)), (3, v(2, true)), (1, v(1, false))]
        );
        let each: Vec<u64> = p.iter().map(|x| x.owner).collect();
        assert_eq!(each, [1, 1, 1, 1, 1, 1, 2, 2, 2, 1]);
        let mut t = p.clone();
        t.truncate(7);
        assert_eq!(t.runs(), &[(6, v(1, false)), (1, v(2, true))]);
        assert_eq!(t.len(), 7);
        t.truncate(6);
        assert_eq!(t.runs(), &[(6, v(1, false))]);
        t.truncate(0);
        assert!(t.is_empty() && t.runs().is_empty());
        let back: Payload = p.iter().collect();
        assert_eq!(back, p);
    }

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

    #[test]
    fn a_spilling_set_answers_like_one_in_memory() {
        // Readers get grants over time; both sets sweep alike; a spilling
        // set with room for 5 grants writes runs (and merges them past
        // SPILL_MAX_RUNS), yet every reader holds the same live grants. A
        // grant dies for good (its slots rewritten): here one seq in three,
        // 500 seqs after it was given. A dead grant read back from disk
        // covers nothing, so only live ones are compared.
        let dead = |g: &Grant, now: u64| g.seq % 3 == 0 && g.seq + 500 < now;
        let live = |v: &[Grant], now: u64| -> Vec<Grant> {
            v.iter().copied().filter(|g| !dead(g, now)).collect()
        };
        let mut st = StaleBits::new(1 << 20);
        st.set_current(0, 1 << 20);
        let (mut mem, mut disk) = (Grants::default(), Grants::spilling(5));
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let mut merged = false;
        for seq in 0..3000u64 {
            let r = rnd(300);
            let a = rnd(1 << 19);
            let b = a + 1 + rnd(64);
            mem.share(&st, r, a, b, seq).unwrap();
            disk.share(&st, r, a, b, seq).unwrap();
            if seq % 97 == 0 {
                mem.sweep(|g| !dead(g, seq)).unwrap();
                disk.sweep(|g| !dead(g, seq)).unwrap();
                let runs = disk.spill.as_ref().unwrap().runs.len();
                assert!(runs <= SPILL_MAX_RUNS, "{runs} runs");
                merged |= runs == 1 && seq > 1000;
            }
            if seq % 7 == 0 {
                let q = rnd(320); // some never granted
                let want = live(mem.of(q), seq);
                let got = live(disk.lookup(q).unwrap(), seq);
                assert_eq!(got, want, "reader {q} at seq {seq}");
            }
        }
        assert!(merged, "runs were never merged");
        let (in_memory, on_disk) = disk.held();
        assert!(on_disk > 0 && in_memory < mem.held().0);
        for q in 0..320 {
            let want = live(mem.of(q), 3000);
            assert_eq!(live(disk.lookup(q).unwrap(), 3000), want, "reader {q}");
        }
    }

    #[test]
    fn classify_follows_the_semantics() {
        let g = [Grant::new(0, 4, 9)];
        let c = |owner, wseq1, unc, s| classify(owner, wseq1, unc, s, 5, &g, ReadKind::Blank);
        assert_eq!(c(5, 3, false, 0), None);
        assert_eq!(c(5, 3, true, 0), Some((ReadKind::Uncertain, 0, true)));
        assert_eq!(c(6, 3, false, 1), Some((ReadKind::Shared, 6, false)));
        assert_eq!(c(6, 11, false, 1), Some((ReadKind::Foreign, 6, false)));
        assert_eq!(c(6, 3, false, 4), Some((ReadKind::Foreign, 6, false)));
        assert_eq!(c(6, 3, true, 9), Some((ReadKind::Foreign, 6, true)));
        assert_eq!(c(NEVER, 0, false, 9), Some((ReadKind::Blank, 0, false)));
        assert_eq!(
            c(SCRUBBED, 2, true, 9),
            Some((ReadKind::Uncertain, 0, true))
        );
        assert_eq!(
            classify(NEVER, 0, true, 9, 5, &g, ReadKind::Unknown),
            Some((ReadKind::Unknown, 0, true))
        );
    }
}
