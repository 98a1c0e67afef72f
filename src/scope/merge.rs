//! Merging shard reports: `merge` combines the reports of shards
//! (`scope::shard`: `scope --pools LIST` runs on a subset of pools) into the
//! report a single run over every pool gives, field for field (the same
//! bytes once written by `report::write_out`).
//!
//! Every per-response number is a count of distinct (pool, slot) pairs, and
//! shards own disjoint pools, so counts add up; seqs and times combine by
//! min/max; tenant tables, counts, coverage notes and the verdict are
//! recomputed from the merged responses exactly as `scope_outcome` does.
//! The one thing a report does not carry is when a reader's blank-only
//! reads happened (they count into `first_read_ns`/`last_read_ns` of a
//! response affected through another pool), so each shard also writes a
//! `ShardInfo` (shard.json) with every reader's read window.
//!
//! The merged folder is a full scope folder
//! (`report::writer::write_merged_folder`). See docs/fleet.md.

use std::collections::{BTreeMap, BTreeSet};

use super::model::*;
use super::shard::ShardInfo;
use super::{finish_coverage, lost_events, verdict};
use crate::error::{Error, Result};

fn mismatch(what: &str) -> Error {
    Error::Other(format!(
        "merge: the shards disagree on {what}: they must come from the same trace and kvtrail version"
    ))
}

/// `merge` of shards whose signed statements were not checked: the report
/// is marked "shards not authenticated" (`coverage.shards_not_authenticated`,
/// a coverage note, never complete evidence, and the verdict says so).
pub fn merge_unauthenticated(parts: &[(ScopeReport, ShardInfo)]) -> Result<ScopeReport> {
    let mut r = merge(parts)?;
    r.coverage.shards_not_authenticated = true;
    finish_coverage(&mut r.coverage);
    r.verdict = format!(
        "shards not authenticated: {}",
        verdict(&r.counts, &r.coverage, r.deployment.tenant_prefix_cache())
    );
    Ok(r)
}

/// Merges shard reports (any order) into the single-run report. The shards'
/// pools must be disjoint and cover every pool of the deployment.
pub fn merge(parts: &[(ScopeReport, ShardInfo)]) -> Result<ScopeReport> {
    let Some((first, _)) = parts.first() else {
        return Err(Error::Other("merge: no shard given".into()));
    };
    let mut owner: BTreeMap<u16, usize> = BTreeMap::new();
    for (i, (r, s)) in parts.iter().enumerate() {
        if s.format != ShardInfo::FORMAT {
            return Err(Error::Other(format!(
                "merge: shard {i} has format {:?}, expected {}",
                s.format,
                ShardInfo::FORMAT
            )));
        }
        if r.format != first.format || r.version != first.version {
            return Err(mismatch("the report format"));
        }
        if r.deployment != first.deployment {
            return Err(mismatch("the deployment"));
        }
        if r.anomalies != first.anomalies || r.counts.requests != first.counts.requests {
            return Err(mismatch("the requests table"));
        }
        let c = (&r.coverage, &first.coverage);
        if c.0.capture_complete != c.1.capture_complete
            || c.0.from_engine_start != c.1.from_engine_start
            || c.0.unverifiable != c.1.unverifiable
            || c.0.files_missing != c.1.files_missing
            || c.0.files_not_in_manifest != c.1.files_not_in_manifest
            || c.0.files_unread != c.1.files_unread
            || c.0.files_modified != c.1.files_modified
            || c.0.files_rows_differ != c.1.files_rows_differ
            || c.0.skipped_lines != c.1.skipped_lines
            || r.counts.kv_files != first.counts.kv_files
        {
            return Err(mismatch("the capture and its files"));
        }
        for &p in &s.pools {
            if let Some(j) = owner.insert(p, i) {
                return Err(Error::Other(format!(
                    "merge: pool {p} is reported by shards {j} and {i}; give each pool to one shard"
                )));
            }
        }
    }
    let missing: Vec<u16> = first
        .deployment
        .pools
        .iter()
        .map(|p| p.id)
        .filter(|p| !owner.contains_key(p))
        .collect();
    if !missing.is_empty() {
        return Err(Error::Other(format!(
            "merge: no shard reports pools {missing:?}; run scope --pools for them too"
        )));
    }

    // Read windows of every reader, over all shards.
    let mut windows: BTreeMap<u64, (i64, i64)> = BTreeMap::new();
    for (_, s) in parts {
        for (&r, &(a, b)) in &s.readers {
            let e = windows.entry(r).or_insert((a, b));
            e.0 = e.0.min(a);
            e.1 = e.1.max(b);
        }
    }

    // Responses.
    let mut resp: BTreeMap<u64, Response> = BTreeMap::new();
    for (r, _) in parts {
        for a in &r.affected_responses {
            match resp.get_mut(&a.request_id) {
                None => {
                    resp.insert(a.request_id, a.clone());
                }
                Some(m) => {
                    m.foreign_tokens = m.foreign_tokens.saturating_add(a.foreign_tokens);
                    m.unknown_tokens = m.unknown_tokens.saturating_add(a.unknown_tokens);
                    m.uncertain_tokens = m.uncertain_tokens.saturating_add(a.uncertain_tokens);
                    m.exposed_tokens = m.exposed_tokens.saturating_add(a.exposed_tokens);
                    for s in &a.sources {
                        match m.sources.iter_mut().find(|x| x.request_id == s.request_id) {
                            None => m.sources.push(s.clone()),
                            Some(x) => {
                                x.tokens = x.tokens.saturating_add(s.tokens);
                                x.first_seq = x.first_seq.min(s.first_seq);
                                x.last_seq = x.last_seq.max(s.last_seq);
                                x.first_ts_ns = x.first_ts_ns.min(s.first_ts_ns);
                                x.last_ts_ns = x.last_ts_ns.max(s.last_ts_ns);
                                x.pools.extend(&s.pools);
                                x.pools.sort_unstable();
                                x.pools.dedup();
                                if s.confidence == Confidence::Confirmed {
                                    x.confidence = Confidence::Confirmed;
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    let mut affected: Vec<Response> = resp.into_values().collect();
    let mut window = TimeWindow::default();
    for a in &mut affected {
        a.sources.sort_by_key(|s| s.request_id);
        a.cross_tenant = a.sources.iter().any(|s| s.cross_tenant);
        a.confidence = if a
            .sources
            .iter()
            .any(|s| s.confidence == Confidence::Confirmed)
        {
            Confidence::Confirmed
        } else {
            Confidence::Possible
        };
        a.reasons.clear();
        if a.foreign_tokens > 0 {
            a.reasons.push("foreign".into());
        }
        if a.unknown_tokens > 0 {
            a.reasons.push("unknown_predates_capture".into());
        }
        if a.uncertain_tokens > 0 {
            a.reasons.push("after_gap".into());
        }
        if let Some(&(f, l)) = windows.get(&a.request_id) {
            a.first_read_ns = f;
            a.last_read_ns = l;
        }
        window.include(a.first_read_ns, a.last_read_ns, a.arrival_ns);
    }

    // Blank reads.
    let mut blank: BTreeMap<u64, BlankReads> = BTreeMap::new();
    for (r, _) in parts {
        for b in &r.blank_read_responses {
            blank
                .entry(b.request_id)
                .and_modify(|x| x.tokens = x.tokens.saturating_add(b.tokens))
                .or_insert_with(|| b.clone());
        }
    }
    let blank_read_responses: Vec<BlankReads> = blank.into_values().collect();

    let (recipients, sources) = super::tenants(&affected);

    // Coverage.
    let mut cov = first.coverage.clone();
    cov.shard_pools = None;
    cov.gaps = parts
        .iter()
        .flat_map(|(r, _)| r.coverage.gaps.iter().copied())
        .collect();
    cov.gaps
        .sort_by_key(|g| (g.pool, g.after_seq, g.before_seq));
    cov.lost_events = lost_events(&cov.gaps);
    // The trace holds no KV event only when no shard replayed one.
    cov.no_kv_events = parts.iter().all(|(r, _)| r.coverage.no_kv_events);
    let mut past: BTreeMap<u16, (u64, u64)> = BTreeMap::new();
    for (r, _) in parts {
        for c in &r.coverage.copies_past_end {
            let e = past.entry(c.pool).or_insert((c.min_src_seq, c.max_src_seq));
            e.0 = e.0.min(c.min_src_seq);
            e.1 = e.1.max(c.max_src_seq);
        }
    }
    cov.copies_past_end = past
        .into_iter()
        .map(|(pool, (lo, hi))| CopiesPastEnd {
            pool,
            min_src_seq: lo,
            max_src_seq: hi,
        })
        .collect();
    let missing: BTreeSet<u64> = parts
        .iter()
        .flat_map(|(r, _)| r.coverage.requests_missing.iter().copied())
        .collect();
    cov.requests_missing = missing.into_iter().collect();
    // Shards report disjoint pools: their engine slots add up.
    cov.engine_reads = parts
        .iter()
        .fold(0u64, |n, (r, _)| n.saturating_add(r.coverage.engine_reads));
    finish_coverage(&mut cov);

    // Counts come from files: saturating, never wrapping.
    let sum = |f: fn(&Counts) -> u64| {
        parts
            .iter()
            .fold(0u64, |n, (r, _)| n.saturating_add(f(&r.counts)))
    };
    let counts = Counts {
        requests: first.counts.requests,
        kv_files: first.counts.kv_files,
        kv_events: sum(|c| c.kv_events),
        slot_touches: sum(|c| c.slot_touches),
        read_events: sum(|c| c.read_events),
        read_slots: sum(|c| c.read_slots),
        anomalies: first.anomalies.len() as u64,
        spilled_events: sum(|c| c.spilled_events),
        ..Counts::of_findings(&affected, &recipients, &sources)
    };
    let cross_tenant_shared = merge_shared_hits(parts.iter().map(|(r, _)| r));
    let counts = Counts {
        cross_tenant_shared_responses: cross_tenant_shared.len() as u64,
        ..counts
    };
    let blank_reads = blank_read_responses
        .iter()
        .fold(0u64, |n, b| n.saturating_add(b.tokens));
    Ok(ScopeReport {
        format: first.format.clone(),
        version: first.version,
        verdict: verdict(&counts, &cov, first.deployment.tenant_prefix_cache()),
        deployment: first.deployment.clone(),
        time_window: window,
        counts,
        affected_responses: affected,
        recipients,
        sources,
        blank_reads,
        blank_read_responses,
        cross_tenant_shared,
        anomalies: first.anomalies.clone(),
        coverage: cov,
    })
}

/// The shards' cross-tenant prefix-cache hits as one list: shards report
/// disjoint pools, so a response's tokens, and each source's, add up.
fn merge_shared_hits<'a>(reports: impl Iterator<Item = &'a ScopeReport>) -> Vec<SharedHit> {
    let mut by_reader: BTreeMap<u64, SharedHit> = BTreeMap::new();
    for r in reports {
        for h in &r.cross_tenant_shared {
            let m = by_reader.entry(h.request_id).or_insert_with(|| SharedHit {
                request_id: h.request_id,
                external_id: h.external_id.clone(),
                tenant: h.tenant.clone(),
                tokens: 0,
                sources: Vec::new(),
            });
            m.tokens = m.tokens.saturating_add(h.tokens);
            for s in &h.sources {
                match m.sources.iter_mut().find(|x| x.request_id == s.request_id) {
                    Some(x) => x.tokens = x.tokens.saturating_add(s.tokens),
                    None => m.sources.push(s.clone()),
                }
            }
        }
    }
    let mut hits: Vec<SharedHit> = by_reader.into_values().collect();
    for h in &mut hits {
        h.sources.sort_by_key(|s| s.request_id);
    }
    hits
}
