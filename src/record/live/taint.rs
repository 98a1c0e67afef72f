//! The slots a live view may have wrong where the trace has them right
//! (`state`): a set of slot ranges per pool, in a B-tree so that writes
//! that cut a tainted pool into many pieces cost a lookup each, not a
//! shift of every later range.

use std::collections::BTreeMap;

/// Disjoint, non-adjacent half-open slot ranges `[start, end)`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Taint {
    /// start -> end.
    ranges: BTreeMap<u64, u64>,
}

impl Taint {
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Slots in the set (walks every range).
    pub fn len(&self) -> u64 {
        self.ranges.iter().map(|(a, b)| b - a).sum()
    }

    /// Adds `[a, b)`, merging what it overlaps or touches.
    pub fn insert(&mut self, a: u64, b: u64) {
        if a >= b {
            return;
        }
        let (mut lo, mut hi) = (a, b);
        // A range starting at or before a that reaches a.
        if let Some((&s, &e)) = self.ranges.range(..=a).next_back()
            && e >= a
        {
            lo = s;
            hi = hi.max(e);
            self.ranges.remove(&s);
        }
        // Ranges starting inside [lo, hi] (touching included).
        while let Some((&s, &e)) = self.ranges.range(lo..=hi).next() {
            hi = hi.max(e);
            self.ranges.remove(&s);
        }
        self.ranges.insert(lo, hi);
    }

    /// Removes `[a, b)`.
    pub fn remove(&mut self, a: u64, b: u64) {
        if a >= b {
            return;
        }
        // A range starting before a that reaches into [a, b).
        if let Some((&s, &e)) = self.ranges.range(..a).next_back()
            && e > a
        {
            self.ranges.insert(s, a);
            if e > b {
                self.ranges.insert(b, e);
                return;
            }
        }
        while let Some((&s, &e)) = self.ranges.range(a..b).next() {
            self.ranges.remove(&s);
            if e > b {
                self.ranges.insert(b, e);
            }
        }
    }

    /// Whether any slot of `[a, b)` is in the set.
    pub fn intersects(&self, a: u64, b: u64) -> bool {
        if a >= b {
            return false;
        }
        self.ranges
            .range(..b)
            .next_back()
            .is_some_and(|(_, &e)| e > a)
    }

    /// The set's pieces inside `[a, b)`, in slot order, onto `out`.
    pub fn within(&self, a: u64, b: u64, out: &mut Vec<(u64, u64)>) {
        if a >= b {
            return;
        }
        let first = self.ranges.range(..=a).next_back().map_or(a, |(&s, _)| s);
        for (&s, &e) in self.ranges.range(first..b) {
            if e > a {
                out.push((s.max(a), e.min(b)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Taint;
    use std::collections::BTreeSet;

    #[test]
    fn agrees_with_a_set() {
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        for _ in 0..300 {
            let mut t = Taint::default();
            let mut naive = BTreeSet::new();
            for _ in 0..16 {
                let a = next(40);
                let b = a + next(10);
                if next(2) == 0 {
                    t.insert(a, b);
                    naive.extend(a..b);
                } else {
                    t.remove(a, b);
                    for x in a..b {
                        naive.remove(&x);
                    }
                }
                assert_eq!(t.len(), naive.len() as u64, "{t:?}");
                let v: Vec<(u64, u64)> = t.ranges.iter().map(|(&a, &b)| (a, b)).collect();
                assert!(v.windows(2).all(|w| w[0].1 < w[1].0), "{v:?}");
                assert!(v.iter().all(|r| r.0 < r.1), "{v:?}");
                let (c, d) = (next(50), next(50));
                assert_eq!(t.intersects(c, d), (c..d).any(|x| naive.contains(&x)));
                let mut w = Vec::new();
                t.within(c, d, &mut w);
                let got: BTreeSet<u64> = w.iter().flat_map(|&(a, b)| a..b).collect();
                let want: BTreeSet<u64> = (c..d).filter(|x| naive.contains(x)).collect();
                assert_eq!(got, want, "{c}..{d} of {v:?}");
            }
        }
    }

    #[test]
    fn ranges_may_end_at_two_to_the_32() {
        let top = 1u64 << 32;
        let mut t = Taint::default();
        t.insert(0, top);
        t.remove(top - 3, top);
        assert!(t.intersects(top - 4, top) && !t.intersects(top - 3, top));
        assert_eq!(t.len(), top - 3);
    }

    /// A tainted pool cut by many writes: each costs a lookup, not a
    /// shift of every later range.
    #[test]
    fn fragmenting_writes_stay_cheap() {
        let mut t = Taint::default();
        t.insert(0, 1 << 24);
        let t0 = std::time::Instant::now();
        for p in 0..200_000u64 {
            let s = (p * 7919 % (1 << 20)) * 16;
            t.remove(s, s + 8);
        }
        assert!(t.ranges.len() > 150_000);
        // Generous for a debug build on a shared machine; a Vec's shifts
        // took seconds here.
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(3),
            "{:?}",
            t0.elapsed()
        );
    }
}
