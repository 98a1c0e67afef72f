//! What the synthetic-trace benchmarks share (bench_scope, bench_threads):
//! a small xorshift generator, SGLang's PD-mode page allocator (lowest free
//! pages first; freed KV stays in the slots) and the slot runs a page list
//! gives for a span of token positions.

use std::collections::BTreeSet;

/// Tokens per page.
pub const PAGE: u32 = 64;

pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// The page allocator: lowest free pages first, page 0 reserved.
pub struct Pages {
    free: BTreeSet<u32>,
}
impl Pages {
    pub fn new(pages: u32) -> Self {
        Pages {
            free: (1..pages).collect(),
        }
    }
    pub fn alloc(&mut self, n: u32) -> Option<Vec<u32>> {
        if (self.free.len() as u32) < n {
            return None;
        }
        Some(
            (0..n)
                .map(|_| self.free.pop_first().expect("free page"))
                .collect(),
        )
    }
    pub fn release(&mut self, pages: &[u32]) {
        self.free.extend(pages.iter().copied());
    }
}

/// Slot of token position `t` in a page list.
pub fn slot(pages: &[u32], t: u32) -> u32 {
    pages[(t / PAGE) as usize] * PAGE + t % PAGE
}

/// Maximal contiguous slot runs covering token positions `a..b`, each at
/// most `max` slots: (first token position, slot, count).
pub fn runs(pages: &[u32], a: u32, b: u32, max: u32) -> Vec<(u32, u32, u32)> {
    let mut out: Vec<(u32, u32, u32)> = Vec::new();
    let mut t = a;
    while t < b {
        let s = slot(pages, t);
        let n = (PAGE - t % PAGE).min(b - t);
        match out.last_mut() {
            Some(l) if l.1 + l.2 == s && l.2 + n <= max => l.2 += n,
            _ => out.push((t, s, n)),
        }
        t += n;
    }
    out
}
