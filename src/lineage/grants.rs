//! Share grants of one pool, per reader (docs/trace-format.md, `share`):
//! a grant covers the slots whose content was current when it was given,
//! until they are written again; a `free` does not end one. Dead grants
//! (every slot rewritten since) are swept; a spilling set writes the
//! older half of its readers' grants to disk past its limit
//! (`grant_spill`).

use std::collections::HashMap;

use crate::error::Result;

use super::grant_spill::{SPILL_MAX_RUNS, Spill, SpillRun, grant_key};
use super::state::Grant;

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

    /// A `share` to `reader` at `seq`: one grant per run in `current`, the
    /// runs of the shared slots whose content is current
    /// (`StaleBits::current_runs`; a grant on stale content covers nothing:
    /// the cache handed out pages their holder never wrote).
    /// Returns true when enough grants piled up that the caller should
    /// [`sweep`](Self::sweep) the dead ones.
    pub fn share(
        &mut self,
        reader: u64,
        current: impl IntoIterator<Item = (u64, u64)>,
        seq: u64,
    ) -> Result<bool> {
        // The reader's spilled grants come back first (the invariant).
        self.lookup(reader)?;
        for (start, end) in current {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lineage::stale::StaleBits;

    #[test]
    fn a_share_grants_only_current_content_until_it_is_rewritten() {
        let mut st = StaleBits::new(64);
        st.set_current(0, 8);
        st.alloc(4, 6);
        let mut g = Grants::default();
        g.share(7, st.current_runs(0, 8), 10).unwrap();
        assert_eq!(g.of(7).len(), 2);
        assert!(g.covered(7, 3, 5)); // written at seq 4, granted at 10
        assert!(!g.covered(7, 4, 5)); // stale when granted
        assert!(!g.covered(7, 3, 12)); // rewritten after the grant
        assert!(!g.covered(8, 3, 5)); // another reader
        g.sweep(|x| x.start() == 6).unwrap();
        assert_eq!(g.of(7), &[Grant::new(6, 8, 10)]);
        assert!(g.one.contains_key(&7) && g.many.is_empty());
        // A second and third grant, then a sweep that keeps one: inline
        // again; the last slot of a 2^32-slot pool fits.
        g.share(7, st.current_runs(1, 3), 11).unwrap();
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
            mem.share(r, st.current_runs(a, b), seq).unwrap();
            disk.share(r, st.current_runs(a, b), seq).unwrap();
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
}
