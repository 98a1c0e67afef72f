//! A shard: `scope --pools LIST` reports a subset of pools, and what it
//! adds to a scope folder is `ShardInfo` (shard.json next to summary.json:
//! its pools and every reader's read window, which a report does not carry).
//!
//! A shard's own report says what it is (`ShardInfo::mark`:
//! `coverage.shard_pools`, a note, a verdict that begins "shard of pools
//! ..."): it is never complete evidence, and `lookup` and `notify` refuse it
//! (`refuse_shard`). `load_shards` checks each shard folder against its
//! evidence.json (shard.json is one of its outputs) and that every shard was
//! made from the same trace files (the input digests its evidence.json
//! records) before anything is merged (`scope::merge`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::model::ScopeReport;
use super::verdict;
use crate::custody;
use crate::error::{Error, Location, Result};
use crate::lineage::LineageOutcome;

/// The shard file `scope --pools LIST --out DIR` writes next to summary.json.
pub const SHARD_FILE: &str = "shard.json";

/// What a shard adds to its report (shard.json next to summary.json).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardInfo {
    pub format: String,
    /// Pools this shard reports.
    pub pools: Vec<u16>,
    /// Every reader with an unclean read in these pools: (first, last) ts_ns.
    pub readers: BTreeMap<u64, (i64, i64)>,
}

impl ShardInfo {
    pub const FORMAT: &'static str = "kvtrail-scope-shard";

    pub fn from_outcome(pools: &[u16], outcome: &LineageOutcome) -> Self {
        let mut p = pools.to_vec();
        p.sort_unstable();
        p.dedup();
        ShardInfo {
            format: Self::FORMAT.into(),
            pools: p,
            readers: outcome
                .exposures
                .readers
                .iter()
                .map(|(&r, a)| (r, (a.first_ts_ns, a.last_ts_ns)))
                .collect(),
        }
    }

    /// Marks the shard's own report as a shard's: `coverage.shard_pools`,
    /// never complete, a note, and a verdict that names the pools it did
    /// not analyse (the one rule for what a shard may claim).
    pub fn mark(&self, r: &mut ScopeReport) {
        let rest: Vec<u16> = r
            .deployment
            .pools
            .iter()
            .map(|p| p.id)
            .filter(|p| !self.pools.contains(p))
            .collect();
        let c = &mut r.coverage;
        c.shard_pools = Some(self.pools.clone());
        c.complete = false;
        c.notes.push(format!(
            "this is a shard (`scope --pools`): only pools {:?} were analysed, pools {rest:?} were not; it cannot rule out exposure, and says nothing about who was not affected; `kvtrail merge` the shards of every pool",
            self.pools
        ));
        r.verdict = format!(
            "shard of pools {:?} only (pools {rest:?} not analysed; `kvtrail merge` the shards for the incident's verdict): {}",
            self.pools,
            verdict(&r.counts, &r.coverage, r.deployment.tenant_prefix_cache())
        );
    }

    /// Writes shard.json into a scope folder (owner-only); returns its path.
    /// Written before evidence.json, so that the evidence lists it.
    pub fn write(&self, dir: &Path) -> Result<PathBuf> {
        let p = dir.join(SHARD_FILE);
        let mut text = serde_json::to_string_pretty(self).expect("shard info serializes");
        text.push('\n');
        custody::write_private(&p, text)?;
        Ok(p)
    }
}

/// Refuses a shard folder where a full scope folder is needed (`lookup`,
/// `notify`): by its summary (`coverage.shard_pools`) or its shard.json.
pub fn refuse_shard(dir: &Path, summary: &ScopeReport, what: &str) -> Result<()> {
    let file = dir.join(SHARD_FILE);
    if summary.coverage.shard_pools.is_none() && !file.exists() {
        return Ok(());
    }
    let pools = summary
        .coverage
        .shard_pools
        .as_ref()
        .map(|p| format!("pools {p:?} only"))
        .unwrap_or_else(|| "some pools only".into());
    let at = if file.exists() {
        file
    } else {
        dir.join("summary.json")
    };
    Err(Error::invalid(
        Location::file(&at),
        format!(
            "this is a shard folder (`scope --pools`, {pools}): {what} needs the findings of every pool, or it would call affected customers not affected"
        ),
        "merge the shards of every pool first (`kvtrail merge SHARD_DIR... --out DIR`) and pass the merged folder",
    ))
}

/// A shard folder, checked against its evidence.json.
#[derive(Debug, Clone)]
pub struct ShardFolder {
    pub dir: PathBuf,
    pub report: ScopeReport,
    pub info: ShardInfo,
    /// Every file of the folder, re-hashed and matching its evidence.json
    /// (kind `scope`): what a merged folder's evidence.json records.
    pub files: custody::Inputs,
    /// The trace inputs the shard's evidence.json records.
    pub trace: custody::Inputs,
}

fn shard_error(p: &Path, key: Option<&str>, what: String) -> Error {
    let mut loc = Location::file(p);
    if let Some(k) = key {
        loc = loc.column(k);
    }
    Error::invalid(
        loc,
        what,
        "pass the unedited folders of `kvtrail scope TRACE --pools LIST --out DIR`, all of one trace and one kvtrail version",
    )
}

/// Reads and checks shard folders: each against its evidence.json (every
/// file, shard.json included), its shard.json against its own summary
/// (pools, read windows), and all of them against the first: the same
/// trace files (trace.json and every data file, by the digests the
/// evidence records) and the same kvtrail version.
pub fn load_shards(dirs: &[PathBuf]) -> Result<Vec<ShardFolder>> {
    let mut out: Vec<ShardFolder> = Vec::new();
    for dir in dirs {
        let ev_path = dir.join(custody::EVIDENCE_JSON);
        if !ev_path.is_file() {
            return Err(shard_error(
                &ev_path,
                None,
                "no evidence.json: not a shard folder with a chain of custody".into(),
            ));
        }
        let files = custody::folder_inputs(dir, "scope")?;
        let (ev, _) = custody::load_evidence(dir)?;
        let Some(trace) = ev.inputs.iter().find(|i| i.kind == "trace").cloned() else {
            return Err(shard_error(
                &ev_path,
                Some("inputs"),
                "records no trace input: not a shard of a trace".into(),
            ));
        };
        let read = |name: &str| -> Result<Vec<u8>> {
            let p = dir.join(name);
            std::fs::read(&p).map_err(|e| Error::io(&p, e))
        };
        let sum_path = dir.join("summary.json");
        let report = ScopeReport::from_json(&read("summary.json")?).map_err(|e| {
            shard_error(&sum_path, None, format!("not a kvtrail scope summary: {e}"))
        })?;
        let shard_path = dir.join(SHARD_FILE);
        let info: ShardInfo = serde_json::from_slice(&read(SHARD_FILE)?).map_err(|e| {
            shard_error(&shard_path, None, format!("not a kvtrail shard file: {e}"))
        })?;
        if info.format != ShardInfo::FORMAT {
            return Err(shard_error(
                &shard_path,
                Some("format"),
                format!("format {:?}, expected {}", info.format, ShardInfo::FORMAT),
            ));
        }
        if report.coverage.shard_pools.as_ref() != Some(&info.pools) {
            return Err(shard_error(
                &shard_path,
                Some("pools"),
                format!(
                    "claims pools {:?}, but the shard's summary.json reports pools {:?}",
                    info.pools, report.coverage.shard_pools
                ),
            ));
        }
        let known: BTreeSet<u16> = report.deployment.pools.iter().map(|p| p.id).collect();
        if let Some(p) = info.pools.iter().find(|p| !known.contains(p)) {
            return Err(shard_error(
                &shard_path,
                Some("pools"),
                format!("pool {p} is not in the deployment (pools {known:?})"),
            ));
        }
        if let Some((r, (a, b))) = info.readers.iter().find(|(_, (a, b))| a > b) {
            return Err(shard_error(
                &shard_path,
                Some(&format!("readers.{r}")),
                format!("read window begins at {a} after it ends at {b}"),
            ));
        }
        if let Some(first) = out.first() {
            let id = |i: &custody::Inputs| -> Vec<(String, u64, String)> {
                i.files
                    .iter()
                    .map(|f| (f.path.clone(), f.bytes, f.blake3.clone()))
                    .collect()
            };
            let (a, b) = (id(&first.trace), id(&trace));
            if a != b {
                let differs = a
                    .iter()
                    .zip(&b)
                    .find(|(x, y)| x != y)
                    .map(|(x, _)| x.0.clone())
                    .unwrap_or_else(|| "the list of files".into());
                return Err(shard_error(
                    &ev_path,
                    Some("inputs"),
                    format!(
                        "the shard was made from another trace than {} ({differs} differs): shards of different traces cannot be merged",
                        first.dir.display()
                    ),
                ));
            }
            let (fv, _) = custody::load_evidence(&first.dir)?;
            if fv.tool_version != ev.tool_version {
                return Err(shard_error(
                    &ev_path,
                    Some("tool_version"),
                    format!(
                        "written by kvtrail {}, {} by kvtrail {}",
                        ev.tool_version,
                        first.dir.display(),
                        fv.tool_version
                    ),
                ));
            }
        }
        out.push(ShardFolder {
            dir: dir.clone(),
            report,
            info,
            files,
            trace,
        });
    }
    Ok(out)
}
