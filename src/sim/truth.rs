//! Ground truth of a simulated run, from the simulator's own bookkeeping at
//! the moment of each read (never from the trace): which responses read
//! foreign KV, whose, and how much; which read blank slots; which read
//! another tenant's KV through a prefix-cache hit.
//!
//! The truth follows content, as docs/trace-format.md "Semantics"
//! (revision 2) does: each slot carries its content owner and whether that
//! content is current (put there after the slot's latest `alloc`: by a
//! write, a scrub, or a copy of current content) or stale (left over from
//! an earlier holder; a copy carries the source's bit). A read of slot s by
//! request R is own (s's content owner is R), shared (R holds a share
//! grant on s, given while s's content was current, and s was not written
//! since), blank (s never written or scrubbed; simulated captures begin
//! with the engine) or foreign (anything else; the content owner is the
//! source). A grant on stale content covers nothing: a decode radix tree
//! that hands out a placeholder's never-written pages hands out an earlier
//! customer's KV, and the truth names that customer.
//! `foreign_tokens` counts distinct (pool, slot) pairs read as foreign; a
//! source's `tokens` counts distinct (pool, slot) pairs read as foreign while
//! that source was the content owner (a slot read twice under different
//! owners counts once in the total and once for each source).
//! `cross_tenant_shared` lists responses with shared reads of another
//! tenant's content (the prefix-cache side channel), counted the same way;
//! it and its summary count are left out of the file when there are none.
//! `garbage` lists responses that read KV of no request: content a load
//! put there from outside the source pool (vLLM's out-of-range remote block
//! ids, vllm-project/vllm#52234), counted as distinct (pool, slot) pairs;
//! such a read is neither own, shared, blank nor foreign, and a capture
//! records the load as a hole (docs/engine-vllm.md). It and its summary
//! count are left out of the file when there are none.
//!
//! Written as JSON to the file given by `--truth`; the replay never reads it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Value of `format` in a truth file.
pub const TRUTH_FORMAT: &str = "kvtrail-sim-truth";

/// One source of foreign KV in a response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Source {
    pub request_id: u64,
    pub tenant: String,
    pub tokens: u64,
}

/// A response that read at least one foreign slot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Affected {
    pub request_id: u64,
    pub tenant: String,
    pub http_status: u16,
    pub foreign_tokens: u64,
    /// Some source has a different tenant.
    pub cross_tenant: bool,
    /// Sorted by request_id.
    pub sources: Vec<Source>,
}

/// A response with shared reads of another tenant's KV (a prefix-cache hit
/// on content another tenant's request wrote).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CrossTenantShared {
    pub request_id: u64,
    pub tenant: String,
    /// Distinct (pool, slot) pairs read as shared with another tenant's
    /// content.
    pub tokens: u64,
    /// Sorted by request_id.
    pub sources: Vec<Source>,
}

/// A request that read blank slots (an integrity defect, not a leak).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlankReads {
    pub request_id: u64,
    pub blank_tokens: u64,
}

/// A response that read slots holding KV of no request (loaded from
/// outside the source pool): an integrity defect whose content nobody can
/// name, answered with `http_status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GarbageReads {
    pub request_id: u64,
    pub tenant: String,
    pub http_status: u16,
    pub garbage_tokens: u64,
}

/// Totals.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    pub requests: u64,
    pub affected_responses: u64,
    pub cross_tenant_responses: u64,
    pub foreign_tokens: u64,
    pub blank_reads: u64,
    /// Responses listed in `cross_tenant_shared`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cross_tenant_shared_responses: u64,
    /// Responses listed in `garbage`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub garbage_responses: u64,
    /// Customer HTTP status -> number of requests.
    pub status_counts: BTreeMap<u16, u64>,
    pub kv_events: u64,
}

/// The truth file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Truth {
    pub format: String,
    pub version: u64,
    pub scenario: String,
    pub engine: String,
    pub seed: u64,
    pub summary: Summary,
    /// Sorted by request_id.
    pub affected: Vec<Affected>,
    /// Sorted by request_id.
    pub blank: Vec<BlankReads>,
    /// Sorted by request_id.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cross_tenant_shared: Vec<CrossTenantShared>,
    /// Sorted by request_id.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub garbage: Vec<GarbageReads>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Truth {
    pub fn store(&self, path: &Path) -> Result<()> {
        let mut s = serde_json::to_string_pretty(self).expect("truth serializes");
        s.push('\n');
        std::fs::write(path, s).map_err(|e| Error::io(path, e))
    }

    pub fn load(path: &Path) -> Result<Truth> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        serde_json::from_str(&text).map_err(|e| {
            Error::invalid(
                crate::error::Location::file(path).row(e.line() as u64),
                format!("not a truth file: {e}"),
                "give the file written by `kvtrail simulate --truth`",
            )
        })
    }

    pub fn affected_ids(&self) -> Vec<u64> {
        self.affected.iter().map(|a| a.request_id).collect()
    }
}

/// What one live request has read so far (kept only while it runs).
#[derive(Debug, Default)]
pub(crate) struct ReadLog {
    /// (source request, pool<<32|slot)
    pub foreign: BTreeSet<(u64, u64)>,
    pub blank: BTreeSet<u64>,
    /// (source request, pool<<32|slot) read as shared with content of
    /// another tenant
    pub cross_shared: BTreeSet<(u64, u64)>,
    /// pool<<32|slot read while holding KV of no request
    pub garbage: BTreeSet<u64>,
    /// source request -> tenant index (the engine's tenant table)
    pub src_tenant: BTreeMap<u64, u32>,
}

/// Accumulates the truth as requests finish.
#[derive(Debug, Default)]
pub(crate) struct TruthBuilder {
    pub summary: Summary,
    pub affected: Vec<Affected>,
    pub blank: Vec<BlankReads>,
    pub cross_tenant_shared: Vec<CrossTenantShared>,
    pub garbage: Vec<GarbageReads>,
}

/// Distinct keys and per-source counts of (source, pool<<32|slot) pairs.
fn by_source(
    reads: &BTreeSet<(u64, u64)>,
    tenant_of: &impl Fn(u64) -> String,
) -> (u64, Vec<Source>) {
    let distinct: BTreeSet<u64> = reads.iter().map(|&(_, k)| k).collect();
    let mut sources: Vec<Source> = Vec::new();
    for &(src, _) in reads {
        match sources.last_mut() {
            Some(s) if s.request_id == src => s.tokens += 1,
            _ => sources.push(Source {
                request_id: src,
                tenant: tenant_of(src),
                tokens: 1,
            }),
        }
    }
    (distinct.len() as u64, sources)
}

impl TruthBuilder {
    /// Folds a finished request's read log in. `tenant_of` names a source.
    pub fn finish(
        &mut self,
        request_id: u64,
        tenant: &str,
        http_status: u16,
        log: ReadLog,
        tenant_of: impl Fn(u64) -> String,
    ) {
        self.summary.requests += 1;
        *self.summary.status_counts.entry(http_status).or_default() += 1;
        if !log.blank.is_empty() {
            self.summary.blank_reads += log.blank.len() as u64;
            self.blank.push(BlankReads {
                request_id,
                blank_tokens: log.blank.len() as u64,
            });
        }
        if !log.garbage.is_empty() {
            self.summary.garbage_responses += 1;
            self.garbage.push(GarbageReads {
                request_id,
                tenant: tenant.to_string(),
                http_status,
                garbage_tokens: log.garbage.len() as u64,
            });
        }
        if !log.cross_shared.is_empty() {
            let (tokens, sources) = by_source(&log.cross_shared, &tenant_of);
            self.summary.cross_tenant_shared_responses += 1;
            self.cross_tenant_shared.push(CrossTenantShared {
                request_id,
                tenant: tenant.to_string(),
                tokens,
                sources,
            });
        }
        if log.foreign.is_empty() {
            return;
        }
        let (distinct, sources) = by_source(&log.foreign, &tenant_of);
        let cross = sources.iter().any(|s| s.tenant != tenant);
        self.summary.affected_responses += 1;
        self.summary.cross_tenant_responses += cross as u64;
        self.summary.foreign_tokens += distinct;
        self.affected.push(Affected {
            request_id,
            tenant: tenant.to_string(),
            http_status,
            foreign_tokens: distinct,
            cross_tenant: cross,
            sources,
        });
    }

    pub fn build(mut self, scenario: &str, engine: &str, seed: u64, kv_events: u64) -> Truth {
        self.affected.sort_by_key(|a| a.request_id);
        self.blank.sort_by_key(|b| b.request_id);
        self.cross_tenant_shared.sort_by_key(|c| c.request_id);
        self.garbage.sort_by_key(|g| g.request_id);
        self.summary.kv_events = kv_events;
        Truth {
            format: TRUTH_FORMAT.into(),
            version: 1,
            scenario: scenario.into(),
            engine: engine.into(),
            seed,
            summary: self.summary,
            affected: self.affected,
            blank: self.blank,
            cross_tenant_shared: self.cross_tenant_shared,
            garbage: self.garbage,
        }
    }
}
