//! A set of slot numbers (u32, so range ends go up to 2^32) kept as
//! sorted, disjoint, non-adjacent half-open ranges. Repeated reads of the same slots (every decode step
//! reads the whole prompt again) cost a binary search, not memory.

/// Sorted disjoint ranges `[start, end)`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IntervalSet {
    ranges: Vec<(u64, u64)>,
}

impl IntervalSet {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `[a, b)`.
    pub fn insert(&mut self, a: u64, b: u64) {
        if a >= b {
            return;
        }
        // first range that ends at or after a (touching ranges merge)
        let i = self.ranges.partition_point(|r| r.1 < a);
        if let Some(r) = self.ranges.get(i)
            && r.0 <= a
            && b <= r.1
        {
            return; // already covered
        }
        let mut j = i;
        let (mut lo, mut hi) = (a, b);
        while j < self.ranges.len() && self.ranges[j].0 <= b {
            lo = lo.min(self.ranges[j].0);
            hi = hi.max(self.ranges[j].1);
            j += 1;
        }
        self.ranges.splice(i..j, std::iter::once((lo, hi)));
    }

    /// Adds every range of `other`.
    pub fn union(&mut self, other: &IntervalSet) {
        for &(a, b) in &other.ranges {
            self.insert(a, b);
        }
    }

    /// Number of slots in the set.
    pub fn len(&self) -> u64 {
        self.ranges.iter().map(|r| r.1 - r.0).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    pub fn ranges(&self) -> &[(u64, u64)] {
        &self.ranges
    }

    pub fn contains(&self, s: u64) -> bool {
        let i = self.ranges.partition_point(|r| r.1 <= s);
        self.ranges.get(i).is_some_and(|r| r.0 <= s)
    }
}

#[cfg(test)]
mod tests {
    use super::IntervalSet;

    #[test]
    fn insert_merges_and_counts_like_a_set() {
        type Ranges = &'static [(u64, u64)];
        let cases: &[(Ranges, Ranges)] = &[
            (&[(0, 5), (5, 8)], &[(0, 8)]),
            (&[(10, 12), (0, 2), (4, 6)], &[(0, 2), (4, 6), (10, 12)]),
            (&[(0, 2), (4, 6), (1, 5)], &[(0, 6)]),
            (&[(3, 9), (4, 5)], &[(3, 9)]),
            (&[(3, 4), (0, 10)], &[(0, 10)]),
        ];
        for (ins, want) in cases {
            let mut s = IntervalSet::new();
            let mut naive = std::collections::BTreeSet::new();
            for &(a, b) in *ins {
                s.insert(a, b);
                naive.extend(a..b);
            }
            assert_eq!(s.ranges(), *want);
            assert_eq!(s.len(), naive.len() as u64);
            for x in 0..12 {
                assert_eq!(s.contains(x), naive.contains(&x), "{x}");
            }
        }
    }

    #[test]
    fn a_range_may_end_at_two_to_the_32() {
        let top = 1u64 << 32;
        let mut s = IntervalSet::new();
        s.insert(top - 3, top);
        s.insert(top - 5, top - 3);
        assert_eq!(s.ranges(), &[(top - 5, top)]);
        assert_eq!(s.len(), 5);
        assert!(s.contains(top - 1));
    }
}
