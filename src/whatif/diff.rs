//! `kvtrail diff`: what changed between a trace and its what-if replay,
//! request by request (matched by request_id), plus the headline: exposure
//! before vs after (scope on both traces).
//!
//! Per request: HTTP status, prefilled tokens, foreign tokens read (scope),
//! output hash, latency (finish - arrival), queueing (first allocation on
//! the request's decode pool - arrival: the time it waited for decode
//! capacity) and the decode capacity it held (slot-seconds from its first
//! allocation to its last free). Rejected requests (status >= 400) that
//! held decode slots are summed separately: that is the capacity the fixed
//! engine's timeout path keeps away from other traffic.
//!
//! The two traces must hold the same workload (per request present in
//! both: tenant, prompt_tokens, prompt_hash where both have one, arrival
//! offset from the first request); otherwise diff refuses them.
//!
//! Slot-seconds per request are order-independent sums (sum of free times
//! minus sum of alloc times, weighted by slots), so unsorted kv files are
//! fine. Memory: one small record per request of each trace.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use crate::error::{Error, Location, Result};
use crate::lineage::LineageOptions;
use crate::progress::Reporter;
use crate::schema::{Op, RequestRecord};
use crate::scope::model::{Confidence, Response, Tenant};
use crate::scope::{ScopeReport, scope};
use crate::trace::manifest::Role;
use crate::trace::read::Trace;

/// Per-request KV accounting on decode pools.
#[derive(Debug, Clone, Copy, Default)]
struct Hold {
    alloc_slots: u64,
    alloc_ts: i128,
    free_slots: u64,
    free_ts: i128,
    first_alloc: Option<i64>,
    last_free: Option<i64>,
    /// Prompt positions the request computed itself on a decode pool (a
    /// write without a copy source): vLLM recomputes a pulled prompt's last
    /// token, and the whole prompt after a failed load under `recompute`.
    decode_prompt_tokens: u64,
}

impl Hold {
    /// Slot-nanoseconds held (slots never freed count until `end`).
    fn slot_ns(&self, end: i64) -> i128 {
        let open = self.alloc_slots.saturating_sub(self.free_slots) as i128;
        self.free_ts + open * end as i128 - self.alloc_ts
    }
}

fn holds(trace: &Trace, reqs: &BTreeMap<u64, RequestRecord>) -> Result<(HashMap<u64, Hold>, i64)> {
    let decode: Vec<u16> = trace
        .deployment()
        .pools
        .iter()
        .filter(|p| p.role == Role::Decode)
        .map(|p| p.id)
        .collect();
    let mut m: HashMap<u64, Hold> = HashMap::new();
    let mut end = i64::MIN;
    for chunk in trace.kv_chunks() {
        for e in chunk?.events {
            end = end.max(e.ts_ns);
            if !decode.contains(&e.pool) {
                continue;
            }
            let n = e.slot_count as u64;
            match e.op {
                Op::Alloc => {
                    let h = m.entry(e.request_id).or_default();
                    h.alloc_slots += n;
                    h.alloc_ts += n as i128 * e.ts_ns as i128;
                    h.first_alloc = Some(h.first_alloc.map_or(e.ts_ns, |t| t.min(e.ts_ns)));
                }
                Op::Free => {
                    let h = m.entry(e.request_id).or_default();
                    h.free_slots += n;
                    h.free_ts += n as i128 * e.ts_ns as i128;
                    h.last_free = Some(h.last_free.map_or(e.ts_ns, |t| t.max(e.ts_ns)));
                }
                Op::Write if e.src.is_none() => {
                    if let (Some(p), Some(r)) = (e.token_pos, reqs.get(&e.request_id)) {
                        let end = (p as u64 + n).min(r.prompt_tokens as u64);
                        if end > p as u64 {
                            m.entry(e.request_id).or_default().decode_prompt_tokens +=
                                end - p as u64;
                        }
                    }
                }
                _ => {}
            }
        }
    }
    Ok((m, end))
}

/// One side of a request's comparison.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Side {
    pub http_status: u16,
    pub prefilled_tokens: Option<u32>,
    pub output_tokens: u32,
    pub foreign_tokens: u64,
    /// The foreign reads behind `foreign_tokens` (scope): how sure, and
    /// whose KV, per source request. None when the request read none.
    pub foreign_reads: Option<ForeignReads>,
    pub latency_ms: Option<f64>,
    /// First decode allocation - arrival.
    pub decode_queue_ms: Option<f64>,
    /// Decode slot-seconds held.
    pub decode_slot_seconds: f64,
    /// First decode allocation to last decode free.
    pub decode_hold_ms: Option<f64>,
    pub output_hash_same: Option<bool>,
    /// Prompt tokens the request computed on decode (see
    /// `DiffReport::decode_prompt_tokens`).
    pub decode_prompt_tokens: u64,
}

/// A response's foreign reads as scope reports them, without what differs
/// between two runs of the same workload by construction (seq numbers and
/// times): two requests read the same foreign KV when these are equal.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ForeignReads {
    pub confidence: Confidence,
    pub cross_tenant: bool,
    /// Distinct (pool, slot) read as foreign, of unknown origin, and
    /// uncertain after a hole.
    pub foreign_tokens: u64,
    pub unknown_tokens: u64,
    pub uncertain_tokens: u64,
    /// foreign | unknown_predates_capture | after_gap
    pub reasons: Vec<String>,
    /// Sorted by request id.
    pub sources: Vec<ForeignSource>,
}

/// One request whose KV a response read.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ForeignSource {
    pub request_id: u64,
    pub tenant: Tenant,
    /// Distinct (pool, slot) of this source read.
    pub tokens: u64,
    /// The pools the reads were on.
    pub pools: Vec<u16>,
    pub cross_tenant: bool,
    pub confidence: Confidence,
}

impl ForeignReads {
    fn of(a: &Response) -> ForeignReads {
        let mut sources: Vec<ForeignSource> = a
            .sources
            .iter()
            .map(|s| {
                let mut pools = s.pools.clone();
                pools.sort_unstable();
                ForeignSource {
                    request_id: s.request_id,
                    tenant: s.tenant.clone(),
                    tokens: s.tokens,
                    pools,
                    cross_tenant: s.cross_tenant,
                    confidence: s.confidence,
                }
            })
            .collect();
        sources.sort_by(|x, y| (x.request_id, &x.tenant).cmp(&(y.request_id, &y.tenant)));
        let mut reasons = a.reasons.clone();
        reasons.sort();
        ForeignReads {
            confidence: a.confidence,
            cross_tenant: a.cross_tenant,
            foreign_tokens: a.foreign_tokens,
            unknown_tokens: a.unknown_tokens,
            uncertain_tokens: a.uncertain_tokens,
            reasons,
            sources,
        }
    }
}

/// A request whose outcome changed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Changed {
    pub request_id: u64,
    pub external_id: Option<String>,
    pub tenant: String,
    pub prompt_tokens: u32,
    /// status, prefilled, foreign_reads_gone / foreign_reads_new /
    /// foreign_reads_changed (other sources, tenants, token counts, pools
    /// or confidence), output.
    pub what: Vec<String>,
    pub before: Side,
    pub after: Side,
}

/// Exposure of one trace (from scope).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Exposure {
    pub engine: String,
    pub affected_responses: u64,
    pub cross_tenant_responses: u64,
    pub foreign_tokens: u64,
    pub evidence_complete: bool,
    pub verdict: String,
    /// Requests of this trace that the other trace does not hold (no
    /// request row and no finding there): the comparison cannot speak
    /// for them.
    pub requests_not_in_other: u64,
    /// Of those, the ones scope found affected in this trace.
    pub affected_not_in_other: u64,
    /// Said when the other trace holds requests this one does not: what
    /// this side's verdict cannot speak for.
    pub comparison_note: Option<String>,
}

/// Decode capacity held by rejected requests (status >= 400).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RejectedHold {
    pub requests: u64,
    pub slot_seconds: f64,
    /// Most slots held at once by rejected requests.
    pub peak_slots: u64,
    pub max_hold_ms: f64,
    pub mean_hold_ms: f64,
}

/// Latency distribution (ms) over requests present in both traces.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Latency {
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub decode_queue_mean_ms: f64,
    pub decode_queue_max_ms: f64,
}

/// Before/after pair.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Pair<T> {
    pub before: T,
    pub after: T,
}

/// The diff report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DiffReport {
    pub format: String,
    pub version: u64,
    pub before_trace: String,
    pub after_trace: String,
    pub headline: String,
    pub exposure: Pair<Exposure>,
    pub status_counts: Pair<BTreeMap<u16, u64>>,
    /// "200->400" -> count.
    pub status_transitions: BTreeMap<String, u64>,
    pub rejected_decode_hold: Pair<RejectedHold>,
    /// Over the requests whose status and reads did not change.
    pub unchanged_latency: Pair<Latency>,
    pub requests_compared: u64,
    pub unchanged: u64,
    /// Unchanged requests whose latency moved by more than 1 ms.
    pub unchanged_latency_moved: u64,
    /// Unchanged requests (own and shared reads only, in both traces) whose
    /// output hash differs: in the reference model a shared prefix carries
    /// the KV of whichever group member wrote it into the radix cache, and
    /// new timing can make another member the writer. Not an exposure.
    pub clean_output_differs: u64,
    /// Prompt tokens computed on decode pools, all requests: the cost of
    /// recomputing KV that a transfer did not deliver (vLLM recomputes
    /// each pulled prompt's last token; `kv_load_failure_policy =
    /// recompute` prefills a failed load's prompt again on decode).
    pub decode_prompt_tokens: Pair<u64>,
    pub changed: Vec<Changed>,
    pub only_before: Vec<u64>,
    pub only_after: Vec<u64>,
}

struct TraceView {
    reqs: BTreeMap<u64, RequestRecord>,
    holds: HashMap<u64, Hold>,
    end: i64,
    foreign: HashMap<u64, (u64, ForeignReads)>,
    scope: ScopeReport,
}

impl TraceView {
    /// The requests of this trace that `other` cannot be compared on:
    /// those with a request row or a finding here but no request row
    /// there (a response without a row on both sides is in both scopes
    /// and counted by each; it has no row to compare).
    fn not_in(&self, other: &TraceView) -> Vec<u64> {
        let mut ids: Vec<u64> = self
            .reqs
            .keys()
            .chain(self.foreign.keys())
            .copied()
            .filter(|id| {
                !other.reqs.contains_key(id)
                    && (self.reqs.contains_key(id) || !other.foreign.contains_key(id))
            })
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

fn requests(trace: &Trace) -> Result<BTreeMap<u64, RequestRecord>> {
    let mut reqs = BTreeMap::new();
    for b in trace.requests() {
        for r in b? {
            reqs.insert(r.request_id, r);
        }
    }
    Ok(reqs)
}

/// Earliest arrival of the replayable requests (request_id 0 is not
/// replayed), the origin of the arrival offsets compared below.
fn first_arrival(reqs: &BTreeMap<u64, RequestRecord>) -> i128 {
    reqs.values()
        .filter(|r| r.request_id != 0)
        .map(|r| r.arrival_ns as i128)
        .min()
        .unwrap_or(0)
}

/// Refuses two traces that do not hold the same workload: every request
/// present in both must have the same tenant, prompt_tokens, prompt_hash
/// (where both have one) and arrival offset from the trace's first arrival
/// (a replay keeps these; it may move the clock's origin).
fn same_workload(
    before: &Trace,
    after: &Trace,
    b: &BTreeMap<u64, RequestRecord>,
    a: &BTreeMap<u64, RequestRecord>,
) -> Result<()> {
    let (b0, a0) = (first_arrival(b), first_arrival(a));
    for (id, rb) in b {
        let Some(ra) = a.get(id) else { continue };
        let hex = |h: &[u8; 32]| {
            h[..8]
                .iter()
                .map(|x| format!("{x:02x}"))
                .collect::<String>()
        };
        let mismatch = if rb.tenant != ra.tenant {
            Some(("tenant", "a different tenant".to_string()))
        } else if rb.prompt_tokens != ra.prompt_tokens {
            Some((
                "prompt_tokens",
                format!("prompt_tokens {} vs {}", rb.prompt_tokens, ra.prompt_tokens),
            ))
        } else if let (Some(x), Some(y)) = (&rb.prompt_hash, &ra.prompt_hash)
            && x != y
        {
            Some((
                "prompt_hash",
                format!("prompt_hash {}... vs {}...", hex(x), hex(y)),
            ))
        } else if rb.arrival_ns as i128 - b0 != ra.arrival_ns as i128 - a0 {
            Some((
                "arrival_ns",
                format!(
                    "arrival {} ns vs {} ns after the first request",
                    rb.arrival_ns as i128 - b0,
                    ra.arrival_ns as i128 - a0
                ),
            ))
        } else {
            None
        };
        if let Some((column, what)) = mismatch {
            return Err(Error::invalid(
                Location::file(&after.dir.join("requests")).column(column),
                format!(
                    "request_id {id} is not the same request in {} and {}: {what}; the traces hold different workloads",
                    before.dir.display(),
                    after.dir.display()
                ),
                "diff compares a trace with its what-if replay (kvtrail replay TRACE --out NEWTRACE); give the trace the replay was made from",
            ));
        }
    }
    Ok(())
}

fn view(
    trace: &Trace,
    reqs: BTreeMap<u64, RequestRecord>,
    opts: &LineageOptions,
    rep: &dyn Reporter,
) -> Result<TraceView> {
    let scope = scope(trace, opts, rep)?;
    let (holds, end) = holds(trace, &reqs)?;
    let foreign = scope
        .affected_responses
        .iter()
        .map(|a| (a.request_id, (a.exposed_tokens, ForeignReads::of(a))))
        .collect();
    Ok(TraceView {
        reqs,
        holds,
        end,
        foreign,
        scope,
    })
}

fn ms(ns: i64) -> f64 {
    ns as f64 / 1e6
}

fn side(v: &TraceView, r: &RequestRecord, other: Option<&RequestRecord>) -> Side {
    let h = v.holds.get(&r.request_id).copied().unwrap_or_default();
    Side {
        http_status: r.http_status,
        prefilled_tokens: r.prefilled_tokens,
        output_tokens: r.output_tokens,
        foreign_tokens: v.foreign.get(&r.request_id).map_or(0, |f| f.0),
        foreign_reads: v.foreign.get(&r.request_id).map(|f| f.1.clone()),
        latency_ms: r.finish_ns.map(|f| ms(f - r.arrival_ns)),
        decode_queue_ms: h.first_alloc.map(|t| ms(t - r.arrival_ns)),
        decode_slot_seconds: h.slot_ns(v.end) as f64 / 1e9,
        decode_hold_ms: match (h.first_alloc, h.last_free) {
            (Some(a), Some(f)) => Some(ms(f - a)),
            (Some(a), None) => Some(ms(v.end - a)),
            _ => None,
        },
        output_hash_same: other.and_then(|o| match (r.output_hash, o.output_hash) {
            (Some(a), Some(b)) => Some(a == b),
            _ => None,
        }),
        decode_prompt_tokens: h.decode_prompt_tokens,
    }
}

/// `v`'s exposure, compared with `other` (named `other_name`, "first"
/// or "second", in the note).
fn exposure(v: &TraceView, other: &TraceView, other_name: &str) -> Exposure {
    let c = &v.scope.counts;
    let not_in_other = v.not_in(other);
    let affected_not_in_other = not_in_other
        .iter()
        .filter(|id| v.foreign.contains_key(id))
        .count() as u64;
    let missing_here = other.not_in(v);
    let missing_affected = missing_here
        .iter()
        .filter(|id| other.foreign.contains_key(id))
        .count() as u64;
    let comparison_note = (!missing_here.is_empty()).then(|| {
        format!(
            "this trace does not hold {} of the {other_name} trace ({missing_affected} affected there): this side's verdict cannot speak for {}",
            super::count(missing_here.len() as u64, "request", "requests"),
            if missing_here.len() == 1 { "it" } else { "them" }
        )
    });
    Exposure {
        engine: v.scope.deployment.engine.clone(),
        affected_responses: c.affected_responses,
        cross_tenant_responses: c.cross_tenant_responses,
        foreign_tokens: c.foreign_tokens,
        evidence_complete: v.scope.coverage.complete,
        verdict: v.scope.verdict.clone(),
        requests_not_in_other: not_in_other.len() as u64,
        affected_not_in_other,
        comparison_note,
    }
}

fn rejected_hold(v: &TraceView) -> RejectedHold {
    let mut out = RejectedHold::default();
    let mut sweep: Vec<(i64, i64)> = Vec::new();
    let mut holds_ms = Vec::new();
    for r in v.reqs.values() {
        if r.http_status < 400 {
            continue;
        }
        let Some(h) = v.holds.get(&r.request_id) else {
            continue;
        };
        let Some(a) = h.first_alloc else { continue };
        let f = h.last_free.unwrap_or(v.end);
        out.requests += 1;
        out.slot_seconds += h.slot_ns(v.end) as f64 / 1e9;
        let slots = h.alloc_slots as i64;
        sweep.push((a, slots));
        sweep.push((f, -slots));
        holds_ms.push(ms(f - a));
    }
    sweep.sort_unstable_by_key(|&(t, d)| (t, d));
    let mut cur = 0i64;
    for (_, d) in sweep {
        cur += d;
        out.peak_slots = out.peak_slots.max(cur.max(0) as u64);
    }
    if !holds_ms.is_empty() {
        out.max_hold_ms = holds_ms.iter().cloned().fold(0.0, f64::max);
        out.mean_hold_ms = holds_ms.iter().sum::<f64>() / holds_ms.len() as f64;
    }
    out
}

fn latency(lat: &mut [f64], queue: &[f64]) -> Latency {
    if lat.is_empty() {
        return Latency::default();
    }
    lat.sort_by(|a, b| a.total_cmp(b));
    let q = |p: f64| lat[((lat.len() - 1) as f64 * p).round() as usize];
    Latency {
        mean_ms: lat.iter().sum::<f64>() / lat.len() as f64,
        p50_ms: q(0.5),
        p99_ms: q(0.99),
        max_ms: lat[lat.len() - 1],
        decode_queue_mean_ms: if queue.is_empty() {
            0.0
        } else {
            queue.iter().sum::<f64>() / queue.len() as f64
        },
        decode_queue_max_ms: queue.iter().cloned().fold(0.0, f64::max),
    }
}

/// Compares `before` with `after` (requests matched by request_id; the
/// same workload, else `Error::Invalid`).
pub fn diff(
    before: &Trace,
    after: &Trace,
    opts: &LineageOptions,
    rep: &dyn Reporter,
) -> Result<DiffReport> {
    let (rb, ra) = (requests(before)?, requests(after)?);
    same_workload(before, after, &rb, &ra)?;
    let b = view(before, rb, opts, rep)?;
    let a = view(after, ra, opts, rep)?;
    let mut changed = Vec::new();
    let mut transitions: BTreeMap<String, u64> = BTreeMap::new();
    let (mut lat_b, mut lat_a, mut q_b, mut q_a) = (vec![], vec![], vec![], vec![]);
    let mut unchanged = 0;
    let mut clean_output_differs = 0;
    let mut moved = 0;
    let mut compared = 0;
    for (id, rb) in &b.reqs {
        let Some(ra) = a.reqs.get(id) else {
            continue;
        };
        compared += 1;
        let sb = side(&b, rb, Some(ra));
        let sa = side(&a, ra, Some(rb));
        if sb.http_status != sa.http_status {
            *transitions
                .entry(format!("{}->{}", sb.http_status, sa.http_status))
                .or_default() += 1;
        }
        let mut what = Vec::new();
        if sb.http_status != sa.http_status {
            what.push("status".to_string());
        }
        if sb.prefilled_tokens != sa.prefilled_tokens {
            what.push("prefilled".to_string());
        }
        match (&sb.foreign_reads, &sa.foreign_reads) {
            (Some(_), None) => what.push("foreign_reads_gone".to_string()),
            (None, Some(_)) => what.push("foreign_reads_new".to_string()),
            (Some(x), Some(y)) if x != y || sb.foreign_tokens != sa.foreign_tokens => {
                what.push("foreign_reads_changed".to_string())
            }
            _ => {}
        }
        let clean = sb.foreign_reads.is_none() && sa.foreign_reads.is_none();
        if sb.output_hash_same == Some(false) {
            if clean && what.is_empty() {
                clean_output_differs += 1;
            } else {
                what.push("output".to_string());
            }
        }
        if what.is_empty() {
            unchanged += 1;
            if let (Some(x), Some(y)) = (sb.latency_ms, sa.latency_ms) {
                lat_b.push(x);
                lat_a.push(y);
                if (x - y).abs() > 1.0 {
                    moved += 1;
                }
            }
            q_b.extend(sb.decode_queue_ms);
            q_a.extend(sa.decode_queue_ms);
            continue;
        }
        changed.push(Changed {
            request_id: *id,
            external_id: rb.external_id.clone(),
            tenant: rb.tenant.clone(),
            prompt_tokens: rb.prompt_tokens,
            what,
            before: sb,
            after: sa,
        });
    }
    let (only_before, only_after) = (b.not_in(&a), a.not_in(&b));
    let counts = |v: &TraceView| {
        let mut m = BTreeMap::new();
        for r in v.reqs.values() {
            *m.entry(r.http_status).or_default() += 1;
        }
        m
    };
    let exposure = Pair {
        before: exposure(&b, &a, "second"),
        after: exposure(&a, &b, "first"),
    };
    let rejected = Pair {
        before: rejected_hold(&b),
        after: rejected_hold(&a),
    };
    let dpt = |v: &TraceView| {
        v.holds
            .values()
            .map(|h| h.decode_prompt_tokens)
            .sum::<u64>()
    };
    let decode_prompt_tokens = Pair {
        before: dpt(&b),
        after: dpt(&a),
    };
    let mut headline = headline(
        &exposure,
        &transitions,
        &rejected.after,
        unchanged,
        compared,
    );
    if decode_prompt_tokens.before != decode_prompt_tokens.after {
        headline.push_str(&format!(
            "; prompt tokens computed on decode: {} -> {}",
            decode_prompt_tokens.before, decode_prompt_tokens.after
        ));
    }
    Ok(DiffReport {
        format: "kvtrail-diff".into(),
        version: 1,
        before_trace: before.dir.display().to_string(),
        after_trace: after.dir.display().to_string(),
        headline,
        exposure,
        status_counts: Pair {
            before: counts(&b),
            after: counts(&a),
        },
        status_transitions: transitions,
        rejected_decode_hold: rejected,
        unchanged_latency: Pair {
            before: latency(&mut lat_b, &q_b),
            after: latency(&mut lat_a, &q_a),
        },
        requests_compared: compared,
        unchanged,
        unchanged_latency_moved: moved,
        clean_output_differs,
        decode_prompt_tokens,
        changed,
        only_before,
        only_after,
    })
}

fn headline(
    e: &Pair<Exposure>,
    t: &BTreeMap<String, u64>,
    held: &RejectedHold,
    unchanged: u64,
    compared: u64,
) -> String {
    use super::count;
    let evid = |x: &Exposure| {
        if x.evidence_complete {
            ""
        } else {
            " (evidence INCOMPLETE)"
        }
    };
    let mut s = format!(
        "exposure: {} ({} cross-tenant, {}) under {}{} -> {} ({} cross-tenant, {}) under {}{}",
        count(
            e.before.affected_responses,
            "affected response",
            "affected responses"
        ),
        e.before.cross_tenant_responses,
        count(e.before.foreign_tokens, "foreign token", "foreign tokens"),
        e.before.engine,
        evid(&e.before),
        e.after.affected_responses,
        e.after.cross_tenant_responses,
        count(e.after.foreign_tokens, "foreign token", "foreign tokens"),
        e.after.engine,
        evid(&e.after),
    );
    let (ob, oa) = (&e.before, &e.after);
    if ob.requests_not_in_other + oa.requests_not_in_other > 0 {
        s.push_str(&format!(
            "; NOT COMPARED: {} only in the first trace ({} affected there), {} only in the second ({} affected there): the comparison cannot speak for them",
            count(ob.requests_not_in_other, "request", "requests"),
            ob.affected_not_in_other,
            oa.requests_not_in_other,
            oa.affected_not_in_other
        ));
    }
    if !t.is_empty() {
        let parts: Vec<String> = t.iter().map(|(k, v)| format!("{v} x {k}")).collect();
        s.push_str(&format!("; status: {}", parts.join(", ")));
    }
    if held.requests > 0 {
        s.push_str(&format!(
            "; {} decode capacity: {:.1} slot-seconds, peak {}, up to {:.1} s each",
            count(
                held.requests,
                "rejected request holds",
                "rejected requests hold"
            ),
            held.slot_seconds,
            count(held.peak_slots, "slot", "slots"),
            held.max_hold_ms / 1000.0
        ));
    }
    s.push_str(&format!(
        "; {unchanged} of {} unchanged",
        count(compared, "request", "requests")
    ));
    s
}
