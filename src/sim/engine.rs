//! The engine model: a discrete-event simulation of an SGLang-style
//! prefill/decode-disaggregated server with one prefill pool (id 0), one
//! decode pool (id 1) and, with `hicache`, a host pool (id 2, role `cache`)
//! backing the decode radix tree, captured through `capture::Recorder`
//! exactly as an engine hook would capture it.
//!
//! The request path (docs/simulator.md, per SGLang version):
//! arrival → front-end context check (400) → both roles receive the request
//! (router dual dispatch) → each role checks `max_req_input_len` of its own
//! pool → decode preallocates the prompt it saw (`early` policy) → prefill
//! bootstraps, allocates (prefix-cache hits are `share`d), forwards (write,
//! read) → transfer: the prefill pages are copied into the decode pages
//! (`write` with src on the decode pool) and Success → decode generates in
//! blocks (alloc at page boundaries, write, read of the whole context) →
//! frees → response row. Version-specific branches for a prompt that the
//! prefill rejects are in [`PrefillMode`] and [`DecodeMode`].
//!
//! Simulated time only (never the wall clock): the same workload and
//! config give a byte-identical trace. Ground truth is kept from the
//! model's own slot bookkeeping at each read (see `truth`). Memory is
//! bounded by the pools and the requests in flight, not by the run length.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};

use crate::capture::Recorder;
use crate::error::Result;
use crate::progress::Reporter;
use crate::schema::{CopySrc, KvEvent, Op, RequestRecord, hash_tokens};
use crate::sim::alloc::Allocator;
use crate::sim::config::{DecodeAllocation, EngineVersion, RouterMode, SimConfig};
use crate::sim::model;
use crate::sim::truth::{ReadLog, TruthBuilder};
use crate::sim::workload::Arrival;
use crate::trace::manifest::{Deployment, Pool, Role};

/// Pool id of the prefill pool in simulated traces.
pub const PREFILL_POOL: u16 = 0;
/// Pool id of the decode pool in simulated traces.
pub const DECODE_POOL: u16 = 1;
/// Pool id of the HiCache host pool (role `cache`; only with `hicache`).
pub const HOST_POOL: u16 = 2;
/// Simulated time 0 is 2026-09-01T00:00:00Z.
pub const EPOCH_NS: i64 = 1_788_220_800_000_000_000;

/// The latest simulated time (ns since [`EPOCH_NS`]) whose timestamp
/// still fits the trace's i64 nanoseconds (2262-04-11).
pub const MAX_CLOCK_NS: i64 = i64::MAX - EPOCH_NS;

/// `value * unit` nanoseconds, saturating at i64::MAX (never wrapping).
pub(crate) fn span(value: u64, unit: u64) -> i64 {
    i64::try_from(value.saturating_mul(unit)).unwrap_or(i64::MAX)
}

/// `now + value * unit`, saturating (an event past [`MAX_CLOCK_NS`] is
/// refused when the clock reaches it).
pub(crate) fn later(now: i64, value: u64, unit: u64) -> i64 {
    now.saturating_add(span(value, unit))
}

/// Refuses a simulated time whose timestamp would not fit the trace.
pub(crate) fn clock_checked(t: i64, request_id: Option<u64>) -> Result<i64> {
    if (0..=MAX_CLOCK_NS).contains(&t) {
        return Ok(t);
    }
    let who = request_id.map_or(String::new(), |r| format!(" (request {r})"));
    Err(crate::error::Error::invalid(
        crate::error::Location::default().column("timing"),
        format!("the simulated clock left the range a trace timestamp can hold{who}"),
        "lower the timing keys, timeouts and arrival spread so the run ends before 2262-04-11 (docs/simulator.md, \"Timing ranges\")",
    ))
}

/// What the simulator did, besides the trace and the truth.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunStats {
    pub requests: u64,
    pub kv_events: u64,
    /// Requests whose prompt the prefill pool rejected (over-long).
    pub over_long: u64,
    pub sim_end_ns: i64,
}

/// Config keys written into trace.json only when `hicache` is on, so that
/// traces of runs without it stay byte-identical to those written before
/// the knob existed (a reader fills in the defaults).
const HICACHE_KEYS: [&str; 2] = ["hicache", "hicache_host_tokens"];

/// The trace.json deployment of a simulated run.
pub fn deployment(cfg: &SimConfig) -> Deployment {
    if cfg.engine.is_vllm() {
        return crate::sim::vllm::deployment(cfg);
    }
    let pool = |id: u16, name: &str, role: Role, p: &crate::sim::config::PoolConfig| {
        let pages = p.capacity_tokens / p.page_size as u64;
        let mut extra = serde_json::Map::new();
        // The buffers hold page 0 (reserved) too: slot ids span
        // (pages + 1) * page_size; SGLang's max_total_num_tokens is kept here.
        extra.insert("max_total_num_tokens".into(), p.capacity_tokens.into());
        Pool {
            id,
            name: name.into(),
            role,
            capacity_tokens: (pages + 1) * p.page_size as u64,
            page_size: p.page_size,
            extra,
        }
    };
    let mut extra = serde_json::Map::new();
    let mut sim = serde_json::to_value(cfg).expect("config serializes");
    if let Some(m) = sim.as_object_mut() {
        if !cfg.hicache {
            for k in HICACHE_KEYS {
                m.remove(k);
            }
        }
        for k in crate::sim::config::VLLM_KEYS {
            m.remove(k);
        }
    }
    extra.insert("simulator".into(), sim);
    let mut pools = vec![
        pool(PREFILL_POOL, "prefill-0", Role::Prefill, &cfg.prefill),
        pool(DECODE_POOL, "decode-0", Role::Decode, &cfg.decode),
    ];
    if cfg.hicache {
        let host = crate::sim::config::PoolConfig {
            capacity_tokens: cfg.hicache_host_tokens,
            page_size: cfg.decode.page_size,
        };
        pools.push(pool(HOST_POOL, "host-0", Role::Cache, &host));
    }
    Deployment {
        name: cfg.name.clone(),
        engine: cfg.engine.name().into(),
        context_window: cfg.context_window,
        pools,
        prefix_cache_scope: None,
        extra,
    }
}

/// What prefill does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PrefillMode {
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
enum DecodeMode {
    /// Preallocates and reads `tokens` prompt tokens.
    Full { tokens: u32 },
    /// Decode rejected it too (0.5.19/0.5.20): a 1-token stub that answers
    /// 400 after one decode step (or times out when nothing is sent).
    Stub,
    /// Rejected at decode's queue door (0.5.21+): 400 at once.
    Door,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DecState {
    Queued,
    Waiting,
    Running,
    Failed,
    Done,
}

struct Live {
    a: Arrival,
    hash: [u8; 32],
    seed: u64,
    tenant: u32,
    pmode: PrefillMode,
    dmode: DecodeMode,
    /// Decode prompt length L (positions read before generating).
    dec_len: u32,
    /// Output tokens decode generates when it runs to the end.
    out_target: u32,
    // prefill side
    pf_slots: Vec<u32>,
    pf_own_pages: Vec<u32>,
    pf_shared_tokens: u32,
    pf_group_locked: Option<u64>,
    /// Writer of the prefix-cache entry this request hit.
    pf_prefix_owner: u64,
    pf_cached_pages: u32,
    pf_released: bool,
    pf_done: bool,
    // decode side
    dstate: DecState,
    dec_slots: Vec<u32>,
    /// Decode pages in position order (decode-tree prefix pages first).
    dec_pages: Vec<u32>,
    /// Leading pages of `dec_pages` owned by the decode radix tree (a hit
    /// at preallocation, or inserted when the request finished).
    dec_tree_pages: u32,
    /// Pages matched in the decode tree at preallocation (not transferred).
    dec_prefix_pages: u32,
    dec_group_locked: Option<u64>,
    dec_reserve: u32,
    generated: u32,
    transfer_in_flight: bool,
    release_on_land: bool,
    dec_released: bool,
    /// (pool, slot) -> (write generation at the grant, whether the content
    /// was current then: a grant on stale content covers nothing)
    grants: HashMap<(u16, u32), (u32, bool)>,
    front_reject: bool,
    status: u16,
    // answers: (status, time)
    prefill_answer: Option<(u16, i64)>,
    decode_answer: Option<(u16, i64)>,
    output_hash: Option<[u8; 32]>,
    row_written: bool,
    log: ReadLog,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    PrefillDone,
    TransferLand,
    DecodeBlock,
    DecodeFinish,
    WaitTimeout,
    DecodeRelease,
}

/// Per-slot content state of one pool (the simulator's bookkeeping).
pub(crate) struct Slots {
    pub(crate) owner: Vec<u64>,
    pub(crate) seed: Vec<u64>,
    pub(crate) pos: Vec<u32>,
    pub(crate) tenant: Vec<u32>,
    pub(crate) wgen: Vec<u32>,
    /// The content was put there after the slot's latest alloc (a write, a
    /// scrub, or a copy of current content); false: it is stale, left over
    /// from an earlier holder.
    pub(crate) current: Vec<bool>,
}

impl Slots {
    pub(crate) fn new(n: usize) -> Slots {
        Slots {
            owner: vec![0; n],
            seed: vec![0; n],
            pos: vec![0; n],
            tenant: vec![0; n],
            wgen: vec![0; n],
            current: vec![true; n],
        }
    }

    /// Copies slot `s` of `from` into slot `d` of `self`: content owner,
    /// model value and current/stale bit; the destination is written.
    pub(crate) fn copy_from(&mut self, d: usize, from: &Slots, s: usize) {
        self.owner[d] = from.owner[s];
        self.seed[d] = from.seed[s];
        self.pos[d] = from.pos[s];
        self.tenant[d] = from.tenant[s];
        self.current[d] = from.current[s];
        self.wgen[d] = self.wgen[d].wrapping_add(1);
    }
}

struct CacheEntry {
    pages: Vec<u32>,
    owner: u64,
    locks: u32,
    last_use: i64,
}

/// A decode-tree entry backed up in the HiCache host pool (held by the
/// engine; kept after a load back, as SGLang keeps a node's host value).
struct HostEntry {
    pages: Vec<u32>,
    owner: u64,
    last_use: i64,
}

/// Runs the engine model over `arrivals` (in arrival order), recording into
/// `rec`. Returns the truth builder's result pieces.
pub(crate) struct Engine<'a> {
    cfg: &'a SimConfig,
    rec: &'a mut Recorder,
    reporter: &'a dyn Reporter,
    /// Finished requests not yet reported (reported in batches).
    unreported: u64,
    now: i64,
    pf_alloc: Allocator,
    dec_alloc: Allocator,
    pf_state: Slots,
    dec_state: Slots,
    /// The HiCache host pool (only with `hicache`).
    host_alloc: Option<Allocator>,
    host_state: Slots,
    hcache: BTreeMap<u64, HostEntry>,
    dec_reserved: u64,
    live: HashMap<u64, Live>,
    heap: BinaryHeap<Reverse<(i64, u64, Ev, u64)>>,
    ctr: u64,
    dec_queue: VecDeque<u64>,
    pf_queue: VecDeque<u64>,
    pf_busy: bool,
    cache: BTreeMap<u64, CacheEntry>,
    dcache: BTreeMap<u64, CacheEntry>,
    tenants: Vec<String>,
    tenant_ix: HashMap<String, u32>,
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

    fn at(&mut self, t: i64, ev: Ev, id: u64) {
        self.ctr += 1;
        self.heap.push(Reverse((t, self.ctr, ev, id)));
    }

    // ---- emission -------------------------------------------------------

    /// Records one event on `pool` at the current simulated time.
    fn emit(
        &mut self,
        pool: u16,
        rid: u64,
        op: Op,
        extent: (u32, u32),
        pos: Option<u32>,
    ) -> Result<u64> {
        self.emit_event(pool, rid, op, extent, pos, None)
    }

    fn emit_event(
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
    fn emit_runs(
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

    fn page_slots(pages: &[u32], ps: u32) -> Vec<u32> {
        pages.iter().flat_map(|&p| p * ps..(p + 1) * ps).collect()
    }

    fn slots_of(&mut self, pool: u16) -> &mut Slots {
        match pool {
            PREFILL_POOL => &mut self.pf_state,
            DECODE_POOL => &mut self.dec_state,
            _ => &mut self.host_state,
        }
    }

    fn state(&self, pool: u16) -> &Slots {
        match pool {
            PREFILL_POOL => &self.pf_state,
            DECODE_POOL => &self.dec_state,
            _ => &self.host_state,
        }
    }

    fn allocator(&mut self, pool: u16) -> &mut Allocator {
        match pool {
            PREFILL_POOL => &mut self.pf_alloc,
            DECODE_POOL => &mut self.dec_alloc,
            _ => self.host_alloc.as_mut().expect("a host pool with hicache"),
        }
    }

    /// Records `alloc` of `slots` for `rid`: their content, whatever it
    /// is, is stale for the new holder until written.
    fn alloc(&mut self, pool: u16, rid: u64, slots: &[u32]) -> Result<()> {
        self.emit_runs(pool, rid, Op::Alloc, slots, None)?;
        let st = self.slots_of(pool);
        for &s in slots {
            st.current[s as usize] = false;
        }
        Ok(())
    }

    /// The engine (request 0) copies whole pages `src` of `src_pool` into
    /// pages `dst` of `dst_pool` (a HiCache offload or load back): one
    /// `write` with src per run contiguous on both sides; token positions
    /// are those of a tree prefix (page i holds positions i * page_size..).
    fn copy_pages(&mut self, src_pool: u16, src: &[u32], dst_pool: u16, dst: &[u32]) -> Result<()> {
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

    fn write(&mut self, pool: u16, rid: u64, slots: &[u32], pos0: u32) -> Result<()> {
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

    fn free(&mut self, pool: u16, rid: u64, pages: &[u32]) -> Result<()> {
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
    fn read(
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

    fn grant(&mut self, pool: u16, rid: u64, slots: &[u32], pos0: u32) -> Result<()> {
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

    // ---- request path ---------------------------------------------------

    fn tenant(&mut self, name: &str) -> u32 {
        if let Some(&i) = self.tenant_ix.get(name) {
            return i;
        }
        let i = self.tenants.len() as u32;
        self.tenants.push(name.to_string());
        self.tenant_ix.insert(name.to_string(), i);
        i
    }

    fn arrive(&mut self, a: Arrival) -> Result<()> {
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
    fn schedule(&mut self) -> Result<()> {
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

    fn try_prealloc(&mut self, rid: u64) -> Result<bool> {
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

    fn try_prefill(&mut self, rid: u64) -> Result<bool> {
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
    fn evict_one(&mut self, keep: Option<u64>) -> Result<bool> {
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
    fn evict_decode_one(&mut self, keep: Option<u64>) -> Result<bool> {
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

    /// HiCache write-back: the engine backs an evicted decode-tree entry
    /// up in the host pool (alloc, then a copy from the decode pool),
    /// evicting the host pool's least recently used entries (never
    /// `keep`) to make room. An entry already backed up is not copied
    /// again; one larger than the host pool, or that finds no room, is
    /// dropped.
    fn offload(&mut self, g: u64, e: &CacheEntry, keep: Option<u64>) -> Result<()> {
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
    fn evict_host_one(&mut self, keep: Option<u64>) -> Result<bool> {
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
    fn load_back(&mut self, g: u64, k: u32, need: u64) -> Result<bool> {
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

    fn handle(&mut self, ev: Ev, rid: u64) -> Result<()> {
        match ev {
            Ev::PrefillDone => self.prefill_done(rid),
            Ev::TransferLand => self.transfer_land(rid),
            Ev::DecodeBlock => self.decode_block(rid),
            Ev::DecodeFinish => self.decode_finish(rid),
            Ev::WaitTimeout => self.wait_timeout(rid),
            Ev::DecodeRelease => self.decode_release(rid),
        }
    }

    fn prefill_done(&mut self, rid: u64) -> Result<()> {
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

    fn start_transfer(&mut self, rid: u64) {
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
    fn release_prefill(&mut self, rid: u64) -> Result<()> {
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

    fn transfer_land(&mut self, rid: u64) -> Result<()> {
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

    fn decode_block(&mut self, rid: u64) -> Result<()> {
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

    fn decode_finish(&mut self, rid: u64) -> Result<()> {
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

    fn wait_timeout(&mut self, rid: u64) -> Result<()> {
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
    fn decode_fail(&mut self, rid: u64, status: u16) -> Result<()> {
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

    fn decode_release(&mut self, rid: u64) -> Result<()> {
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
    fn maybe_row(&mut self, rid: u64) -> Result<()> {
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

    fn finish_row(&mut self, rid: u64) -> Result<()> {
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

/// The contiguous runs of `slots` (in position order): each run's offset
/// in `slots` and its extent (first slot, count), one KV event each. The
/// SGLang and vLLM engine models emit through it.
pub(super) fn slot_runs(slots: &[u32]) -> impl Iterator<Item = (u32, (u32, u32))> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        if i >= slots.len() {
            return None;
        }
        let mut j = i + 1;
        while j < slots.len() && slots[j - 1].checked_add(1) == Some(slots[j]) {
            j += 1;
        }
        let run = (i as u32, (slots[i], (j - i) as u32));
        i = j;
        Some(run)
    })
}
