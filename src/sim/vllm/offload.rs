//! The vLLM model's stores into and loads from its KV tiers (`tier`): the
//! engine's copies between a block pool and a tier pool, LRU eviction
//! with the planted stale-key defect, loads into a request's fresh blocks
//! with the grants the capture gives them, the CPU tier's store of
//! blocks the decode pool evicts, and LMCache's store of a finished
//! request's prefix chunks.

use super::server::{Engine, picked};
use super::tier::{Entry, Loaded, NO_OWNER, Tier, chunk_key};
use crate::error::Result;
use crate::schema::{CopySrc, ENGINE_REQUEST, Op};
use crate::sim::base::{DECODE_POOL, Slots};

/// Salt of the stale-page trigger (per tier eviction, deterministic).
const STALE_TIER_SALT: u64 = 0x7AE5_57A1_E0FF_1CE5;

impl Engine<'_> {
    pub(super) fn tier(&self, pool: u16) -> &Tier {
        [&self.cpu, &self.lmc]
            .into_iter()
            .flatten()
            .find(|t| t.pool == pool)
            .expect("tier pool")
    }

    pub(super) fn tier_mut(&mut self, pool: u16) -> &mut Tier {
        [&mut self.cpu, &mut self.lmc]
            .into_iter()
            .flatten()
            .find(|t| t.pool == pool)
            .expect("tier pool")
    }

    /// Copies blocks `src` of `src_pool` into blocks `dst` of `dst_pool`
    /// for `rid` (request 0: the engine): one `write` with src per run
    /// contiguous on both sides, token positions from `pos0` block by
    /// block. The destination's content state follows the source's.
    pub(super) fn copy_blocks(
        &mut self,
        rid: u64,
        (src_pool, src): (u16, &[u32]),
        (dst_pool, dst): (u16, &[u32]),
        pos0: u32,
    ) -> Result<()> {
        let bs = self.bs();
        let src_seq = self.rec.next_seq(src_pool)?.saturating_sub(1);
        let mut i = 0;
        while i < dst.len() {
            let mut j = i + 1;
            while j < dst.len() && src[j] == src[j - 1] + 1 && dst[j] == dst[j - 1] + 1 {
                j += 1;
            }
            let count = (j - i) as u32 * bs;
            self.emit(
                dst_pool,
                rid,
                Op::Write,
                (dst[i] * bs, count),
                Some(pos0 + i as u32 * bs),
                Some(CopySrc {
                    pool: src_pool,
                    slot_start: src[i] * bs,
                    seq: src_seq,
                }),
            )?;
            // Distinct pools: move the destination out to borrow the
            // source beside it.
            let mut to = std::mem::replace(self.state_mut(dst_pool), Slots::new(0));
            for k in 0..count {
                to.copy_from(
                    (dst[i] * bs + k) as usize,
                    self.state(src_pool),
                    (src[i] * bs + k) as usize,
                );
            }
            *self.state_mut(dst_pool) = to;
            i = j;
        }
        Ok(())
    }

    /// Frees an entry's tier blocks (the engine's `free`).
    fn tier_free(&mut self, pool: u16, blocks: &[u32]) -> Result<()> {
        self.free_events(pool, ENGINE_REQUEST, blocks)?;
        let t = self.tier_mut(pool);
        t.free.extend(blocks.iter().copied());
        Ok(())
    }

    /// Stores device blocks `blocks` of `src_pool` under key `k` in tier
    /// `pool` (one entry of the tier's unit). A key already held is only
    /// touched. When full, the least recently used entry is evicted; under
    /// the planted defect its blocks are freed but its key stays.
    pub(super) fn tier_store(
        &mut self,
        pool: u16,
        src_pool: u16,
        blocks: &[u32],
        k: u64,
    ) -> Result<()> {
        let t = self.tier_mut(pool);
        if t.entries.contains_key(&k) {
            t.touch(k);
            return Ok(());
        }
        let unit = t.unit as usize;
        debug_assert_eq!(blocks.len(), unit);
        while self.tier(pool).free.len() < unit {
            let t = self.tier_mut(pool);
            let Some((&tick, &victim)) = t.lru.iter().next() else {
                return Ok(());
            };
            t.lru.remove(&tick);
            t.evictions += 1;
            let stale = picked(t.evictions, STALE_TIER_SALT ^ pool as u64, t.stale_ppm);
            let freed = if stale {
                let e = t.entries.get_mut(&victim).expect("indexed");
                e.tick = None;
                e.blocks.clone()
            } else {
                t.entries.remove(&victim).expect("indexed").blocks
            };
            self.tier_free(pool, &freed)?;
        }
        let t = self.tier_mut(pool);
        let dst: Vec<u32> = (0..unit)
            .map(|_| t.free.pop_first().expect("room was made"))
            .collect();
        for &b in &dst {
            t.written_for[b as usize] = Some(k);
        }
        let slots = self.block_slots(&dst);
        self.emit_runs(pool, ENGINE_REQUEST, Op::Alloc, &slots, None)?;
        let st = self.state_mut(pool);
        for s in slots {
            st.current[s as usize] = false;
        }
        self.copy_blocks(ENGINE_REQUEST, (src_pool, blocks), (pool, &dst), 0)?;
        let bs = self.bs() as usize;
        let src = self.state(src_pool);
        let owners = blocks.iter().map(|&b| src.owner[b as usize * bs]).collect();
        let t = self.tier_mut(pool);
        t.tick += 1;
        let tick = t.tick;
        t.lru.insert(tick, k);
        t.entries.insert(
            k,
            Entry {
                blocks: dst,
                owners,
                tick: Some(tick),
            },
        );
        Ok(())
    }

    /// Loads prompt blocks `first..first + dst.len()` (block indexes of the
    /// prompt whose keys are `keys`) from tier `pool` into the request's
    /// fresh blocks `dst` of `dst_pool` (already allocated to it), then
    /// grants the slots of every block whose tier block was stored for the
    /// key looked up. The caller checked the entries with
    /// [`Tier::lookup`].
    pub(super) fn tier_load(
        &mut self,
        pool: u16,
        rid: u64,
        keys: &[Option<u64>],
        first: usize,
        (dst_pool, dst): (u16, &[u32]),
    ) -> Result<Loaded> {
        let bs = self.bs();
        let u = self.tier(pool).unit as usize;
        let mut src = Vec::with_capacity(dst.len());
        let mut owners = Vec::with_capacity(dst.len());
        let mut granted = Vec::new();
        for (i, &d) in dst.iter().enumerate() {
            let b = first + i;
            let t = self.tier_mut(pool);
            let k = t.entry_key(keys, b / u).expect("looked up");
            t.touch(k);
            let e = &t.entries[&k];
            let tb = e.blocks[b % u];
            src.push(tb);
            if t.written_for[tb as usize] == Some(k) {
                owners.push(e.owners[b % u]);
                granted.push((b as u32 * bs, d));
            } else {
                owners.push(NO_OWNER);
                self.pool_of(dst_pool).blocks[d as usize].ungranted = true;
            }
        }
        self.copy_blocks(rid, (pool, &src), (dst_pool, dst), first as u32 * bs)?;
        self.grant_blocks(dst_pool, rid, &granted)?;
        Ok(Loaded { owners })
    }

    /// `share`s whole blocks `(token position of the block, block)` to
    /// `rid`, one event per run contiguous in positions and slots.
    pub(super) fn grant_blocks(
        &mut self,
        pool: u16,
        rid: u64,
        blocks: &[(u32, u32)],
    ) -> Result<()> {
        let bs = self.bs();
        let mut i = 0;
        while i < blocks.len() {
            let mut j = i + 1;
            while j < blocks.len() && blocks[j].0 == blocks[j - 1].0 + bs {
                j += 1;
            }
            let ids: Vec<u32> = blocks[i..j].iter().map(|x| x.1).collect();
            let slots = self.block_slots(&ids);
            self.grant(pool, rid, &slots, blocks[i].0)?;
            i = j;
        }
        Ok(())
    }

    /// The decode pool's `get_new`, storing every cached block it evicts
    /// in the CPU tier first (before the block is reused).
    pub(super) fn d_get_new(&mut self, n: usize) -> Result<Option<Vec<u32>>> {
        let got = self.d.get_new(n);
        let evicted = std::mem::take(&mut self.d.evicted);
        if let Some(pool) = self.cpu.as_ref().map(|t| t.pool) {
            for (b, k) in evicted {
                self.tier_store(pool, DECODE_POOL, &[b], k)?;
            }
        }
        Ok(got)
    }

    /// LMCache: stores the full prefix chunks of `table` (the block table
    /// of a prompt whose block keys are `keys`) from `src_pool`.
    pub(super) fn lmcache_store(
        &mut self,
        src_pool: u16,
        table: &[u32],
        keys: &[Option<u64>],
    ) -> Result<()> {
        let Some(t) = self.lmc.as_ref() else {
            return Ok(());
        };
        let (pool, u) = (t.pool, t.unit as usize);
        for j in 0..keys.len().min(table.len()) / u {
            let Some(k) = chunk_key(keys, u, j) else {
                break;
            };
            self.tier_store(pool, src_pool, &table[j * u..(j + 1) * u], k)?;
        }
        Ok(())
    }
}
