//! `kvtrail scope TRACE`: replay a trace and report every affected
//! response, its sources, the tenants on both sides and the coverage.

use std::path::PathBuf;

use kvtrail::custody::statement::Predicate;
use kvtrail::lineage::{BackendChoice, BackendConfig};
use kvtrail::report;
use kvtrail::report::writer::Signing;
use kvtrail::scope::ScopeReport;
use kvtrail::scope::run::{ScopeRun, Scoped};
use kvtrail::text::term;

use crate::cli::output;
use crate::cli::progress::BarReporter;

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
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
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
    /// With --out: sign the folder with this OpenSSH ed25519 private key (owner-only): an in-toto statement over every file, in a DSSE envelope (statement.intoto.jsonl; `kvtrail verify` checks it).
    #[arg(long, value_name = "FILE", requires = "out")]
    pub signing_key: Option<PathBuf>,
}

/// Runs scope on a trace and returns the report (shared with `demo`).
pub fn compute(trace_dir: &std::path::Path, backend: BackendChoice) -> anyhow::Result<ScopeReport> {
    Ok(
        compute_shard(trace_dir, BackendConfig::new(backend, 0), None)?
            .0
            .report,
    )
}

/// Runs scope on a trace, or on a shard of its pools, saying which backend
/// replays it.
fn compute_shard(
    trace_dir: &std::path::Path,
    config: BackendConfig,
    pools: Option<Vec<u16>>,
) -> anyhow::Result<(Scoped, String)> {
    let run = ScopeRun::open_with(trace_dir, config)?;
    let note = run.backend_note().to_string();
    eprintln!("kvtrail: replay backend: {note}");
    Ok((run.run(pools, &BarReporter::default())?, note))
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    if let Some(dir) = &args.out {
        // Before the replay: a refused folder should not cost a replay.
        kvtrail::custody::prepare_out(dir, "scope", &[args.trace.as_path()], args.force)?;
    }
    // The key is loaded (and refused when unsafe) before the replay.
    let key = super::signing::load_key(args.signing_key.as_deref())?;
    let (
        Scoped {
            trace,
            report: r,
            shard,
        },
        backend,
    ) = compute_shard(
        &args.trace,
        BackendConfig::new(args.backend, args.threads.map_or(0, usize::from)),
        args.pools.clone(),
    )?;
    // The folder is written whole or not at all (the trace is read again
    // for the evidence, and a remote object may have been replaced
    // meanwhile): on any failure no partial report stays.
    if let Some(dir) = &args.out {
        let command = output::command_line();
        let sign = key.as_deref().map(|key| {
            let mut predicate = Predicate::new("scope", &command);
            predicate.backend = Some(backend.clone());
            predicate.threads = Some(args.threads.map_or(0, u64::from));
            Signing { key, predicate }
        });
        let w = report::writer::write_scope_folder_signed(
            dir,
            &trace,
            &r,
            shard.as_ref(),
            &command,
            sign,
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
