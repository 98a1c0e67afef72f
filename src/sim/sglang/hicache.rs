//! The SGLang model's HiCache: the decode tree backed up in the host pool
//! (pool 2, role `cache`). An evicted decode-tree entry is written back
//! (`offload`), a miss on an entry the host holds is loaded back
//! (`load_back`); both are engine copies recorded as `write` with src.

use super::server::{CacheEntry, Engine, HostEntry};
use crate::error::Result;
use crate::schema::{CopySrc, Op};
use crate::sim::base::{DECODE_POOL, HOST_POOL, Slots};

impl Engine<'_> {
    /// The engine (request 0) copies whole pages `src` of `src_pool` into
    /// pages `dst` of `dst_pool` (a HiCache offload or load back): one
    /// `write` with src per run contiguous on both sides; token positions
    /// are those of a tree prefix (page i holds positions i * page_size..).
    pub(super) fn copy_pages(
        &mut self,
        src_pool: u16,
        src: &[u32],
        dst_pool: u16,
        dst: &[u32],
    ) -> Result<()> {
        let ps = self.allocator(dst_pool).page_size();
        debug_assert_eq!(ps, self.allocator(src_pool).page_size());
        let src_seq = self.rec.next_seq(src_pool)?.saturating_sub(1);
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i < n {
            let mut j = i + 1;
            while j < n && src[j] == src[j - 1] + 1 && dst[j] == dst[j - 1] + 1 {
                j += 1;
            }
            let count = (j - i) as u32 * ps;
            self.emit_event(
                dst_pool,
                crate::schema::ENGINE_REQUEST,
                Op::Write,
                (dst[i] * ps, count),
                Some(i as u32 * ps),
                Some(CopySrc {
                    pool: src_pool,
                    slot_start: src[i] * ps,
                    seq: src_seq,
                }),
            )?;
            // The pools are distinct: move the destination out to borrow
            // the source beside it.
            let mut to = std::mem::replace(self.slots_of(dst_pool), Slots::new(0));
            for k in 0..count {
                let s = (src[i] * ps + k) as usize;
                let d = (dst[i] * ps + k) as usize;
                to.copy_from(d, self.state(src_pool), s);
            }
            *self.slots_of(dst_pool) = to;
            i = j;
        }
        Ok(())
    }

    /// HiCache write-back: the engine backs an evicted decode-tree entry
    /// up in the host pool (alloc, then a copy from the decode pool),
    /// evicting the host pool's least recently used entries (never
    /// `keep`) to make room. An entry already backed up is not copied
    /// again; one larger than the host pool, or that finds no room, is
    /// dropped.
    pub(super) fn offload(&mut self, g: u64, e: &CacheEntry, keep: Option<u64>) -> Result<()> {
        let now = self.now;
        if let Some(h) = self.hcache.get_mut(&g) {
            h.last_use = now;
            return Ok(());
        }
        let n = e.pages.len() as u32;
        let host = self.allocator(HOST_POOL);
        if n == 0 || n > host.num_pages() {
            return Ok(());
        }
        while self.allocator(HOST_POOL).available_pages() < n {
            if !self.evict_host_one(keep)? {
                return Ok(());
            }
        }
        let pages = self
            .allocator(HOST_POOL)
            .alloc_pages(n)
            .expect("room was made");
        let ps = self.allocator(HOST_POOL).page_size();
        self.alloc(
            HOST_POOL,
            crate::schema::ENGINE_REQUEST,
            &Self::page_slots(&pages, ps),
        )?;
        self.copy_pages(DECODE_POOL, &e.pages, HOST_POOL, &pages)?;
        self.hcache.insert(
            g,
            HostEntry {
                pages,
                owner: e.owner,
                last_use: now,
            },
        );
        Ok(())
    }

    /// Evicts the host pool's least recently used entry (never `keep`);
    /// false when there is none.
    pub(super) fn evict_host_one(&mut self, keep: Option<u64>) -> Result<bool> {
        let victim = self
            .hcache
            .iter()
            .filter(|(g, _)| Some(**g) != keep)
            .min_by_key(|(g, h)| (h.last_use, **g))
            .map(|(g, _)| *g);
        let Some(g) = victim else { return Ok(false) };
        let h = self.hcache.remove(&g).expect("victim");
        self.free(HOST_POOL, crate::schema::ENGINE_REQUEST, &h.pages)?;
        Ok(true)
    }

    /// HiCache load back: a decode-tree miss on `g` whose entry is in the
    /// host pool. The engine allocates fresh device pages for the `k`
    /// leading pages the request can use and copies them in from the host
    /// pool; they become the tree entry (owner: the entry's writer), which
    /// the request then hits. False (nothing loaded) when the device pool
    /// cannot make room for them and the request's own `need` pages.
    pub(super) fn load_back(&mut self, g: u64, k: u32, need: u64) -> Result<bool> {
        while (self.dec_alloc.available_pages() as u64) < self.dec_reserved + k as u64 + need {
            if !self.evict_decode_one(Some(g))? {
                return Ok(false);
            }
        }
        let now = self.now;
        let (src, owner) = {
            let h = self.hcache.get_mut(&g).expect("host entry");
            h.last_use = now;
            (h.pages[..k as usize].to_vec(), h.owner)
        };
        let dev = self.dec_alloc.alloc_pages(k).expect("room was made");
        let ps = self.dec_alloc.page_size();
        self.alloc(
            DECODE_POOL,
            crate::schema::ENGINE_REQUEST,
            &Self::page_slots(&dev, ps),
        )?;
        self.copy_pages(HOST_POOL, &src, DECODE_POOL, &dev)?;
        self.dcache.insert(
            g,
            CacheEntry {
                pages: dev,
                owner,
                locks: 0,
                last_use: now,
            },
        );
        Ok(true)
    }
}
