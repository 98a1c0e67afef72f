//! The vLLM engine model: a discrete-event simulation of a vLLM 0.33.0
//! prefill/decode deployment with the NixlConnector (pull), one prefill
//! instance (pool 0) and one decode instance (pool 1), captured through
//! `capture::Recorder` exactly as an engine hook would capture it. The
//! rules and where they were read in the released package are in
//! docs/engine-vllm.md.
//!
//! The request path: front end (prompt >= max_model_len: 400) → prefill
//! (`BlockPool`: prefix hits `share`d, scoped by `cache_salt`; new blocks
//! `alloc`ed from the head of the free queue; forward `write` + `read`) →
//! the producer holds the request's blocks under a lease (`request_finished`
//! with `kv_lease_duration`) → decode (local prefix hits, `alloc` of the
//! rest, pull: a `write` with src on the decode pool per run of blocks, end
//! aligned as `_apply_prefix_caching` pairs them; the notification releases
//! the producer's blocks) → the last prompt token recomputed, decode in
//! blocks (alloc at block boundaries, write, read of the whole context) →
//! free. A failed load follows `kv_load_failure_policy`: `fail` answers
//! 500, `recompute` prefills again on decode.
//!
//! Fail-open paths (vllm-project/vllm#52234): a load NIXL reports done is
//! a success to decode whatever it read. `bug_stale_reference_ppm` hands
//! decode an earlier, consumed reference; `bug_lease_expiry` keeps decode's
//! heartbeats from the producer, whose lease then runs out while decode
//! still holds the reference. Either way decode reads blocks the producer
//! released (and may have reused), caches them and answers 200.
//! `bug_out_of_range_ppm` names remote blocks past the end of the
//! producer's pool: the read brings in memory of no request (`garbage` in
//! the truth), and the capture records each such run as a hole in the
//! decode pool, as the sidecar records the hook's out-of-range `xfer_pull`
//! run. `reference_check` (a mitigation, not a vLLM option) fails such a
//! load.
//!
//! Simulated time only; the ground truth comes from the model's own slot
//! bookkeeping at each read (`truth`), as in the SGLang model.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};

use crate::capture::Recorder;
use crate::error::Result;
use crate::progress::Reporter;
use crate::schema::{CopySrc, KvEvent, Op, RequestRecord, hash_tokens};
use crate::sim::config::{CacheSalt, FailurePolicy, SGLANG_KEYS, SimConfig};
use crate::sim::engine::{
    DECODE_POOL, EPOCH_NS, PREFILL_POOL, RunStats, Slots, clock_checked, later, span,
};
use crate::sim::model;
use crate::sim::truth::{ReadLog, TruthBuilder};
use crate::sim::workload::Arrival;
use crate::trace::manifest::{Deployment, Pool, PrefixCacheScope, Role};

/// The trace.json deployment of a simulated vLLM run: two pools of
/// `num_gpu_blocks` blocks each (block 0 is vLLM's null block), and the
/// effective config with the vLLM keys filled in.
pub fn deployment(cfg: &SimConfig) -> Deployment {
    let bs = cfg.block_size();
    let pool = |id: u16, name: &str, role: Role, p: &crate::sim::config::PoolConfig| {
        let blocks = p.capacity_tokens / bs as u64;
        let mut extra = serde_json::Map::new();
        extra.insert("num_gpu_blocks".into(), (blocks + 1).into());
        // The usable tokens, under the key what-if replay reads.
        extra.insert("max_total_num_tokens".into(), p.capacity_tokens.into());
        Pool {
            id,
            name: name.into(),
            role,
            capacity_tokens: (blocks + 1) * bs as u64,
            page_size: bs,
            extra,
        }
    };
    let mut sim = serde_json::to_value(cfg.vllm_effective()).expect("config serializes");
    if let Some(m) = sim.as_object_mut() {
        for k in SGLANG_KEYS {
            m.remove(k);
        }
    }
    let mut extra = serde_json::Map::new();
    extra.insert("simulator".into(), sim);
    Deployment {
        name: cfg.name.clone(),
        engine: cfg.engine.name().into(),
        context_window: cfg.context_window,
        pools: vec![
            pool(PREFILL_POOL, "prefill-0", Role::Prefill, &cfg.prefill),
            pool(DECODE_POOL, "decode-0", Role::Decode, &cfg.decode),
        ],
        prefix_cache_scope: (cfg.prefix_cache && cfg.cache_salt() == CacheSalt::Tenant)
            .then_some(PrefixCacheScope::Tenant),
        extra,
    }
}

// ---- the block pool ------------------------------------------------------

#[derive(Debug, Clone, Default)]
struct Block {
    ref_cnt: u32,
    /// The block's hash key when it is registered for prefix hits.
    key: Option<u64>,
    /// The block carries a hash (a full block): freed to the tail of the
    /// queue (LRU) instead of the head.
    hashed: bool,
    /// Position in the free queue while ref_cnt is 0.
    qkey: Option<i64>,
}

/// vLLM's `BlockPool` (v1/core/block_pool.py) for one KV cache group:
/// block 0 is the null block; the free queue starts 1..=n; `get_new_blocks`
/// pops from the head and evicts a cached hash; `free_blocks` takes the
/// blocks in eviction order (the manager passes them reversed) and
/// prepends unhashed blocks, appends hashed ones; `touch` takes a hit
/// block out of the queue.
struct BlockPool {
    bs: u32,
    caching: bool,
    blocks: Vec<Block>,
    free: BTreeMap<i64, u32>,
    head: i64,
    tail: i64,
    table: HashMap<u64, u32>,
}

impl BlockPool {
    fn new(usable_blocks: u32, bs: u32, caching: bool) -> BlockPool {
        let mut blocks = vec![Block::default(); usable_blocks as usize + 1];
        let mut free = BTreeMap::new();
        for b in 1..=usable_blocks {
            free.insert(b as i64, b);
            blocks[b as usize].qkey = Some(b as i64);
        }
        BlockPool {
            bs,
            caching,
            blocks,
            free,
            head: 1,
            tail: usable_blocks as i64 + 1,
            table: HashMap::new(),
        }
    }

    fn slot_space(&self) -> usize {
        self.blocks.len() * self.bs as usize
    }

    /// The longest run of leading keys registered (`find_longest_cache_hit`).
    fn lookup(&self, keys: &[Option<u64>]) -> Vec<u32> {
        if !self.caching {
            return Vec::new();
        }
        keys.iter()
            .map_while(|k| k.and_then(|k| self.table.get(&k).copied()))
            .collect()
    }

    /// Hit blocks still in the free queue (they stop being free when touched).
    fn idle(&self, blocks: &[u32]) -> usize {
        blocks
            .iter()
            .filter(|&&b| self.blocks[b as usize].ref_cnt == 0)
            .count()
    }

    fn touch(&mut self, blocks: &[u32]) {
        for &b in blocks {
            let blk = &mut self.blocks[b as usize];
            if blk.ref_cnt == 0
                && let Some(q) = blk.qkey.take()
            {
                self.free.remove(&q);
            }
            blk.ref_cnt += 1;
        }
    }

    fn get_new(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let (_, b) = self.free.pop_first().expect("counted");
            let blk = &mut self.blocks[b as usize];
            blk.qkey = None;
            if let Some(k) = blk.key.take()
                && self.table.get(&k) == Some(&b)
            {
                self.table.remove(&k);
            }
            blk.hashed = false;
            blk.ref_cnt = 1;
            out.push(b);
        }
        Some(out)
    }

    /// `KVCacheManager.free`: the request's table in order; freed reversed.
    fn free(&mut self, table: &[u32]) {
        let mut first = Vec::new();
        let mut last = Vec::new();
        for &b in table.iter().rev() {
            let blk = &mut self.blocks[b as usize];
            blk.ref_cnt -= 1;
            if blk.ref_cnt == 0 {
                if blk.hashed && self.caching {
                    last.push(b);
                } else {
                    first.push(b);
                }
            }
        }
        for &b in first.iter().rev() {
            self.head -= 1;
            self.free.insert(self.head, b);
            self.blocks[b as usize].qkey = Some(self.head);
        }
        for b in last {
            self.free.insert(self.tail, b);
            self.blocks[b as usize].qkey = Some(self.tail);
            self.tail += 1;
        }
    }

    /// `cache_full_blocks` for one full block (a block already hashed
    /// keeps its hash; a key another block holds keeps that block).
    fn cache(&mut self, b: u32, key: Option<u64>) {
        if !self.caching {
            return;
        }
        let blk = &mut self.blocks[b as usize];
        if blk.hashed {
            return;
        }
        blk.hashed = true;
        if let Some(k) = key {
            blk.key = Some(k);
            self.table.entry(k).or_insert(b);
        }
    }
}

// ---- requests ------------------------------------------------------------

/// The producer's hold on a finished prefill request's blocks.
struct Hold {
    /// The request's block table (hits included: their references too).
    table: Vec<u32>,
    /// Blocks the request allocated (its `free` events).
    own: Vec<u32>,
    expiry: i64,
    /// First heartbeat from decode, while decode's heartbeats flow.
    hb_start: Option<i64>,
}

struct Live {
    a: Arrival,
    hash: [u8; 32],
    seed: u64,
    tenant: u32,
    len: u32,
    out_target: u32,
    /// Hash key of each full prompt block (None: no other prompt has it).
    keys: Vec<Option<u64>>,
    p_hits: u32,
    /// Content owner of each prefill hit block at the hit.
    p_hit_owner: Vec<u64>,
    /// The producer reference decode was handed: request and block table.
    ref_rid: u64,
    ref_blocks: Vec<u32>,
    /// The reference names blocks past the end of the producer's pool.
    out_of_range: bool,
    d_table: Vec<u32>,
    d_hits: u32,
    d_own: Vec<u32>,
    d_reserve: u32,
    d_slots: Vec<u32>,
    /// The decode side prefills the prompt itself (`recompute` after a
    /// failed load).
    recompute: bool,
    rewind: bool,
    generated: u32,
    output_hash: Option<[u8; 32]>,
    grants: HashMap<(u16, u32), (u32, bool)>,
    log: ReadLog,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    PrefillDone,
    TransferLand,
    LocalPrefillDone,
    Step,
    Finish,
    LeaseCheck,
}

pub(crate) struct Engine<'a> {
    cfg: &'a SimConfig,
    rec: &'a mut Recorder,
    reporter: &'a dyn Reporter,
    unreported: u64,
    now: i64,
    p: BlockPool,
    d: BlockPool,
    pf_state: Slots,
    dec_state: Slots,
    live: HashMap<u64, Live>,
    holds: BTreeMap<u64, Hold>,
    /// The latest reference whose transfer consumed it (the producer
    /// released its blocks on decode's notification).
    last_consumed: Option<(u64, Vec<u32>)>,
    heap: BinaryHeap<Reverse<(i64, u64, Ev, u64)>>,
    ctr: u64,
    p_queue: VecDeque<u64>,
    p_busy: bool,
    d_queue: VecDeque<u64>,
    d_reserved: u64,
    tenants: Vec<String>,
    tenant_ix: HashMap<String, u32>,
    pub truth: TruthBuilder,
    pub stats: RunStats,
}

/// Salts of the bug and failure triggers (per request, deterministic).
const STALE_SALT: u64 = 0x5A1E_4EF0_52E3_4A11;
const FAIL_SALT: u64 = 0xFA11_0AD5_0B1E_C7ED;
const STRAGGLE_SALT: u64 = 0x57A6_61E5;
const RANGE_SALT: u64 = 0x0B0B_4A96_E0FF_5E75;

/// Content owner of a slot a load filled from outside the source pool:
/// KV of no request (above `trace::read::MAX_REQUEST_ID`, so no request
/// has this id).
const GARBAGE: u64 = u64::MAX;

fn picked(rid: u64, salt: u64, ppm: u32) -> bool {
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
        let d = BlockPool::new(
            (cfg.decode.capacity_tokens / bs as u64) as u32,
            bs,
            cfg.prefix_cache,
        );
        Engine {
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

    fn at(&mut self, t: i64, ev: Ev, id: u64) {
        self.ctr += 1;
        self.heap.push(Reverse((t, self.ctr, ev, id)));
    }

    fn handle(&mut self, ev: Ev, rid: u64) -> Result<()> {
        match ev {
            Ev::PrefillDone => self.prefill_done(rid),
            Ev::TransferLand => self.transfer_land(rid),
            Ev::LocalPrefillDone => self.local_prefill_done(rid),
            Ev::Step => self.step(rid),
            Ev::Finish => self.finish(rid, 200),
            Ev::LeaseCheck => self.lease_check(rid),
        }
    }

    // ---- emission -------------------------------------------------------

    fn emit(
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

    fn emit_runs(
        &mut self,
        pool: u16,
        rid: u64,
        op: Op,
        slots: &[u32],
        pos0: Option<u32>,
    ) -> Result<()> {
        for (offset, extent) in super::engine::slot_runs(slots) {
            self.emit(pool, rid, op, extent, pos0.map(|p| p + offset), None)?;
        }
        Ok(())
    }

    fn bs(&self) -> u32 {
        self.p.bs
    }

    fn block_slots(&self, blocks: &[u32]) -> Vec<u32> {
        let bs = self.bs();
        blocks.iter().flat_map(|&b| b * bs..(b + 1) * bs).collect()
    }

    /// Slots of positions `0..n` of a block table.
    fn table_slots(&self, table: &[u32], n: u32) -> Vec<u32> {
        let bs = self.bs();
        (0..n)
            .map(|p| table[(p / bs) as usize] * bs + p % bs)
            .collect()
    }

    fn state_mut(&mut self, pool: u16) -> &mut Slots {
        if pool == PREFILL_POOL {
            &mut self.pf_state
        } else {
            &mut self.dec_state
        }
    }

    fn alloc(&mut self, pool: u16, rid: u64, blocks: &[u32]) -> Result<()> {
        let slots = self.block_slots(blocks);
        self.emit_runs(pool, rid, Op::Alloc, &slots, None)?;
        let st = self.state_mut(pool);
        for s in slots {
            st.current[s as usize] = false;
        }
        Ok(())
    }

    fn write(&mut self, pool: u16, rid: u64, slots: &[u32], pos0: u32) -> Result<()> {
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
    fn free_events(&mut self, pool: u16, rid: u64, own: &[u32]) -> Result<()> {
        if own.is_empty() {
            return Ok(());
        }
        let mut sorted = own.to_vec();
        sorted.sort_unstable();
        let slots = self.block_slots(&sorted);
        self.emit_runs(pool, rid, Op::Free, &slots, None)
    }

    fn grant(&mut self, pool: u16, rid: u64, slots: &[u32], pos0: u32) -> Result<()> {
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
    fn read(&mut self, pool: u16, rid: u64, slots: &[u32], want: bool) -> Result<Vec<u64>> {
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

    /// Hash keys of the full prompt blocks: a block inside the request's
    /// shared prefix has the key of (group, salt, index), as vLLM's chained
    /// block hash over the same tokens would; any other block's tokens are
    /// the request's own and match no other prompt.
    fn keys(&self, a: &Arrival, tenant: u32, len: u32) -> Vec<Option<u64>> {
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

    fn arrive(&mut self, a: Arrival) -> Result<()> {
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

    fn schedule(&mut self) -> Result<()> {
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
    fn try_prefill(&mut self, rid: u64) -> Result<bool> {
        let bs = self.bs();
        let (len, hits) = {
            let l = &self.live[&rid];
            let max_hit = ((l.len - 1) / bs) as usize;
            (l.len, self.p.lookup(&l.keys[..max_hit.min(l.keys.len())]))
        };
        let need = (len.div_ceil(bs) as usize) - hits.len();
        if self.p.free.len() - self.p.idle(&hits) < need {
            return Ok(false);
        }
        self.p.touch(&hits);
        let owners: Vec<u64> = hits
            .iter()
            .map(|&b| self.pf_state.owner[(b * bs) as usize])
            .collect();
        let hit_slots = self.block_slots(&hits);
        self.grant(PREFILL_POOL, rid, &hit_slots, 0)?;
        let new = self.p.get_new(need).expect("counted");
        self.alloc(PREFILL_POOL, rid, &new)?;
        let t = &self.cfg.timing;
        let computed = (len - hits.len() as u32 * bs) as u64;
        let dur =
            span(t.prefill_base_us, 1000).saturating_add(span(computed, t.prefill_ns_per_token));
        let l = self.live.get_mut(&rid).expect("live");
        l.p_hits = hits.len() as u32;
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
    fn prefill_done(&mut self, rid: u64) -> Result<()> {
        self.p_busy = false;
        let bs = self.bs();
        let (len, hits, table, keys) = {
            let l = &self.live[&rid];
            (l.len, l.p_hits, l.ref_blocks.clone(), l.keys.clone())
        };
        let slots = self.table_slots(&table, len);
        self.write(PREFILL_POOL, rid, &slots[(hits * bs) as usize..], hits * bs)?;
        self.read(PREFILL_POOL, rid, &slots, false)?;
        for (i, k) in keys.iter().enumerate() {
            self.p.cache(table[i], *k);
        }
        let now = self.now;
        let lease = self.cfg.lease_s();
        let expiry = later(now, lease, 1_000_000_000);
        self.holds.insert(
            rid,
            Hold {
                own: table[hits as usize..].to_vec(),
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
    fn try_decode(&mut self, rid: u64) -> Result<bool> {
        let bs = self.bs();
        let (len, out, hits, recompute) = {
            let l = &self.live[&rid];
            let max_hit = ((l.len - 1) / bs) as usize;
            (
                l.len,
                l.out_target,
                self.d.lookup(&l.keys[..max_hit.min(l.keys.len())]),
                l.recompute,
            )
        };
        let nblocks = len.div_ceil(bs) as usize;
        let need = nblocks - hits.len();
        let out_blocks = ((len + out).div_ceil(bs) as usize).saturating_sub(nblocks);
        let avail = self.d.free.len() - self.d.idle(&hits);
        if (avail as u64) < self.d_reserved + (need + out_blocks) as u64 {
            return Ok(false);
        }
        self.d.touch(&hits);
        let hit_slots = self.block_slots(&hits);
        self.grant(DECODE_POOL, rid, &hit_slots, 0)?;
        let new = self.d.get_new(need).expect("counted");
        self.alloc(DECODE_POOL, rid, &new)?;
        self.d_reserved += out_blocks as u64;
        let mut table = hits.clone();
        table.extend_from_slice(&new);
        let d_slots = self.table_slots(&table, len);
        {
            let l = self.live.get_mut(&rid).expect("live");
            l.d_hits = hits.len() as u32;
            l.d_table = table;
            l.d_own = new.clone();
            l.d_reserve = out_blocks as u32;
            l.d_slots = d_slots;
        }
        let t = &self.cfg.timing;
        let now = self.now;
        if recompute {
            let computed = (len - hits.len() as u32 * bs) as u64;
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

    /// Stops decode's heartbeats for reference `r`.
    fn stop_heartbeat(&mut self, r: u64) {
        if let Some(h) = self.holds.get_mut(&r) {
            h.hb_start = None;
        }
    }

    /// The producer releases a hold (notification or lease expiry).
    fn release_hold(&mut self, r: u64) -> Result<Option<Vec<u32>>> {
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
    fn lease_check(&mut self, r: u64) -> Result<()> {
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
    fn transfer_land(&mut self, rid: u64) -> Result<()> {
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
    fn load_failed(&mut self, rid: u64) -> Result<()> {
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

    fn local_prefill_done(&mut self, rid: u64) -> Result<()> {
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
    fn step(&mut self, rid: u64) -> Result<()> {
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
                    .d
                    .get_new(1)
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
    fn drop_decode(&mut self, rid: u64) -> Result<()> {
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
    fn finish(&mut self, rid: u64, status: u16) -> Result<()> {
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

    fn reported(&mut self) -> Result<()> {
        self.unreported += 1;
        if self.unreported >= 1024 {
            self.reporter.advance(self.unreported);
            self.unreported = 0;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_queue_follows_vllm_block_pool_order() {
        let mut p = BlockPool::new(6, 4, true);
        // Block 0 is the null block; the queue starts in id order.
        let a = p.get_new(3).unwrap();
        assert_eq!(a, vec![1, 2, 3]);
        // Blocks 1, 2 full (hashed, 1 with a prefix key); 3 partial.
        p.cache(1, Some(77));
        p.cache(2, None);
        p.free(&a);
        // Freed reversed: the unhashed block 3 goes to the head (LIFO),
        // hashed 2 then 1 to the tail (LRU).
        let order: Vec<u32> = p.free.values().copied().collect();
        assert_eq!(order, vec![3, 4, 5, 6, 2, 1]);
        // A prefix hit on block 1 takes it out of the queue.
        assert_eq!(p.lookup(&[Some(77), Some(78)]), vec![1]);
        assert_eq!(p.idle(&[1]), 1);
        p.touch(&[1]);
        assert_eq!(p.free.len(), 5);
        // Reuse evicts the cached key of a block taken from the queue.
        let b = p.get_new(5).unwrap();
        assert_eq!(b, vec![3, 4, 5, 6, 2]);
        assert!(p.get_new(1).is_none());
        p.free(&[1]);
        let c = p.get_new(1).unwrap();
        assert_eq!(c, vec![1]);
        assert!(p.lookup(&[Some(77)]).is_empty(), "evicted on reuse");
    }

    #[test]
    fn caching_off_frees_everything_to_the_head() {
        let mut p = BlockPool::new(4, 4, false);
        let a = p.get_new(2).unwrap();
        p.cache(1, Some(5));
        p.free(&a);
        // `prepend_n` of the reversed table: the tail block is reused first.
        let order: Vec<u32> = p.free.values().copied().collect();
        assert_eq!(order, vec![2, 1, 3, 4]);
        assert!(p.lookup(&[Some(5)]).is_empty());
    }
}
