//! `kvtrail simulate`: run a named scenario through the engine model and
//! write a trace, plus the ground truth to a separate file.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use kvtrail::sim::{self, EngineVersion, RunLabel, SimConfig, scenario};
use kvtrail::text::term;
use kvtrail::whatif::ReplaySpec;

use crate::cli::progress::BarReporter;

/// A name flag whose accepted values come from the table of the code
/// that accepts them: help and shell completions list them, and the value
/// goes through as given, so the library's own parse (with its hints)
/// decides, and what the help lists is what it accepts.
#[derive(Clone, Debug)]
pub struct Listed(fn() -> Vec<&'static str>);

impl clap::builder::TypedValueParser for Listed {
    type Value = String;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<String, clap::Error> {
        clap::builder::StringValueParser::new().parse_ref(cmd, arg, value)
    }

    fn possible_values(
        &self,
    ) -> Option<Box<dyn Iterator<Item = clap::builder::PossibleValue> + '_>> {
        Some(Box::new(
            (self.0)()
                .into_iter()
                .map(clap::builder::PossibleValue::new),
        ))
    }
}

/// The scenarios `sim::scenario::scenario` builds.
pub fn scenario_names() -> Vec<&'static str> {
    scenario::SCENARIOS.to_vec()
}

/// The engines `EngineVersion::parse_arg` accepts.
pub fn engine_names() -> Vec<&'static str> {
    EngineVersion::ALL.iter().map(|e| e.name()).collect()
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Scenario (docs/simulator.md).
    #[arg(long, value_parser = Listed(scenario_names))]
    pub scenario: String,
    /// Number of requests (default: the scenario's).
    #[arg(long)]
    pub requests: Option<u64>,
    /// Workload seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Trace directory to create.
    #[arg(long)]
    pub out: PathBuf,
    /// Write the ground truth (JSON) here.
    #[arg(long)]
    pub truth: Option<PathBuf>,
    /// OpenSSH ed25519 private key (owner-only, no passphrase): seal the finished trace (seals/, docs/evidence.md).
    #[arg(long, value_name = "FILE")]
    pub signing_key: Option<PathBuf>,
}

/// The engine flags of `simulate` and `replay`: which engine behaviour and
/// deployment config the model runs. `replay` words their help for a
/// recorded trace (`mut_arg` there); the flags and their order are one.
#[derive(clap::Args, Debug)]
pub struct EngineArgs {
    /// Engine behaviour (default: the scenario's).
    #[arg(long, value_parser = Listed(engine_names))]
    pub engine: Option<String>,
    /// Deployment config (TOML or JSON) replacing the scenario's.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override one config key, e.g. --set allow_auto_truncate=true (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

impl EngineArgs {
    /// The flags as the engine model takes them: `--config` loaded, then
    /// `--engine`, then every `--set` in order.
    pub fn spec(&self) -> anyhow::Result<ReplaySpec> {
        Ok(ReplaySpec {
            config: match &self.config {
                Some(p) => Some(SimConfig::load(p)?),
                None => None,
            },
            engine: self.engine.clone(),
            sets: self.set.clone(),
        })
    }
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let mut sc = scenario::scenario(&args.scenario, args.requests, args.seed)?;
    let spec = args.engine.spec()?;
    if let Some(c) = spec.config {
        sc.config = c;
    }
    if let Some(e) = &spec.engine {
        sc.config.set_engine(EngineVersion::parse_arg(e)?);
    }
    for s in &spec.sets {
        sc.config.set(s)?;
    }
    sc.config.validate()?;
    let key = super::verify::load_key(args.signing_key.as_deref())?;
    kvtrail::custody::prepare_trace_out(&args.out, &[])?;
    sc.fit_workload();
    let label = RunLabel {
        scenario: sc.name.clone(),
        seed: args.seed,
    };
    let started = std::time::Instant::now();
    let out = sim::run(
        &sc.config,
        sim::workload::Generator::new(sc.workload.clone()),
        &args.out,
        &label,
        &BarReporter::default(),
    )?;
    super::verify::seal_written(&args.out, key, "simulate")?;
    if let Some(path) = &args.truth {
        out.truth
            .store(path)
            .with_context(|| format!("writing the truth to {}", path.display()))?;
    }
    let s = &out.truth.summary;
    let mut err = std::io::stderr().lock();
    writeln!(
        err,
        "simulated {} requests ({}, {}) in {:.2}s: {} kv events, {} over-long prompts, {} affected responses ({} cross-tenant), {} foreign tokens, {} blank reads",
        out.stats.requests,
        term(&sc.name),
        sc.config.engine.name(),
        started.elapsed().as_secs_f64(),
        out.stats.kv_events,
        out.stats.over_long,
        s.affected_responses,
        s.cross_tenant_responses,
        s.foreign_tokens,
        s.blank_reads,
    )?;
    writeln!(err, "trace: {}", term(&args.out.display().to_string()))?;
    Ok(0)
}
