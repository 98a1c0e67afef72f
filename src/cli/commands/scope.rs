//! `kvtrail scope TRACE`: replay a trace and report every affected
//! response, its sources, the tenants on both sides and the coverage.

use std::path::PathBuf;

use kvtrail::lineage::BackendChoice;
use kvtrail::report;
use kvtrail::report::fmt::term;
use kvtrail::scope::ScopeReport;
use kvtrail::scope::run::{ScopeRun, Scoped};

use crate::cli::output;
use crate::cli::progress::BarReporter;

/// Replay backend on the command line.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default)]
pub enum BackendArg {
    /// CUDA when built with `--features cuda` and a GPU is usable, else CPU.
    #[default]
    Auto,
    /// The CPU reference backend.
    Cpu,
    /// The CUDA backend (exit 2 when it cannot run here).
    Cuda,
    /// The GPU kernels emulated on the CPU (tests and debugging; slow).
    #[value(hide = true)]
    Emu,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Trace directory (holds trace.json).
    pub trace: PathBuf,
    /// Write responses.csv, tenants.csv, findings.parquet, summary.json, requests.csv, timeline.json, report.html, findings.ocsf.jsonl, timeline.jsonl and evidence.json here (a new or empty folder outside the trace; owner-only files).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// With --out: replace an earlier `kvtrail scope --out` folder of the same trace (it must hold nothing but the files its evidence.json lists).
    #[arg(long, requires = "out")]
    pub force: bool,
    /// Print the full report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// Replay backend.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    pub backend: BackendArg,
    /// Exit with 1 when any response is affected (confirmed or possible), or when the trace holds no KV events (no evidence either way).
    #[arg(long)]
    pub fail_on_exposure: bool,
    /// Shard: report only these pools (comma-separated ids); the pools their
    /// copies read from are replayed but not reported. --out then also gets
    /// shard.json; combine shards with `kvtrail merge`.
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub pools: Option<Vec<u16>>,
    /// Threads of the replay and its other parallel steps on the CPU (default: every core, or RAYON_NUM_THREADS
    /// when set; at most 1024); the report is byte-identical for every value.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=kvtrail::lineage::MAX_THREADS as i64))]
    pub threads: Option<u16>,
}

impl From<BackendArg> for BackendChoice {
    fn from(b: BackendArg) -> Self {
        match b {
            BackendArg::Auto => BackendChoice::Auto,
            BackendArg::Cpu => BackendChoice::Cpu,
            BackendArg::Cuda => BackendChoice::Cuda,
            BackendArg::Emu => BackendChoice::Emu,
        }
    }
}

/// Runs scope on a trace and returns the report (shared with `demo`).
pub fn compute(trace_dir: &std::path::Path, backend: BackendArg) -> anyhow::Result<ScopeReport> {
    Ok(compute_shard(trace_dir, backend, None, 0)?.report)
}

/// Runs scope on a trace, or on a shard of its pools, saying which backend
/// replays it (the CPU one on `threads` threads, 0: every core).
fn compute_shard(
    trace_dir: &std::path::Path,
    backend: BackendArg,
    pools: Option<Vec<u16>>,
    threads: usize,
) -> anyhow::Result<Scoped> {
    let run = ScopeRun::open_threads(trace_dir, backend.into(), threads)?;
    eprintln!("kvtrail: replay backend: {}", run.backend_note());
    Ok(run.run(pools, &BarReporter::default())?)
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    if let Some(dir) = &args.out {
        // Before the replay: a refused folder should not cost a replay.
        kvtrail::custody::prepare_out(dir, "scope", &[args.trace.as_path()], args.force)?;
    }
    let Scoped {
        trace,
        report: r,
        shard,
    } = compute_shard(
        &args.trace,
        args.backend,
        args.pools.clone(),
        args.threads.map_or(0, usize::from),
    )?;
    // A remote read that failed anywhere makes the report rest on part of
    // the trace: an error, before anything is written.
    if let Some(e) = kvtrail::trace::files::remote_failure(&args.trace) {
        return Err(e.into());
    }
    // The folder is written whole or not at all (the trace is read again
    // for the evidence, and a remote object may have been replaced
    // meanwhile): on any failure no partial report stays.
    if let Some(dir) = &args.out {
        let w = report::writer::write_scope_folder(
            dir,
            &trace,
            &r,
            shard.as_ref(),
            &crate::cli::command_line(),
        )?;
        for f in w.files {
            eprintln!("kvtrail: wrote {}", term(&f.display().to_string()));
        }
        eprintln!(
            "kvtrail: evidence digest (blake3 of evidence.json): {}",
            w.digest
        );
    }
    output::print(args.json, &r, |out| {
        out.write_all(report::human(&r).as_bytes())
    })?;
    // A gate never passes a trace that records nothing: no KV events is
    // no evidence that nothing was exposed.
    Ok(
        if args.fail_on_exposure && (r.any_exposure() || r.coverage.no_kv_events) {
            if !r.any_exposure() {
                eprintln!(
                    "kvtrail: --fail-on-exposure: the trace holds no KV events, so exposure cannot be ruled out"
                );
            }
            1
        } else {
            0
        },
    )
}
