//! Paged per-slot state: a pool's slots are grouped in pages of `PAGE`
//! slots, and a page is allocated the first time something is stored in
//! it. A page never stored to reads as the backend's blank page (a shared
//! static), so memory follows the slots a trace touches, never the
//! capacity a manifest declares (up to 2^32 slots a pool).
//!
//! The directory has two levels, each grown on demand: a block per 2^22
//! slots, and in it one entry per page. A pool nobody touched costs a few
//! words; one touched page costs the page plus at most two short vectors.
//! A page holds `page_len` slots: `PAGE`, or fewer for the last page of a
//! pool (so a pool of 16 slots never allocates 1024).

/// log2 of the slots in a page.
pub const PAGE_BITS: u32 = 10;
/// Slots in a page.
pub const PAGE: usize = 1 << PAGE_BITS;
/// log2 of the pages in a directory block.
const BLOCK_BITS: u32 = 12;
const BLOCK: usize = 1 << BLOCK_BITS;

/// Pages of type `P` (one page holds the state of up to `PAGE` slots).
pub struct Pages<P: ?Sized> {
    blocks: Vec<Vec<Option<Box<P>>>>,
    allocated: usize,
}

impl<P: ?Sized> Default for Pages<P> {
    fn default() -> Self {
        Self {
            blocks: Vec::new(),
            allocated: 0,
        }
    }
}

impl<P: ?Sized> Pages<P> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Page `page`, if anything was ever stored in it.
    #[inline]
    pub fn get(&self, page: usize) -> Option<&P> {
        self.blocks
            .get(page >> BLOCK_BITS)?
            .get(page & (BLOCK - 1))?
            .as_deref()
    }

    /// Page `page`, if anything was ever stored in it, to change.
    #[inline]
    pub fn get_mut(&mut self, page: usize) -> Option<&mut P> {
        self.blocks
            .get_mut(page >> BLOCK_BITS)?
            .get_mut(page & (BLOCK - 1))?
            .as_deref_mut()
    }

    /// Page `page`, allocated with `make` on first use.
    #[inline]
    pub fn get_or_insert_with(&mut self, page: usize, make: impl FnOnce() -> Box<P>) -> &mut P {
        let (hi, lo) = (page >> BLOCK_BITS, page & (BLOCK - 1));
        if self.blocks.len() <= hi {
            self.blocks.resize_with(hi + 1, Vec::new);
        }
        let block = &mut self.blocks[hi];
        if block.len() <= lo {
            block.resize_with(lo + 1, || None);
        }
        let slot = &mut block[lo];
        if slot.is_none() {
            self.allocated += 1;
        }
        slot.get_or_insert_with(make)
    }

    /// Number of pages allocated.
    pub fn allocated(&self) -> usize {
        self.allocated
    }
}

/// Slots of page `page` in a pool of `capacity` slots.
#[inline]
pub fn page_len(capacity: u64, page: usize) -> usize {
    capacity
        .saturating_sub((page as u64) << PAGE_BITS)
        .min(PAGE as u64) as usize
}

/// One value per slot of a pool of `capacity` slots, paged: slots never
/// stored to hold `blank`.
pub struct SlotVec<T: Copy> {
    pages: Pages<[T]>,
    capacity: u64,
    blank: T,
}

impl<T: Copy + PartialEq> SlotVec<T> {
    pub fn new(capacity: u64, blank: T) -> Self {
        Self {
            pages: Pages::new(),
            capacity,
            blank,
        }
    }

    #[inline]
    fn page_mut(&mut self, page: usize) -> &mut [T] {
        let (blank, n) = (self.blank, page_len(self.capacity, page));
        self.pages
            .get_or_insert_with(page, || vec![blank; n].into_boxed_slice())
    }

    #[inline]
    pub fn get(&self, s: u64) -> T {
        match self.pages.get((s >> PAGE_BITS) as usize) {
            Some(p) => p[s as usize & (PAGE - 1)],
            None => self.blank,
        }
    }

    /// Sets slot `s` (below the capacity) to `v`.
    #[inline]
    pub fn set(&mut self, s: u64, v: T) {
        self.page_mut((s >> PAGE_BITS) as usize)[s as usize & (PAGE - 1)] = v;
    }

    /// Sets slots `a..b` (below the capacity) to `v`; storing `blank`
    /// allocates nothing.
    pub fn fill(&mut self, a: u64, b: u64, v: T) {
        for (pi, lo, hi) in segments(a, b) {
            if v == self.blank && self.pages.get(pi).is_none() {
                continue;
            }
            self.page_mut(pi)[lo..hi].fill(v);
        }
    }

    /// The values of slots `a..b`, in order.
    pub fn range(&self, a: u64, b: u64) -> impl Iterator<Item = T> + '_ {
        segments(a, b).flat_map(move |(pi, lo, hi)| {
            let page = self.pages.get(pi);
            (lo..hi).map(move |o| page.map_or(self.blank, |p| p[o]))
        })
    }
}

/// The pieces of the slot range `a..b` by page: `(page, lo, hi)`, slots
/// `lo..hi` of page `page` (so slot `page * PAGE + lo` is the first).
#[inline]
pub fn segments(a: u64, b: u64) -> impl Iterator<Item = (usize, usize, usize)> {
    let mut s = a;
    std::iter::from_fn(move || {
        if s >= b {
            return None;
        }
        let page = (s >> PAGE_BITS) as usize;
        let lo = (s as usize) & (PAGE - 1);
        let end = ((page as u64 + 1) << PAGE_BITS).min(b);
        let hi = lo + (end - s) as usize;
        s = end;
        Some((page, lo, hi))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_cover_the_range_page_by_page() {
        let p = PAGE as u64;
        let cases: &[(u64, u64)] = &[
            (0, 0),
            (0, 1),
            (0, p),
            (p - 1, p + 1),
            (3, 3 * p + 5),
            ((1 << 32) - 2, 1 << 32),
        ];
        for &(a, b) in cases {
            let mut next = a;
            for (page, lo, hi) in segments(a, b) {
                assert!(lo < hi && hi <= PAGE, "{a}..{b}: {page} {lo} {hi}");
                assert_eq!(page as u64 * p + lo as u64, next);
                next = page as u64 * p + hi as u64;
            }
            assert_eq!(next, b.max(a));
        }
    }

    #[test]
    fn pages_are_allocated_on_first_store_only() {
        let mut pages: Pages<[u8; 4]> = Pages::new();
        assert!(pages.get(0).is_none());
        assert!(pages.get((1 << 22) - 1).is_none());
        pages.get_or_insert_with((1 << 22) - 1, || Box::new([7; 4]))[0] = 1;
        assert_eq!(pages.get((1 << 22) - 1), Some(&[1, 7, 7, 7]));
        assert!(pages.get(5).is_none());
        pages.get_or_insert_with((1 << 22) - 1, || unreachable!());
        assert_eq!(pages.allocated(), 1);
    }

    #[test]
    fn slot_vec_reads_blank_until_written_and_fills_across_pages() {
        let top = 1u64 << 32;
        let mut v = SlotVec::new(top, 9u32);
        assert_eq!(v.get(top - 1), 9);
        v.fill(top - PAGE as u64 - 2, top, 4);
        v.set(7, 1);
        assert_eq!(v.get(top - 1), 4);
        assert_eq!(v.get(top - PAGE as u64 - 3), 9);
        assert_eq!(v.get(7), 1);
        let near: Vec<u32> = v.range(top - PAGE as u64 - 4, top - PAGE as u64).collect();
        assert_eq!(near, [9, 9, 4, 4]);
        v.fill(1 << 20, 1 << 21, 9); // blank over untouched pages: nothing allocated
        assert_eq!(v.pages.allocated(), 3);
    }

    #[test]
    fn a_small_pool_allocates_only_its_own_slots() {
        assert_eq!(page_len(16, 0), 16);
        assert_eq!(page_len(PAGE as u64 + 3, 1), 3);
        assert_eq!(page_len(1 << 32, (1 << 22) - 1), PAGE);
        let mut v = SlotVec::new(16, 0u64);
        v.fill(0, 16, 5);
        assert_eq!(v.pages.get(0).map(|p| p.len()), Some(16));
        assert_eq!(v.range(14, 16).collect::<Vec<_>>(), [5, 5]);
    }
}
