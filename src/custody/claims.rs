//! A scope folder's claims about its trace (coverage, holes, files
//! unread or missing) re-derived from the trace and compared: a folder
//! whose claims hide what the trace shows fails.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use crate::custody::evidence::FolderProblem;
use crate::error::{Error, Location, Result};

/// The report a scope folder holds its coverage in.
pub(crate) const SUMMARY_JSON: &str = "summary.json";

/// What a scope folder's summary.json says about its evidence
/// (`coverage`), read without the scope types (custody sits below scope).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct ClaimedCoverage {
    complete: bool,
    capture_complete: bool,
    gaps: Vec<ClaimedGap>,
    files_unread: Vec<String>,
    files_missing: Vec<String>,
    no_kv_events: bool,
    shard_pools: Option<Vec<u16>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
struct ClaimedGap {
    pool: u16,
    after_seq: Option<u64>,
    before_seq: u64,
}

impl ClaimedGap {
    fn missing(&self) -> u64 {
        self.before_seq
            .saturating_sub(self.after_seq.map_or(0, |a| a.saturating_add(1)))
    }
}

#[derive(Deserialize)]
struct ClaimedSummary {
    coverage: ClaimedCoverage,
}

/// What the evidence is, re-derived (from a trace, or a shard's claims).
#[derive(Debug, Default)]
pub(crate) struct DerivedEvidence {
    capture_complete: bool,
    /// Per pool: seq holes and events lost.
    holes: BTreeMap<u16, (u64, u64)>,
    /// Pools the derivation speaks for (None: every pool of the trace).
    pools: Option<Vec<u16>>,
    files_unread: Vec<String>,
    files_missing: Vec<String>,
    no_kv_events: bool,
    /// Anything that makes the evidence incomplete.
    incomplete: bool,
}

impl ClaimedCoverage {
    /// A shard's claims as evidence for the folder merged from it.
    pub(crate) fn as_derived(&self) -> DerivedEvidence {
        let mut holes: BTreeMap<u16, (u64, u64)> = BTreeMap::new();
        for g in &self.gaps {
            let e = holes.entry(g.pool).or_default();
            e.0 += 1;
            e.1 = e.1.saturating_add(g.missing());
        }
        DerivedEvidence {
            capture_complete: self.capture_complete,
            pools: Some(holes.keys().copied().collect()),
            holes,
            files_unread: self.files_unread.clone(),
            files_missing: self.files_missing.clone(),
            // A shard without events says nothing of the merged trace's.
            no_kv_events: false,
            incomplete: !self.gaps.is_empty()
                || !self.files_unread.is_empty()
                || !self.files_missing.is_empty()
                || !self.capture_complete,
        }
    }
}

/// Reads the coverage a summary.json claims, streaming (a summary of many
/// findings is never held whole).
pub(crate) fn read_claims(path: &Path) -> Result<ClaimedCoverage> {
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let s: ClaimedSummary = serde_json::from_reader(std::io::BufReader::new(f)).map_err(|e| {
        Error::invalid(
            Location::file(path),
            format!("not a scope summary: {e}"),
            "summary.json is written by `kvtrail scope --out`; restore the folder as written",
        )
    })?;
    Ok(s.coverage)
}

/// Re-derives from the trace what a scope run must say about it: seq
/// holes per pool (the structural check `verify` runs), the files the
/// readers skip or miss ([`crate::trace::files::reader_skips`]), the
/// capture state and whether there are KV events at all. No replay.
pub(crate) fn derive_from_trace(root: &Path) -> Result<DerivedEvidence> {
    use crate::trace::files::reader_skips;
    use crate::trace::read::{Trace, rel_path};
    let (trace, refused) = Trace::scan(root)?;
    if let Some(e) = refused.into_iter().next() {
        return Err(e);
    }
    let m = &trace.manifest;
    let kv = crate::trace::check::check_kv(&trace, None, None)?;
    let mut d = DerivedEvidence {
        capture_complete: m.capture.complete,
        ..Default::default()
    };
    let mut events = 0u64;
    for p in &kv.pools {
        events = events.saturating_add(p.events);
        d.holes.insert(p.pool, (p.holes, p.missing_events));
    }
    d.no_kv_events = events == 0;
    let on_disk: std::collections::BTreeSet<String> = trace
        .request_files
        .iter()
        .chain(&trace.kv_files)
        .map(|p| rel_path(root, p))
        .collect();
    for sub in ["requests", "kv"] {
        for (p, _) in trace.unread_files(sub) {
            d.files_unread.push(rel_path(root, &p));
        }
    }
    for f in m.files.iter().flatten() {
        if on_disk.contains(&f.path) {
            continue;
        }
        if reader_skips(&f.path).is_some() {
            d.files_unread.push(f.path.clone());
        } else {
            d.files_missing.push(f.path.clone());
        }
    }
    d.files_unread.sort();
    d.files_unread.dedup();
    d.incomplete = !d.capture_complete
        || d.no_kv_events
        || m.files.is_none()
        || !d.files_unread.is_empty()
        || !d.files_missing.is_empty();
    Ok(d)
}

/// Names every way the claims `c` of a folder hide what `d` (re-derived
/// from input `from`) shows.
pub(crate) fn compare_claims(
    c: &ClaimedCoverage,
    d: &DerivedEvidence,
    from: &str,
    out: &mut Vec<FolderProblem>,
) {
    let mut push = |detail: String| {
        out.push(FolderProblem {
            side: "output".into(),
            path: SUMMARY_JSON.into(),
            kind: "contradicts".into(),
            detail: format!(
                "{detail} (re-derived from {from}): the folder does not say what its evidence holds"
            ),
        })
    };
    let mut claimed: BTreeMap<u16, (u64, u64)> = BTreeMap::new();
    for g in &c.gaps {
        let e = claimed.entry(g.pool).or_default();
        e.0 += 1;
        e.1 = e.1.saturating_add(g.missing());
    }
    // The pools the folder reports: a shard's own, or all.
    let reported = |pool: u16| c.shard_pools.as_ref().is_none_or(|s| s.contains(&pool));
    let mut hidden_holes = false;
    for (&pool, &(holes, lost)) in &d.holes {
        if !reported(pool) || d.pools.as_ref().is_some_and(|p| !p.contains(&pool)) {
            continue;
        }
        let (ch, cl) = claimed.get(&pool).copied().unwrap_or((0, 0));
        if (ch, cl) != (holes, lost) {
            hidden_holes |= ch < holes || cl < lost;
            push(format!(
                "pool {pool}: summary.json lists {ch} seq holes ({cl} events lost), the evidence holds {holes} ({lost} lost)"
            ));
        }
    }
    for f in &d.files_unread {
        if !c.files_unread.contains(f) {
            push(format!(
                "{f} may hold rows no reader reads, and summary.json does not list it as unread"
            ));
        }
    }
    for f in &d.files_missing {
        if !c.files_missing.contains(f) {
            push(format!(
                "{f} is listed in trace.json but missing, and summary.json does not say so"
            ));
        }
    }
    if c.capture_complete && !d.capture_complete {
        push("summary.json says the capture closed cleanly, the evidence says it did not".into());
    }
    if d.no_kv_events && !c.no_kv_events {
        push("the trace holds no KV events, and summary.json does not say so".into());
    }
    if c.complete && (d.incomplete || hidden_holes) {
        push("summary.json calls the evidence complete, and it is not".into());
    }
}
