//! The SGLang model's decode side: generation in blocks (alloc at page
//! boundaries, write, read of the whole context), the finish, the waiting
//! timeout and failures (answered at once, their KV released unread at
//! once, after the in-flight transfer, or after the deferred-release
//! wait), and the response row once the customer's answer is known.

use std::collections::BTreeMap;

use super::server::{CacheEntry, DecState, DecodeMode, Engine, Ev, PrefillMode};
use crate::error::Result;
use crate::schema::{RequestRecord, hash_tokens};
use crate::sim::base::{DECODE_POOL, EPOCH_NS, PREFILL_POOL, later, span};
use crate::sim::config::RouterMode;
use crate::sim::model;

impl Engine<'_> {
    pub(super) fn decode_block(&mut self, rid: u64) -> Result<()> {
        let ps = self.dec_alloc.page_size();
        let block = self.cfg.timing.decode_block_tokens;
        let (l_len, generated, target) = {
            let l = &self.live[&rid];
            (l.dec_len, l.generated, l.out_target)
        };
        let j1 = (generated + block).min(target);
        // Slots for positions L+generated .. L+j1: the preallocation, then the
        // last partial page, then new pages at page boundaries.
        let mut new_pages = Vec::new();
        for p in l_len + generated..l_len + j1 {
            let l = &self.live[&rid];
            if (p as usize) < l.dec_slots.len() {
                continue;
            }
            let last = *l.dec_slots.last().unwrap_or(&0);
            let covered = l.dec_pages.len() as u32 * ps;
            let (slot, page) = if p < covered {
                (last + 1, None)
            } else {
                self.dec_alloc
                    .alloc_decode(p + 1, last)
                    .expect("decode pages are reserved at admission")
            };
            let l = self.live.get_mut(&rid).expect("live");
            l.dec_slots.push(slot);
            if let Some(pg) = page {
                l.dec_pages.push(pg);
                l.dec_reserve -= 1;
                self.dec_reserved -= 1;
                new_pages.push(pg);
            }
        }
        if !new_pages.is_empty() {
            let all = Self::page_slots(&new_pages, ps);
            self.alloc(DECODE_POOL, rid, &all)?;
        }
        let wslots =
            self.live[&rid].dec_slots[(l_len + generated) as usize..(l_len + j1) as usize].to_vec();
        self.write(DECODE_POOL, rid, &wslots, l_len + generated)?;
        let ctx = self.live[&rid].dec_slots[..(l_len + j1) as usize].to_vec();
        let last = j1 == target;
        let values = self.read(DECODE_POOL, rid, &ctx, 0, last)?;
        let dur = span(
            (j1 - generated) as u64,
            self.cfg.timing.decode_step_us.saturating_mul(1000),
        );
        let l = self.live.get_mut(&rid).expect("live");
        l.generated = j1;
        let now = self.now;
        if last {
            let toks = model::output_tokens(&values, l_len as usize);
            l.output_hash = Some(hash_tokens(&toks));
            self.at(now.saturating_add(dur), Ev::DecodeFinish, rid);
        } else {
            self.at(now.saturating_add(dur), Ev::DecodeBlock, rid);
        }
        Ok(())
    }

    pub(super) fn decode_finish(&mut self, rid: u64) -> Result<()> {
        let now = self.now;
        let l = self.live.get_mut(&rid).expect("live");
        let status = if l.dmode == DecodeMode::Stub {
            400
        } else {
            200
        };
        if status != 200 {
            l.output_hash = None;
        }
        // A normal finish inserts the prompt's prefix into the decode tree
        // (cache_finished_req, is_insert=True), whatever its pages hold.
        if self.cfg.decode_radix_cache
            && status == 200
            && l.dec_tree_pages == 0
            && let Some(g) = l.a.prefix_group
            && !self.dcache.contains_key(&g)
        {
            let k = l.a.prefix_tokens.min(l.dec_len) / self.dec_alloc.page_size();
            if k > 0 {
                l.dec_tree_pages = k;
                let pages = l.dec_pages[..k as usize].to_vec();
                self.dcache.insert(
                    g,
                    CacheEntry {
                        pages,
                        owner: rid,
                        locks: 0,
                        last_use: now,
                    },
                );
            }
        }
        l.decode_answer = Some((status, now));
        l.dstate = DecState::Done;
        self.decode_release(rid)?;
        self.maybe_row(rid)
    }

    pub(super) fn wait_timeout(&mut self, rid: u64) -> Result<()> {
        let Some(l) = self.live.get(&rid) else {
            return Ok(());
        };
        if l.dstate != DecState::Waiting {
            return Ok(());
        }
        self.decode_fail(rid, 500)
    }

    /// Decode fails the request (timeout, checksum): answers `status` now
    /// and releases its KV unread: at once, after the in-flight transfer
    /// drains, or after the deferred-release wait.
    pub(super) fn decode_fail(&mut self, rid: u64, status: u16) -> Result<()> {
        let now = self.now;
        let cfg = self.cfg;
        let l = self.live.get_mut(&rid).expect("live");
        l.decode_answer = Some((status, now));
        l.dstate = DecState::Failed;
        l.output_hash = None;
        if l.transfer_in_flight && !cfg.bug_inflight_reuse {
            l.release_on_land = true;
        } else if l.transfer_in_flight {
            // Sibling bug: freed while the transfer is still in flight.
            self.decode_release(rid)?;
        } else if cfg.deferred_release() {
            let wait = cfg
                .abort_ack_ms
                .unwrap_or(cfg.deferred_release_timeout_ms)
                .min(cfg.deferred_release_timeout_ms);
            self.at(later(now, wait, 1_000_000), Ev::DecodeRelease, rid);
        } else {
            self.decode_release(rid)?;
        }
        self.maybe_row(rid)
    }

    pub(super) fn decode_release(&mut self, rid: u64) -> Result<()> {
        let l = self.live.get_mut(&rid).expect("live");
        if l.dec_released {
            return Ok(());
        }
        l.dec_released = true;
        self.dec_reserved -= l.dec_reserve as u64;
        l.dec_reserve = 0;
        // Kept: a late (in-flight) transfer still targets these pages.
        let pages = l.dec_pages[l.dec_tree_pages as usize..].to_vec();
        if let Some(g) = l.dec_group_locked.take()
            && let Some(e) = self.dcache.get_mut(&g)
        {
            e.locks -= 1;
            e.last_use = self.now;
        }
        self.free(DECODE_POOL, rid, &pages)?;
        self.maybe_row(rid)
    }

    /// Writes the response row once the customer's answer is known, and
    /// drops the request (folding its reads into the truth) once both roles
    /// are done with it.
    pub(super) fn maybe_row(&mut self, rid: u64) -> Result<()> {
        let Some(l) = self.live.get(&rid) else {
            return Ok(()); // already complete
        };
        let answered = match (self.cfg.router, l.prefill_answer, l.decode_answer) {
            (RouterMode::PrefillError, Some((s, _)), _) if s >= 400 => true,
            (_, _, Some(_)) => true,
            _ => false,
        };
        if answered && !l.row_written {
            self.finish_row(rid)?;
        }
        let l = &self.live[&rid];
        if l.row_written && l.pf_released && l.dec_released && !l.transfer_in_flight {
            let l = self.live.remove(&rid).expect("live");
            let tenants = &self.tenants;
            let log = l.log;
            let names: BTreeMap<u64, String> = log
                .src_tenant
                .iter()
                .map(|(&r, &t)| (r, tenants[t as usize].clone()))
                .collect();
            self.truth
                .finish(rid, &l.a.tenant, l.status, log, |r| names[&r].clone());
        }
        Ok(())
    }

    pub(super) fn finish_row(&mut self, rid: u64) -> Result<()> {
        let cfg = self.cfg;
        let l = self.live.get_mut(&rid).expect("live");
        l.row_written = true;
        let front = l.front_reject;
        let (status, t) = match (cfg.router, l.prefill_answer, l.decode_answer) {
            (RouterMode::PrefillError, Some((s, t)), _) if s >= 400 => (s, t),
            (_, _, Some(x)) => x,
            (_, Some(x), None) => x,
            _ => unreachable!("finish_row without an answer"),
        };
        let prefilled = if front {
            None
        } else {
            Some(match l.pmode {
                PrefillMode::Full { tokens } if l.pf_done => tokens,
                PrefillMode::Placeholder { .. } if l.pf_done => 1,
                _ => 0,
            })
        };
        let ok = status == 200;
        l.status = status;
        let rec = RequestRecord {
            request_id: rid,
            external_id: l.a.external_id.clone(),
            tenant: l.a.tenant.clone(),
            arrival_ns: EPOCH_NS + l.a.arrival_ns,
            finish_ns: Some(EPOCH_NS + t),
            prompt_tokens: l.a.prompt_tokens,
            prefilled_tokens: prefilled,
            output_tokens: if ok { l.out_target } else { 0 },
            http_status: status,
            finish_reason: Some(
                match status {
                    200 => "stop",
                    400 => "abort",
                    _ => "error",
                }
                .into(),
            ),
            prefill_pool: (!front && l.pmode != PrefillMode::Idle).then_some(PREFILL_POOL),
            decode_pool: (!front).then_some(DECODE_POOL),
            prompt_hash: Some(l.hash),
            output_hash: if ok { l.output_hash } else { None },
        };
        self.rec.request(rec)?;
        self.stats.requests += 1;
        self.unreported += 1;
        if self.unreported >= 1024 {
            self.reporter.advance(self.unreported);
            self.unreported = 0;
        }
        Ok(())
    }
}
