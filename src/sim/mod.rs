//! The engine model and simulator (`kvtrail simulate`): a discrete-event
//! model of an SGLang-style or vLLM PD-disaggregated engine with paged KV pools,
//! captured through `capture::Recorder` exactly as a real engine hook would
//! be, with the ground truth kept apart.
//!
//! - `config`: the deployment and every engine knob (serde, TOML/JSON).
//! - `alloc`: SGLang's paged allocator and admission limit.
//! - `base`: what both engine models share: the simulated clock, pool ids,
//!   per-slot content state, `RunStats`.
//! - `sglang`: the SGLang request path, version by version.
//! - `model`: the integer-only reference model (output hashes; reused by
//!   the replay and a CUDA kernel).
//! - `workload`: arrivals, the seeded generator.
//! - `scenario`: named scenarios.
//! - `truth`: the ground-truth file.
//! - `vllm`: the vLLM 0.33.0 request path (block pool, prefix caching with
//!   `cache_salt`, the NixlConnector's lease, `kv_load_failure_policy`).
//!
//! Library callers (what-if replay) run [`run`] with any `Vec<Arrival>`.

pub mod alloc;
pub mod base;
pub mod config;
pub mod model;
pub mod scenario;
pub mod sglang;
pub mod truth;
pub mod vllm;
pub mod workload;

use std::path::Path;

use crate::capture::{Recorder, RecorderOptions};
use crate::error::Result;
use crate::progress::Reporter;
use crate::trace::manifest::{Deployment, Manifest};

pub use base::RunStats;
pub use config::{EngineVersion, SimConfig};
pub use truth::Truth;
pub use workload::Arrival;

/// Rows per Parquet row group in simulated traces.
pub const ROW_GROUP_ROWS: usize = 32 * 1024;

/// Labels written into the truth file.
#[derive(Debug, Clone)]
pub struct RunLabel {
    pub scenario: String,
    pub seed: u64,
}

/// What a run produced.
#[derive(Debug, Clone)]
pub struct RunOutput {
    pub stats: RunStats,
    pub truth: Truth,
    pub manifest: Manifest,
}

/// The trace.json deployment of a simulated run, as the engine model
/// `cfg` names describes it.
pub fn deployment(cfg: &SimConfig) -> Deployment {
    if cfg.engine.is_vllm() {
        vllm::deployment(cfg)
    } else {
        sglang::deployment(cfg)
    }
}

/// Runs the engine model over `arrivals` (sorted by arrival time, unique
/// request ids from 1) and writes a complete trace to `out` (a new
/// directory). Deterministic: the same inputs give a byte-identical trace.
pub fn run(
    cfg: &SimConfig,
    arrivals: impl IntoIterator<Item = Arrival>,
    out: &Path,
    label: &RunLabel,
    reporter: &dyn Reporter,
) -> Result<RunOutput> {
    cfg.validate()?;
    let arrivals = arrivals.into_iter();
    let (lo, hi) = arrivals.size_hint();
    reporter.start("simulate", hi.unwrap_or(lo) as u64);
    let opts = RecorderOptions {
        started_ns: Some(base::EPOCH_NS),
        from_engine_start: true,
        writer: format!("kvtrail-sim {}", env!("CARGO_PKG_VERSION")),
        // Buffered rows are the simulator's only memory that grows with
        // the run (up to this many rows per stream); keep it small.
        row_group_rows: ROW_GROUP_ROWS,
        ..RecorderOptions::default()
    };
    let mut rec = Recorder::create(out, deployment(cfg), opts)?;
    let (stats, tb) = if cfg.engine.is_vllm() {
        let mut eng = vllm::Engine::new(cfg, &mut rec, reporter);
        eng.run(arrivals)?;
        (eng.stats.clone(), std::mem::take(&mut eng.truth))
    } else {
        let mut eng = sglang::Engine::new(cfg, &mut rec, reporter);
        eng.run(arrivals)?;
        (eng.stats.clone(), std::mem::take(&mut eng.truth))
    };
    let manifest = rec.close()?;
    reporter.finish();
    let truth = tb.build(
        &label.scenario,
        cfg.engine.name(),
        label.seed,
        stats.kv_events,
    );
    Ok(RunOutput {
        stats,
        truth,
        manifest,
    })
}
