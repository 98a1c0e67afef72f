//! The SGLang model's state and its bookkeeping: the requests in flight
//! ([`Live`], with what prefill and decode each do with them), the pools'
//! allocators and per-slot content ([`Slots`]), the prefill radix cache,
//! the decode tree and its HiCache host backing, the event queue and the
//! clock. [`Engine::run`] is the event loop; the KV primitives here (`alloc`,
//! `write`, `free`, `read`, `grant`) record one event per contiguous run
//! and keep the slot state and the truth in step with it. The request path
//! that calls them is in `admit`, `forward`, `decode` and `hicache`.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};

use crate::capture::Recorder;
use crate::error::Result;
use crate::progress::Reporter;
use crate::schema::{CopySrc, KvEvent, Op};
use crate::sim::alloc::Allocator;
use crate::sim::base::{
    DECODE_POOL, EPOCH_NS, PREFILL_POOL, RunStats, Slots, clock_checked, slot_runs,
};
use crate::sim::config::SimConfig;
use crate::sim::model;
use crate::sim::truth::{ReadLog, TruthBuilder};
use crate::sim::workload::Arrival;

/// What prefill does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PrefillMode {
    /// Forwards `tokens` (the prompt, or its auto-truncated head) and sends
    /// their pages.
    Full { tokens: u32 },
    /// `set_finish_with_abort`: 1-token placeholder forward; `send` (0.5.19)
    /// sends its page and Success, otherwise (0.5.20) it is retired with 400.
    Placeholder { send: bool },
    /// Rejected at the queue door (0.5.21+): 400, no forward.
    Door,
    /// Never bootstraps (decode rejected the request at its own door).
    Idle,
}

/// What decode does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum DecodeMode {
    /// Preallocates and reads `tokens` prompt tokens.
    Full { tokens: u32 },
    /// Decode rejected it too (0.5.19/0.5.20): a 1-token stub that answers
    /// 400 after one decode step (or times out when nothing is sent).
    Stub,
    /// Rejected at decode's queue door (0.5.21+): 400 at once.
    Door,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum DecState {
    Queued,
    Waiting,
    Running,
    Failed,
    Done,
}

pub(super) struct Live {
    pub(super) a: Arrival,
    pub(super) hash: [u8; 32],
    pub(super) seed: u64,
    pub(super) tenant: u32,
    pub(super) pmode: PrefillMode,
    pub(super) dmode: DecodeMode,
    /// Decode prompt length L (positions read before generating).
    pub(super) dec_len: u32,
    /// Output tokens decode generates when it runs to the end.
    pub(super) out_target: u32,
    // prefill side
    pub(super) pf_slots: Vec<u32>,
    pub(super) pf_own_pages: Vec<u32>,
    pub(super) pf_shared_tokens: u32,
    pub(super) pf_group_locked: Option<u64>,
    /// Writer of the prefix-cache entry this request hit.
    pub(super) pf_prefix_owner: u64,
    pub(super) pf_cached_pages: u32,
    pub(super) pf_released: bool,
    pub(super) pf_done: bool,
    // decode side
    pub(super) dstate: DecState,
    pub(super) dec_slots: Vec<u32>,
    /// Decode pages in position order (decode-tree prefix pages first).
    pub(super) dec_pages: Vec<u32>,
    /// Leading pages of `dec_pages` owned by the decode radix tree (a hit
    /// at preallocation, or inserted when the request finished).
    pub(super) dec_tree_pages: u32,
    /// Pages matched in the decode tree at preallocation (not transferred).
    pub(super) dec_prefix_pages: u32,
    pub(super) dec_group_locked: Option<u64>,
    pub(super) dec_reserve: u32,
    pub(super) generated: u32,
    pub(super) transfer_in_flight: bool,
    pub(super) release_on_land: bool,
    pub(super) dec_released: bool,
    /// (pool, slot) -> (write generation at the grant, whether the content
    /// was current then: a grant on stale content covers nothing)
    pub(super) grants: HashMap<(u16, u32), (u32, bool)>,
    pub(super) front_reject: bool,
    pub(super) status: u16,
    // answers: (status, time)
    pub(super) prefill_answer: Option<(u16, i64)>,
    pub(super) decode_answer: Option<(u16, i64)>,
    pub(super) output_hash: Option<[u8; 32]>,
    pub(super) row_written: bool,
    pub(super) log: ReadLog,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Ev {
    PrefillDone,
    TransferLand,
    DecodeBlock,
    DecodeFinish,
    WaitTimeout,
    DecodeRelease,
}

pub(super) struct CacheEntry {
    pub(super) pages: Vec<u32>,
    pub(super) owner: u64,
    pub(super) locks: u32,
    pub(super) last_use: i64,
}

/// A decode-tree entry backed up in the HiCache host pool (held by the
/// engine; kept after a load back, as SGLang keeps a node's host value).
pub(super) struct HostEntry {
    pub(super) pages: Vec<u32>,
    pub(super) owner: u64,
    pub(super) last_use: i64,
}

/// Runs the engine model over `arrivals` (in arrival order), recording into
/// `rec`. Returns the truth builder's result pieces.
pub(crate) struct Engine<'a> {
    pub(super) cfg: &'a SimConfig,
    pub(super) rec: &'a mut Recorder,
    pub(super) reporter: &'a dyn Reporter,
    /// Finished requests not yet reported (reported in batches).
    pub(super) unreported: u64,
    pub(super) now: i64,
    pub(super) pf_alloc: Allocator,
    pub(super) dec_alloc: Allocator,
    pub(super) pf_state: Slots,
    pub(super) dec_state: Slots,
    /// The HiCache host pool (only with `hicache`).
    pub(super) host_alloc: Option<Allocator>,
    pub(super) host_state: Slots,
    pub(super) hcache: BTreeMap<u64, HostEntry>,
    pub(super) dec_reserved: u64,
    pub(super) live: HashMap<u64, Live>,
    pub(super) heap: BinaryHeap<Reverse<(i64, u64, Ev, u64)>>,
    pub(super) ctr: u64,
    pub(super) dec_queue: VecDeque<u64>,
    pub(super) pf_queue: VecDeque<u64>,
    pub(super) pf_busy: bool,
    pub(super) cache: BTreeMap<u64, CacheEntry>,
    pub(super) dcache: BTreeMap<u64, CacheEntry>,
    pub(super) tenants: Vec<String>,
    pub(super) tenant_ix: HashMap<String, u32>,
    pub truth: TruthBuilder,
    pub stats: RunStats,
}

impl<'a> Engine<'a> {
    pub fn new(cfg: &'a SimConfig, rec: &'a mut Recorder, reporter: &'a dyn Reporter) -> Self {
        let pf_alloc = Allocator::new(
            cfg.prefill.capacity_tokens,
            cfg.prefill.page_size,
            cfg.free_list,
        );
        let dec_alloc = Allocator::new(
            cfg.decode.capacity_tokens,
            cfg.decode.page_size,
            cfg.free_list,
        );
        let host_alloc = cfg
            .hicache
            .then(|| Allocator::new(cfg.hicache_host_tokens, cfg.decode.page_size, cfg.free_list));
        Engine {
            pf_state: Slots::new(pf_alloc.slot_space() as usize),
            dec_state: Slots::new(dec_alloc.slot_space() as usize),
            host_state: Slots::new(host_alloc.as_ref().map_or(0, |a| a.slot_space() as usize)),
            host_alloc,
            hcache: BTreeMap::new(),
            pf_alloc,
            dec_alloc,
            cfg,
            rec,
            reporter,
            unreported: 0,
            now: 0,
            dec_reserved: 0,
            live: HashMap::new(),
            heap: BinaryHeap::new(),
            ctr: 0,
            dec_queue: VecDeque::new(),
            pf_queue: VecDeque::new(),
            pf_busy: false,
            cache: BTreeMap::new(),
            dcache: BTreeMap::new(),
            tenants: Vec::new(),
            tenant_ix: HashMap::new(),
            truth: TruthBuilder::default(),
            stats: RunStats::default(),
        }
    }

    /// Runs every arrival to completion.
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
        if !self.live.is_empty() {
            let mut ids: Vec<u64> = self.live.keys().copied().collect();
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
            Ev::DecodeBlock => self.decode_block(rid),
            Ev::DecodeFinish => self.decode_finish(rid),
            Ev::WaitTimeout => self.wait_timeout(rid),
            Ev::DecodeRelease => self.decode_release(rid),
        }
    }

    /// Records one event on `pool` at the current simulated time.
    pub(super) fn emit(
        &mut self,
        pool: u16,
        rid: u64,
        op: Op,
        extent: (u32, u32),
        pos: Option<u32>,
    ) -> Result<u64> {
        self.emit_event(pool, rid, op, extent, pos, None)
    }

    pub(super) fn emit_event(
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

    /// Emits `op` over slots (in position order, first position `pos0`),
    /// one event per contiguous run.
    pub(super) fn emit_runs(
        &mut self,
        pool: u16,
        rid: u64,
        op: Op,
        slots: &[u32],
        pos0: Option<u32>,
    ) -> Result<()> {
        for (offset, extent) in slot_runs(slots) {
            self.emit(pool, rid, op, extent, pos0.map(|p| p + offset))?;
        }
        Ok(())
    }

    pub(super) fn page_slots(pages: &[u32], ps: u32) -> Vec<u32> {
        pages.iter().flat_map(|&p| p * ps..(p + 1) * ps).collect()
    }

    pub(super) fn slots_of(&mut self, pool: u16) -> &mut Slots {
        match pool {
            PREFILL_POOL => &mut self.pf_state,
            DECODE_POOL => &mut self.dec_state,
            _ => &mut self.host_state,
        }
    }

    pub(super) fn state(&self, pool: u16) -> &Slots {
        match pool {
            PREFILL_POOL => &self.pf_state,
            DECODE_POOL => &self.dec_state,
            _ => &self.host_state,
        }
    }

    pub(super) fn allocator(&mut self, pool: u16) -> &mut Allocator {
        match pool {
            PREFILL_POOL => &mut self.pf_alloc,
            DECODE_POOL => &mut self.dec_alloc,
            _ => self.host_alloc.as_mut().expect("a host pool with hicache"),
        }
    }

    /// Records `alloc` of `slots` for `rid`: their content, whatever it
    /// is, is stale for the new holder until written.
    pub(super) fn alloc(&mut self, pool: u16, rid: u64, slots: &[u32]) -> Result<()> {
        self.emit_runs(pool, rid, Op::Alloc, slots, None)?;
        let st = self.slots_of(pool);
        for &s in slots {
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
        let st = self.slots_of(pool);
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

    pub(super) fn free(&mut self, pool: u16, rid: u64, pages: &[u32]) -> Result<()> {
        if pages.is_empty() {
            return Ok(());
        }
        let ps = self.allocator(pool).page_size();
        let mut sorted = pages.to_vec();
        sorted.sort_unstable();
        let slots = Self::page_slots(&sorted, ps);
        if self.cfg.scrub_on_free {
            self.emit_runs(pool, rid, Op::Scrub, &slots, None)?;
            let st = self.slots_of(pool);
            for &s in &slots {
                st.owner[s as usize] = 0;
                st.wgen[s as usize] = st.wgen[s as usize].wrapping_add(1);
                st.current[s as usize] = true;
            }
        }
        self.emit_runs(pool, rid, Op::Free, &slots, None)?;
        self.allocator(pool).free_pages(&sorted);
        Ok(())
    }

    /// Reads slots (position order from `pos0`) for `rid`, classifying each
    /// for the truth; returns the model values read.
    pub(super) fn read(
        &mut self,
        pool: u16,
        rid: u64,
        slots: &[u32],
        pos0: u32,
        want_values: bool,
    ) -> Result<Vec<u64>> {
        self.emit_runs(pool, rid, Op::Read, slots, Some(pos0))?;
        let st = match pool {
            PREFILL_POOL => &self.pf_state,
            DECODE_POOL => &self.dec_state,
            _ => &self.host_state,
        };
        let live = self.live.get_mut(&rid).expect("live reader");
        let mut values = Vec::with_capacity(if want_values { slots.len() } else { 0 });
        for &s in slots {
            let su = s as usize;
            let owner = st.owner[su];
            if owner != rid {
                // A grant covers the content it saw, and only when that
                // content was current.
                let shared = live
                    .grants
                    .get(&(pool, s))
                    .is_some_and(|&(g, current)| current && g == st.wgen[su]);
                if shared && owner != 0 && st.tenant[su] != live.tenant {
                    let key = (pool as u64) << 32 | s as u64;
                    live.log.cross_shared.insert((owner, key));
                    live.log.src_tenant.insert(owner, st.tenant[su]);
                }
                if !shared {
                    let key = (pool as u64) << 32 | s as u64;
                    if owner == 0 {
                        live.log.blank.insert(key);
                    } else {
                        live.log.foreign.insert((owner, key));
                        live.log.src_tenant.insert(owner, st.tenant[su]);
                    }
                }
            }
            if want_values {
                values.push(if owner == 0 {
                    0
                } else {
                    model::kv(st.seed[su], st.pos[su])
                });
            }
        }
        Ok(values)
    }

    pub(super) fn grant(&mut self, pool: u16, rid: u64, slots: &[u32], pos0: u32) -> Result<()> {
        self.emit_runs(pool, rid, Op::Share, slots, Some(pos0))?;
        let st = self.state(pool);
        let gens: Vec<((u16, u32), (u32, bool))> = slots
            .iter()
            .map(|&s| ((pool, s), (st.wgen[s as usize], st.current[s as usize])))
            .collect();
        let live = self.live.get_mut(&rid).expect("live");
        live.grants.extend(gens);
        Ok(())
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
}
