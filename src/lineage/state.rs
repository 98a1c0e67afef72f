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

/// The share grants of one pool, per request. Most readers hold one grant
/// (one prefix-cache hit): those are kept inline in a map of their own (24
/// bytes an entry), the others in a vector each. Grants live until every
/// slot of theirs is rewritten (a `free` does not end one), so they follow
/// live sharing: a prefix kept in the cache and hit by every request holds
/// one grant per request until it is evicted and rewritten.
pub struct Grants {
    one: HashMap<u64, Grant>,
    many: HashMap<u64, Vec<Grant>>,
    /// Number of grants held, and the count at which to sweep dead ones.
    n: usize,
    sweep_at: usize,
}

impl Default for Grants {
    fn default() -> Self {
        Grants {
            one: HashMap::new(),
            many: HashMap::new(),
            n: 0,
            sweep_at: GRANT_SWEEP_MIN,
        }
    }
}

impl Grants {
    fn push(&mut self, reader: u64, g: Grant) {
        if let Some(v) = self.many.get_mut(&reader) {
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
    pub fn share(&mut self, stale: &StaleBits, reader: u64, a: u64, b: u64, seq: u64) -> bool {
        for (start, end) in stale.current_runs(a, b) {
            self.push(reader, Grant::new(start, end, seq));
        }
        self.n >= self.sweep_at
    }

    /// The grants `reader` holds, in the order they were given.
    #[inline]
    pub fn of(&self, reader: u64) -> &[Grant] {
        if let Some(g) = self.one.get(&reader) {
            return std::slice::from_ref(g);
        }
        self.many.get(&reader).map(|v| &v[..]).unwrap_or(&[])
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
    /// sharing.
    pub fn sweep(&mut self, mut alive: impl FnMut(&Grant) -> bool) {
        self.one.retain(|_, g| alive(g));
        let mut moved = Vec::new();
        self.many.retain(|&r, v| {
            v.retain(&mut alive);
            match v.len() {
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
        self.one.extend(moved);
        self.one.shrink_to_fit();
        self.many.shrink_to_fit();
        let n = self.one.len() + self.many.values().map(Vec::len).sum::<usize>();
        self.n = n;
        self.sweep_at = (2 * n).max(GRANT_SWEEP_MIN);
    }

    /// Drops `reader`'s grants that overlap slots `a..b` (the reader freed
    /// them).
    pub fn release(&mut self, reader: u64, a: u64, b: u64) {
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

    /// A copy: slot `a + i` takes the staleness of `stale(i)`, for slots
    /// `a..b`.
    pub fn copy(&mut self, a: u64, b: u64, mut stale: impl FnMut(usize) -> bool) {
        let mut i = 0;
        for (pi, lo, hi) in segments(a, b) {
            let page = self.page_mut(pi);
            for o in lo..hi {
                let (w, bit) = (o / 64, 1u64 << (o % 64));
                if stale(i) {
                    page[w] |= bit;
                } else {
                    page[w] &= !bit;
                }
                i += 1;
            }
        }
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

/// Sets or clears bits `lo..hi` of a page's words.
fn set_bits(words: &mut [u64], lo: usize, hi: usize, on: bool) {
    let mut o = lo;
    while o < hi {
        let (w, b) = (o / 64, o % 64);
        let n = (64 - b).min(hi - o);
        let mask = if n == 64 {
            u64::MAX
        } else {
            ((1u64 << n) - 1) << b
        };
        if on {
            words[w] |= mask;
        } else {
            words[w] &= !mask;
        }
        o += n;
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
        st.copy(1020, 1030, |i| i % 3 == 0);
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
        g.share(&st, 7, 0, 8, 10);
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
        g.share(&st, 7, 1, 3, 11);
        let top = Grant::new((1 << 32) - 1, 1 << 32, 12);
        g.push(7, top);
        assert_eq!(g.of(7).len(), 3);
        assert!(g.covered(7, (1 << 32) - 1, 12));
        g.sweep(|x| x.seq == 12);
        assert_eq!(g.of(7), &[top]);
        assert!(g.many.is_empty() && g.n == 1);
        g.sweep(|_| false);
        assert!(g.of(7).is_empty() && g.n == 0);
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
