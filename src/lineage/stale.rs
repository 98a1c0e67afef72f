//! Which slots of a pool hold stale content: one bit a slot beside the
//! owner (docs/trace-format.md, "Semantics": `alloc` makes content stale,
//! a write or scrub makes it current, a copy carries its source's bit).
//! Only a `share` consults the bit (a grant covers current slots only) and
//! a copy carries it, so every backend keeps the bits on the host.

use super::slots::{PAGE, PAGE_BITS, Pages, page_len, segments};

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
            if let Some(page) = self.pages.get_mut(pi) {
                set_bits(page, lo, hi, true);
            }
        }
    }

    /// A write or scrub of slots `a..b`: the content is current.
    pub fn set_current(&mut self, a: u64, b: u64) {
        for (pi, lo, hi) in segments(a, b) {
            set_bits(self.page_mut(pi), lo, hi, false);
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
    use crate::lineage::state::{Payload, SlotVal};

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
        let mut s = 1020;
        for &(n, v) in vals.runs() {
            st.set_range(s, s + n as u64, v.stale);
            s += n as u64;
        }
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
}
