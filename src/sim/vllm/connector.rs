//! The vLLM model's NixlConnector (pull): decode's heartbeats, the
//! producer's lease reaper, the pull itself (a `write` with src on the
//! decode pool per run of blocks, end aligned as `_apply_prefix_caching`
//! pairs them; the fail-open paths of vllm-project/vllm#52234 and
//! `reference_check`) and a failed load under `kv_load_failure_policy`.

use super::server::{Engine, Ev, FAIL_SALT, GARBAGE, picked};
use crate::error::Result;
use crate::schema::{CopySrc, Op};
use crate::sim::base::{DECODE_POOL, PREFILL_POOL, later, span};
use crate::sim::config::FailurePolicy;
use crate::sim::model;

impl Engine<'_> {
    /// Stops decode's heartbeats for reference `r`.
    pub(super) fn stop_heartbeat(&mut self, r: u64) {
        if let Some(h) = self.holds.get_mut(&r) {
            h.hb_start = None;
        }
    }

    /// The producer releases a hold (notification or lease expiry).
    pub(super) fn release_hold(&mut self, r: u64) -> Result<Option<Vec<u32>>> {
        let Some(h) = self.holds.remove(&r) else {
            return Ok(None);
        };
        self.free_events(PREFILL_POOL, r, &h.own)?;
        self.p.free(&h.table);
        Ok(Some(h.table))
    }

    /// The producer's lease reaper (`_reap_expired_send_leases`): a hold
    /// whose lease ran out is released; heartbeats (`lease // 6` seconds
    /// apart, each extending to `now + lease * 2 // 3`) push it on while
    /// decode sends them.
    pub(super) fn lease_check(&mut self, r: u64) -> Result<()> {
        let now = self.now;
        let lease = self.cfg.lease_s();
        let Some(h) = self.holds.get_mut(&r) else {
            return Ok(());
        };
        if now < h.expiry {
            let t = h.expiry;
            self.at(t, Ev::LeaseCheck, r);
            return Ok(());
        }
        if let Some(t0) = h.hb_start {
            let interval = span(lease / 6, 1_000_000_000);
            let last_hb = if interval == 0 {
                now
            } else {
                t0 + (now - t0) / interval * interval
            };
            let extended = later(last_hb, lease * 2 / 3, 1_000_000_000).max(h.expiry);
            if extended > now {
                h.expiry = extended;
                self.at(extended, Ev::LeaseCheck, r);
                return Ok(());
            }
        }
        self.release_hold(r)?;
        Ok(())
    }

    /// The pull completes. NIXL reports it done unless the transfer
    /// failed; a reference the producer no longer holds is read as it is
    /// (vllm-project/vllm#52234), unless `reference_check` fails it.
    pub(super) fn transfer_land(&mut self, rid: u64) -> Result<()> {
        let bs = self.bs();
        let (ref_rid, ref_blocks, d_table, d_hits, len, out_of_range) = {
            let l = &self.live[&rid];
            (
                l.ref_rid,
                l.ref_blocks.clone(),
                l.d_table.clone(),
                l.d_hits,
                l.len,
                l.out_of_range,
            )
        };
        self.stop_heartbeat(ref_rid);
        let held = self.holds.contains_key(&ref_rid);
        let failed = picked(rid, FAIL_SALT, self.cfg.transfer_failure_ppm.unwrap_or(0))
            || ((!held || out_of_range) && self.cfg.reference_check.unwrap_or(false));
        if failed {
            return self.load_failed(rid);
        }
        // Local block i reads remote block len(R) - len(L) + i.
        let local = &d_table[d_hits as usize..];
        let off = ref_blocks.len() - local.len();
        let remote = &ref_blocks[off..];
        let src_seq = self.rec.next_seq(PREFILL_POOL)?.saturating_sub(1);
        let src_slots = self.pf_state.owner.len() as u64;
        let mut i = 0;
        while i < local.len() {
            let mut j = i + 1;
            while j < local.len() && local[j] == local[j - 1] + 1 && remote[j] == remote[j - 1] + 1
            {
                j += 1;
            }
            let count = (j - i) as u32 * bs;
            let src0 = remote[i] as u64 * bs as u64;
            if src0 + count as u64 > src_slots {
                // Out of the producer's pool: NIXL reads memory of no
                // request and reports the read done. The hook's run names
                // source slots past the pool; the sidecar records it as one
                // lost event of the decode pool (a hole), never a copy.
                self.rec.lose(DECODE_POOL, 1)?;
                for k in 0..count as u64 {
                    let d = (local[i] * bs) as usize + k as usize;
                    let st = &mut self.dec_state;
                    if src0 + k < src_slots {
                        st.copy_from(d, &self.pf_state, (src0 + k) as usize);
                    } else {
                        st.owner[d] = GARBAGE;
                        st.seed[d] = model::mix64(GARBAGE ^ (src0 + k));
                        st.pos[d] = 0;
                        st.tenant[d] = u32::MAX;
                        st.current[d] = true;
                        st.wgen[d] = st.wgen[d].wrapping_add(1);
                    }
                }
                i = j;
                continue;
            }
            self.emit(
                DECODE_POOL,
                rid,
                Op::Write,
                (local[i] * bs, count),
                Some((d_hits + i as u32) * bs),
                Some(CopySrc {
                    pool: PREFILL_POOL,
                    slot_start: remote[i] * bs,
                    seq: src_seq,
                }),
            )?;
            for k in 0..count {
                let s = (remote[i] * bs + k) as usize;
                let d = (local[i] * bs + k) as usize;
                self.dec_state.copy_from(d, &self.pf_state, s);
            }
            i = j;
        }
        // The notification releases the producer's blocks (a reference it
        // no longer holds is only logged there).
        if let Some(table) = self.release_hold(ref_rid)? {
            self.last_consumed = Some((ref_rid, table));
        }
        // `_update_waiting_for_remote_kv` caches the loaded blocks.
        let keys = self.live[&rid].keys.clone();
        for (i, k) in keys.iter().enumerate().skip(d_hits as usize) {
            self.d.cache(d_table[i], *k);
        }
        // The prefill-side prefix hit covered KV another request wrote:
        // share the decode slots that hold it, at its positions.
        let (p_hits, owners, slots) = {
            let l = &self.live[&rid];
            (l.p_hits, l.p_hit_owner.clone(), l.d_slots.clone())
        };
        let mut granted: Vec<(u32, u32)> = Vec::new();
        for p in d_hits * bs..(p_hits * bs).min(len) {
            let s = slots[p as usize];
            let su = s as usize;
            let w = owners[(p / bs) as usize];
            if w != rid && self.dec_state.owner[su] == w && self.dec_state.pos[su] == p {
                granted.push((p, s));
            }
        }
        let mut i = 0;
        while i < granted.len() {
            let mut j = i + 1;
            while j < granted.len() && granted[j].0 == granted[j - 1].0 + 1 {
                j += 1;
            }
            let run: Vec<u32> = granted[i..j].iter().map(|x| x.1).collect();
            self.grant(DECODE_POOL, rid, &run, granted[i].0)?;
            i = j;
        }
        // The whole prompt arrived: the last prompt token is recomputed.
        self.live.get_mut(&rid).expect("live").rewind = true;
        let now = self.now;
        self.at(now, Ev::Step, rid);
        Ok(())
    }

    /// `failed_recving` on a request waiting for remote KV.
    pub(super) fn load_failed(&mut self, rid: u64) -> Result<()> {
        match self.cfg.failure_policy() {
            FailurePolicy::Fail => self.finish(rid, 500),
            FailurePolicy::Recompute => {
                // num_computed_tokens = 0: the blocks are freed and the
                // request is scheduled again (a local hit may serve part).
                self.drop_decode(rid)?;
                self.live.get_mut(&rid).expect("live").recompute = true;
                self.d_queue.push_front(rid);
                Ok(())
            }
        }
    }
}
