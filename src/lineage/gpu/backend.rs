//! `GpuBackend`: the replay `Backend` on a `Device`, the same code for the
//! CUDA device and the emulator.
//!
//! A batch of one pool's events (seq order) is cut into sub-batches of at
//! most `max_touches` slot touches, so device memory is bounded by the pool
//! capacity plus one sub-batch, whatever the trace size. Per sub-batch:
//!
//! 1. host: counters, share grants (kept per request on the host, as the CPU
//!    backend does), and for every read the reader's grants that overlap it;
//!    writes, scrubs and reads (the events that touch slot state) go up.
//! 2. device: exclusive scan of slot counts, expansion into touches (one per
//!    slot of each event), stable radix sort of touches by slot, inclusive
//!    max-scan of `slot << 32 | writer + 1` (last writer per slot so far),
//!    classification of every read touch against the slot's state just
//!    before it (exactly `cpu.rs`), new slot state from each slot's last
//!    writer, and compaction of non-clean read touches into runs in
//!    (event, slot) order: the CPU backend's `ReadRun`s, in its order.
//! 3. host: the runs come back and get their reader, seq and time.
//!
//! Copies are device gathers (`capture`) and scatters (`apply_copy`).

use std::collections::HashMap;

use super::device::{
    CLASSIFY, COPY_GATHER, COPY_SCATTER, Device, EXPAND, Grow, MARK_WRITERS, RUN_FLAGS,
    RUN_SCATTER, UPDATE_STATE, bytes_of, bytes_of_mut, params::*,
};
use super::prims::{Prims, ScanOp};
use crate::error::{Error, Result};
use crate::lineage::backend::{Backend, Counters, NEVER, Payload, ReadKind, ReadRun, SlotVal};
use crate::lineage::grants::Grants;
use crate::lineage::rule::{PoolState, SlotData};
use crate::lineage::state::Grant;
use crate::schema::{KvEvent, Op};

const EV_WRITE: u32 = 1;
const EV_SCRUB: u32 = 2;
const EV_READ: u32 = 3;
const CLS_FOREIGN: u32 = 1;
const CLS_BLANK: u32 = 2;
const CLS_UNKNOWN: u32 = 3;
const CLS_UNCERTAIN: u32 = 4;
const CLS_SHARED: u32 = 5;
const CLS_UNC_BIT: u32 = 0x100;

/// The most slots the GPU backend holds, summed over the replayed pools:
/// it allocates every declared slot on the device (20 bytes a slot, so
/// 20 GiB at the limit). `auto` replays larger deployments on the CPU.
pub const GPU_MAX_SLOTS: u64 = 1 << 30;

/// Sizes of the device work.
#[derive(Debug, Clone, Copy)]
pub struct GpuConfig {
    /// Items per thread of the scans.
    pub scan_chunk: u64,
    /// Items per thread of the radix sort.
    pub radix_chunk: u64,
    /// Slot touches per sub-batch (a single larger event still goes alone).
    pub max_touches: u64,
}

impl Default for GpuConfig {
    fn default() -> Self {
        Self {
            scan_chunk: 32,
            radix_chunk: 512,
            max_touches: 1 << 25,
        }
    }
}

struct Pool<D: Device> {
    id: u16,
    capacity: u64,
    owner: D::Buf,
    wseq1: D::Buf,
    flags: D::Buf,
    gap_mark: u64,
    never_kind: u32,
    /// Host side, as on the CPU backend: the rule's stale bits and share
    /// grants (only shares consult the stale bits).
    rule: PoolState,
}

/// Device buffers of one sub-batch, grown on demand.
struct Scratch<D: Device> {
    ev_off: Grow<D>,
    ev_slot: Grow<D>,
    ev_kind: Grow<D>,
    ev_val: Grow<D>,
    ev_seq1: Grow<D>,
    ev_gofs: Grow<D>,
    ev_gcnt: Grow<D>,
    g_start: Grow<D>,
    g_end: Grow<D>,
    g_seq: Grow<D>,
    touch_ev: Grow<D>,
    touch_slot: Grow<D>,
    k0: Grow<D>,
    v0: Grow<D>,
    k1: Grow<D>,
    v1: Grow<D>,
    mk: Grow<D>,
    cls_kind: Grow<D>,
    cls_src: Grow<D>,
    fs: Grow<D>,
    fe: Grow<D>,
    run_ev: Grow<D>,
    run_slot: Grow<D>,
    run_t0: Grow<D>,
    run_t1: Grow<D>,
    run_kind: Grow<D>,
    run_src: Grow<D>,
    counters: Grow<D>,
    pay_owner: Grow<D>,
    pay_flag: Grow<D>,
}

impl<D: Device> Default for Scratch<D> {
    fn default() -> Self {
        Self {
            ev_off: Grow::default(),
            ev_slot: Grow::default(),
            ev_kind: Grow::default(),
            ev_val: Grow::default(),
            ev_seq1: Grow::default(),
            ev_gofs: Grow::default(),
            ev_gcnt: Grow::default(),
            g_start: Grow::default(),
            g_end: Grow::default(),
            g_seq: Grow::default(),
            touch_ev: Grow::default(),
            touch_slot: Grow::default(),
            k0: Grow::default(),
            v0: Grow::default(),
            k1: Grow::default(),
            v1: Grow::default(),
            mk: Grow::default(),
            cls_kind: Grow::default(),
            cls_src: Grow::default(),
            fs: Grow::default(),
            fe: Grow::default(),
            run_ev: Grow::default(),
            run_slot: Grow::default(),
            run_t0: Grow::default(),
            run_t1: Grow::default(),
            run_kind: Grow::default(),
            run_src: Grow::default(),
            counters: Grow::default(),
            pay_owner: Grow::default(),
            pay_flag: Grow::default(),
        }
    }
}

/// Host staging of one sub-batch (reused).
#[derive(Default)]
struct Stage {
    /// Index in the sub-batch of each device event.
    host_ev: Vec<usize>,
    ev_cnt: Vec<u64>,
    ev_slot: Vec<u32>,
    ev_kind: Vec<u32>,
    ev_val: Vec<u64>,
    ev_seq1: Vec<u64>,
    ev_gofs: Vec<u32>,
    ev_gcnt: Vec<u32>,
    g_start: Vec<u32>,
    g_end: Vec<u32>,
    g_seq: Vec<u64>,
    /// A copy's payload, slot by slot (owner, uncertain).
    pay_owner: Vec<u64>,
    pay_flag: Vec<u32>,
}

impl Stage {
    fn clear(&mut self) {
        self.host_ev.clear();
        self.ev_cnt.clear();
        self.ev_slot.clear();
        self.ev_kind.clear();
        self.ev_val.clear();
        self.ev_seq1.clear();
        self.ev_gofs.clear();
        self.ev_gcnt.clear();
        self.g_start.clear();
        self.g_end.clear();
        self.g_seq.clear();
        self.pay_owner.clear();
        self.pay_flag.clear();
    }
}

/// A sub-batch's staging as the slot rule sees it (`rule::SlotData`):
/// writes, scrubs and reads (with the reader's grants that overlap them)
/// go up to the device, copies' payloads are gathered for their scatter.
struct Staging<'a> {
    st: &'a mut Stage,
    /// Index in the sub-batch of the event being applied.
    i: usize,
    /// Slot touches staged.
    touches: u64,
    c: &'a mut Counters,
}

impl Staging<'_> {
    fn push(&mut self, e: &KvEvent, kind: u32, val: u64, grants: &[Grant]) {
        if e.slot_count == 0 {
            return;
        }
        let st = &mut *self.st;
        let (a, b) = (e.slot_start as u64, e.slot_end());
        let gofs = st.g_start.len() as u32;
        for g in grants {
            if g.start() < b && a < g.end() {
                // device slot numbers are u32: pools hold at most
                // GPU_MAX_SLOTS slots
                st.g_start.push(g.start() as u32);
                st.g_end.push(g.end() as u32);
                st.g_seq.push(g.seq);
            }
        }
        st.host_ev.push(self.i);
        st.ev_cnt.push(e.slot_count as u64);
        st.ev_slot.push(e.slot_start);
        st.ev_kind.push(kind);
        st.ev_val.push(val);
        st.ev_seq1.push(e.seq + 1);
        st.ev_gofs.push(gofs);
        st.ev_gcnt.push(st.g_start.len() as u32 - gofs);
        self.touches += e.slot_count as u64;
    }
}

impl SlotData for Staging<'_> {
    fn set(&mut self, e: &KvEvent, _a: u64, _b: u64, owner: u64) -> Result<()> {
        let kind = if e.op == Op::Scrub {
            EV_SCRUB
        } else {
            EV_WRITE
        };
        self.push(e, kind, owner, &[]);
        Ok(())
    }

    fn copy(&mut self, _e: &KvEvent, a: u64, b: u64, v: SlotVal) -> Result<()> {
        let n = (b - a) as usize;
        self.st.pay_owner.extend(std::iter::repeat_n(v.owner, n));
        self.st
            .pay_flag
            .extend(std::iter::repeat_n(v.uncertain as u32, n));
        Ok(())
    }

    fn read(&mut self, e: &KvEvent, _a: u64, _b: u64, grants: &mut Grants) -> Result<()> {
        self.c.read_events += 1;
        self.c.read_slots += e.slot_count as u64;
        let g = grants.lookup(e.request_id)?;
        self.push(e, EV_READ, e.request_id, g);
        Ok(())
    }

    /// Device slot state is not read back to sweep dead grants: all kept.
    fn alive(&self, _g: &Grant) -> bool {
        true
    }
}

/// The replay backend on a device.
pub struct GpuBackend<D: Device> {
    dev: D,
    name: &'static str,
    cfg: GpuConfig,
    pools: Vec<Pool<D>>,
    index: HashMap<u16, usize>,
    prims: Prims<D>,
    s: Scratch<D>,
    stage: Stage,
}

impl<D: Device> GpuBackend<D> {
    pub fn new(dev: D, cfg: GpuConfig) -> Self {
        Self::named(dev, cfg, "cuda")
    }

    /// A backend that reports `name` (the emulator says `emu`).
    pub fn named(dev: D, cfg: GpuConfig, name: &'static str) -> Self {
        Self {
            dev,
            name,
            cfg,
            pools: Vec::new(),
            index: HashMap::new(),
            prims: Prims::new(cfg.scan_chunk, cfg.radix_chunk),
            s: Scratch::default(),
            stage: Stage::default(),
        }
    }

    pub fn device(&self) -> &D {
        &self.dev
    }

    fn pool_index(&self, id: u16) -> Result<usize> {
        self.index
            .get(&id)
            .copied()
            .ok_or_else(|| Error::Other(format!("replay: pool {id} was not declared")))
    }

    fn up<T: super::device::Pod>(dev: &D, g: &mut Grow<D>, v: &[T]) -> Result<u64> {
        let a = g.ensure(dev, std::mem::size_of_val(v))?;
        if !v.is_empty() {
            dev.upload(a, bytes_of(v))?;
        }
        Ok(a)
    }

    fn down<T: super::device::Pod + Default>(dev: &D, addr: u64, n: usize) -> Result<Vec<T>> {
        let mut v = vec![T::default(); n];
        if n > 0 {
            dev.download(addr, bytes_of_mut(&mut v))?;
        }
        Ok(v)
    }

    /// Host pass over a sub-batch: counters, the rule (stale bits and
    /// grants), staging of what touches device slot state.
    fn stage(&mut self, pi: usize, events: &[KvEvent], c: &mut Counters) -> Result<u64> {
        self.stage.clear();
        let pool = &mut self.pools[pi];
        let mut slots = Staging {
            st: &mut self.stage,
            i: 0,
            touches: 0,
            c,
        };
        for (i, e) in events.iter().enumerate() {
            slots.c.events += 1;
            slots.c.slot_touches += e.slot_count as u64;
            slots.i = i;
            pool.rule
                .apply(&mut slots, e, e.slot_start as u64, e.slot_end())?;
        }
        Ok(slots.touches)
    }

    fn run_batch(
        &mut self,
        pi: usize,
        events: &[KvEvent],
        out: &mut Vec<ReadRun>,
        c: &mut Counters,
    ) -> Result<()> {
        let n_touch = self.stage(pi, events, c)?;
        if n_touch == 0 {
            return Ok(());
        }
        let dev = &self.dev;
        let st = &self.stage;
        let s = &mut self.s;
        let pool = &self.pools[pi];
        let n_ev = st.ev_cnt.len() as u64;
        let nt = n_touch as usize;

        let ev_off = Self::up(dev, &mut s.ev_off, &st.ev_cnt)?;
        let ev_slot = Self::up(dev, &mut s.ev_slot, &st.ev_slot)?;
        let ev_kind = Self::up(dev, &mut s.ev_kind, &st.ev_kind)?;
        let ev_val = Self::up(dev, &mut s.ev_val, &st.ev_val)?;
        let ev_seq1 = Self::up(dev, &mut s.ev_seq1, &st.ev_seq1)?;
        let ev_gofs = Self::up(dev, &mut s.ev_gofs, &st.ev_gofs)?;
        let ev_gcnt = Self::up(dev, &mut s.ev_gcnt, &st.ev_gcnt)?;
        let g_start = Self::up(dev, &mut s.g_start, &st.g_start)?;
        let g_end = Self::up(dev, &mut s.g_end, &st.g_end)?;
        let g_seq = Self::up(dev, &mut s.g_seq, &st.g_seq)?;
        let counters = Self::up(dev, &mut s.counters, &[0u64, 0u64])?;

        // 1. touches
        self.prims
            .scan_in_place(dev, ev_off, n_ev, ScanOp::ExclusiveSum)?;
        let touch_ev = s.touch_ev.ensure(dev, nt * 4)?;
        let touch_slot = s.touch_slot.ensure(dev, nt * 4)?;
        let k0 = s.k0.ensure(dev, nt * 4)?;
        let v0 = s.v0.ensure(dev, nt * 4)?;
        let k1 = s.k1.ensure(dev, nt * 4)?;
        let v1 = s.v1.ensure(dev, nt * 4)?;
        dev.launch(
            &EXPAND,
            n_touch,
            ExpandParams {
                ev_off,
                ev_slot,
                touch_ev,
                touch_slot,
                key: k0,
                val: v0,
                n_ev,
                n_touch,
            },
        )?;
        // 2. stable sort by slot
        let bits = 64 - pool.capacity.saturating_sub(1).leading_zeros();
        let (skey, sval) = self.prims.radix_sort(dev, n_touch, bits, k0, v0, k1, v1)?;
        // 3. last writer per slot
        let mk = s.mk.ensure(dev, nt * 8)?;
        dev.launch(
            &MARK_WRITERS,
            n_touch,
            MarkParams {
                skey,
                sval,
                touch_ev,
                ev_kind,
                mk,
                n: n_touch,
            },
        )?;
        self.prims
            .scan_in_place(dev, mk, n_touch, ScanOp::InclusiveMax)?;
        // 4. classify reads, then the new slot state
        let cls_kind = s.cls_kind.ensure(dev, nt * 4)?;
        let cls_src = s.cls_src.ensure(dev, nt * 8)?;
        let (st_owner, st_wseq1, st_flags) = (
            dev.addr(&pool.owner),
            dev.addr(&pool.wseq1),
            dev.addr(&pool.flags),
        );
        dev.launch(
            &CLASSIFY,
            n_touch,
            ClassifyParams {
                skey,
                sval,
                lw: mk,
                touch_ev,
                ev_kind,
                ev_val,
                ev_seq1,
                ev_gofs,
                ev_gcnt,
                g_start,
                g_end,
                g_seq,
                st_owner,
                st_wseq1,
                st_flags,
                cls_kind,
                cls_src,
                counters,
                n: n_touch,
                gap_mark: pool.gap_mark,
                never_kind: pool.never_kind as u64,
            },
        )?;
        dev.launch(
            &UPDATE_STATE,
            n_touch,
            UpdateParams {
                skey,
                lw: mk,
                ev_val,
                ev_seq1,
                st_owner,
                st_wseq1,
                st_flags,
                n: n_touch,
            },
        )?;
        // 5. runs
        let mut rp = RunParams {
            touch_ev,
            touch_slot,
            cls_kind,
            cls_src,
            fs: s.fs.ensure(dev, nt * 8)?,
            fe: s.fe.ensure(dev, nt * 8)?,
            n: n_touch,
            ..Default::default()
        };
        dev.launch(&RUN_FLAGS, n_touch, rp)?;
        let n_runs = self.prims.scan(dev, rp.fs, n_touch, ScanOp::ExclusiveSum)?;
        let n_ends = self.prims.scan(dev, rp.fe, n_touch, ScanOp::ExclusiveSum)?;
        if n_runs != n_ends {
            return Err(Error::Other(format!(
                "{} backend: {n_runs} run starts but {n_ends} run ends",
                self.name
            )));
        }
        let nr = n_runs as usize;
        rp.run_ev = s.run_ev.ensure(dev, nr * 4)?;
        rp.run_slot = s.run_slot.ensure(dev, nr * 4)?;
        rp.run_t0 = s.run_t0.ensure(dev, nr * 4)?;
        rp.run_t1 = s.run_t1.ensure(dev, nr * 4)?;
        rp.run_kind = s.run_kind.ensure(dev, nr * 4)?;
        rp.run_src = s.run_src.ensure(dev, nr * 8)?;
        if nr > 0 {
            dev.launch(&RUN_SCATTER, n_touch, rp)?;
        }
        let own_shared: Vec<u64> = Self::down(dev, counters, 2)?;
        c.own_slots += own_shared[0];
        c.shared_slots += own_shared[1];
        if nr == 0 {
            return Ok(());
        }
        let run_ev: Vec<u32> = Self::down(dev, rp.run_ev, nr)?;
        let run_slot: Vec<u32> = Self::down(dev, rp.run_slot, nr)?;
        let run_t0: Vec<u32> = Self::down(dev, rp.run_t0, nr)?;
        let run_t1: Vec<u32> = Self::down(dev, rp.run_t1, nr)?;
        let run_kind: Vec<u32> = Self::down(dev, rp.run_kind, nr)?;
        let run_src: Vec<u64> = Self::down(dev, rp.run_src, nr)?;
        out.reserve(nr);
        for k in 0..nr {
            let e = &events[st.host_ev[run_ev[k] as usize]];
            let kind = match run_kind[k] & 0xFF {
                CLS_FOREIGN => ReadKind::Foreign,
                CLS_BLANK => ReadKind::Blank,
                CLS_UNKNOWN => ReadKind::Unknown,
                CLS_UNCERTAIN => ReadKind::Uncertain,
                CLS_SHARED => ReadKind::Shared,
                other => {
                    return Err(Error::Other(format!(
                        "{} backend: read class {other} from the device",
                        self.name
                    )));
                }
            };
            out.push(ReadRun {
                reader: e.request_id,
                pool: pool.id,
                slot_start: run_slot[k],
                count: run_t1[k] - run_t0[k] + 1,
                kind,
                source: run_src[k],
                uncertain: run_kind[k] & CLS_UNC_BIT != 0,
                seq: e.seq,
                ts_ns: e.ts_ns,
            });
        }
        Ok(())
    }

    fn copy_params(&mut self, pi: usize, start: u32, count: u32) -> Result<CopyParams> {
        let n = count as usize;
        let pool = &self.pools[pi];
        if start as u64 + count as u64 > pool.capacity {
            return Err(Error::Other(format!(
                "replay: slots {start}..{} outside pool {} (capacity {})",
                start as u64 + count as u64,
                pool.id,
                pool.capacity
            )));
        }
        Ok(CopyParams {
            st_owner: self.dev.addr(&pool.owner),
            st_wseq1: self.dev.addr(&pool.wseq1),
            st_flags: self.dev.addr(&pool.flags),
            pay_owner: self.s.pay_owner.ensure(&self.dev, n * 8)?,
            pay_flag: self.s.pay_flag.ensure(&self.dev, n * 4)?,
            start: start as u64,
            count: count as u64,
            seq1: 0,
            gap_mark: pool.gap_mark,
            uncertain: 0,
        })
    }
}

impl<D: Device> Backend for GpuBackend<D> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn add_pool(&mut self, pool: u16, capacity: u64, from_engine_start: bool) -> Result<()> {
        let held: u64 = self.pools.iter().map(|p| p.capacity).sum();
        if held.saturating_add(capacity) > GPU_MAX_SLOTS {
            return Err(Error::Other(format!(
                "{} backend: pool {pool} of {capacity} slots would take the device slot state past {GPU_MAX_SLOTS} slots; use --backend cpu",
                self.name
            )));
        }
        let n = capacity as usize;
        let p = Pool {
            id: pool,
            capacity,
            owner: self.dev.alloc(n * 8, 0xFF)?, // NEVER
            wseq1: self.dev.alloc(n * 8, 0)?,
            flags: self.dev.alloc(n * 4, 0)?,
            gap_mark: 0,
            never_kind: if from_engine_start {
                CLS_BLANK
            } else {
                CLS_UNKNOWN
            },
            rule: PoolState::new(capacity, Grants::default()),
        };
        debug_assert_eq!(NEVER, u64::MAX);
        self.index.insert(pool, self.pools.len());
        self.pools.push(p);
        Ok(())
    }

    fn slot_limit(&self) -> Option<u64> {
        Some(GPU_MAX_SLOTS)
    }

    fn mark_gap(&mut self, pool: u16, before_seq: u64) {
        if let Ok(i) = self.pool_index(pool) {
            let p = &mut self.pools[i];
            p.gap_mark = p.gap_mark.max(before_seq + 1);
        }
    }

    fn apply(
        &mut self,
        pool: u16,
        events: &[KvEvent],
        out: &mut Vec<ReadRun>,
        c: &mut Counters,
    ) -> Result<()> {
        let pi = self.pool_index(pool)?;
        let cap = self.pools[pi].capacity;
        if let Some(e) = events
            .iter()
            .find(|e| e.slot_start as u64 + e.slot_count as u64 > cap)
        {
            return Err(Error::Other(format!(
                "replay: event seq {} of pool {pool} reaches slot {} past the capacity {cap}",
                e.seq,
                e.slot_start as u64 + e.slot_count as u64
            )));
        }
        let max = self.cfg.max_touches.max(1);
        let mut i = 0;
        while i < events.len() {
            let mut j = i;
            let mut t = 0u64;
            while j < events.len() && (j == i || t + events[j].slot_count as u64 <= max) {
                t += events[j].slot_count as u64;
                j += 1;
            }
            self.run_batch(pi, &events[i..j], out, c)?;
            i = j;
        }
        Ok(())
    }

    fn apply_copy(
        &mut self,
        pool: u16,
        e: &KvEvent,
        payload: &Payload,
        c: &mut Counters,
    ) -> Result<()> {
        let pi = self.pool_index(pool)?;
        if payload.len() != e.slot_count as usize {
            return Err(Error::Other(format!(
                "replay: copy payload of {} slots for an extent of {}",
                payload.len(),
                e.slot_count
            )));
        }
        c.events += 1;
        c.slot_touches += e.slot_count as u64;
        if e.slot_count == 0 {
            return Ok(());
        }
        let mut p = self.copy_params(pi, e.slot_start, e.slot_count)?;
        p.seq1 = e.seq + 1;
        self.stage.clear();
        let mut none = Counters::default();
        let mut slots = Staging {
            st: &mut self.stage,
            i: 0,
            touches: 0,
            c: &mut none,
        };
        self.pools[pi]
            .rule
            .copy_payload(&mut slots, e, e.slot_start as u64, payload)?;
        self.dev
            .upload(p.pay_owner, bytes_of(&self.stage.pay_owner))?;
        self.dev
            .upload(p.pay_flag, bytes_of(&self.stage.pay_flag))?;
        self.dev.launch(&COPY_SCATTER, p.count, p)
    }

    fn capture(
        &mut self,
        pool: u16,
        slot_start: u32,
        count: u32,
        uncertain: bool,
        out: &mut Payload,
    ) -> Result<()> {
        let pi = self.pool_index(pool)?;
        out.clear();
        if count == 0 {
            return Ok(());
        }
        let mut p = self.copy_params(pi, slot_start, count)?;
        p.uncertain = uncertain as u64;
        self.dev.launch(&COPY_GATHER, p.count, p)?;
        let owners: Vec<u64> = Self::down(&self.dev, p.pay_owner, count as usize)?;
        let flags: Vec<u32> = Self::down(&self.dev, p.pay_flag, count as usize)?;
        let stale = &self.pools[pi].rule.stale;
        let a = slot_start as u64;
        out.extend(
            owners
                .iter()
                .zip(&flags)
                .zip(a..)
                .map(|((&owner, &f), s)| SlotVal {
                    owner,
                    uncertain: f != 0,
                    stale: stale.is_stale(s),
                }),
        );
        Ok(())
    }
}
