//! The vLLM model's scheduler: the front end (a prompt of `max_model_len`
//! tokens or more answers 400), prefill (prefix hits `share`d, new blocks
//! `alloc`ed, the forward, `request_finished` holding the blocks under the
//! lease), decode admission (local hits, new blocks, the blocks its output
//! will need), the local prefill of `recompute`, decode steps and the
//! finish with its response row.

use std::collections::{BTreeMap, HashMap};

use super::server::{Engine, Ev, Hold, Live, RANGE_SALT, STALE_SALT, STRAGGLE_SALT, picked};
use crate::error::Result;
use crate::schema::{RequestRecord, hash_tokens};
use crate::sim::base::{DECODE_POOL, EPOCH_NS, PREFILL_POOL, later, span};
use crate::sim::model;
use crate::sim::truth::ReadLog;
use crate::sim::workload::Arrival;

impl Engine<'_> {
    pub(super) fn arrive(&mut self, a: Arrival) -> Result<()> {
        let cfg = self.cfg;
        let hash = a.prompt_hash();
        let tenant = self.tenant(&a.tenant);
        let rid = a.request_id;
        let ctx = cfg.context_window;
        let prompt = a.prompt_tokens as u64;
        if prompt >= ctx {
            // input_processor: a prompt of max_model_len tokens or more is
            // refused before the engine (HTTP 400).
            let rec = RequestRecord {
                request_id: rid,
                external_id: a.external_id.clone(),
                tenant: a.tenant.clone(),
                arrival_ns: EPOCH_NS + a.arrival_ns,
                finish_ns: Some(EPOCH_NS + self.now),
                prompt_tokens: a.prompt_tokens,
                prefilled_tokens: None,
                output_tokens: 0,
                http_status: 400,
                finish_reason: Some("abort".into()),
                prefill_pool: None,
                decode_pool: None,
                prompt_hash: Some(hash),
                output_hash: None,
            };
            self.rec.request(rec)?;
            self.stats.requests += 1;
            self.truth
                .finish(rid, &a.tenant, 400, ReadLog::default(), |_| String::new());
            return self.reported();
        }
        let len = a.prompt_tokens;
        // max_tokens is clamped to what max_model_len leaves.
        let room = (ctx - prompt) as u32;
        let out_target = a.output_tokens.clamp(1, room.max(1));
        let keys = self.keys(&a, tenant, len);
        let live = Live {
            hash,
            seed: model::seed(&hash),
            tenant,
            len,
            out_target,
            keys,
            p_hits: 0,
            p_loaded: 0,
            p_hit_owner: Vec::new(),
            ref_rid: rid,
            ref_blocks: Vec::new(),
            out_of_range: false,
            d_table: Vec::new(),
            d_hits: 0,
            d_own: Vec::new(),
            d_reserve: 0,
            d_slots: Vec::new(),
            recompute: false,
            rewind: false,
            generated: 0,
            output_hash: None,
            grants: HashMap::new(),
            log: ReadLog::default(),
            a,
        };
        self.live.insert(rid, live);
        self.p_queue.push_back(rid);
        Ok(())
    }

    pub(super) fn schedule(&mut self) -> Result<()> {
        while let Some(&rid) = self.d_queue.front() {
            if !self.try_decode(rid)? {
                break;
            }
            self.d_queue.pop_front();
        }
        while !self.p_busy {
            let Some(&rid) = self.p_queue.front() else {
                break;
            };
            if !self.try_prefill(rid)? {
                break;
            }
            self.p_queue.pop_front();
        }
        Ok(())
    }

    /// Prefill admission: prefix hits (at most prompt - 1 tokens, whole
    /// blocks), then new blocks for the rest; waits while the pool (held
    /// leases included) cannot give them.
    pub(super) fn try_prefill(&mut self, rid: u64) -> Result<bool> {
        let bs = self.bs();
        let (len, hits, keys) = {
            let l = &self.live[&rid];
            let max_hit = ((l.len - 1) / bs) as usize;
            let keys = l.keys[..max_hit.min(l.keys.len())].to_vec();
            (l.len, self.p.lookup(&keys), keys)
        };
        // LMCache: the leading chunks the store holds, past the local hit.
        let loaded = self.lmc.as_ref().map_or(0, |t| {
            (t.lookup(&keys) * t.unit as usize)
                .min(keys.len())
                .saturating_sub(hits.len())
        });
        let need = (len.div_ceil(bs) as usize) - hits.len();
        if self.p.free.len() - self.p.idle(&hits) < need {
            return Ok(false);
        }
        self.p.touch(&hits);
        let mut owners = Vec::with_capacity(hits.len() + loaded);
        let mut granted = Vec::with_capacity(hits.len());
        for (i, &b) in hits.iter().enumerate() {
            if self.p.blocks[b as usize].ungranted {
                owners.push(super::tier::NO_OWNER);
            } else {
                owners.push(self.pf_state.owner[(b * bs) as usize]);
                granted.push((i as u32 * bs, b));
            }
        }
        self.grant_blocks(PREFILL_POOL, rid, &granted)?;
        let new = self.p.get_new(need).expect("counted");
        self.alloc(PREFILL_POOL, rid, &new)?;
        if loaded > 0 {
            let pool = crate::sim::base::LMCACHE_POOL;
            let dst = (PREFILL_POOL, &new[..loaded]);
            let got = self.tier_load(pool, rid, &keys, hits.len(), dst)?;
            owners.extend(got.owners);
        }
        let t = &self.cfg.timing;
        let done = (hits.len() + loaded) as u32;
        let computed = (len - done * bs) as u64;
        let dur =
            span(t.prefill_base_us, 1000).saturating_add(span(computed, t.prefill_ns_per_token));
        let l = self.live.get_mut(&rid).expect("live");
        l.p_hits = done;
        l.p_loaded = loaded as u32;
        l.p_hit_owner = owners;
        let mut table = hits;
        table.extend_from_slice(&new);
        l.ref_blocks = table;
        self.p_busy = true;
        let now = self.now;
        self.at(now.saturating_add(dur), Ev::PrefillDone, rid);
        Ok(true)
    }

    /// The forward ends: the prompt's KV is written and read, its full
    /// blocks are cached, and the request finishes (LENGTH, one token):
    /// `request_finished` holds the blocks for decode under the lease and
    /// the proxy hands decode the reference.
    pub(super) fn prefill_done(&mut self, rid: u64) -> Result<()> {
        self.p_busy = false;
        let bs = self.bs();
        let (len, hits, loaded, table, keys) = {
            let l = &self.live[&rid];
            let k = l.keys.clone();
            (l.len, l.p_hits, l.p_loaded, l.ref_blocks.clone(), k)
        };
        let slots = self.table_slots(&table, len);
        self.write(PREFILL_POOL, rid, &slots[(hits * bs) as usize..], hits * bs)?;
        self.read(PREFILL_POOL, rid, &slots, false)?;
        for (i, k) in keys.iter().enumerate() {
            self.p.cache(table[i], *k);
        }
        self.lmcache_store(PREFILL_POOL, &table, &keys)?;
        let now = self.now;
        let lease = self.cfg.lease_s();
        let expiry = later(now, lease, 1_000_000_000);
        self.holds.insert(
            rid,
            Hold {
                own: table[(hits - loaded) as usize..].to_vec(),
                table: table.clone(),
                expiry,
                hb_start: None,
            },
        );
        self.at(expiry, Ev::LeaseCheck, rid);
        // The reference decode gets: its own, or (sibling bug) an earlier
        // consumed one at least as long (a shorter one trips the block
        // count assertion in `_apply_prefix_caching`).
        let nblocks = len.div_ceil(bs) as usize;
        let stale = if picked(
            rid,
            STALE_SALT,
            self.cfg.bug_stale_reference_ppm.unwrap_or(0),
        ) {
            self.last_consumed
                .as_ref()
                .filter(|(_, b)| b.len() >= nblocks)
                .cloned()
        } else {
            None
        };
        let (ref_rid, mut ref_blocks) = stale.unwrap_or((rid, table));
        // Sibling bug: the reference's second half of blocks (all of a
        // one-block reference) names ids past the producer's last block.
        let out_of_range = picked(rid, RANGE_SALT, self.cfg.bug_out_of_range_ppm.unwrap_or(0));
        if out_of_range {
            let n = self.p.blocks.len() as u32;
            let half = ref_blocks.len() / 2;
            for b in &mut ref_blocks[half..] {
                *b = b.saturating_add(n);
            }
        }
        // Decode's `on_new_request` starts heartbeats for the reference.
        if !self.cfg.bug_lease_expiry.unwrap_or(false)
            && let Some(h) = self.holds.get_mut(&ref_rid)
        {
            h.hb_start = Some(now);
        }
        let l = self.live.get_mut(&rid).expect("live");
        l.ref_rid = ref_rid;
        l.ref_blocks = ref_blocks;
        l.out_of_range = out_of_range;
        self.d_queue.push_back(rid);
        Ok(())
    }

    /// Decode admission: local prefix hits, new blocks for the rest of the
    /// prompt, and the blocks its output will need (the model reserves them
    /// at admission instead of preempting). Then the pull, or with
    /// `recompute` a local prefill.
    pub(super) fn try_decode(&mut self, rid: u64) -> Result<bool> {
        let bs = self.bs();
        let (len, out, hits, recompute, keys) = {
            let l = &self.live[&rid];
            let max_hit = ((l.len - 1) / bs) as usize;
            let keys = l.keys[..max_hit.min(l.keys.len())].to_vec();
            (l.len, l.out_target, self.d.lookup(&keys), l.recompute, keys)
        };
        let nblocks = len.div_ceil(bs) as usize;
        let need = nblocks - hits.len();
        let out_blocks = ((len + out).div_ceil(bs) as usize).saturating_sub(nblocks);
        let avail = self.d.free.len() - self.d.idle(&hits);
        if (avail as u64) < self.d_reserved + (need + out_blocks) as u64 {
            return Ok(false);
        }
        self.d.touch(&hits);
        let granted: Vec<(u32, u32)> = (hits.iter().enumerate())
            .filter(|(_, b)| !self.d.blocks[**b as usize].ungranted)
            .map(|(i, &b)| (i as u32 * bs, b))
            .collect();
        self.grant_blocks(DECODE_POOL, rid, &granted)?;
        let new = self.d_get_new(need)?.expect("counted");
        self.alloc(DECODE_POOL, rid, &new)?;
        // The CPU tier: the blocks past the local hit that it holds (looked
        // up once the blocks it stored for this allocation are in).
        let loaded = self
            .cpu
            .as_ref()
            .map_or(0, |t| t.lookup(&keys[hits.len()..]));
        if loaded > 0 {
            let dst = (DECODE_POOL, &new[..loaded]);
            self.tier_load(crate::sim::base::CPU_POOL, rid, &keys, hits.len(), dst)?;
            for (i, &b) in new[..loaded].iter().enumerate() {
                self.d.cache(b, keys[hits.len() + i]);
            }
        }
        self.d_reserved += out_blocks as u64;
        let hits_len = hits.len() + loaded;
        let mut table = hits.clone();
        table.extend_from_slice(&new);
        let d_slots = self.table_slots(&table, len);
        {
            let l = self.live.get_mut(&rid).expect("live");
            l.d_hits = hits_len as u32;
            l.d_table = table;
            l.d_own = new.clone();
            l.d_reserve = out_blocks as u32;
            l.d_slots = d_slots;
        }
        let t = &self.cfg.timing;
        let now = self.now;
        if recompute {
            let computed = (len - hits_len as u32 * bs) as u64;
            let dur = span(t.prefill_base_us, 1000)
                .saturating_add(span(computed, t.prefill_ns_per_token));
            self.at(now.saturating_add(dur), Ev::LocalPrefillDone, rid);
        } else {
            let mut dur = span(t.transfer_base_us, 1000)
                .saturating_add(span(new.len() as u64, t.transfer_ns_per_page));
            if picked(rid, STRAGGLE_SALT, t.straggler_ppm) {
                dur = dur.saturating_add(span(t.straggler_delay_ms, 1_000_000));
            }
            self.at(now.saturating_add(dur), Ev::TransferLand, rid);
        }
        Ok(true)
    }

    pub(super) fn local_prefill_done(&mut self, rid: u64) -> Result<()> {
        let bs = self.bs();
        let (slots, hits, len, table, keys) = {
            let l = &self.live[&rid];
            (
                l.d_slots.clone(),
                l.d_hits,
                l.len,
                l.d_table.clone(),
                l.keys.clone(),
            )
        };
        self.write(DECODE_POOL, rid, &slots[(hits * bs) as usize..], hits * bs)?;
        for (i, k) in keys.iter().enumerate().skip(hits as usize) {
            self.d.cache(table[i], *k);
        }
        debug_assert!(slots.len() == len as usize);
        let now = self.now;
        self.at(now, Ev::Step, rid);
        Ok(())
    }

    /// One decode block: new blocks at block boundaries (reserved at
    /// admission), write the block's positions, read the whole context.
    pub(super) fn step(&mut self, rid: u64) -> Result<()> {
        let bs = self.bs();
        let block = self.cfg.timing.decode_block_tokens;
        let (len, generated, target, rewind) = {
            let l = &self.live[&rid];
            (l.len, l.generated, l.out_target, l.rewind)
        };
        if rewind {
            let s = self.live[&rid].d_slots[(len - 1) as usize];
            self.write(DECODE_POOL, rid, &[s], len - 1)?;
            self.live.get_mut(&rid).expect("live").rewind = false;
        }
        let j1 = (generated + block).min(target);
        for p in len + generated..len + j1 {
            if (p / bs) as usize >= self.live[&rid].d_table.len() {
                let b = self
                    .d_get_new(1)?
                    .expect("decode blocks are reserved at admission")[0];
                self.alloc(DECODE_POOL, rid, &[b])?;
                self.d_reserved -= 1;
                let l = self.live.get_mut(&rid).expect("live");
                l.d_reserve -= 1;
                l.d_table.push(b);
                l.d_own.push(b);
            }
            let l = self.live.get_mut(&rid).expect("live");
            let s = l.d_table[(p / bs) as usize] * bs + p % bs;
            l.d_slots.push(s);
        }
        let wslots =
            self.live[&rid].d_slots[(len + generated) as usize..(len + j1) as usize].to_vec();
        self.write(DECODE_POOL, rid, &wslots, len + generated)?;
        let ctx = self.live[&rid].d_slots[..(len + j1) as usize].to_vec();
        let last = j1 == target;
        let values = self.read(DECODE_POOL, rid, &ctx, last)?;
        let dur = span(
            (j1 - generated) as u64,
            self.cfg.timing.decode_step_us.saturating_mul(1000),
        );
        let now = self.now;
        let l = self.live.get_mut(&rid).expect("live");
        l.generated = j1;
        if last {
            let toks = model::output_tokens(&values, len as usize);
            l.output_hash = Some(hash_tokens(&toks));
            self.at(now.saturating_add(dur), Ev::Finish, rid);
        } else {
            self.at(now.saturating_add(dur), Ev::Step, rid);
        }
        Ok(())
    }

    /// Frees the request's decode blocks (its own get `free` events) and
    /// its remaining reservation.
    pub(super) fn drop_decode(&mut self, rid: u64) -> Result<()> {
        let (own, table, reserve) = {
            let l = self.live.get_mut(&rid).expect("live");
            let r = l.d_reserve;
            l.d_reserve = 0;
            (
                std::mem::take(&mut l.d_own),
                std::mem::take(&mut l.d_table),
                r,
            )
        };
        self.d_reserved -= reserve as u64;
        self.free_events(DECODE_POOL, rid, &own)?;
        self.d.free(&table);
        Ok(())
    }

    /// The request ends on decode with `status`; writes its response row
    /// and folds its reads into the truth.
    pub(super) fn finish(&mut self, rid: u64, status: u16) -> Result<()> {
        let bs = self.bs();
        if status == 200 {
            // Full blocks of the finished sequence carry hashes (LRU).
            let (n, table) = {
                let l = &self.live[&rid];
                ((l.len + l.out_target) / bs, l.d_table.clone())
            };
            if self.cfg.prefix_cache {
                for &b in table.iter().take(n as usize) {
                    self.d.cache(b, None);
                }
            }
            let keys = self.live[&rid].keys.clone();
            self.lmcache_store(DECODE_POOL, &table, &keys)?;
        } else {
            let r = self.live[&rid].ref_rid;
            self.stop_heartbeat(r);
        }
        self.drop_decode(rid)?;
        let l = self.live.remove(&rid).expect("live");
        let ok = status == 200;
        let output_hash = if ok { l.output_hash } else { None };
        let rec = RequestRecord {
            request_id: rid,
            external_id: l.a.external_id.clone(),
            tenant: l.a.tenant.clone(),
            arrival_ns: EPOCH_NS + l.a.arrival_ns,
            finish_ns: Some(EPOCH_NS + self.now),
            prompt_tokens: l.a.prompt_tokens,
            prefilled_tokens: Some(l.len),
            output_tokens: if ok { l.out_target } else { 0 },
            http_status: status,
            finish_reason: Some(if ok { "stop" } else { "error" }.into()),
            prefill_pool: Some(PREFILL_POOL),
            decode_pool: Some(DECODE_POOL),
            prompt_hash: Some(l.hash),
            output_hash,
        };
        self.rec.request(rec)?;
        self.stats.requests += 1;
        let tenants = &self.tenants;
        let names: BTreeMap<u64, String> = l
            .log
            .src_tenant
            .iter()
            .map(|(&r, &t)| (r, tenants[t as usize].clone()))
            .collect();
        self.truth
            .finish(rid, &l.a.tenant, status, l.log, |r| names[&r].clone());
        self.reported()
    }

    pub(super) fn reported(&mut self) -> Result<()> {
        self.unreported += 1;
        if self.unreported >= 1024 {
            self.reporter.advance(self.unreported);
            self.unreported = 0;
        }
        Ok(())
    }
}
