//! The vLLM model's state and its bookkeeping: the requests in flight
//! ([`Live`]), the producer's holds on finished prefills ([`Hold`]), the
//! two block pools and their per-slot content, the event queue and the
//! clock. [`Engine::run`] is the event loop; the KV primitives here
//! (`alloc`, `write`, `free_events`, `read`, `grant`) record one event per
//! contiguous run and keep the slot state and the truth in step with it.
//! The request path that calls them is in `scheduler` and `connector`.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};

use super::block_pool::BlockPool;
use super::tier::Tier;
use crate::capture::Recorder;
use crate::error::Result;
use crate::progress::Reporter;
use crate::schema::{CopySrc, KvEvent, Op};
use crate::sim::base::{
    CPU_POOL, DECODE_POOL, EPOCH_NS, LMCACHE_POOL, PREFILL_POOL, RunStats, Slots, clock_checked,
};
use crate::sim::config::{CacheSalt, SimConfig};
use crate::sim::model;
use crate::sim::truth::{ReadLog, TruthBuilder};
use crate::sim::workload::Arrival;

/// The producer's hold on a finished prefill request's blocks.
pub(super) struct Hold {
    /// The request's block table (hits included: their references too).
    pub(super) table: Vec<u32>,
    /// Blocks the request allocated (its `free` events).
    pub(super) own: Vec<u32>,
    pub(super) expiry: i64,
    /// First heartbeat from decode, while decode's heartbeats flow.
    pub(super) hb_start: Option<i64>,
}

pub(super) struct Live {
    pub(super) a: Arrival,
    pub(super) hash: [u8; 32],
    pub(super) seed: u64,
    pub(super) tenant: u32,
    pub(super) len: u32,
    pub(super) out_target: u32,
    /// Hash key of each full prompt block (None: no other prompt has it).
    pub(super) keys: Vec<Option<u64>>,
    pub(super) p_hits: u32,
    /// Of `p_hits`, the blocks loaded from the LMCache store (allocated
    /// by the request itself).
    pub(super) p_loaded: u32,
    /// Content owner of each prefill hit block at the hit.
    pub(super) p_hit_owner: Vec<u64>,
    /// The producer reference decode was handed: request and block table.
    pub(super) ref_rid: u64,
    pub(super) ref_blocks: Vec<u32>,
    /// The reference names blocks past the end of the producer's pool.
    pub(super) out_of_range: bool,
    pub(super) d_table: Vec<u32>,
    pub(super) d_hits: u32,
    pub(super) d_own: Vec<u32>,
    pub(super) d_reserve: u32,
    pub(super) d_slots: Vec<u32>,
    /// The decode side prefills the prompt itself (`recompute` after a
    /// failed load).
    pub(super) recompute: bool,
    pub(super) rewind: bool,
    pub(super) generated: u32,
    pub(super) output_hash: Option<[u8; 32]>,
    pub(super) grants: HashMap<(u16, u32), (u32, bool)>,
    pub(super) log: ReadLog,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Ev {
    PrefillDone,
    TransferLand,
    LocalPrefillDone,
    Step,
    Finish,
    LeaseCheck,
}

pub(crate) struct Engine<'a> {
    pub(super) cfg: &'a SimConfig,
    pub(super) rec: &'a mut Recorder,
    pub(super) reporter: &'a dyn Reporter,
    pub(super) unreported: u64,
    pub(super) now: i64,
    pub(super) p: BlockPool,
    pub(super) d: BlockPool,
    pub(super) pf_state: Slots,
    pub(super) dec_state: Slots,
    /// The decode instance's CPU tier (`cpu_offload_tokens`).
    pub(super) cpu: Option<Tier>,
    /// The LMCache store both instances share (`lmcache_tokens`).
    pub(super) lmc: Option<Tier>,
    pub(super) live: HashMap<u64, Live>,
    pub(super) holds: BTreeMap<u64, Hold>,
    /// The latest reference whose transfer consumed it (the producer
    /// released its blocks on decode's notification).
    pub(super) last_consumed: Option<(u64, Vec<u32>)>,
    pub(super) heap: BinaryHeap<Reverse<(i64, u64, Ev, u64)>>,
    pub(super) ctr: u64,
    pub(super) p_queue: VecDeque<u64>,
    pub(super) p_busy: bool,
    pub(super) d_queue: VecDeque<u64>,
    pub(super) d_reserved: u64,
    pub(super) tenants: Vec<String>,
    pub(super) tenant_ix: HashMap<String, u32>,
    pub truth: TruthBuilder,
    pub stats: RunStats,
}

/// Salts of the bug and failure triggers (per request, deterministic).
pub(super) const STALE_SALT: u64 = 0x5A1E_4EF0_52E3_4A11;
pub(super) const FAIL_SALT: u64 = 0xFA11_0AD5_0B1E_C7ED;
pub(super) const STRAGGLE_SALT: u64 = 0x57A6_61E5;
pub(super) const RANGE_SALT: u64 = 0x0B0B_4A96_E0FF_5E75;

/// Content owner of a slot a load filled from outside the source pool:
/// KV of no request (above `trace::read::MAX_REQUEST_ID`, so no request
/// has this id).
pub(super) const GARBAGE: u64 = u64::MAX;

pub(super) fn picked(rid: u64, salt: u64, ppm: u32) -> bool {
    ppm > 0 && model::mix64(rid ^ salt) % 1_000_000 < ppm as u64
}

impl<'a> Engine<'a> {
    pub fn new(cfg: &'a SimConfig, rec: &'a mut Recorder, reporter: &'a dyn Reporter) -> Self {
        let bs = cfg.block_size();
        let p = BlockPool::new(
            (cfg.prefill.capacity_tokens / bs as u64) as u32,
            bs,
            cfg.prefix_cache,
        );
        let mut d = BlockPool::new(
            (cfg.decode.capacity_tokens / bs as u64) as u32,
            bs,
            cfg.prefix_cache,
        );
        let cpu = cfg.cpu_offload_tokens.map(|t| {
            let ppm = cfg.bug_stale_cpu_offload_ppm.unwrap_or(0);
            Tier::new(CPU_POOL, t, bs, 1, ppm)
        });
        d.track_evictions = cpu.is_some() && cfg.prefix_cache;
        let lmc = cfg.lmcache_tokens.map(|t| {
            let ppm = cfg.bug_stale_lmcache_ppm.unwrap_or(0);
            Tier::new(LMCACHE_POOL, t, bs, cfg.lmcache_chunk() / bs, ppm)
        });
        Engine {
            cpu,
            lmc,
            pf_state: Slots::new(p.slot_space()),
            dec_state: Slots::new(d.slot_space()),
            p,
            d,
            cfg,
            rec,
            reporter,
            unreported: 0,
            now: 0,
            live: HashMap::new(),
            holds: BTreeMap::new(),
            last_consumed: None,
            heap: BinaryHeap::new(),
            ctr: 0,
            p_queue: VecDeque::new(),
            p_busy: false,
            d_queue: VecDeque::new(),
            d_reserved: 0,
            tenants: Vec::new(),
            tenant_ix: HashMap::new(),
            truth: TruthBuilder::default(),
            stats: RunStats::default(),
        }
    }

    pub fn run(&mut self, arrivals: impl IntoIterator<Item = Arrival>) -> Result<()> {
        let mut arrivals = arrivals.into_iter().peekable();
        loop {
            let next_arrival = arrivals.peek().map(|a| a.arrival_ns.max(self.now));
            let next_event = self.heap.peek().map(|Reverse((t, ..))| *t);
            match (next_arrival, next_event) {
                (None, None) => break,
                (Some(ta), te) if te.is_none_or(|te| ta <= te) => {
                    let a = arrivals.next().expect("peeked");
                    self.now = clock_checked(ta, Some(a.request_id))?;
                    self.arrive(a)?;
                }
                _ => {
                    let Reverse((t, _, ev, id)) = self.heap.pop().expect("peeked");
                    self.now = clock_checked(t, Some(id))?;
                    self.handle(ev, id)?;
                }
            }
            self.schedule()?;
        }
        if !self.live.is_empty() || !self.holds.is_empty() {
            let mut ids: Vec<u64> = self.live.keys().chain(self.holds.keys()).copied().collect();
            ids.sort_unstable();
            return Err(crate::error::Error::Other(format!(
                "engine model bug: {} requests never completed (first {})",
                ids.len(),
                ids[0]
            )));
        }
        self.reporter.advance(self.unreported);
        self.unreported = 0;
        self.stats.sim_end_ns = self.now;
        self.stats.kv_events = self.rec.stats().kv_events;
        Ok(())
    }

    pub(super) fn at(&mut self, t: i64, ev: Ev, id: u64) {
        self.ctr += 1;
        self.heap.push(Reverse((t, self.ctr, ev, id)));
    }

    pub(super) fn handle(&mut self, ev: Ev, rid: u64) -> Result<()> {
        match ev {
            Ev::PrefillDone => self.prefill_done(rid),
            Ev::TransferLand => self.transfer_land(rid),
            Ev::LocalPrefillDone => self.local_prefill_done(rid),
            Ev::Step => self.step(rid),
            Ev::Finish => self.finish(rid, 200),
            Ev::LeaseCheck => self.lease_check(rid),
        }
    }

    pub(super) fn emit(
        &mut self,
        pool: u16,
        rid: u64,
        op: Op,
        (start, count): (u32, u32),
        pos: Option<u32>,
        src: Option<CopySrc>,
    ) -> Result<u64> {
        self.rec.kv(KvEvent {
            pool,
            seq: 0,
            ts_ns: EPOCH_NS + self.now,
            request_id: rid,
            op,
            slot_start: start,
            slot_count: count,
            token_pos: pos,
            src,
        })
    }

    pub(super) fn emit_runs(
        &mut self,
        pool: u16,
        rid: u64,
        op: Op,
        slots: &[u32],
        pos0: Option<u32>,
    ) -> Result<()> {
        for (offset, extent) in crate::sim::base::slot_runs(slots) {
            self.emit(pool, rid, op, extent, pos0.map(|p| p + offset), None)?;
        }
        Ok(())
    }

    pub(super) fn bs(&self) -> u32 {
        self.p.bs
    }

    pub(super) fn block_slots(&self, blocks: &[u32]) -> Vec<u32> {
        let bs = self.bs();
        blocks.iter().flat_map(|&b| b * bs..(b + 1) * bs).collect()
    }

    /// Slots of positions `0..n` of a block table.
    pub(super) fn table_slots(&self, table: &[u32], n: u32) -> Vec<u32> {
        let bs = self.bs();
        (0..n)
            .map(|p| table[(p / bs) as usize] * bs + p % bs)
            .collect()
    }

    pub(super) fn state_mut(&mut self, pool: u16) -> &mut Slots {
        match pool {
            PREFILL_POOL => &mut self.pf_state,
            DECODE_POOL => &mut self.dec_state,
            _ => &mut self.tier_mut(pool).slots,
        }
    }

    pub(super) fn state(&self, pool: u16) -> &Slots {
        match pool {
            PREFILL_POOL => &self.pf_state,
            DECODE_POOL => &self.dec_state,
            _ => &self.tier(pool).slots,
        }
    }

    /// The block pool of an instance.
    pub(super) fn pool_of(&mut self, pool: u16) -> &mut BlockPool {
        if pool == PREFILL_POOL {
            &mut self.p
        } else {
            &mut self.d
        }
    }

    pub(super) fn alloc(&mut self, pool: u16, rid: u64, blocks: &[u32]) -> Result<()> {
        let slots = self.block_slots(blocks);
        self.emit_runs(pool, rid, Op::Alloc, &slots, None)?;
        let st = self.state_mut(pool);
        for s in slots {
            st.current[s as usize] = false;
        }
        Ok(())
    }

    pub(super) fn write(&mut self, pool: u16, rid: u64, slots: &[u32], pos0: u32) -> Result<()> {
        self.emit_runs(pool, rid, Op::Write, slots, Some(pos0))?;
        let (seed, tenant) = {
            let l = &self.live[&rid];
            (l.seed, l.tenant)
        };
        let st = self.state_mut(pool);
        for (i, &s) in slots.iter().enumerate() {
            let s = s as usize;
            st.owner[s] = rid;
            st.seed[s] = seed;
            st.pos[s] = pos0 + i as u32;
            st.tenant[s] = tenant;
            st.wgen[s] = st.wgen[s].wrapping_add(1);
            st.current[s] = true;
        }
        Ok(())
    }

    /// `free` events for the blocks `rid` allocated (their content stays).
    pub(super) fn free_events(&mut self, pool: u16, rid: u64, own: &[u32]) -> Result<()> {
        if own.is_empty() {
            return Ok(());
        }
        let mut sorted = own.to_vec();
        sorted.sort_unstable();
        let slots = self.block_slots(&sorted);
        self.emit_runs(pool, rid, Op::Free, &slots, None)
    }

    pub(super) fn grant(&mut self, pool: u16, rid: u64, slots: &[u32], pos0: u32) -> Result<()> {
        if slots.is_empty() {
            return Ok(());
        }
        self.emit_runs(pool, rid, Op::Share, slots, Some(pos0))?;
        let st = if pool == PREFILL_POOL {
            &self.pf_state
        } else {
            &self.dec_state
        };
        let gens: Vec<((u16, u32), (u32, bool))> = slots
            .iter()
            .map(|&s| ((pool, s), (st.wgen[s as usize], st.current[s as usize])))
            .collect();
        self.live.get_mut(&rid).expect("live").grants.extend(gens);
        Ok(())
    }

    /// Reads slots for `rid`, classifying each for the truth (as the SGLang
    /// model does); returns the model values when asked.
    pub(super) fn read(
        &mut self,
        pool: u16,
        rid: u64,
        slots: &[u32],
        want: bool,
    ) -> Result<Vec<u64>> {
        self.emit_runs(pool, rid, Op::Read, slots, Some(0))?;
        let st = if pool == PREFILL_POOL {
            &self.pf_state
        } else {
            &self.dec_state
        };
        let live = self.live.get_mut(&rid).expect("live reader");
        let mut values = Vec::with_capacity(if want { slots.len() } else { 0 });
        for &s in slots {
            let su = s as usize;
            let owner = st.owner[su];
            if owner == GARBAGE {
                // KV of no request (loaded from outside the producer's
                // pool): neither own, shared, blank nor foreign.
                live.log.garbage.insert((pool as u64) << 32 | s as u64);
            } else if owner != rid {
                let shared = live
                    .grants
                    .get(&(pool, s))
                    .is_some_and(|&(g, current)| current && g == st.wgen[su]);
                let key = (pool as u64) << 32 | s as u64;
                if shared && owner != 0 && st.tenant[su] != live.tenant {
                    live.log.cross_shared.insert((owner, key));
                    live.log.src_tenant.insert(owner, st.tenant[su]);
                }
                if !shared {
                    if owner == 0 {
                        live.log.blank.insert(key);
                    } else {
                        live.log.foreign.insert((owner, key));
                        live.log.src_tenant.insert(owner, st.tenant[su]);
                    }
                }
            }
            if want {
                values.push(if owner == 0 {
                    0
                } else {
                    model::kv(st.seed[su], st.pos[su])
                });
            }
        }
        Ok(values)
    }

    pub(super) fn tenant(&mut self, name: &str) -> u32 {
        if let Some(&i) = self.tenant_ix.get(name) {
            return i;
        }
        let i = self.tenants.len() as u32;
        self.tenants.push(name.to_string());
        self.tenant_ix.insert(name.to_string(), i);
        i
    }

    /// Hash keys of the full prompt blocks: a block inside the request's
    /// shared prefix has the key of (group, salt, index), as vLLM's chained
    /// block hash over the same tokens would; any other block's tokens are
    /// the request's own and match no other prompt.
    pub(super) fn keys(&self, a: &Arrival, tenant: u32, len: u32) -> Vec<Option<u64>> {
        let bs = self.bs();
        let salt = match self.cfg.cache_salt() {
            CacheSalt::None => 0,
            CacheSalt::Tenant => model::mix64(0x5A17 ^ (tenant as u64 + 1)),
        };
        (0..len / bs)
            .map(|i| match a.prefix_group {
                Some(g) if (i + 1) * bs <= a.prefix_tokens.min(len) => Some(model::mix64(
                    model::mix64(model::mix64(g) ^ salt) ^ (i as u64 + 1),
                )),
                _ => None,
            })
            .collect()
    }
}
