//! `kvtrail replay TRACE --engine NAME [--config FILE | --set k=v ...] --out NEWTRACE [--compare]`:
//! re-run a recorded workload through the engine model under another
//! engine behaviour or configuration and capture a new trace.

use std::path::PathBuf;

use kvtrail::lineage::LineageOptions;
use kvtrail::text::term;
use kvtrail::whatif::{self, count};

use super::simulate::EngineArgs;
use crate::cli::output;
use crate::cli::progress::BarReporter;

#[derive(clap::Args, Debug)]
#[command(
    mut_arg("engine", |a| a.help("Engine behaviour (default: the recorded one)")),
    mut_arg("config", |a| a.help("Deployment config (TOML or JSON) replacing the recorded deployment")),
    mut_arg("set", |a| a.help("Override one config key, e.g. --set prefill.capacity_tokens=32768 (repeatable)")),
)]
pub struct Args {
    /// Recorded trace directory (holds trace.json).
    pub trace: PathBuf,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// New trace directory to create.
    #[arg(long)]
    pub out: PathBuf,
    /// Print `kvtrail diff TRACE NEWTRACE` after the replay.
    #[arg(long)]
    pub compare: bool,
    /// With --compare: print the diff as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let trace = kvtrail::trace::Trace::open(&args.trace)?;
    kvtrail::custody::prepare_trace_out(&args.out, &[args.trace.as_path()])?;
    let spec = args.engine.spec()?;
    let rep = BarReporter::default();
    let started = std::time::Instant::now();
    let run = whatif::replay_trace(&trace, &spec, &args.out, &rep)?;
    let secs = started.elapsed().as_secs_f64();
    let w = &run.workload;
    eprintln!(
        "kvtrail: replayed {} of {} under {} in {:.2} s ({:.0} requests/s): {} kv events -> {}",
        count(w.arrivals.len() as u64, "request", "requests"),
        term(&args.trace.display().to_string()),
        run.config.engine.name(),
        secs,
        w.arrivals.len() as f64 / secs.max(1e-9),
        run.output.stats.kv_events,
        term(&args.out.display().to_string())
    );
    let mut workload = format!(
        "kvtrail: workload: {} ({}) from share events",
        count(w.prefix_groups, "prefix group", "prefix groups"),
        count(w.prefix_members, "member", "members")
    );
    if !w.inferred_output.is_empty() {
        workload.push_str(&format!(
            "; {} without a recorded output length (not answered 2xx) got the median output length of the 2xx responses, {}",
            count(w.inferred_output.len() as u64, "request", "requests"),
            count(w.default_output as u64, "token", "tokens")
        ));
    }
    eprintln!("{workload}");
    if !run.evidence_complete {
        eprintln!(
            "kvtrail: warning: the evidence of {} is INCOMPLETE ({}); the replay re-runs only the recorded workload:",
            term(&args.trace.display().to_string()),
            count(
                run.evidence_notes.len() as u64,
                "coverage note",
                "coverage notes"
            )
        );
        for n in &run.evidence_notes {
            eprintln!("  - {}", term(n));
        }
    }
    if args.compare {
        let new = kvtrail::trace::Trace::open(&args.out)?;
        let r = whatif::diff::diff(
            &trace,
            &new,
            &LineageOptions::default(),
            &BarReporter::default(),
        )?;
        output::print(args.json, &r, |out| {
            out.write_all(super::diff::human(&r).as_bytes())
        })?;
    }
    Ok(0)
}
