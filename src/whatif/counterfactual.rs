//! Counterfactual replay of suspect responses: for every affected response
//! of a trace written with the reference model (the simulator), rebuild the
//! KV context its last decode read attended over and re-run the reference
//! model on it twice:
//!
//! 1. as recorded: must reproduce the recorded output_hash exactly (this
//!    checks the replay's fidelity: slot lineage, positions, seeds);
//! 2. with every foreign slot replaced by the request's own KV at that
//!    position (blank where the request has no prompt hash, hence no KV of
//!    its own): did the output change?
//!
//! It also reports the share of attention on foreign slots: in the
//! reference model every attended position adds exactly one term to the
//! state, so the share is foreign positions / attended positions.
//!
//! Model evaluation goes through one trait, [`ModelEval`], over whole
//! batches of contexts; [`CpuModel`] is the only place that calls
//! `sim::model`. A CUDA evaluator implements the same trait.
//!
//! Lineage comes from the replay scheduler (`lineage::run_with`) with a
//! backend of our own that tracks (content owner, owner position) per slot
//! and records the values read by the target requests on decode pools.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::Serialize;

use crate::error::{Error, Result};
use crate::lineage::backend::{Backend, Counters, NEVER, Payload, ReadRun, SCRUBBED, SlotVal};
use crate::lineage::grants::Grants;
use crate::lineage::rule::{PoolState, SlotData};
use crate::lineage::slots::SlotVec;
use crate::lineage::state::Grant;
use crate::lineage::{LineageOptions, run_with};
use crate::progress::Reporter;
use crate::schema::{KvEvent, Op, hash_tokens, hex32};
use crate::scope::scope;
use crate::trace::manifest::Role;
use crate::trace::read::Trace;

/// Content of one attended position: (content seed, position it was
/// written at), or None when blank.
pub type SlotContent = Option<(u64, u32)>;

/// One decode context to evaluate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Context {
    /// Positions 0..prompt_len+T, in position order.
    pub slots: Vec<SlotContent>,
    /// Decode prompt length L (the rest are generated positions).
    pub prompt_len: u32,
}

/// Evaluates the reference model over a batch of contexts: output token ids
/// per context. Implementations must be bit-identical to [`CpuModel`].
pub trait ModelEval {
    fn name(&self) -> &'static str;
    fn eval(&self, batch: &[Context]) -> Result<Vec<Vec<u32>>>;
}

/// The CPU reference model (`sim::model`).
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuModel;

impl ModelEval for CpuModel {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn eval(&self, batch: &[Context]) -> Result<Vec<Vec<u32>>> {
        use crate::sim::model;
        Ok(batch
            .iter()
            .map(|c| {
                let values: Vec<u64> = c.slots.iter().map(|&s| model::slot_value(s)).collect();
                model::output_tokens(&values, c.prompt_len as usize)
            })
            .collect())
    }
}

/// The model seed of a prompt hash (first 8 bytes, little-endian), as the
/// reference model defines it.
fn seed_of(h: &[u8; 32]) -> u64 {
    u64::from_le_bytes(h[..8].try_into().expect("8 bytes"))
}

/// Fidelity of the as-recorded re-run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fidelity {
    /// Reproduced the recorded output_hash.
    Ok,
    /// Did not: the replay of this response is not trustworthy.
    Mismatch,
    /// No output_hash recorded (not a 2xx response): nothing to compare.
    NoOutputRecorded,
    /// A content owner has no prompt hash: its KV cannot be recomputed.
    MissingSeed,
}

/// One re-run response.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Rerun {
    pub request_id: u64,
    pub external_id: Option<String>,
    pub tenant: String,
    pub http_status: u16,
    pub attended_positions: u64,
    pub foreign_positions: u64,
    pub foreign_attention_share: f64,
    pub fidelity: Fidelity,
    /// The counterfactual output differs from the recorded one (None when
    /// fidelity is not ok: no trustworthy baseline).
    pub output_changed: Option<bool>,
    pub recorded_output_hash: Option<String>,
    pub counterfactual_output_hash: Option<String>,
}

/// The counterfactual report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CounterfactualReport {
    pub format: String,
    pub version: u64,
    pub trace: String,
    /// False when the trace was not written with the reference model (or
    /// its evidence has holes): then `reason` says why and nothing was run.
    pub applicable: bool,
    pub reason: Option<String>,
    pub evaluator: String,
    pub affected_responses: u64,
    pub fidelity_ok: u64,
    pub fidelity_mismatch: u64,
    pub outputs_changed: u64,
    pub responses: Vec<Rerun>,
}

struct Target {
    /// position -> (content, foreign), for the positions read: a map, so
    /// memory follows the reads, not the largest token position.
    ctx: BTreeMap<usize, (SlotContent, bool)>,
    missing_seed: bool,
}

/// Owner, token position and write seq per slot, paged (memory follows
/// the slots the trace touches, not the declared capacity).
struct PoolSt {
    slots: ModelSlots,
    /// Stale bits and share grants (dead grants swept).
    rule: PoolState,
}

struct ModelSlots {
    decode: bool,
    owner: SlotVec<u64>,
    pos: SlotVec<u32>,
    wseq1: SlotVec<u64>,
}

/// A pool's slots as the slot rule sees them (`rule::SlotData`) while a
/// batch is applied: reads record the targets' decode contexts.
struct Applying<'a> {
    slots: &'a mut ModelSlots,
    seeds: &'a HashMap<u64, u64>,
    targets: &'a mut HashMap<u64, Target>,
}

impl SlotData for Applying<'_> {
    fn set(&mut self, e: &KvEvent, a: u64, b: u64, owner: u64) -> Result<()> {
        let p = &mut *self.slots;
        if e.op == Op::Write {
            if e.request_id >= u32::MAX as u64 - 2 {
                return Err(Error::Other(format!(
                    "counterfactual: request id {} does not fit the reference model's 32-bit ids",
                    e.request_id
                )));
            }
            let p0 = need_pos(e)?;
            p.owner.fill(a, b, owner);
            for (i, s) in (a..b).enumerate() {
                p.pos.set(s, p0.wrapping_add(i as u32));
            }
        } else {
            p.owner.fill(a, b, owner);
        }
        p.wseq1.fill(a, b, e.seq + 1);
        Ok(())
    }

    fn copy(&mut self, e: &KvEvent, a: u64, b: u64, v: SlotVal) -> Result<()> {
        let p = &mut *self.slots;
        let (o, pos) = unpack(v.owner);
        p.owner.fill(a, b, o);
        for s in a..b {
            p.pos.set(s, pos);
        }
        p.wseq1.fill(a, b, e.seq + 1);
        Ok(())
    }

    fn read(&mut self, e: &KvEvent, a: u64, b: u64, grants: &mut Grants) -> Result<()> {
        let p = &*self.slots;
        if !p.decode {
            return Ok(());
        }
        let Some(t) = self.targets.get_mut(&e.request_id) else {
            return Ok(());
        };
        let p0 = need_pos(e)? as usize;
        let r = e.request_id;
        let grants = grants.lookup(r)?;
        for (i, s) in (a..b).enumerate() {
            let o = p.owner.get(s);
            let content = if o == NEVER || o == SCRUBBED {
                None
            } else {
                match self.seeds.get(&o) {
                    Some(&sd) => Some((sd, p.pos.get(s))),
                    None => {
                        t.missing_seed = true;
                        None
                    }
                }
            };
            let w = p.wseq1.get(s);
            let shared = grants.iter().any(|g| g.covers(s, w));
            let foreign = o != r && o != NEVER && o != SCRUBBED && !shared;
            let q = p0 + i;
            t.ctx.insert(q, (content, foreign));
        }
        Ok(())
    }

    /// Some slot of the grant was not rewritten since it was given.
    fn alive(&self, g: &Grant) -> bool {
        self.slots
            .wseq1
            .range(g.start(), g.end())
            .any(|w| w <= g.seq)
    }
}

/// Replay backend that keeps (owner, position) per slot and the decode
/// contexts of the targets.
struct ModelBackend<'a> {
    pools: HashMap<u16, PoolSt>,
    roles: HashMap<u16, Role>,
    seeds: &'a HashMap<u64, u64>,
    targets: HashMap<u64, Target>,
}

const POS_SHIFT: u32 = 32;

fn pack(owner: u64, pos: u32) -> u64 {
    if owner == NEVER || owner == SCRUBBED {
        owner
    } else {
        (pos as u64) << POS_SHIFT | owner
    }
}

fn unpack(v: u64) -> (u64, u32) {
    if v == NEVER || v == SCRUBBED {
        (v, 0)
    } else {
        (v & 0xFFFF_FFFF, (v >> POS_SHIFT) as u32)
    }
}

impl ModelBackend<'_> {
    fn pool(&mut self, id: u16) -> Result<&mut PoolSt> {
        self.pools
            .get_mut(&id)
            .ok_or_else(|| Error::Other(format!("counterfactual: pool {id} was not declared")))
    }
}

fn need_pos(e: &KvEvent) -> Result<u32> {
    e.token_pos.ok_or_else(|| {
        Error::Other(format!(
            "counterfactual: {} event seq {} on pool {} has no token_pos; positions are needed to recompute KV",
            e.op.as_str(),
            e.seq,
            e.pool
        ))
    })
}

impl Backend for ModelBackend<'_> {
    fn name(&self) -> &'static str {
        "cpu-model"
    }

    fn add_pool(&mut self, pool: u16, capacity: u64, _from_engine_start: bool) -> Result<()> {
        let decode = self.roles.get(&pool) == Some(&Role::Decode);
        self.pools.insert(
            pool,
            PoolSt {
                slots: ModelSlots {
                    decode,
                    owner: SlotVec::new(capacity, NEVER),
                    pos: SlotVec::new(capacity, 0),
                    wseq1: SlotVec::new(capacity, 0),
                },
                rule: PoolState::new(capacity, Grants::default()),
            },
        );
        Ok(())
    }

    fn mark_gap(&mut self, _pool: u16, _before_seq: u64) {}

    fn apply(
        &mut self,
        pool: u16,
        events: &[KvEvent],
        _out: &mut Vec<ReadRun>,
        c: &mut Counters,
    ) -> Result<()> {
        let seeds = self.seeds;
        let p = self
            .pools
            .get_mut(&pool)
            .ok_or_else(|| Error::Other(format!("counterfactual: pool {pool} was not declared")))?;
        let mut slots = Applying {
            slots: &mut p.slots,
            seeds,
            targets: &mut self.targets,
        };
        for e in events {
            c.events += 1;
            p.rule
                .apply(&mut slots, e, e.slot_start as u64, e.slot_end())?;
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
        let seeds = self.seeds;
        let p = self
            .pools
            .get_mut(&pool)
            .ok_or_else(|| Error::Other(format!("counterfactual: pool {pool} was not declared")))?;
        c.events += 1;
        let mut slots = Applying {
            slots: &mut p.slots,
            seeds,
            targets: &mut self.targets,
        };
        p.rule
            .copy_payload(&mut slots, e, e.slot_start as u64, payload)
    }

    fn capture(
        &mut self,
        pool: u16,
        slot_start: u32,
        count: u32,
        uncertain: bool,
        out: &mut Payload,
    ) -> Result<()> {
        let p = self.pool(pool)?;
        let a = slot_start as u64;
        out.clear();
        out.extend((a..a + count as u64).map(|s| SlotVal {
            owner: pack(p.slots.owner.get(s), p.slots.pos.get(s)),
            uncertain,
            stale: p.rule.stale.is_stale(s),
        }));
        Ok(())
    }
}

/// Runs counterfactual replay on a trace with `model`.
pub fn counterfactual(
    trace: &Trace,
    model: &dyn ModelEval,
    opts: &LineageOptions,
    rep: &dyn Reporter,
) -> Result<CounterfactualReport> {
    let m = &trace.manifest;
    let mut report = CounterfactualReport {
        format: "kvtrail-counterfactual".into(),
        version: 1,
        trace: trace.dir.display().to_string(),
        applicable: false,
        reason: None,
        evaluator: model.name().into(),
        affected_responses: 0,
        fidelity_ok: 0,
        fidelity_mismatch: 0,
        outputs_changed: 0,
        responses: Vec::new(),
    };
    if !super::workload::is_reference_model_trace(&m.deployment, &m.capture.writer) {
        report.reason = Some(format!(
            "counterfactual replay needs the reference model: this trace was written by `{}` for engine `{}`, whose outputs come from a real model that cannot be re-run here; skipped",
            m.capture.writer, m.deployment.engine
        ));
        return Ok(report);
    }
    let sc = scope(trace, opts, rep)?;
    if !sc.coverage.complete {
        report.reason = Some(format!(
            "the trace's evidence is incomplete ({}); a re-run over it would not be faithful; skipped",
            sc.coverage.notes.join("; ")
        ));
        return Ok(report);
    }
    report.applicable = true;
    let targets: HashSet<u64> = sc.affected_responses.iter().map(|a| a.request_id).collect();
    report.affected_responses = targets.len() as u64;
    if targets.is_empty() {
        return Ok(report);
    }
    let mut seeds: HashMap<u64, u64> = HashMap::new();
    let mut recs = BTreeMap::new();
    for b in trace.requests() {
        for r in b? {
            if let Some(h) = &r.prompt_hash {
                seeds.insert(r.request_id, seed_of(h));
            }
            if targets.contains(&r.request_id) {
                recs.insert(r.request_id, r);
            }
        }
    }
    let mut backend = ModelBackend {
        pools: HashMap::new(),
        roles: m.deployment.pools.iter().map(|p| (p.id, p.role)).collect(),
        seeds: &seeds,
        targets: targets
            .iter()
            .map(|&t| {
                (
                    t,
                    Target {
                        ctx: BTreeMap::new(),
                        missing_seed: false,
                    },
                )
            })
            .collect(),
    };
    run_with(trace, &mut backend, opts, rep)?;
    let mut ids: Vec<u64> = targets.into_iter().collect();
    ids.sort_unstable();
    let mut batch = Vec::new();
    let mut meta = Vec::new();
    for id in ids {
        let t = &backend.targets[&id];
        let Some(r) = recs.get(&id) else { continue };
        // Positions 0..n, where n is one past the last position read.
        let n = t.ctx.last_key_value().map_or(0, |(&q, _)| q as u64 + 1);
        let foreign = t.ctx.values().filter(|c| c.1).count() as u64;
        let complete = t.ctx.len() as u64 == n;
        let out_t = r.output_tokens as u64;
        let own_seed = seeds.get(&id).copied();
        let mut run = Rerun {
            request_id: id,
            external_id: r.external_id.clone(),
            tenant: r.tenant.clone(),
            http_status: r.http_status,
            attended_positions: n,
            foreign_positions: foreign,
            foreign_attention_share: if n == 0 {
                0.0
            } else {
                foreign as f64 / n as f64
            },
            fidelity: Fidelity::NoOutputRecorded,
            output_changed: None,
            recorded_output_hash: r.output_hash.as_ref().map(hex32),
            counterfactual_output_hash: None,
        };
        if r.output_hash.is_none() || out_t == 0 || n < out_t || !complete {
            if r.output_hash.is_some() {
                run.fidelity = Fidelity::Mismatch;
            }
            meta.push((run, None));
            continue;
        }
        if t.missing_seed {
            run.fidelity = Fidelity::MissingSeed;
            meta.push((run, None));
            continue;
        }
        let prompt_len = (n - out_t) as u32;
        let recorded = Context {
            slots: t.ctx.values().map(|c| c.0).collect(),
            prompt_len,
        };
        let cf = Context {
            slots: t
                .ctx
                .iter()
                .map(|(&q, &(c, f))| {
                    if f {
                        own_seed.map(|s| (s, q as u32))
                    } else {
                        c
                    }
                })
                .collect(),
            prompt_len,
        };
        meta.push((run, Some(batch.len())));
        batch.push(recorded);
        batch.push(cf);
    }
    let outs = model.eval(&batch)?;
    for (mut run, ix) in meta {
        if let Some(i) = ix {
            let rec_hash = hash_tokens(&outs[i]);
            let cf_hash = hash_tokens(&outs[i + 1]);
            let recorded = run.recorded_output_hash.clone();
            if Some(hex32(&rec_hash)) == recorded {
                run.fidelity = Fidelity::Ok;
                run.output_changed = Some(cf_hash != rec_hash);
            } else {
                run.fidelity = Fidelity::Mismatch;
            }
            run.counterfactual_output_hash = Some(hex32(&cf_hash));
        }
        match run.fidelity {
            Fidelity::Ok => report.fidelity_ok += 1,
            Fidelity::Mismatch => report.fidelity_mismatch += 1,
            _ => {}
        }
        report.outputs_changed += (run.output_changed == Some(true)) as u64;
        report.responses.push(run);
    }
    Ok(report)
}
