//! The reference model (src/sim/model.rs) on a device: slot values from
//! (seed, position), attention terms gathered through a paged block table,
//! an inclusive prefix sum, and the output tokens. Bit-identical to the CPU
//! functions (wrapping u64 arithmetic; the sum is order-independent).
//!
//! `output_tokens` has the CPU function's parameters plus the device;
//! `paged_output_tokens` reads a request's positions from a pool's slot
//! values through its block table, as paged attention does.

use super::device::{
    Device, Grow, MODEL_SLOT_VALUES, MODEL_TERMS, MODEL_TOKENS, bytes_of, bytes_of_mut,
    params::{KvParams, TermsParams, TokensParams},
};
use super::prims::{Prims, ScanOp};
use crate::error::{Error, Result};

/// Position value of a blank slot in `slot_values`.
pub const BLANK_POS: u32 = u32::MAX;

/// The reference model's kernels on a device, with their scratch buffers.
pub struct DeviceModel<D: Device> {
    dev: D,
    prims: Prims<D>,
    a: Grow<D>,
    b: Grow<D>,
    c: Grow<D>,
}

impl<D: Device> DeviceModel<D> {
    pub fn new(dev: D) -> Self {
        Self {
            dev,
            prims: Prims::new(32, 1024),
            a: Grow::default(),
            b: Grow::default(),
            c: Grow::default(),
        }
    }

    /// `kv(seed[i], pos[i])` per slot, 0 where `pos[i] == BLANK_POS`
    /// (`sim::model::slot_value`).
    pub fn slot_values(&mut self, seed: &[u64], pos: &[u32]) -> Result<Vec<u64>> {
        if seed.len() != pos.len() {
            return Err(Error::Other(format!(
                "model: {} seeds for {} positions",
                seed.len(),
                pos.len()
            )));
        }
        let n = seed.len();
        let dev = &self.dev;
        let p = KvParams {
            seed: self.a.ensure(dev, n * 8)?,
            pos: self.b.ensure(dev, n * 4)?,
            out: self.c.ensure(dev, n * 8)?,
            n: n as u64,
        };
        let mut out = vec![0u64; n];
        if n > 0 {
            dev.upload(p.seed, bytes_of(seed))?;
            dev.upload(p.pos, bytes_of(pos))?;
            dev.launch(&MODEL_SLOT_VALUES, n as u64, p)?;
            dev.download(p.out, bytes_of_mut(&mut out))?;
        }
        Ok(out)
    }

    /// `sim::model::output_tokens(context, prompt_len)` on the device.
    pub fn output_tokens(&mut self, context: &[u64], prompt_len: usize) -> Result<Vec<u32>> {
        self.tokens(context, &[], 0, context.len(), prompt_len)
    }

    /// Output tokens of a request whose position `p` lives in slot
    /// `block_table[p / page_size] * page_size + p % page_size` of a pool
    /// with `slot_values`; `len` = prompt length + output tokens.
    pub fn paged_output_tokens(
        &mut self,
        slot_values: &[u64],
        block_table: &[u32],
        page_size: u32,
        len: usize,
        prompt_len: usize,
    ) -> Result<Vec<u32>> {
        if page_size == 0 {
            return Err(Error::Other("model: page size 0".into()));
        }
        let ps = page_size as usize;
        if len.div_ceil(ps) > block_table.len() {
            return Err(Error::Other(format!(
                "model: {len} positions need {} pages, the block table has {}",
                len.div_ceil(ps),
                block_table.len()
            )));
        }
        if let Some(&b) = block_table[..len.div_ceil(ps)]
            .iter()
            .find(|&&b| (b as usize + 1) * ps > slot_values.len())
        {
            return Err(Error::Other(format!(
                "model: page {b} lies outside the {} slots",
                slot_values.len()
            )));
        }
        self.tokens(slot_values, block_table, page_size, len, prompt_len)
    }

    fn tokens(
        &mut self,
        values: &[u64],
        table: &[u32],
        page_size: u32,
        len: usize,
        prompt_len: usize,
    ) -> Result<Vec<u32>> {
        if prompt_len > len {
            return Err(Error::Other(format!(
                "model: prompt length {prompt_len} past the {len} positions"
            )));
        }
        let n_tokens = len - prompt_len;
        let mut out = vec![0u32; n_tokens];
        if n_tokens == 0 {
            return Ok(out);
        }
        let dev = &self.dev;
        let tp = TermsParams {
            values: self.a.ensure(dev, values.len() * 8)?,
            block_table: self.b.ensure(dev, table.len() * 4)?,
            out: self.c.ensure(dev, len * 8)?,
            n: len as u64,
            page_size: page_size as u64,
        };
        dev.upload(tp.values, bytes_of(values))?;
        if !table.is_empty() {
            dev.upload(tp.block_table, bytes_of(table))?;
        }
        dev.launch(&MODEL_TERMS, len as u64, tp)?;
        self.prims
            .scan_in_place(dev, tp.out, len as u64, ScanOp::InclusiveSum)?;
        // tokens go where the values were (no longer needed)
        let kp = TokensParams {
            prefix: tp.out,
            out: tp.values,
            prompt_len: prompt_len as u64,
            n_tokens: n_tokens as u64,
        };
        if values.len() * 8 < n_tokens * 4 {
            return Err(Error::Other(
                "model: value table shorter than the output".into(),
            ));
        }
        dev.launch(&MODEL_TOKENS, n_tokens as u64, kp)?;
        dev.download(kp.out, bytes_of_mut(&mut out))?;
        Ok(out)
    }
}
