//! `inspect`: a one-screen summary of a trace for a responder, as data.
//!
//! Deployment, pools, capture state, time range, request and KV event counts
//! (by op, per pool), tenants, statuses, requests whose prefill computed
//! fewer tokens than the prompt, prompts longer than the prefill pool can
//! take, and the integrity of each pool's seq stream (holes, duplicates).
//! The CLI prints it; this module never prints.
//!
//! Memory: the KV tables are streamed once; seq holes come from the
//! trace-wide checks of `trace::check` (per (file, pool) run summaries, and
//! a bounded external sort only for a pool whose seqs are out of order or
//! whose files overlap), which also refuse what `verify` and `scope`
//! refuse: duplicate seqs, copy cycles. Requests go through the request
//! index (which grows with the number of requests, and rejects duplicate
//! request ids).

use std::collections::BTreeMap;

use serde::Serialize;

use crate::error::Result;
use crate::progress::Reporter;
use crate::schema::{ENGINE_REQUEST, Op, RequestRecord};
use crate::scope::anomalies::{answered_ok, short_prefill};
use crate::trace::check::{self, FileRuns};
use crate::trace::manifest::{Deployment, Role};
use crate::trace::read::Trace;
use crate::trace::request_keys::{RequestKeys, scan_requests};

pub use crate::trace::check::{Hole, MAX_HOLES_LISTED};
/// Request ids listed as examples per finding (all are counted).
pub const MAX_EXAMPLES: usize = 10;
/// Tenants listed by request count.
pub const TOP_TENANTS: usize = 10;
/// Everything `inspect` reports.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct InspectReport {
    pub deployment: DeploymentSummary,
    pub capture: CaptureSummary,
    pub files: FilesSummary,
    pub time_range: TimeRange,
    pub requests: RequestSummary,
    pub kv: KvSummary,
    /// Everything that lowers the confidence of an analysis of this trace,
    /// one sentence each (empty for a clean, complete, verifiable trace).
    pub evidence_warnings: Vec<String>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct DeploymentSummary {
    pub name: String,
    pub engine: String,
    pub context_window: u64,
    pub pools: Vec<PoolSummary>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PoolSummary {
    pub id: u16,
    pub name: String,
    pub role: String,
    pub capacity_tokens: u64,
    pub page_size: u32,
    /// Prefill/mixed pools: SGLang's `max_req_input_len` for this pool,
    /// `min(context_window - 1, capacity_tokens - 1) - 5`; a prompt of this
    /// many tokens or more is rejected (or, in the incident, replaced).
    pub max_req_input_len: Option<u64>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CaptureSummary {
    pub writer: String,
    pub started_ns: i64,
    pub ended_ns: i64,
    pub complete: bool,
    pub from_engine_start: Option<bool>,
    /// JSONL import: malformed lines skipped (lost evidence).
    pub skipped_lines: Option<u64>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FilesSummary {
    /// Files listed in trace.json; `None` when it has no `files` (then
    /// nothing can be verified).
    pub listed: Option<usize>,
    pub verifiable: bool,
    pub request_files: usize,
    pub kv_files: usize,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TimeRange {
    /// Smallest timestamp in the data (kv ts_ns, request arrival/finish).
    pub first_ns: Option<i64>,
    pub last_ns: Option<i64>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Count<K> {
    pub key: K,
    pub count: u64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Finding {
    pub count: u64,
    /// How many of them the customer got with a 2xx status.
    pub with_2xx: u64,
    /// The smallest request ids among them.
    pub examples: Vec<u64>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RequestSummary {
    pub count: u64,
    pub tenants: u64,
    /// Tenants with the most requests (ties by name).
    pub top_tenants: Vec<Count<String>>,
    /// http_status histogram, ascending.
    pub statuses: Vec<Count<u16>>,
    /// prefilled_tokens < prompt_tokens (the prefill did not compute the
    /// whole prompt, e.g. a 1-token placeholder).
    pub short_prefill: Finding,
    /// prompt_tokens ≥ the prefill pool's max_req_input_len.
    pub over_long_prompts: Finding,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct KvSummary {
    pub events: u64,
    pub by_op: Vec<Count<String>>,
    /// Events whose request_id (not 0) has no row in the requests table:
    /// `count` events, `examples` the smallest such ids (`with_2xx` unused).
    pub unknown_request_events: Finding,
    pub pools: Vec<PoolKv>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PoolKv {
    pub pool: u16,
    pub events: u64,
    pub by_op: Vec<Count<String>>,
    pub first_seq: Option<u64>,
    pub last_seq: Option<u64>,
    pub holes: u64,
    pub missing_events: u64,
    /// The first holes in seq order.
    pub holes_listed: Vec<Hole>,
    /// Always 0: a duplicate seq is bad input (an error), kept for the
    /// report's shape.
    pub duplicate_seqs: u64,
    /// "runs" (streaming) or "sort" (out of order or overlapping files:
    /// sorted externally).
    pub seq_check: String,
}

#[derive(Default)]
struct PoolAcc {
    by_op: [u64; 6],
}

/// Inspects a trace. Errors (exit 2) when any file cannot be read or breaks
/// the contract, on duplicate request ids, duplicate seqs and copy cycles
/// (the checks `verify` and `scope` make, see `trace::check`).
pub fn inspect(trace: &Trace, reporter: &dyn Reporter) -> Result<InspectReport> {
    let m = &trace.manifest;
    let dep = &m.deployment;
    let mut first_ns: Option<i64> = None;
    let mut last_ns: Option<i64> = None;
    let mut see = |t: i64| {
        first_ns = Some(first_ns.map_or(t, |f| f.min(t)));
        last_ns = Some(last_ns.map_or(t, |l| l.max(t)));
    };

    // Requests first, through the index (duplicates are an error), so the
    // KV pass can tell events of requests the table does not have.
    reporter.start("requests", trace.request_files.len() as u64);
    let mut req_acc = RequestAcc::new(dep);
    let index = scan_requests(trace, |r| req_acc.add(&r))?;
    reporter.finish();
    let mut orphans = FindingAcc::default();

    // KV: one streaming pass.
    let mut pool_index = vec![u32::MAX; u16::MAX as usize + 1];
    for (i, p) in dep.pools.iter().enumerate() {
        pool_index[p.id as usize] = i as u32;
    }
    let mut accs: Vec<PoolAcc> = dep.pools.iter().map(|_| PoolAcc::default()).collect();
    reporter.start("kv files", trace.kv_files.len() as u64);
    let (mut last_id, mut last_known) = (ENGINE_REQUEST, true);
    let mut file_runs = Vec::with_capacity(trace.kv_files.len());
    for path in &trace.kv_files {
        let mut runs = FileRuns::new(path);
        let (mut lo, mut hi) = (i64::MAX, i64::MIN);
        for chunk in trace.kv_file(path)? {
            let chunk = chunk?;
            for (i, ev) in chunk.events.iter().enumerate() {
                // The reader rejected unknown pools already.
                let pi = pool_index[ev.pool as usize] as usize;
                accs[pi].by_op[ev.op as usize] += 1;
                // A request's events come in runs: one binary search per
                // run of ids, not per event.
                if ev.request_id != last_id {
                    last_id = ev.request_id;
                    last_known = ev.request_id == ENGINE_REQUEST || index.contains(ev.request_id);
                }
                if !last_known {
                    orphans.add(ev.request_id, 0);
                }
                lo = lo.min(ev.ts_ns);
                hi = hi.max(ev.ts_ns);
                runs.push(
                    ev.pool,
                    ev.seq,
                    ev.src.map(|s| s.pool),
                    chunk.first_row + i as u64,
                )?;
            }
        }
        if lo <= hi {
            see(lo);
            see(hi);
        }
        file_runs.push(runs);
        reporter.advance(1);
    }
    reporter.finish();

    let checked = check::finish(trace, &file_runs, None, None)?;
    let mut pools_kv = Vec::with_capacity(dep.pools.len());
    for (pi, seqs) in checked.pools.into_iter().enumerate() {
        let acc = &accs[pi];
        pools_kv.push(PoolKv {
            pool: seqs.pool,
            events: acc.by_op.iter().sum(),
            by_op: op_counts(&acc.by_op),
            first_seq: seqs.first_seq,
            last_seq: seqs.last_seq,
            holes: seqs.holes,
            missing_events: seqs.missing_events,
            holes_listed: seqs.holes_listed,
            duplicate_seqs: 0,
            seq_check: seqs.check.as_str().into(),
        });
    }

    if let Some((lo, hi)) = req_acc.span {
        see(lo);
        see(hi);
    }
    let requests = req_acc.finish(&index);

    let mut total_ops = [0u64; 6];
    for acc in &accs {
        for (t, n) in total_ops.iter_mut().zip(acc.by_op) {
            *t += n;
        }
    }
    let kv = KvSummary {
        events: total_ops.iter().sum(),
        by_op: op_counts(&total_ops),
        unknown_request_events: orphans.finish(),
        pools: pools_kv,
    };
    let skipped_lines = m
        .capture
        .extra
        .get("skipped_lines")
        .and_then(|v| v.as_u64());
    let capture = CaptureSummary {
        writer: m.capture.writer.clone(),
        started_ns: m.capture.started_ns,
        ended_ns: m.capture.ended_ns,
        complete: m.capture.complete,
        from_engine_start: m.capture.from_engine_start,
        skipped_lines,
    };
    let files = FilesSummary {
        listed: m.files.as_ref().map(Vec::len),
        verifiable: m.files.is_some(),
        request_files: trace.request_files.len(),
        kv_files: trace.kv_files.len(),
    };
    let mut evidence_warnings = warnings(&capture, &files, &kv);
    // The files against trace.json (digests, rows, unlisted, unread,
    // missing), checked by scope's own rule: inspect never calls evidence
    // complete that scope would not.
    let files_checked = crate::scope::trace_evidence(trace, reporter)?;
    evidence_warnings.extend(crate::scope::file_notes(&files_checked));
    Ok(InspectReport {
        deployment: summarize_deployment(dep),
        capture,
        files,
        time_range: TimeRange { first_ns, last_ns },
        requests,
        kv,
        evidence_warnings,
    })
}

fn op_counts(by_op: &[u64; 6]) -> Vec<Count<String>> {
    Op::ALL
        .iter()
        .map(|op| Count {
            key: op.as_str().to_string(),
            count: by_op[*op as usize],
        })
        .collect()
}

fn summarize_deployment(dep: &Deployment) -> DeploymentSummary {
    DeploymentSummary {
        name: dep.name.clone(),
        engine: dep.engine.clone(),
        context_window: dep.context_window,
        pools: dep
            .pools
            .iter()
            .map(|p| PoolSummary {
                id: p.id,
                name: p.name.clone(),
                role: p.role.as_str().to_string(),
                capacity_tokens: p.capacity_tokens,
                page_size: p.page_size,
                max_req_input_len: (p.role != Role::Decode).then(|| dep.prompt_limit(p)),
            })
            .collect(),
    }
}

/// Collects a finding: counts all, keeps the smallest ids as examples.
#[derive(Default)]
struct FindingAcc {
    count: u64,
    with_2xx: u64,
    ids: Vec<u64>,
}

impl FindingAcc {
    fn add(&mut self, id: u64, status: u16) {
        self.count += 1;
        if answered_ok(status) {
            self.with_2xx += 1;
        }
        self.ids.push(id);
        if self.ids.len() >= 4 * MAX_EXAMPLES {
            self.ids.sort_unstable();
            self.ids.dedup();
            self.ids.truncate(MAX_EXAMPLES);
        }
    }
    fn finish(mut self) -> Finding {
        self.ids.sort_unstable();
        self.ids.dedup();
        self.ids.truncate(MAX_EXAMPLES);
        Finding {
            count: self.count,
            with_2xx: self.with_2xx,
            examples: self.ids,
        }
    }
}

/// The request summary, gathered row by row as the request keys are read
/// (nothing per request is kept here).
struct RequestAcc<'a> {
    dep: &'a Deployment,
    /// Earliest and latest arrival or finish time.
    span: Option<(i64, i64)>,
    statuses: BTreeMap<u16, u64>,
    short: FindingAcc,
    long: FindingAcc,
}

impl<'a> RequestAcc<'a> {
    fn new(dep: &'a Deployment) -> Self {
        RequestAcc {
            dep,
            span: None,
            statuses: BTreeMap::new(),
            short: FindingAcc::default(),
            long: FindingAcc::default(),
        }
    }

    /// Prompt limit of a request without prefill_pool: the smallest of the
    /// prefill-capable pools (the strictest one it could have landed on).
    fn limit_of(&self, pool: Option<u16>) -> Option<u64> {
        let dep = self.dep;
        match pool.and_then(|id| dep.pool(id)) {
            Some(p) => Some(dep.prompt_limit(p)),
            None => dep
                .pools
                .iter()
                .filter(|p| p.role != Role::Decode)
                .map(|p| dep.prompt_limit(p))
                .min(),
        }
    }

    fn add(&mut self, r: &RequestRecord) {
        for t in std::iter::once(r.arrival_ns).chain(r.finish_ns) {
            self.span = Some(self.span.map_or((t, t), |(lo, hi)| (lo.min(t), hi.max(t))));
        }
        *self.statuses.entry(r.http_status).or_default() += 1;
        if short_prefill(r.prompt_tokens, r.prefilled_tokens) {
            self.short.add(r.request_id, r.http_status);
        }
        if let Some(limit) = self.limit_of(r.prefill_pool)
            && r.prompt_tokens as u64 >= limit
        {
            self.long.add(r.request_id, r.http_status);
        }
    }

    fn finish(self, index: &RequestKeys) -> RequestSummary {
        let mut per_tenant = vec![0u64; index.tenants().len()];
        for (_, t) in index.iter() {
            per_tenant[t as usize] += 1;
        }
        let mut top: Vec<Count<String>> = per_tenant
            .iter()
            .enumerate()
            .map(|(i, &n)| Count {
                key: index.tenants()[i].to_string(),
                count: n,
            })
            .collect();
        top.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.key.cmp(&b.key)));
        top.truncate(TOP_TENANTS);
        RequestSummary {
            count: index.len() as u64,
            tenants: per_tenant.len() as u64,
            top_tenants: top,
            statuses: self
                .statuses
                .into_iter()
                .map(|(key, count)| Count { key, count })
                .collect(),
            short_prefill: self.short.finish(),
            over_long_prompts: self.long.finish(),
        }
    }
}

fn warnings(capture: &CaptureSummary, files: &FilesSummary, kv: &KvSummary) -> Vec<String> {
    let mut w = Vec::new();
    if kv.events == 0 {
        w.push(crate::trace::NO_KV_EVENTS.to_string());
    }
    if !capture.complete {
        w.push("capture is incomplete (capture.complete = false): events may be missing at the end; findings are lower bounds".to_string());
    }
    if let Some(n) = capture.skipped_lines {
        w.push(format!(
            "{n} malformed input lines were skipped at import: their events are lost"
        ));
    }
    if capture.from_engine_start != Some(true) {
        w.push("capture did not begin with the engine: slots never written in the trace may hold older KV (reads of them are unknown, not clean)".to_string());
    }
    if !files.verifiable {
        w.push("trace.json lists no files: nothing can be verified against digests".to_string());
    }
    if kv.unknown_request_events.count > 0 {
        w.push(format!(
            "{} kv events belong to requests missing from the requests table (e.g. request {}): who they belong to is unknown",
            kv.unknown_request_events.count,
            kv.unknown_request_events.examples.first().copied().unwrap_or(0)
        ));
    }
    for p in &kv.pools {
        if p.holes > 0 {
            w.push(format!(
                "pool {}: {} seq holes, {} events missing: replay downstream of them has lowered confidence",
                p.pool, p.holes, p.missing_events
            ));
        }
        if p.duplicate_seqs > 0 {
            w.push(format!(
                "pool {}: {} duplicate seqs: the event order is ambiguous",
                p.pool, p.duplicate_seqs
            ));
        }
    }
    w
}
