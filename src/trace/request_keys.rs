//! The request keys: every request id of a trace with its tenant, read in
//! one streaming pass, compact, with duplicate ids rejected.
//!
//! Analyses (inspect, scope, verify) join KV events to requests by id; this
//! is the one place that reads the requests table for that purpose, so a
//! duplicate `request_id` is caught the same way everywhere: an error naming
//! both files and rows (bad input, exit 2).
//!
//! Memory: the ids, sorted and packed with their tenant keys (about two
//! bits and the tenant key's width per request when ids are dense, at most
//! about eight bytes when they are random 64-bit values; no hash map), plus
//! each distinct tenant string once; while the pass runs, at most one
//! run of 4 MiB unpacked besides; whatever else an analysis
//! needs of a row it takes from the row as the pass hands it over
//! ([`scan_request_rows`], in place; [`scan_requests`], as a record), so
//! the full rows are never all held (they were, at about 600 bytes per
//! request: 1.2 GB for 2 million requests).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Location, Result};
use crate::schema::{RequestRecord, req_col};
use crate::spill::{Merge, Source};
use crate::trace::read::{RequestRows, Trace};

/// Every request id of a trace, sorted, each with its tenant as a small key.
#[derive(Debug, Clone, Default)]
pub struct RequestKeys {
    /// (request_id, index into `tenants`), ascending by id, ids unique.
    keys: PackedKeys,
    tenants: Vec<Box<str>>,
}

impl RequestKeys {
    pub fn len(&self) -> usize {
        self.keys.len
    }

    pub fn is_empty(&self) -> bool {
        self.keys.len == 0
    }

    /// The tenant key of a request, when the requests table has it.
    pub fn tenant_key(&self, request_id: u64) -> Option<u32> {
        self.keys.get(request_id)
    }

    /// Whether the requests table has this request.
    pub fn contains(&self, request_id: u64) -> bool {
        self.tenant_key(request_id).is_some()
    }

    /// The tenant of a request, when the requests table has it.
    pub fn tenant(&self, request_id: u64) -> Option<&str> {
        self.tenant_key(request_id)
            .map(|k| &*self.tenants[k as usize])
    }

    /// Distinct tenants, in order of first appearance (a tenant key
    /// indexes it).
    pub fn tenants(&self) -> &[Box<str>] {
        &self.tenants
    }

    /// Every (request_id, tenant key), ascending by id.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        Cursor::new(&self.keys)
    }
}

/// Keys gathered (16 bytes each) before they are sorted and packed into a
/// run: the most a scan holds unpacked, 4 MiB.
const RUN: usize = 1 << 18;
/// Keys per packed block: a look-up decodes at most one block.
const BLOCK: usize = 64;

/// Sorted (id, tenant key) pairs packed in blocks of [`BLOCK`]: each block
/// keeps its first id apart (for the binary search) and then, bit-packed at
/// the block's own widths, its first tenant key and each following key's
/// id gap and tenant key. Consecutive ids cost about one bit and a tenant
/// key `log2(tenants)` bits; random 64-bit ids about `64 - log2(n)` bits.
#[derive(Debug, Clone, Default)]
struct PackedKeys {
    firsts: Vec<u64>,
    /// Per block: its bit offset in `bits` << 16 | gap width << 8 | tenant width.
    heads: Vec<u64>,
    bits: Vec<u64>,
    /// Bits written.
    end: u64,
    len: usize,
}

fn width(v: u64) -> u32 {
    64 - v.leading_zeros()
}

fn read_bits(bits: &[u64], pos: u64, w: u32) -> u64 {
    if w == 0 {
        return 0;
    }
    let word = (pos / 64) as usize;
    let sh = (pos % 64) as u32;
    let mut v = bits[word] >> sh;
    if sh + w > 64 {
        v |= bits[word + 1] << (64 - sh);
    }
    if w == 64 { v } else { v & ((1u64 << w) - 1) }
}

impl PackedKeys {
    /// Bytes the packed keys hold (the test of their size).
    #[cfg(test)]
    fn bytes(&self) -> usize {
        (self.firsts.capacity() + self.heads.capacity() + self.bits.capacity()) * 8
    }

    fn write(&mut self, v: u64, w: u32) {
        if w == 0 {
            return;
        }
        let sh = (self.end % 64) as u32;
        if sh == 0 {
            self.bits.push(v);
        } else {
            *self.bits.last_mut().expect("a partial word") |= v << sh;
            if sh + w > 64 {
                self.bits.push(v >> (64 - sh));
            }
        }
        self.end += w as u64;
    }

    /// Appends one block of ascending, distinct keys.
    fn push_block(&mut self, block: &[(u64, u32)]) {
        let gap_w = width(block.windows(2).map(|w| w[1].0 - w[0].0).max().unwrap_or(0));
        let ten_w = width(block.iter().map(|&(_, t)| t as u64).max().unwrap_or(0));
        self.firsts.push(block[0].0);
        self.heads
            .push(self.end << 16 | (gap_w as u64) << 8 | ten_w as u64);
        self.write(block[0].1 as u64, ten_w);
        for w in block.windows(2) {
            self.write(w[1].0 - w[0].0, gap_w);
            self.write(w[1].1 as u64, ten_w);
        }
        self.len += block.len();
    }

    fn shrink(&mut self) {
        self.firsts.shrink_to_fit();
        self.heads.shrink_to_fit();
        self.bits.shrink_to_fit();
    }

    fn get(&self, id: u64) -> Option<u32> {
        let b = self.firsts.partition_point(|&f| f <= id).checked_sub(1)?;
        let mut c = Cursor::at_block(self, b);
        while let Some((k, t)) = c.next() {
            if k >= id || c.i == 0 {
                return (k == id).then_some(t);
            }
        }
        None
    }
}

/// Reads a [`PackedKeys`] in order.
struct Cursor<'a> {
    keys: &'a PackedKeys,
    block: usize,
    /// Index of the next key within its block.
    i: usize,
    pos: u64,
    id: u64,
    gap_w: u32,
    ten_w: u32,
}

impl<'a> Cursor<'a> {
    fn new(keys: &'a PackedKeys) -> Self {
        Cursor::at_block(keys, 0)
    }

    fn at_block(keys: &'a PackedKeys, block: usize) -> Self {
        Cursor {
            keys,
            block,
            i: 0,
            pos: 0,
            id: 0,
            gap_w: 0,
            ten_w: 0,
        }
    }
}

impl Iterator for Cursor<'_> {
    type Item = (u64, u32);

    fn next(&mut self) -> Option<(u64, u32)> {
        let k = self.keys;
        if self.i == 0 {
            let head = *k.heads.get(self.block)?;
            self.pos = head >> 16;
            self.gap_w = (head >> 8 & 0xff) as u32;
            self.ten_w = (head & 0xff) as u32;
            self.id = k.firsts[self.block];
        } else {
            self.id += read_bits(&k.bits, self.pos, self.gap_w);
            self.pos += self.gap_w as u64;
        }
        let t = read_bits(&k.bits, self.pos, self.ten_w) as u32;
        self.pos += self.ten_w as u64;
        let in_block = if self.block + 1 < k.firsts.len() {
            BLOCK
        } else {
            k.len - self.block * BLOCK
        };
        self.i += 1;
        if self.i == in_block {
            self.i = 0;
            self.block += 1;
        }
        Some((self.id, t))
    }
}

/// Packs ascending keys into blocks (every block but the last full),
/// noting each id that repeats.
#[derive(Default)]
struct Packer {
    keys: PackedKeys,
    block: Vec<(u64, u32)>,
    last: Option<u64>,
    dups: Vec<u64>,
}

impl Packer {
    fn push(&mut self, key: (u64, u32)) {
        if self.last == Some(key.0) {
            if self.dups.last() != Some(&key.0) {
                self.dups.push(key.0);
            }
            return;
        }
        self.last = Some(key.0);
        self.block.push(key);
        if self.block.len() == BLOCK {
            self.keys.push_block(&self.block);
            self.block.clear();
        }
    }

    fn finish(mut self) -> (PackedKeys, Vec<u64>) {
        if !self.block.is_empty() {
            self.keys.push_block(&self.block);
        }
        self.keys.shrink();
        (self.keys, self.dups)
    }
}

/// Gathers keys in any order: runs of [`RUN`] are sorted and packed as
/// they fill, and merged at the end, so a scan never holds more than one
/// run unpacked.
struct KeysBuilder {
    buf: Vec<(u64, u32)>,
    /// Keys a run holds ([`RUN`]; smaller in tests).
    run: usize,
    runs: Vec<PackedKeys>,
    dups: Vec<u64>,
}

impl Default for KeysBuilder {
    fn default() -> Self {
        KeysBuilder::with_run(RUN)
    }
}

impl KeysBuilder {
    fn with_run(run: usize) -> Self {
        KeysBuilder {
            buf: Vec::new(),
            run,
            runs: Vec::new(),
            dups: Vec::new(),
        }
    }

    fn push(&mut self, key: (u64, u32)) {
        self.buf.push(key);
        if self.buf.len() == self.run {
            self.pack_run();
        }
    }

    fn pack_run(&mut self) {
        self.buf.sort_unstable_by_key(|k| k.0);
        let mut p = Packer::default();
        for &k in &self.buf {
            p.push(k);
        }
        let (run, dups) = p.finish();
        self.dups.extend(dups);
        self.runs.push(run);
        self.buf.clear();
    }

    /// The keys, ascending, and every id that occurs more than once
    /// (ascending, each once).
    fn finish(mut self) -> (PackedKeys, Vec<u64>) {
        if !self.buf.is_empty() {
            self.pack_run();
        }
        self.buf = Vec::new();
        let (keys, merged_dups) = match self.runs.len() {
            0 => (PackedKeys::default(), Vec::new()),
            1 => (self.runs.pop().expect("one run"), Vec::new()),
            _ => merge_runs(&self.runs),
        };
        let mut dups = self.dups;
        dups.extend(merged_dups);
        dups.sort_unstable();
        dups.dedup();
        (keys, dups)
    }
}

/// The runs merged into one (`crate::spill::Merge`: the runs are packed
/// in memory, not on disk), with the ids that occur more than once.
fn merge_runs(runs: &[PackedKeys]) -> (PackedKeys, Vec<u64>) {
    let cursors: Vec<Cursor> = runs.iter().map(Cursor::new).collect();
    let mut p = Packer::default();
    for k in Merge::new(cursors).expect("in-memory runs cannot fail") {
        p.push(k.expect("in-memory runs cannot fail"));
    }
    p.finish()
}

impl Source<(u64, u32)> for Cursor<'_> {
    fn next_record(&mut self) -> Result<Option<(u64, u32)>> {
        Ok(self.next())
    }
}

/// Reads every request of `trace` once, in reading order (files sorted by
/// path, rows in file order), handing each row to `visit`, and returns the
/// request keys. Errors (exit 2) on any invalid row, on a pool id the
/// deployment does not list, and on a duplicate `request_id` (naming both
/// places: the first row, in reading order, whose id came before, and where
/// it came first). A duplicate is found once the pass is over (the keys are
/// sorted then), so `visit` may have seen both rows of it; its caller
/// discards what it gathered on an error.
pub fn scan_requests(trace: &Trace, mut visit: impl FnMut(RequestRecord)) -> Result<RequestKeys> {
    scan_request_rows(trace, |rows, i| visit(rows.record(i)))
}

/// [`scan_requests`], handing `visit` each row in place (a batch and the
/// row's index in it): a pass that needs a few fields of most rows reads
/// them without building every row's record.
pub fn scan_request_rows(
    trace: &Trace,
    mut visit: impl FnMut(&RequestRows<'_>, usize),
) -> Result<RequestKeys> {
    let mut known = vec![false; 1 << 16];
    for p in &trace.deployment().pools {
        known[p.id as usize] = true;
    }
    let mut tenants: Vec<Box<str>> = Vec::new();
    let mut tenant_ids: HashMap<Box<str>, u32> = HashMap::new();
    let mut builder = KeysBuilder::default();
    for path in &trace.request_files {
        let mut reader = trace.request_file(path)?;
        while let Some(res) = reader.next_rows(|first, rows| {
            for i in 0..rows.len() {
                check_pools(&known, path, first + i as u64, rows, i)?;
                let t = rows.tenant(i);
                let tenant = match tenant_ids.get(t) {
                    Some(&k) => k,
                    None => {
                        let k = tenants.len() as u32;
                        tenants.push(t.into());
                        tenant_ids.insert(t.into(), k);
                        k
                    }
                };
                builder.push((rows.request_id(i), tenant));
                visit(rows, i);
            }
            Ok(())
        }) {
            res?;
        }
    }
    drop(tenant_ids);
    let (keys, dups) = builder.finish();
    if dups.is_empty() {
        return Ok(RequestKeys { keys, tenants });
    }
    drop(keys);
    Err(locate_duplicate(trace, &dups))
}

/// The error for the first row, in reading order, whose id is among `dups`
/// and came before (a second pass, holding only the duplicated ids).
fn locate_duplicate(trace: &Trace, dups: &[u64]) -> Error {
    let mut first: HashMap<u64, (PathBuf, u64)> = HashMap::new();
    for path in &trace.request_files {
        let mut reader = match trace.request_file(path) {
            Ok(r) => r,
            Err(e) => return e,
        };
        while let Some(res) = reader.next_rows(|row0, rows| {
            for i in 0..rows.len() {
                let id = rows.request_id(i);
                if dups.binary_search(&id).is_ok() {
                    let row = row0 + i as u64;
                    if let Some((f, fr)) = first.get(&id) {
                        return Ok(Some(duplicate_id(id, path, row, f, *fr)));
                    }
                    first.insert(id, (path.clone(), row));
                }
            }
            Ok(None)
        }) {
            match res {
                Ok(None) => {}
                Ok(Some(e)) | Err(e) => return e,
            }
        }
    }
    Error::Other(
        "a request_id occurs twice, but not on a second reading: the requests table changed while it was read".into(),
    )
}

fn duplicate_id(id: u64, path: &Path, row: u64, first: &Path, first_row: u64) -> Error {
    Error::invalid(
        Location::file(path).row(row).column(req_col::REQUEST_ID),
        format!(
            "duplicate request_id {id}: already at {}, row {first_row}",
            first.display()
        ),
        "request_id must be unique within a trace; fix the writer or remove the duplicate row",
    )
}

fn check_pools(known: &[bool], path: &Path, row: u64, rows: &RequestRows, i: usize) -> Result<()> {
    for (col, p) in [
        (req_col::PREFILL_POOL, rows.prefill_pool(i)),
        (req_col::DECODE_POOL, rows.decode_pool(i)),
    ] {
        if let Some(p) = p
            && !known[p as usize]
        {
            return Err(Error::invalid(
                Location::file(path).row(row).column(col),
                format!("unknown pool id {p}"),
                "every pool id must be listed in trace.json deployment.pools",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(keys: &[(u64, u32)], run: usize) -> (PackedKeys, Vec<u64>) {
        let mut b = KeysBuilder::with_run(run);
        for &k in keys {
            b.push(k);
        }
        b.finish()
    }

    /// A small deterministic generator (xorshift), so the test needs no
    /// crate and fails the same way every time.
    fn rng(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    fn check(keys: &[(u64, u32)], run: usize, probes: &[u64]) {
        let (packed, dups) = build(keys, run);
        let mut want: std::collections::BTreeMap<u64, u32> = Default::default();
        let mut want_dups = std::collections::BTreeSet::new();
        for &(id, t) in keys {
            if want.insert(id, t).is_some() {
                want_dups.insert(id);
            }
        }
        assert_eq!(dups, want_dups.into_iter().collect::<Vec<_>>());
        if !dups.is_empty() {
            return;
        }
        assert_eq!(packed.len, want.len());
        let got: Vec<(u64, u32)> = Cursor::new(&packed).collect();
        assert_eq!(got, want.iter().map(|(&a, &b)| (a, b)).collect::<Vec<_>>());
        for &(id, t) in keys {
            assert_eq!(packed.get(id), Some(t), "id {id}");
        }
        for &p in probes {
            assert_eq!(packed.get(p), want.get(&p).copied(), "probe {p}");
        }
    }

    #[test]
    fn packed_keys_match_a_sorted_map() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        // Empty, one key, the extremes of u64, a block and one more.
        check(&[], 4, &[0, 1, u64::MAX]);
        check(&[(u64::MAX, 3)], 4, &[0, u64::MAX - 1, u64::MAX]);
        check(&[(0, 0), (u64::MAX, u32::MAX)], 1, &[1, u64::MAX - 1]);
        let block: Vec<(u64, u32)> = (0..=BLOCK as u64)
            .map(|i| (i * 3 + 1, (i % 5) as u32))
            .collect();
        check(
            &block,
            7,
            &[
                0,
                2,
                3,
                BLOCK as u64 * 3 + 2,
                BLOCK as u64 * 3 + 4,
                u64::MAX,
            ],
        );
        for run in [1, 3, 64, 1000, RUN] {
            // Dense ids, shuffled, over several runs.
            let mut dense: Vec<(u64, u32)> =
                (0..5000u64).map(|i| (i + 10, (i % 977) as u32)).collect();
            for i in (1..dense.len()).rev() {
                dense.swap(i, (rng(&mut seed) % (i as u64 + 1)) as usize);
            }
            check(&dense, run, &[0, 9, 10, 5009, 5010, u64::MAX]);
            // Random 64-bit ids with random tenant keys of every width.
            let random: Vec<(u64, u32)> = (0..3000)
                .map(|_| {
                    (
                        rng(&mut seed),
                        (rng(&mut seed) >> (rng(&mut seed) % 33)) as u32,
                    )
                })
                .collect();
            let probes: Vec<u64> = (0..500).map(|_| rng(&mut seed)).collect();
            check(&random, run, &probes);
            // Duplicates within a run and across runs.
            let mut dup = dense.clone();
            dup.push((42, 1));
            dup.insert(0, (4000, 2));
            dup.push((4000, 2));
            check(&dup, run, &[]);
        }
    }

    #[test]
    fn dense_keys_pack_small() {
        let keys: Vec<(u64, u32)> = (1..=100_000u64).map(|i| (i, (i % 1000) as u32)).collect();
        let (packed, _) = build(&keys, 1 << 14);
        // One bit of gap and ten of tenant key a key, and a block's head.
        assert!(packed.bytes() < 100_000 * 2, "{} bytes", packed.bytes());
    }
}
