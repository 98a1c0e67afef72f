//! The plan: a trace's shards (`lineage::shard::plan_shards`, planned here
//! natively, so a trace that cannot be read or replayed is refused before
//! Spark starts), and the plan file the Spark job reads (`JobPlan`: the
//! trace as the executors see it, the binary's name, the backend, where
//! the shards go, one `index`/`pools` entry per shard).

use std::path::Path;

use serde::Serialize;

use super::place;
use crate::error::{Error, Result};
use crate::lineage::BackendChoice;
use crate::lineage::shard::{ShardGroup, plan_shards};
use crate::trace::read::Trace;

/// The shards of a trace.
pub fn plan(trace: &Path) -> Result<Vec<ShardGroup>> {
    let t = Trace::open(trace)?;
    let shards = plan_shards(&t)?;
    Ok(shards)
}

/// The plan file the job reads (fleet/spark_scope.py's PLAN.json).
#[derive(Debug, Serialize)]
pub struct JobPlan<'a> {
    format: &'static str,
    trace: String,
    binary: String,
    backend: &'static str,
    direct: bool,
    staging: String,
    shards: Vec<JobShard<'a>>,
}

/// One shard of the job: its number (`shard-NNNN`) and its pools.
#[derive(Debug, Serialize)]
struct JobShard<'a> {
    index: usize,
    pools: &'a [u16],
}

impl<'a> JobPlan<'a> {
    pub const FORMAT: &'static str = "kvtrail-fleet-spark-plan";

    /// The plan of `shards` of `trace`, run by the shipped `binary` (its
    /// file name) on `backend`, the shards going to `staging` (the driver's
    /// folder: written there directly by the executors for a local trace,
    /// by the job from the executors' lines for a remote one).
    pub fn new(
        trace: &Path,
        binary: &Path,
        backend: BackendChoice,
        staging: &Path,
        shards: &'a [ShardGroup],
    ) -> Result<Self> {
        Ok(JobPlan {
            format: Self::FORMAT,
            trace: place::executor_arg(trace)?,
            binary: binary
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "kvtrail".into()),
            backend: backend.name(),
            direct: !place::is_remote(trace),
            staging: staging.display().to_string(),
            shards: shards
                .iter()
                .enumerate()
                .map(|(index, s)| JobShard {
                    index,
                    pools: &s.pools,
                })
                .collect(),
        })
    }

    /// Writes the plan file.
    pub fn write(&self, path: &Path) -> Result<()> {
        let bytes = serde_json::to_vec_pretty(self).expect("a plan serializes");
        std::fs::write(path, bytes).map_err(|e| Error::io(path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn golden() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/golden-v1")
    }

    #[test]
    fn the_shards_cover_every_pool_once() {
        let shards = plan(&golden()).unwrap();
        assert!(!shards.is_empty());
        let t = Trace::open(&golden()).unwrap();
        let mut reported: Vec<u16> = shards.iter().flat_map(|s| s.pools.clone()).collect();
        reported.sort_unstable();
        let mut all: Vec<u16> = t.manifest.deployment.pools.iter().map(|p| p.id).collect();
        all.sort_unstable();
        assert_eq!(reported, all);
        for s in &shards {
            assert!(s.pools.iter().all(|p| s.replays.contains(p)), "{s:?}");
        }
    }

    #[test]
    fn an_unreadable_trace_is_refused_while_planning() {
        let tmp = tempfile::tempdir().unwrap();
        let e = plan(tmp.path()).unwrap_err().to_string();
        assert!(e.contains("trace.json"), "{e}");
    }

    #[test]
    fn the_plan_file_names_each_shard_the_binary_and_the_staging_folder() {
        let shards = plan(&golden()).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let p = JobPlan::new(
            &golden(),
            Path::new("/opt/bin/kvtrail-x86"),
            BackendChoice::Cpu,
            Path::new("/shared/.out.shards.abc"),
            &shards,
        )
        .unwrap();
        let file = tmp.path().join("plan.json");
        p.write(&file).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
        assert_eq!(v["format"], JobPlan::FORMAT);
        assert_eq!(v["binary"], "kvtrail-x86");
        assert_eq!(v["backend"], "cpu");
        assert_eq!(v["direct"], true);
        assert_eq!(v["staging"], "/shared/.out.shards.abc");
        assert!(Path::new(v["trace"].as_str().unwrap()).is_absolute());
        let listed = v["shards"].as_array().unwrap();
        assert_eq!(listed.len(), shards.len());
        for (i, (l, s)) in listed.iter().zip(&shards).enumerate() {
            assert_eq!(l["index"], i);
            assert_eq!(l["pools"], serde_json::json!(s.pools));
        }
        let remote = JobPlan::new(
            Path::new("s3://b/t"),
            Path::new("kvtrail"),
            BackendChoice::Auto,
            Path::new("/s"),
            &shards,
        )
        .unwrap();
        let v = serde_json::to_value(&remote).unwrap();
        assert_eq!(v["direct"], false);
        assert_eq!(v["trace"], "s3://b/t");
        assert_eq!(v["backend"], "auto");
    }
}
