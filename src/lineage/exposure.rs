//! Aggregates the backend's read runs into per-reader exposure: distinct
//! (pool, slot) sets per source, plus blank, unknown and uncertain reads.
//!
//! Sets are interval sets, so memory follows the number of distinct
//! exposed ranges, not the number of reads. The result does not depend on
//! the order runs arrive in.

use std::collections::{BTreeMap, HashMap};

use super::backend::{ReadKind, ReadRun};
use super::intervals::IntervalSet;
use crate::schema::ENGINE_REQUEST;

/// Slots per pool.
pub type PoolSets = BTreeMap<u16, IntervalSet>;

fn add(sets: &mut PoolSets, r: &ReadRun) {
    sets.entry(r.pool)
        .or_default()
        .insert(r.slot_start as u64, r.slot_start as u64 + r.count as u64);
}

/// Distinct slots over all pools.
pub fn count(sets: &PoolSets) -> u64 {
    sets.values().map(IntervalSet::len).sum()
}

/// What one reader read of one source's KV.
#[derive(Debug, Clone, Default)]
pub struct SourceAgg {
    pub slots: PoolSets,
    /// Slots read with certain provenance (no hole involved).
    pub certain: PoolSets,
    pub first_seq: u64,
    pub last_seq: u64,
    pub first_ts_ns: i64,
    pub last_ts_ns: i64,
}

/// Everything unclean one request read.
#[derive(Debug, Clone, Default)]
pub struct ReaderAgg {
    pub sources: HashMap<u64, SourceAgg>,
    pub foreign: PoolSets,
    pub blank: PoolSets,
    pub unknown: PoolSets,
    pub uncertain: PoolSets,
    pub first_ts_ns: i64,
    pub last_ts_ns: i64,
}

/// Each request's tenant as a small key (the trace's request keys): a
/// shared read between two requests of the same known tenant is no
/// cross-tenant prefix-cache hit and is dropped as it arrives, so memory
/// follows cross-tenant hits, not every prefix hit.
#[derive(Debug, Clone, Default)]
pub struct TenantKeys {
    keys: crate::trace::request_keys::RequestKeys,
}

/// Where [`TenantKeys`] come from: loaded when the first shared read of
/// another request's KV arrives, so a replay without prefix hits never
/// reads them (and holds nothing for them).
#[derive(Clone)]
pub struct TenantKeysSource(std::sync::Arc<dyn Fn() -> TenantKeys + Send + Sync>);

impl TenantKeysSource {
    pub fn new(load: impl Fn() -> TenantKeys + Send + Sync + 'static) -> Self {
        TenantKeysSource(std::sync::Arc::new(load))
    }
}

impl std::fmt::Debug for TenantKeysSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TenantKeysSource")
    }
}

impl TenantKeys {
    pub fn new(keys: crate::trace::request_keys::RequestKeys) -> Self {
        TenantKeys { keys }
    }

    /// Whether both requests are known and of the same tenant.
    pub fn same(&self, a: u64, b: u64) -> bool {
        matches!((self.keys.tenant_key(a), self.keys.tenant_key(b)), (Some(x), Some(y)) if x == y)
    }
}

/// Per-reader aggregation of all read runs.
#[derive(Debug, Clone, Default)]
pub struct Exposures {
    pub readers: HashMap<u64, ReaderAgg>,
    /// Clean shared reads of another request's KV (prefix-cache hits):
    /// reader -> source -> slots. Kept apart from `readers`, which holds
    /// only what is not clean.
    pub shared: HashMap<u64, HashMap<u64, PoolSets>>,
    /// When set, shared reads within one tenant are not kept: the keys,
    /// loaded from `tenant_source` on the first shared read.
    pub tenant_source: Option<TenantKeysSource>,
    pub tenants: Option<TenantKeys>,
}

impl Exposures {
    pub fn add_runs(&mut self, runs: &[ReadRun]) {
        for r in runs {
            if r.kind == ReadKind::Shared {
                // The engine's reads affect no response, and content the
                // engine wrote is no tenant's.
                if r.reader == ENGINE_REQUEST || r.source == ENGINE_REQUEST {
                    continue;
                }
                if self.tenants.is_none()
                    && let Some(src) = &self.tenant_source
                {
                    self.tenants = Some((src.0)());
                }
                if self
                    .tenants
                    .as_ref()
                    .is_some_and(|t| t.same(r.reader, r.source))
                {
                    continue;
                }
                let by_source = self.shared.entry(r.reader).or_default();
                add(by_source.entry(r.source).or_default(), r);
                continue;
            }
            let ra = self.readers.entry(r.reader).or_insert_with(|| ReaderAgg {
                first_ts_ns: r.ts_ns,
                last_ts_ns: r.ts_ns,
                ..Default::default()
            });
            ra.first_ts_ns = ra.first_ts_ns.min(r.ts_ns);
            ra.last_ts_ns = ra.last_ts_ns.max(r.ts_ns);
            match r.kind {
                ReadKind::Foreign => {
                    add(&mut ra.foreign, r);
                    let s = ra.sources.entry(r.source).or_insert_with(|| SourceAgg {
                        first_seq: r.seq,
                        last_seq: r.seq,
                        first_ts_ns: r.ts_ns,
                        last_ts_ns: r.ts_ns,
                        ..Default::default()
                    });
                    add(&mut s.slots, r);
                    if !r.uncertain {
                        add(&mut s.certain, r);
                    }
                    s.first_seq = s.first_seq.min(r.seq);
                    s.last_seq = s.last_seq.max(r.seq);
                    s.first_ts_ns = s.first_ts_ns.min(r.ts_ns);
                    s.last_ts_ns = s.last_ts_ns.max(r.ts_ns);
                }
                ReadKind::Blank => add(&mut ra.blank, r),
                ReadKind::Unknown => add(&mut ra.unknown, r),
                ReadKind::Uncertain => add(&mut ra.uncertain, r),
                ReadKind::Shared => {} // kept apart above
            }
        }
    }
}
