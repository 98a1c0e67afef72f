//! What-if replay: re-run a recorded workload through the engine
//! model under another engine behaviour or configuration, compare the two
//! traces, and re-run suspect responses with the reference model
//! (counterfactual). `resolve_config` is the config a replay runs (recorded
//! or `--config`, then `--engine`, then `--set`); `replay_trace` re-runs a
//! recorded workload through `sim::run` under it. `audit` builds on the
//! recorded deployment read here.
//!
//! - `workload`: arrivals, prefix structure and deployment recovered from a trace.
//! - `extras`: trace.json's deployment extras read strictly (`VllmView`,
//!   the recorded vLLM P/D settings that replay and audit both read).
//! - `diff`: per-request comparison of two traces plus the exposure headline.
//! - `counterfactual`: reference-model re-runs of affected responses, through
//!   one swappable [`counterfactual::ModelEval`].
//!
//! The engine model itself is `crate::sim`; this module only feeds it
//! recorded arrivals through `sim::run`.

pub mod counterfactual;
pub mod diff;
pub mod extras;
pub mod workload;

use std::path::Path;

use crate::error::{Error, Location, Result};
use crate::sim::{self, EngineVersion, RunLabel, SimConfig};
use crate::trace::manifest::Role;
use crate::trace::read::Trace;

pub use workload::Workload;

/// How the replay's deployment differs from the recorded one.
#[derive(Debug, Clone, Default)]
pub struct ReplaySpec {
    /// A whole config replacing the recorded deployment.
    pub config: Option<SimConfig>,
    /// Engine behaviour (applied after `config`).
    pub engine: Option<String>,
    /// `key=value` patches (applied last, in order).
    pub sets: Vec<String>,
}

/// The what-if and audit outputs word every count through the crate's one
/// plural rule.
pub use crate::words::count;

/// The config a replay runs: recorded (or `--config`), then engine, then sets.
pub fn resolve_config(trace: &Trace, spec: &ReplaySpec) -> Result<SimConfig> {
    let mut cfg = match &spec.config {
        Some(c) => c.clone(),
        None => {
            if spec.engine.is_none() && !workload::engine_known(trace.deployment()) {
                return Err(Error::invalid(
                    Location::file(&trace.dir.join("trace.json")).column("deployment.engine"),
                    format!(
                        "engine `{}` is not one the model knows",
                        trace.deployment().engine
                    ),
                    format!(
                        "name the behaviour to replay with --engine ({})",
                        EngineVersion::names()
                    ),
                ));
            }
            workload::recorded_config(trace)?
        }
    };
    if let Some(e) = &spec.engine {
        cfg.set_engine(EngineVersion::parse_arg(e)?);
    }
    for s in &spec.sets {
        cfg.set(s)?;
    }
    cfg.validate()?;
    for (role, p) in [(Role::Prefill, &cfg.prefill), (Role::Decode, &cfg.decode)] {
        if p.capacity_tokens > MAX_SIM_POOL_TOKENS {
            let key = format!("{}.capacity_tokens", role.as_str());
            let recorded = spec.config.is_none()
                && !spec.sets.iter().any(|s| s.trim_start().starts_with(&key));
            let loc = if recorded {
                recorded_pool_key(trace, role)
            } else {
                Location::default().column(&key)
            };
            return Err(Error::invalid(
                loc,
                format!(
                    "the {} pool has {} tokens; the engine model keeps state for every slot and simulates at most {MAX_SIM_POOL_TOKENS} tokens a pool",
                    role.as_str(),
                    p.capacity_tokens
                ),
                format!(
                    "replay a smaller pool with --set {key}=N; scope, audit and diff read a trace of any pool size"
                ),
            ));
        }
    }
    if cfg.prefill.page_size != cfg.decode.page_size {
        return Err(Error::invalid(
            Location::default().column("page_size"),
            format!(
                "prefill page_size {} differs from decode page_size {}",
                cfg.prefill.page_size, cfg.decode.page_size
            ),
            "the engine model transfers whole pages of one size; set both page sizes equal",
        ));
    }
    Ok(cfg)
}

/// The largest pool a what-if replay simulates: the engine model keeps
/// state for every slot of its pools (28 bytes a slot plus the free page
/// list), so 2^26 tokens a pool is about 2 GiB.
pub const MAX_SIM_POOL_TOKENS: u64 = 1 << 26;

/// Where the recorded size of the `role` pool comes from in trace.json.
fn recorded_pool_key(trace: &Trace, role: Role) -> Location {
    let loc = Location::file(&trace.dir.join("trace.json"));
    let d = trace.deployment();
    if d.extra.contains_key("simulator") {
        return loc.column(&format!(
            "deployment.simulator.{}.capacity_tokens",
            role.as_str()
        ));
    }
    match d.pools.iter().position(|p| p.role == role) {
        Some(i) if d.pools[i].extra.contains_key("max_total_num_tokens") => {
            loc.column(&format!("deployment.pools[{i}].max_total_num_tokens"))
        }
        Some(i) => loc.column(&format!("deployment.pools[{i}].capacity_tokens")),
        None => loc.column("deployment.pools"),
    }
}

/// What a what-if replay did.
#[derive(Debug, Clone)]
pub struct ReplayRun {
    pub config: SimConfig,
    pub workload: Workload,
    pub output: sim::RunOutput,
    /// Whether the replayed trace's evidence is complete (scope's rule on
    /// its files and capture, plus the prefill pools' seq streams that the
    /// prefix structure is read from); when it is not, `evidence_notes`
    /// says what the replayed workload may lack.
    pub evidence_complete: bool,
    pub evidence_notes: Vec<String>,
}

/// Re-runs `trace`'s workload under `spec` and writes the new trace to
/// `out` (a new directory). Deterministic: the same trace and spec give a
/// byte-identical new trace.
pub fn replay_trace(
    trace: &Trace,
    spec: &ReplaySpec,
    out: &Path,
    reporter: &dyn crate::progress::Reporter,
) -> Result<ReplayRun> {
    let config = resolve_config(trace, spec)?;
    let workload = workload::extract(trace)?;
    let cov = crate::scope::trace_evidence(trace, reporter)?;
    let mut evidence_notes = cov.notes.clone();
    if workload.prefill_seq_missing > 0 {
        evidence_notes.push(format!(
            "the prefill pools' seq streams miss {}: prefix sharing recorded in them is not in the replayed workload",
            count(workload.prefill_seq_missing, "event", "events")
        ));
    }
    if !cov.files_missing.is_empty() || !cov.files_unread.is_empty() {
        evidence_notes.push(
            "requests and prefix groups of files that are missing or were not read are not in the replayed workload".into(),
        );
    }
    let evidence_complete = cov.complete && workload.prefill_seq_missing == 0;
    let label = RunLabel {
        scenario: format!("replay:{}", trace.deployment().name),
        seed: 0,
    };
    let output = sim::run(
        &config,
        workload.arrivals.iter().cloned(),
        out,
        &label,
        reporter,
    )?;
    Ok(ReplayRun {
        config,
        workload,
        output,
        evidence_complete,
        evidence_notes,
    })
}
