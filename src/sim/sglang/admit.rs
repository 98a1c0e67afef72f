//! The SGLang model's front door and scheduler: a request arrives (front-end
//! context check, router dual dispatch, each role's `max_req_input_len`),
//! decode preallocates the prompt it saw, prefill bootstraps and forwards,
//! and either side evicts its least recently used radix-cache entries when
//! its pool runs short.

use std::collections::HashMap;

use super::server::{DecState, DecodeMode, Engine, Ev, Live, PrefillMode};
use crate::error::Result;
use crate::sim::base::{DECODE_POOL, PREFILL_POOL, later, span};
use crate::sim::config::{DecodeAllocation, EngineVersion};
use crate::sim::model;
use crate::sim::truth::ReadLog;
use crate::sim::workload::Arrival;

impl Engine<'_> {
    pub(super) fn arrive(&mut self, a: Arrival) -> Result<()> {
        let cfg = self.cfg;
        let v = cfg.engine;
        let hash = a.prompt_hash();
        let tenant = self.tenant(&a.tenant);
        let ctx = cfg.context_window;
        let mut n = a.prompt_tokens as u64;
        let front_reject = n >= ctx && !cfg.allow_auto_truncate;
        if n >= ctx {
            // Tokenizer auto-truncation to the context window.
            n = ctx - 1;
        }
        let (plim, dlim) = (cfg.prefill_limit(), cfg.decode_limit());
        let pre_rejects = n >= plim;
        let dec_rejects = n >= dlim;
        if pre_rejects && !cfg.allow_auto_truncate && !front_reject {
            self.stats.over_long += 1;
        }
        let dmode = if dec_rejects && !cfg.allow_auto_truncate {
            if v >= EngineVersion::V0521 {
                DecodeMode::Door
            } else {
                DecodeMode::Stub
            }
        } else {
            DecodeMode::Full {
                tokens: n.min(if dec_rejects { dlim } else { n }) as u32,
            }
        };
        let pmode = if dmode == DecodeMode::Door {
            PrefillMode::Idle
        } else if pre_rejects && !cfg.allow_auto_truncate {
            match v {
                EngineVersion::V0519 => PrefillMode::Placeholder { send: true },
                EngineVersion::V0520 => PrefillMode::Placeholder { send: false },
                _ => PrefillMode::Door,
            }
        } else {
            PrefillMode::Full {
                tokens: n.min(if pre_rejects { plim } else { n }) as u32,
            }
        };
        let dec_len = match dmode {
            DecodeMode::Full { tokens } => tokens,
            DecodeMode::Stub => 1,
            DecodeMode::Door => 0,
        };
        // max_new_tokens is clamped to what the decode context leaves.
        let max_req_len = (ctx - 1).min(cfg.decode.capacity_tokens - 1);
        let room = max_req_len.saturating_sub(dec_len as u64).max(1) as u32;
        let out_target = match dmode {
            DecodeMode::Stub => 1,
            _ => a.output_tokens.clamp(1, room),
        };
        let rid = a.request_id;
        let live = Live {
            hash,
            seed: model::seed(&hash),
            tenant,
            pmode,
            dmode,
            dec_len,
            out_target,
            pf_slots: Vec::new(),
            pf_own_pages: Vec::new(),
            pf_shared_tokens: 0,
            pf_group_locked: None,
            pf_prefix_owner: 0,
            pf_cached_pages: 0,
            pf_released: false,
            pf_done: false,
            dstate: DecState::Queued,
            dec_slots: Vec::new(),
            dec_pages: Vec::new(),
            dec_tree_pages: 0,
            dec_prefix_pages: 0,
            dec_group_locked: None,
            dec_reserve: 0,
            generated: 0,
            transfer_in_flight: false,
            release_on_land: false,
            dec_released: false,
            grants: HashMap::new(),
            front_reject,
            status: 0,
            prefill_answer: None,
            decode_answer: None,
            output_hash: None,
            row_written: false,
            log: ReadLog::default(),
            a,
        };
        self.live.insert(rid, live);
        if front_reject {
            let l = self.live.get_mut(&rid).expect("live");
            l.prefill_answer = Some((400, self.now));
            l.decode_answer = Some((400, self.now));
            l.dstate = DecState::Done;
            l.dec_released = true;
            l.pf_released = true;
            return self.maybe_row(rid);
        }
        let now = self.now;
        {
            let l = self.live.get_mut(&rid).expect("live");
            if pmode == PrefillMode::Door {
                l.prefill_answer = Some((400, now));
                l.pf_released = true;
                l.pf_done = true;
            }
            if pmode == PrefillMode::Idle {
                l.pf_released = true;
                l.pf_done = true;
            }
            if dmode == DecodeMode::Door {
                l.decode_answer = Some((400, now));
                l.dstate = DecState::Done;
                l.dec_released = true;
            }
        }
        if dmode == DecodeMode::Door {
            return self.maybe_row(rid);
        }
        let sends = matches!(
            pmode,
            PrefillMode::Full { .. } | PrefillMode::Placeholder { send: true }
        );
        match cfg.decode_allocation {
            DecodeAllocation::Early => self.dec_queue.push_back(rid),
            DecodeAllocation::PrefillComplete => {
                if matches!(
                    pmode,
                    PrefillMode::Full { .. } | PrefillMode::Placeholder { .. }
                ) {
                    self.pf_queue.push_back(rid);
                }
                if !sends {
                    // Decode never reserves KV; it times out waiting for
                    // prefill completion.
                    let l = self.live.get_mut(&rid).expect("live");
                    l.dstate = DecState::Waiting;
                    self.at(
                        later(now, cfg.waiting_timeout_ms, 1_000_000),
                        Ev::WaitTimeout,
                        rid,
                    );
                }
            }
        }
        Ok(())
    }

    /// Starts what can start: decode preallocations (FIFO), then one
    /// prefill forward at a time (FIFO). Exhausted pools make requests wait.
    pub(super) fn schedule(&mut self) -> Result<()> {
        while let Some(&rid) = self.dec_queue.front() {
            if !self.try_prealloc(rid)? {
                break;
            }
            self.dec_queue.pop_front();
        }
        while !self.pf_busy {
            let Some(&rid) = self.pf_queue.front() else {
                break;
            };
            if !self.try_prefill(rid)? {
                break;
            }
            self.pf_queue.pop_front();
        }
        Ok(())
    }

    pub(super) fn try_prealloc(&mut self, rid: u64) -> Result<bool> {
        let ps = self.dec_alloc.page_size();
        let (dec_len, out, dmode, group) = {
            let l = &self.live[&rid];
            (l.dec_len, l.out_target, l.dmode, l.a.prefix_group)
        };
        // A miss that the host pool holds is loaded back first (HiCache).
        if self.cfg.hicache
            && matches!(dmode, DecodeMode::Full { .. })
            && let Some(g) = group
            && !self.dcache.contains_key(&g)
            && let Some(h) = self.hcache.get(&g)
        {
            let k = ((dec_len - 1) / ps).min(h.pages.len() as u32);
            let need = ((dec_len + out).div_ceil(ps) - k) as u64;
            if k > 0 && !self.load_back(g, k, need)? {
                return Ok(false);
            }
        }
        // Decode radix tree match: whole pages, at most dec_len - 1 tokens.
        let mut tree: Vec<u32> = Vec::new();
        if self.cfg.decode_radix_cache
            && matches!(dmode, DecodeMode::Full { .. })
            && let Some(g) = group
            && let Some(e) = self.dcache.get(&g)
        {
            let k = ((dec_len - 1) / ps).min(e.pages.len() as u32);
            tree = e.pages[..k as usize].to_vec();
        }
        let k = tree.len() as u32;
        let need_total = ((dec_len + out).div_ceil(ps) - k) as u64;
        while (self.dec_alloc.available_pages() as u64) < self.dec_reserved + need_total {
            if !self.evict_decode_one(group)? {
                return Ok(false);
            }
        }
        let last_loc = tree.last().map(|p| p * ps + ps - 1).unwrap_or(0);
        let Some((own_slots, pages)) = self.dec_alloc.alloc_extend(k * ps, dec_len, last_loc)
        else {
            return Ok(false);
        };
        let reserve = need_total as u32 - pages.len() as u32;
        self.dec_reserved += reserve as u64;
        let mut slots = Self::page_slots(&tree, ps);
        if k > 0 {
            let g = group.expect("a tree hit has a group");
            let e = self.dcache.get_mut(&g).expect("entry");
            e.locks += 1;
            e.last_use = self.now;
            self.live.get_mut(&rid).expect("live").dec_group_locked = Some(g);
            self.grant(DECODE_POOL, rid, &slots, 0)?;
        }
        slots.extend_from_slice(&own_slots);
        let mut all_pages = tree;
        all_pages.extend_from_slice(&pages);
        let all = Self::page_slots(&pages, ps);
        self.alloc(DECODE_POOL, rid, &all)?;
        let pages = all_pages;
        let now = self.now;
        let (pmode, policy) = (self.live[&rid].pmode, self.cfg.decode_allocation);
        let l = self.live.get_mut(&rid).expect("live");
        l.dec_slots = slots;
        l.dec_pages = pages;
        l.dec_tree_pages = k;
        l.dec_prefix_pages = k;
        l.dec_reserve = reserve;
        l.dstate = DecState::Waiting;
        match policy {
            DecodeAllocation::Early => {
                self.at(
                    later(now, self.cfg.waiting_timeout_ms, 1_000_000),
                    Ev::WaitTimeout,
                    rid,
                );
                if matches!(
                    pmode,
                    PrefillMode::Full { .. } | PrefillMode::Placeholder { .. }
                ) {
                    self.pf_queue.push_back(rid);
                }
            }
            DecodeAllocation::PrefillComplete => {
                // Prefill already completed: transfer now.
                self.start_transfer(rid);
            }
        }
        Ok(true)
    }

    pub(super) fn try_prefill(&mut self, rid: u64) -> Result<bool> {
        let ps = self.pf_alloc.page_size();
        let (pmode, group, prefix) = {
            let l = &self.live[&rid];
            (l.pmode, l.a.prefix_group, l.a.prefix_tokens)
        };
        let tokens = match pmode {
            PrefillMode::Full { tokens } => tokens,
            PrefillMode::Placeholder { .. } => 1,
            _ => unreachable!("only forwarding requests are queued for prefill"),
        };
        // Prefix cache match: whole cached pages, at most tokens - 1.
        let mut shared_pages: Vec<u32> = Vec::new();
        if self.cfg.prefix_cache
            && matches!(pmode, PrefillMode::Full { .. })
            && let Some(g) = group
            && let Some(e) = self.cache.get(&g)
        {
            let k = (prefix.min(tokens.saturating_sub(1)) / ps).min(e.pages.len() as u32);
            shared_pages = e.pages[..k as usize].to_vec();
        }
        let shared = shared_pages.len() as u32 * ps;
        let last_loc = shared_pages.last().map(|p| p * ps + ps - 1).unwrap_or(0);
        let got = loop {
            if let Some(x) = self.pf_alloc.alloc_extend(shared, tokens, last_loc) {
                break Some(x);
            }
            if !self.evict_one(group)? {
                break None;
            }
        };
        let Some((own_slots, own_pages)) = got else {
            return Ok(false);
        };
        if !shared_pages.is_empty() {
            let g = group.expect("shared implies group");
            let e = self.cache.get_mut(&g).expect("entry");
            e.locks += 1;
            e.last_use = self.now;
            let owner = e.owner;
            let l = self.live.get_mut(&rid).expect("live");
            l.pf_group_locked = Some(g);
            l.pf_prefix_owner = owner;
            let sslots = Self::page_slots(&shared_pages, ps);
            self.grant(PREFILL_POOL, rid, &sslots, 0)?;
        }
        let own_all = Self::page_slots(&own_pages, ps);
        self.alloc(PREFILL_POOL, rid, &own_all)?;
        let mut pf_slots = Self::page_slots(&shared_pages, ps);
        pf_slots.extend_from_slice(&own_slots);
        let t = &self.cfg.timing;
        let dur = span(t.prefill_base_us, 1000)
            .saturating_add(span((tokens - shared) as u64, t.prefill_ns_per_token));
        let l = self.live.get_mut(&rid).expect("live");
        l.pf_slots = pf_slots;
        l.pf_own_pages = own_pages;
        l.pf_shared_tokens = shared;
        self.pf_busy = true;
        self.at(self.now.saturating_add(dur), Ev::PrefillDone, rid);
        Ok(true)
    }

    /// Evicts the least recently used unlocked prefix-cache entry (never
    /// `keep`); false when nothing can be evicted.
    pub(super) fn evict_one(&mut self, keep: Option<u64>) -> Result<bool> {
        let victim = self
            .cache
            .iter()
            .filter(|(g, e)| e.locks == 0 && Some(**g) != keep)
            .min_by_key(|(g, e)| (e.last_use, **g))
            .map(|(g, _)| *g);
        let Some(g) = victim else { return Ok(false) };
        let e = self.cache.remove(&g).expect("victim");
        self.free(PREFILL_POOL, crate::schema::ENGINE_REQUEST, &e.pages)?;
        Ok(true)
    }

    /// Evicts the least recently used unlocked decode-tree entry (never
    /// `keep`); false when nothing can be evicted.
    pub(super) fn evict_decode_one(&mut self, keep: Option<u64>) -> Result<bool> {
        let victim = self
            .dcache
            .iter()
            .filter(|(g, e)| e.locks == 0 && Some(**g) != keep)
            .min_by_key(|(g, e)| (e.last_use, **g))
            .map(|(g, _)| *g);
        let Some(g) = victim else { return Ok(false) };
        let e = self.dcache.remove(&g).expect("victim");
        if self.cfg.hicache {
            self.offload(g, &e, keep)?;
        }
        self.free(DECODE_POOL, crate::schema::ENGINE_REQUEST, &e.pages)?;
        Ok(true)
    }
}
