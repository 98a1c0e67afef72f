//! Recovers a replayable workload and deployment from a recorded trace:
//! the [`Arrival`]s the engine model re-runs, and the [`SimConfig`] of the
//! recorded deployment.
//!
//! What is used (docs/what-if.md "What replay takes from a trace"):
//! - requests table: request_id, external_id, tenant, arrival_ns, the
//!   ORIGINAL prompt_tokens, prompt_hash (kept, so the replayed request has
//!   the same reference-model seed), output_tokens of 2xx responses. A
//!   request that was not answered 2xx has no recorded output length; it
//!   gets the median output length of the 2xx responses (marked inferred).
//! - kv table, prefill pools: prefix sharing. A `share` by R of slots whose
//!   content owner is W means R's prompt starts with W's prefix: R joins
//!   W's group (group id = the root writer's request id) with a prefix of
//!   the shared tokens. A writer's own prefix is the pages it left to the
//!   radix cache (allocated, never freed by itself).
//! - the manifest: the simulator's own config when the trace was written by
//!   the simulator (`deployment.simulator`, `simulator_config`), else one
//!   built from the pools (`recorded_config`, `pool_tokens`); manifest keys
//!   that are present but unreadable are errors naming the key.
//!
//! Memory: one small record per request (the arrivals must be sorted) and
//! one u64 per prefill slot.

use std::collections::HashMap;

use super::extras::VllmView;
use crate::engines::is_vllm_engine;
use crate::error::{Error, Location, Result};
use crate::lineage::slots::SlotVec;
use crate::schema::{Op, RequestRecord};
use crate::sim::base::{EPOCH_NS, MAX_CLOCK_NS};
use crate::sim::config::{EngineVersion, PoolConfig, SimConfig};
use crate::sim::workload::Arrival;
use crate::trace::manifest::{Deployment, Pool, Role};
use crate::trace::read::Trace;

/// The replayable workload of a trace.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Sorted by (arrival time, request id).
    pub arrivals: Vec<Arrival>,
    /// Requests whose output length was not recorded (not 2xx).
    pub inferred_output: Vec<u64>,
    /// Output length given to them.
    pub default_output: u32,
    /// Subtracted from recorded arrival_ns to get simulated time.
    pub time_base_ns: i64,
    /// Requests in a prefix group (a share was recorded).
    pub prefix_members: u64,
    pub prefix_groups: u64,
    /// Rows skipped: request_id 0 (the engine itself).
    pub skipped_engine_rows: u64,
    /// Events missing from the prefill pools' seq streams (holes, and a
    /// stream that does not start at seq 0): prefix sharing recorded in
    /// them is lost to the replay.
    pub prefill_seq_missing: u64,
}

/// SGLang's max_total_num_tokens of pool `i` of a manifest read from
/// `loc`: `max_total_num_tokens` from the pool's extra keys (the simulator
/// writes it: its slot space also holds the reserved page 0), else
/// capacity_tokens. A value that is present but not a whole number from 1
/// to the pool's capacity_tokens is an error naming the key.
pub fn pool_tokens(p: &Pool, i: usize, loc: &Location) -> Result<u64> {
    match p.extra.get("max_total_num_tokens") {
        None => Ok(p.capacity_tokens),
        Some(v) => v
            .as_u64()
            .filter(|&n| n >= 1 && n <= p.capacity_tokens)
            .ok_or_else(|| {
                Error::invalid(
                    loc.clone()
                        .column(&format!("deployment.pools[{i}].max_total_num_tokens")),
                    format!(
                        "max_total_num_tokens is {v}, not a whole number from 1 to the pool's capacity_tokens {}",
                        p.capacity_tokens
                    ),
                    "write SGLang's max_total_num_tokens as an integer, or leave it out (capacity_tokens is used)",
                )
            }),
    }
}

/// The simulator config a manifest carries (`deployment.simulator`), if
/// any; one that does not parse is an error naming the key (never read
/// as "no config").
pub fn simulator_config(d: &Deployment, loc: &Location) -> Result<Option<SimConfig>> {
    match d.extra.get("simulator") {
        None => Ok(None),
        Some(v) => serde_json::from_value::<SimConfig>(v.clone())
            .map(Some)
            .map_err(|e| {
                Error::invalid(
                    loc.clone().column("deployment.simulator"),
                    format!("the simulator config in the manifest does not parse: {e}"),
                    "give the deployment with --config FILE (docs/simulator.md), or remove the broken deployment.simulator",
                )
            }),
    }
}

/// True when the trace was written by the simulator (its outputs come from
/// the integer reference model, so counterfactual replay applies).
pub fn is_reference_model_trace(d: &Deployment, writer: &str) -> bool {
    writer.starts_with("kvtrail-sim") && d.extra.contains_key("simulator")
}

/// The recorded deployment as an engine-model config.
pub fn recorded_config(trace: &Trace) -> Result<SimConfig> {
    let d = trace.deployment();
    let loc = Location::file(&trace.dir.join("trace.json"));
    if let Some(cfg) = simulator_config(d, &loc)? {
        return Ok(cfg);
    }
    let one = |role: Role| -> Result<(usize, &Pool)> {
        let ps: Vec<(usize, &Pool)> = d
            .pools
            .iter()
            .enumerate()
            .filter(|(_, p)| p.role == role)
            .collect();
        match ps.as_slice() {
            [p] => Ok(*p),
            _ => Err(Error::invalid(
                loc.clone().column("deployment.pools"),
                format!(
                    "{} {} pools; the engine model has exactly one prefill and one decode pool",
                    ps.len(),
                    role.as_str()
                ),
                "give a deployment the model can run with --config FILE (docs/simulator.md)",
            )),
        }
    };
    let (pf, dc) = (one(Role::Prefill)?, one(Role::Decode)?);
    let pool = |(i, p): (usize, &Pool)| -> Result<PoolConfig> {
        let ps = p.page_size.max(1) as u64;
        Ok(PoolConfig {
            capacity_tokens: pool_tokens(p, i, &loc)? / ps * ps,
            page_size: p.page_size,
        })
    };
    let mut cfg = SimConfig {
        name: d.name.clone(),
        context_window: d.context_window,
        prefill: pool(pf)?,
        decode: pool(dc)?,
        ..SimConfig::default()
    };
    if let Some(engine) = EngineVersion::parse(&d.engine) {
        cfg.set_engine(engine);
    }
    if cfg.engine.is_vllm() {
        // The recorded vLLM settings, read as audit reads them.
        let v = VllmView::from_extra(&d.extra, &loc)?;
        cfg.kv_lease_duration = v.kv_lease_duration;
        cfg.kv_load_failure_policy = match v.kv_load_failure_policy.as_deref() {
            None => None,
            Some("fail") => Some(crate::sim::config::FailurePolicy::Fail),
            Some("recompute") => Some(crate::sim::config::FailurePolicy::Recompute),
            Some(other) => {
                return Err(Error::invalid(
                    loc.column("deployment.kv_transfer_config.kv_load_failure_policy"),
                    format!("kv_load_failure_policy `{other}` is not one vLLM accepts"),
                    "replay with --set kv_load_failure_policy=fail or =recompute",
                ));
            }
        };
    }
    Ok(cfg)
}

/// True when the manifest's engine string names a modelled version (or the
/// trace carries a simulator config).
pub fn engine_known(d: &Deployment) -> bool {
    d.extra.contains_key("simulator") || EngineVersion::parse(&d.engine).is_some()
}

struct Row {
    id: u64,
    external_id: Option<String>,
    tenant: String,
    arrival_ns: i64,
    prompt_tokens: u32,
    output_tokens: Option<u32>,
    prompt_hash: Option<[u8; 32]>,
}

/// Reads the workload of a trace.
pub fn extract(trace: &Trace) -> Result<Workload> {
    let mut rows: Vec<Row> = Vec::new();
    let mut skipped = 0;
    for batch in trace.requests() {
        for r in batch? {
            let RequestRecord {
                request_id,
                external_id,
                tenant,
                arrival_ns,
                prompt_tokens,
                output_tokens,
                http_status,
                prompt_hash,
                ..
            } = r;
            if request_id == 0 {
                skipped += 1;
                continue;
            }
            let ok = (200..300).contains(&http_status) && output_tokens > 0;
            rows.push(Row {
                id: request_id,
                external_id,
                tenant,
                arrival_ns,
                prompt_tokens,
                output_tokens: ok.then_some(output_tokens),
                prompt_hash,
            });
        }
    }
    rows.sort_by_key(|r| (r.arrival_ns, r.id));
    let mut seen: Vec<u64> = rows.iter().map(|r| r.id).collect();
    seen.sort_unstable();
    if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::invalid(
            Location::file(&trace.dir.join("requests")).column("request_id"),
            format!("request_id {} appears twice", w[0]),
            "request ids must be unique within a trace",
        ));
    }
    let mut outs: Vec<u32> = rows.iter().filter_map(|r| r.output_tokens).collect();
    outs.sort_unstable();
    let default_output = outs.get(outs.len() / 2).copied().unwrap_or(1).max(1);
    let first = rows.first().map(|r| r.arrival_ns).unwrap_or(EPOCH_NS);
    // Simulator traces keep their clock; other traces start at the
    // simulator's epoch.
    let time_base_ns = if first >= EPOCH_NS { EPOCH_NS } else { first };
    // The engine model's clock starts at its epoch and ends where a trace
    // timestamp ends (2262-04-11); a recorded arrival past that (less a
    // week for the requests to finish) cannot be replayed. Said here, so
    // the message blames the arrivals, not the timing keys.
    const FINISH_ROOM_NS: i64 = 7 * 86_400 * 1_000_000_000;
    if let Some(r) = rows
        .iter()
        .find(|r| r.arrival_ns.saturating_sub(time_base_ns) > MAX_CLOCK_NS - FINISH_ROOM_NS)
    {
        return Err(Error::invalid(
            Location::file(&trace.dir.join("requests")).column("arrival_ns"),
            format!(
                "request_id {} arrives {} s after {}: the engine model's clock runs from 2026-09-01 to 2262-04-11, so the recorded arrivals do not fit it (the timing keys are not the cause)",
                r.id,
                (r.arrival_ns as i128 - time_base_ns as i128) / 1_000_000_000,
                if time_base_ns == EPOCH_NS {
                    "the simulator's epoch (2026-09-01)"
                } else {
                    "the trace's first request"
                }
            ),
            "replay a trace whose arrival_ns values lie within about 236 years of each other; check the recorded arrival_ns of that request",
        ));
    }
    let (mut prefix, prefill_seq_missing) = prefix_structure(trace)?;
    if is_vllm_engine(&trace.deployment().engine) {
        // vLLM: a member's hit is cut short by block eviction, not by its
        // prefix; the group's prefix is the longest hit of any member (a
        // generated group's prefix length is one per group).
        let mut longest: HashMap<u64, u32> = HashMap::new();
        for &(g, t) in prefix.values() {
            let e = longest.entry(g).or_default();
            *e = (*e).max(t);
        }
        for v in prefix.values_mut() {
            v.1 = longest[&v.0];
        }
    }
    let mut inferred = Vec::new();
    let mut members = 0;
    let mut arrivals = Vec::with_capacity(rows.len());
    for r in rows {
        let out = r.output_tokens.unwrap_or_else(|| {
            inferred.push(r.id);
            default_output
        });
        let (group, tokens) = match prefix.get(&r.id) {
            Some(&(g, t)) if t > 0 => {
                members += (g != r.id) as u64;
                (Some(g), t.min(r.prompt_tokens.saturating_sub(1)))
            }
            _ => (None, 0),
        };
        arrivals.push(Arrival {
            request_id: r.id,
            external_id: r.external_id,
            tenant: r.tenant,
            arrival_ns: r.arrival_ns.saturating_sub(time_base_ns),
            prompt_tokens: r.prompt_tokens,
            output_tokens: out,
            prefix_group: if tokens > 0 { group } else { None },
            prefix_tokens: if tokens > 0 { tokens } else { 0 },
            recorded_prompt_hash: r.prompt_hash,
        });
    }
    inferred.sort_unstable();
    let groups = prefix
        .iter()
        .filter(|(id, (g, t))| *id == g && *t > 0)
        .count() as u64;
    Ok(Workload {
        arrivals,
        inferred_output: inferred,
        default_output,
        time_base_ns,
        prefix_members: members,
        prefix_groups: groups,
        skipped_engine_rows: skipped,
        prefill_seq_missing,
    })
}

/// request -> (group root, prefix tokens).
type Prefixes = HashMap<u64, (u64, u32)>;

/// The prefix groups from the prefill pools' events, and how many events
/// the prefill pools' seq streams miss.
fn prefix_structure(trace: &Trace) -> Result<(Prefixes, u64)> {
    let d = trace.deployment();
    let prefill: Vec<&Pool> = d
        .pools
        .iter()
        .filter(|p| matches!(p.role, Role::Prefill | Role::Mixed))
        .collect();
    // Per prefill pool: the last writer of each slot. Events must be
    // applied in seq order: collect per pool and sort when a file is out
    // of order (the simulator writes each pool in seq order).
    // (paged: memory follows the slots written, not the declared capacity)
    let mut writer: HashMap<u16, (u64, SlotVec<u64>)> = prefill
        .iter()
        .map(|p| {
            (
                p.id,
                (p.capacity_tokens, SlotVec::new(p.capacity_tokens, 0)),
            )
        })
        .collect();
    // parent: member -> writer whose slots it shared; shared tokens.
    let mut parent: HashMap<u64, u64> = HashMap::new();
    let mut shared: HashMap<u64, u32> = HashMap::new();
    // (allocated, freed by itself) slots per request on prefill pools.
    let mut held: HashMap<u64, (u64, u64)> = HashMap::new();
    let mut last_seq: HashMap<u16, u64> = HashMap::new();
    let mut missing = 0u64;
    for chunk in trace.kv_chunks() {
        let chunk = chunk?;
        for (i, e) in chunk.events.iter().enumerate() {
            let Some((cap, w)) = writer.get_mut(&e.pool) else {
                continue;
            };
            if let Some(&prev) = last_seq.get(&e.pool)
                && e.seq <= prev
            {
                return Err(Error::invalid(
                    Location::file(&chunk.file)
                        .row(chunk.first_row + i as u64)
                        .column("seq"),
                    format!(
                        "prefill pool {} events are not in seq order ({} after {prev})",
                        e.pool, e.seq
                    ),
                    "replay reads prefix sharing from prefill pools written in seq order; rewrite the trace sorted (kvtrail ingest)",
                ));
            }
            missing = missing.saturating_add(match last_seq.get(&e.pool) {
                Some(&prev) => e.seq - prev - 1,
                None => e.seq,
            });
            last_seq.insert(e.pool, e.seq);
            let a = e.slot_start as u64;
            let b = e.slot_end().min(*cap);
            match e.op {
                Op::Write => w.fill(a, b, e.request_id),
                Op::Scrub => w.fill(a, b, 0),
                Op::Alloc => held.entry(e.request_id).or_default().0 += e.slot_count as u64,
                Op::Free => held.entry(e.request_id).or_default().1 += e.slot_count as u64,
                Op::Share => {
                    if let Some(owner) = w.range(a, b).find(|&o| o != 0 && o != e.request_id) {
                        parent.entry(e.request_id).or_insert(owner);
                        let end = e.token_pos.unwrap_or(0) + e.slot_count;
                        let s = shared.entry(e.request_id).or_default();
                        *s = (*s).max(end);
                    }
                }
                Op::Read => {}
            }
        }
    }
    let root = |mut r: u64| {
        let mut hops = 0;
        while let Some(&p) = parent.get(&r) {
            if p == r || hops > 64 {
                break;
            }
            r = p;
            hops += 1;
        }
        r
    };
    let mut out: Prefixes = HashMap::new();
    for (&r, &t) in &shared {
        let g = root(r);
        out.insert(r, (g, t));
        // The root's prefix covers at least what any member shared.
        let e = out.entry(g).or_insert((g, 0));
        if e.0 == g {
            e.1 = e.1.max(t);
        }
    }
    // Writers that left pages to the radix cache.
    for (&r, &(alloc, freed)) in &held {
        if r == 0 || alloc <= freed {
            continue;
        }
        let kept = (alloc - freed).min(u32::MAX as u64) as u32;
        let e = out.entry(r).or_insert((r, 0));
        if e.0 == r {
            e.1 = e.1.max(kept);
        }
    }
    Ok((out, missing))
}
