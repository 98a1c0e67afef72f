//! The SGLang model's prefill forward and transfer: prefill writes and reads
//! the prompt (or its placeholder), its pages are copied into decode's
//! preallocation (`write` with src on the decode pool) and Success is
//! sent; prefill then frees what the radix cache did not take.

use super::server::{CacheEntry, DecState, DecodeMode, Engine, Ev, PrefillMode};
use crate::error::Result;
use crate::schema::{CopySrc, Op};
use crate::sim::base::{DECODE_POOL, PREFILL_POOL, span};
use crate::sim::config::DecodeAllocation;
use crate::sim::model;

impl Engine<'_> {
    pub(super) fn prefill_done(&mut self, rid: u64) -> Result<()> {
        self.pf_busy = false;
        let ps = self.pf_alloc.page_size();
        let (pmode, shared, slots, group, prefix) = {
            let l = &self.live[&rid];
            (
                l.pmode,
                l.pf_shared_tokens,
                l.pf_slots.clone(),
                l.a.prefix_group,
                l.a.prefix_tokens,
            )
        };
        let own = slots[shared as usize..].to_vec();
        self.write(PREFILL_POOL, rid, &own, shared)?;
        self.read(PREFILL_POOL, rid, &slots, 0, false)?;
        // Insert the prefix into the radix cache (the tree takes the pages).
        if self.cfg.prefix_cache
            && matches!(pmode, PrefillMode::Full { .. })
            && shared == 0
            && let Some(g) = group
            && !self.cache.contains_key(&g)
        {
            let k = prefix.min(slots.len() as u32) / ps;
            if k > 0 {
                let l = self.live.get_mut(&rid).expect("live");
                let pages: Vec<u32> = l.pf_own_pages[..k as usize].to_vec();
                l.pf_cached_pages = k;
                l.pf_group_locked = Some(g);
                self.cache.insert(
                    g,
                    CacheEntry {
                        pages,
                        owner: rid,
                        locks: 1,
                        last_use: self.now,
                    },
                );
            }
        }
        let now = self.now;
        let l = self.live.get_mut(&rid).expect("live");
        l.pf_done = true;
        match pmode {
            PrefillMode::Placeholder { send: false } => {
                // 0.5.20: retired with 400, KV released unsent.
                l.prefill_answer = Some((400, now));
                self.release_prefill(rid)?;
                return self.maybe_row(rid);
            }
            _ => {
                if self.cfg.bug_stale_copy {
                    self.release_prefill(rid)?;
                }
            }
        }
        match self.cfg.decode_allocation {
            DecodeAllocation::Early => self.start_transfer(rid),
            DecodeAllocation::PrefillComplete => self.dec_queue.push_back(rid),
        }
        Ok(())
    }

    pub(super) fn start_transfer(&mut self, rid: u64) {
        let t = &self.cfg.timing;
        let ps = self.pf_alloc.page_size();
        let l = self.live.get_mut(&rid).expect("live");
        let pages = (l.pf_slots.len() as u64).div_ceil(ps as u64);
        let mut dur =
            span(t.transfer_base_us, 1000).saturating_add(span(pages, t.transfer_ns_per_page));
        if t.straggler_ppm > 0
            && model::mix64(rid ^ 0x57A6_61E5) % 1_000_000 < t.straggler_ppm as u64
        {
            dur = dur.saturating_add(span(t.straggler_delay_ms, 1_000_000));
        }
        l.transfer_in_flight = true;
        let now = self.now;
        self.at(now.saturating_add(dur), Ev::TransferLand, rid);
    }

    /// Frees prefill's own pages (not those the radix cache took) and drops
    /// its cache lock.
    pub(super) fn release_prefill(&mut self, rid: u64) -> Result<()> {
        let l = self.live.get_mut(&rid).expect("live");
        if l.pf_released {
            return Ok(());
        }
        l.pf_released = true;
        let pages = l.pf_own_pages[l.pf_cached_pages as usize..].to_vec();
        if let Some(g) = l.pf_group_locked.take()
            && let Some(e) = self.cache.get_mut(&g)
        {
            e.locks -= 1;
            e.last_use = self.now;
        }
        self.free(PREFILL_POOL, rid, &pages)
    }

    pub(super) fn transfer_land(&mut self, rid: u64) -> Result<()> {
        let pps = self.pf_alloc.page_size();
        let dps = self.dec_alloc.page_size();
        debug_assert_eq!(pps, dps, "the model transfers whole pages of equal size");
        let (src_slots, dst_pages, shared, dstate, dec_prefix) = {
            let l = self.live.get_mut(&rid).expect("live");
            l.transfer_in_flight = false;
            (
                l.pf_slots.clone(),
                l.dec_pages.clone(),
                l.pf_shared_tokens,
                l.dstate,
                l.dec_prefix_pages as usize,
            )
        };
        // Pages sent: those covering prefill's tokens, cut to the
        // destination (the Mooncake workaround for a shorter destination).
        let src_pages: Vec<u32> = src_slots.chunks(pps as usize).map(|c| c[0] / pps).collect();
        let n = src_pages.len().min(dst_pages.len());
        let src_seq = self.rec.next_seq(PREFILL_POOL)?.saturating_sub(1);
        // Pages the decode tree already holds are not sent
        // (decode_prefix_len).
        let mut i = dec_prefix.min(n);
        while i < n {
            let mut j = i + 1;
            while j < n
                && src_pages[j] == src_pages[j - 1] + 1
                && dst_pages[j] == dst_pages[j - 1] + 1
            {
                j += 1;
            }
            let count = (j - i) as u32 * pps;
            self.emit_event(
                DECODE_POOL,
                rid,
                Op::Write,
                (dst_pages[i] * dps, count),
                Some(i as u32 * pps),
                Some(CopySrc {
                    pool: PREFILL_POOL,
                    slot_start: src_pages[i] * pps,
                    seq: src_seq,
                }),
            )?;
            for k in 0..count {
                let s = (src_pages[i] * pps + k) as usize;
                let d = (dst_pages[i] * dps + k) as usize;
                self.dec_state.copy_from(d, &self.pf_state, s);
            }
            i = j;
        }
        // Prefill's part is over once the copy has run.
        self.release_prefill(rid)?;
        if dstate == DecState::Failed || dstate == DecState::Done {
            // Late landing after decode gave up.
            let l = &self.live[&rid];
            if l.release_on_land && !l.dec_released {
                self.decode_release(rid)?;
            }
            return self.maybe_row(rid);
        }
        // Decode may attend over a shared prefix another request wrote.
        // Decode may attend over the shared prefix its prefix-cache hit
        // granted on prefill: grant exactly the decode slots that hold the
        // prefix owner's KV at the right position (a stale copy is not
        // covered by the grant).
        if shared > 0 {
            let l = &self.live[&rid];
            let w = l.pf_prefix_owner;
            let n = (shared as usize).min(l.dec_slots.len());
            let from = (l.dec_prefix_pages * dps) as usize;
            let mut granted: Vec<(u32, u32)> = Vec::new();
            for (p, &s) in l.dec_slots[..n].iter().enumerate().skip(from) {
                let su = s as usize;
                if self.dec_state.owner[su] == w && self.dec_state.pos[su] == p as u32 {
                    granted.push((p as u32, s));
                }
            }
            // One share per run of consecutive positions.
            let mut i = 0;
            while i < granted.len() {
                let mut j = i + 1;
                while j < granted.len() && granted[j].0 == granted[j - 1].0 + 1 {
                    j += 1;
                }
                let slots: Vec<u32> = granted[i..j].iter().map(|x| x.1).collect();
                self.grant(DECODE_POOL, rid, &slots, granted[i].0)?;
                i = j;
            }
        }
        let (sent_tokens, dec_len, dmode) = {
            let l = &self.live[&rid];
            let sent = match l.pmode {
                PrefillMode::Full { tokens } => tokens,
                _ => 1,
            };
            (sent, l.dec_len, l.dmode)
        };
        if self.cfg.kv_checksum && sent_tokens < dec_len && dmode != DecodeMode::Stub {
            // Decode's checksum over [0, len(origin_input_ids)) mismatches.
            return self.decode_fail(rid, 500);
        }
        self.live.get_mut(&rid).expect("live").dstate = DecState::Running;
        let now = self.now;
        self.at(now, Ev::DecodeBlock, rid);
        Ok(())
    }
}
