//! Device primitives built from the kernels: in-place scans (exclusive
//! sum, inclusive max) by recursive reduce-then-scan, and a stable LSD radix
//! sort of (u32 key, u32 value) pairs with 8-bit digits. Host code only
//! sequences launches; all data stays on the device.

use super::device::{
    Device, Grow, RADIX_HIST, RADIX_SCATTER, SCAN_APPLY, SCAN_REDUCE, SCAN_SINGLE,
    params::{RadixParams, ScanParams},
};
use crate::error::Result;

/// Scan operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScanOp {
    /// Exclusive wrapping sum.
    ExclusiveSum,
    /// Inclusive wrapping sum.
    InclusiveSum,
    /// Inclusive max (identity 0).
    InclusiveMax,
}

/// Scratch space of the primitives, kept across calls.
pub struct Prims<D: Device> {
    /// Items per thread of the scans and of the radix sort.
    pub scan_chunk: u64,
    pub radix_chunk: u64,
    levels: Vec<Grow<D>>,
    total: Grow<D>,
    hist: Grow<D>,
}

impl<D: Device> Prims<D> {
    pub fn new(scan_chunk: u64, radix_chunk: u64) -> Self {
        Self {
            scan_chunk: scan_chunk.max(2),
            radix_chunk: radix_chunk.max(1),
            levels: Vec::new(),
            total: Grow::default(),
            hist: Grow::default(),
        }
    }

    /// Scans `n` u64 at `data` in place and returns the total (sum or max
    /// of all items).
    pub fn scan(&mut self, dev: &D, data: u64, n: u64, op: ScanOp) -> Result<u64> {
        let total = self.scan_in_place(dev, data, n, op)?;
        let mut t = [0u64];
        dev.download(total, super::device::bytes_of_mut(&mut t))?;
        Ok(t[0])
    }

    /// Like `scan`, without waiting for the total: returns its address.
    pub fn scan_in_place(&mut self, dev: &D, data: u64, n: u64, op: ScanOp) -> Result<u64> {
        let total = self.total.ensure(dev, 8)?;
        let (opc, inclusive) = match op {
            ScanOp::ExclusiveSum => (0, 0),
            ScanOp::InclusiveSum => (0, 1),
            ScanOp::InclusiveMax => (1, 1),
        };
        self.scan_level(dev, data, n, opc, inclusive, 0, total)?;
        Ok(total)
    }

    #[allow(clippy::too_many_arguments)]
    fn scan_level(
        &mut self,
        dev: &D,
        data: u64,
        n: u64,
        op: u64,
        inclusive: u64,
        depth: usize,
        total: u64,
    ) -> Result<()> {
        let chunk = self.scan_chunk;
        let mut p = ScanParams {
            data,
            sums: 0,
            total,
            n,
            chunk,
            op,
            inclusive,
        };
        if n <= chunk {
            return dev.launch(&SCAN_SINGLE, 1, p);
        }
        let nch = n.div_ceil(chunk);
        while self.levels.len() <= depth {
            self.levels.push(Grow::default());
        }
        p.sums = self.levels[depth].ensure(dev, nch as usize * 8)?;
        dev.launch(&SCAN_REDUCE, nch, p)?;
        // Carries into the chunks: an exclusive scan of the partials.
        self.scan_level(dev, p.sums, nch, op, 0, depth + 1, total)?;
        dev.launch(&SCAN_APPLY, nch, p)
    }

    /// Sorts `n` (key, value) pairs stably by the low `bits` bits of the
    /// key. Input in (`k0`, `v0`), `k1`/`v1` are scratch of the same size;
    /// returns where the sorted pairs are.
    #[allow(clippy::too_many_arguments)]
    pub fn radix_sort(
        &mut self,
        dev: &D,
        n: u64,
        bits: u32,
        k0: u64,
        v0: u64,
        k1: u64,
        v1: u64,
    ) -> Result<(u64, u64)> {
        let (mut ki, mut vi, mut ko, mut vo) = (k0, v0, k1, v1);
        if n <= 1 {
            return Ok((ki, vi));
        }
        let nch = n.div_ceil(self.radix_chunk);
        let hist = self.hist.ensure(dev, 256 * nch as usize * 8)?;
        let mut shift = 0;
        while shift < bits {
            let p = RadixParams {
                key_in: ki,
                val_in: vi,
                key_out: ko,
                val_out: vo,
                hist,
                n,
                chunk: self.radix_chunk,
                shift: shift as u64,
            };
            dev.launch(&RADIX_HIST, nch, p)?;
            self.scan_in_place(dev, hist, 256 * nch, ScanOp::ExclusiveSum)?;
            dev.launch(&RADIX_SCATTER, nch, p)?;
            std::mem::swap(&mut ki, &mut ko);
            std::mem::swap(&mut vi, &mut vo);
            shift += 8;
        }
        Ok((ki, vi))
    }
}
