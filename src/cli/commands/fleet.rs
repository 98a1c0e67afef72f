//! `kvtrail fleet plan|spark`: native scope fanned out by pool. The
//! arguments and what is printed; the work is the library's `fleet`
//! (plan, submit, collect, the merge-validity check, the executor's task).
//! `plan TRACE` prints the shards; `spark TRACE --out DIR` runs them as
//! Spark tasks and merges them into the single-run folder DIR, the shard
//! folders in `DIR.shards/` (docs/fleet.md).

use std::path::PathBuf;

use kvtrail::fleet::spark::Spark;
use kvtrail::fleet::submit::{Submit, stop_on_signals};
use kvtrail::fleet::task::Task;
use kvtrail::fleet::{FleetError, pools_list};
use kvtrail::lineage::shard::ShardGroup;
use kvtrail::report;
use kvtrail::text::term;
use serde::Serialize;

use crate::cli::output;
use kvtrail::lineage::BackendChoice;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    pub command: FleetCommand,
}

#[derive(clap::Subcommand, Debug)]
pub enum FleetCommand {
    /// Print a trace's shards: the pools each reports (`scope --pools`) and replays, with their events.
    Plan(PlanArgs),
    /// Run the shards as Spark tasks (spark-submit, this binary shipped to the executors) and merge them into one scope folder.
    Spark(SparkArgs),
    /// A Spark task of `fleet spark` (the job pipes shards through it): reads "INDEX POOLS" lines on stdin, runs `scope --pools` for each and prints JSON lines.
    #[command(hide = true)]
    Task(TaskArgs),
}

#[derive(clap::Args, Debug)]
pub struct TaskArgs {
    /// The trace, as the job's plan gives it.
    #[arg(long)]
    pub trace: String,
    /// Replay backend of every shard.
    #[arg(long, value_enum)]
    pub backend: BackendChoice,
    /// Write each shard folder into this folder (one every executor sees);
    /// without it the folders' files travel back as lines.
    #[arg(long, value_name = "DIR")]
    pub staging: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// Trace directory or URL (s3://, gs://, az://, http(s)://).
    pub trace: PathBuf,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
    /// Print only each shard's pools, one comma-separated line per shard
    /// (a shards.txt for other schedulers).
    #[arg(long, conflicts_with = "json")]
    pub list: bool,
}

#[derive(clap::Args, Debug)]
pub struct SparkArgs {
    /// Trace URL (s3://, gs://, az://, http(s)://) or a directory every executor sees at this path.
    pub trace: PathBuf,
    /// Write the merged scope folder here (a new or empty folder); the shard folders go to DIR.shards.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Spark master (spark-submit --master); default: spark-submit's own (spark-defaults.conf, else local[*]).
    #[arg(long, value_name = "URL")]
    pub master: Option<String>,
    /// A Spark setting for spark-submit (repeatable), e.g. spark.executor.memory=4g.
    #[arg(long, value_name = "KEY=VALUE")]
    pub conf: Vec<String>,
    /// The spark-submit to run; default: $SPARK_HOME/bin/spark-submit, else spark-submit on PATH.
    #[arg(long, value_name = "PATH")]
    pub spark_submit: Option<PathBuf>,
    /// The kvtrail binary shipped to the executors (default: this one; a
    /// build for the executors' platform where it differs).
    #[arg(long, value_name = "PATH")]
    pub binary: Option<PathBuf>,
    /// Replay backend of every shard.
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// Print the merged report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// Sign every shard folder (as it comes back, before it is put in place) and the merged folder with this OpenSSH ed25519 private key (owner-only): in-toto statements (statement.intoto.jsonl). The key stays on this machine; executors never see it.
    #[arg(long, value_name = "FILE")]
    pub signing_key: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    match args.command {
        FleetCommand::Plan(a) => plan(a),
        FleetCommand::Spark(a) => spark(a),
        FleetCommand::Task(a) => task(a),
    }
}

/// Prints the lines an error asks to be shown before it.
fn shown(e: FleetError) -> anyhow::Error {
    for l in e.shown() {
        eprintln!("kvtrail: {l}");
    }
    e.into()
}

/// What `fleet plan --json` prints.
#[derive(Serialize)]
struct PlanOut<'a> {
    trace: String,
    shards: &'a [ShardGroup],
}

fn plan(args: PlanArgs) -> anyhow::Result<i32> {
    let shards = kvtrail::fleet::plan::plan(&args.trace)?;
    let value = PlanOut {
        trace: args.trace.display().to_string(),
        shards: &shards,
    };
    output::print(args.json, &value, |out| {
        for (i, s) in shards.iter().enumerate() {
            if args.list {
                writeln!(out, "{}", pools_list(&s.pools))?;
            } else {
                writeln!(
                    out,
                    "shard {i}: --pools {} (replays {}; {} events)",
                    pools_list(&s.pools),
                    pools_list(&s.replays),
                    s.events
                )?;
            }
        }
        Ok(())
    })?;
    Ok(0)
}

fn spark(args: SparkArgs) -> anyhow::Result<i32> {
    let prepared = Spark {
        trace: args.trace,
        out: args.out,
        submit: Submit {
            spark_submit: args.spark_submit,
            master: args.master,
            conf: args.conf,
        },
        binary: args.binary,
        backend: args.backend,
        signing_key: super::signing::load_key(args.signing_key.as_deref())?,
    }
    .prepare()
    .map_err(shown)?;
    eprintln!(
        "kvtrail: fleet spark: {} shards ({})",
        prepared.shards.len(),
        prepared
            .shards
            .iter()
            .map(|s| format!("--pools {}", pools_list(&s.pools)))
            .collect::<Vec<_>>()
            .join("; ")
    );
    // SIGTERM or SIGINT from here on stops the job and leaves nothing.
    let stop = stop_on_signals().map_err(shown)?;
    let shards = prepared.shards.len();
    let m = prepared
        .run(&stop, &output::command_line())
        .map_err(shown)?;
    eprintln!(
        "kvtrail: fleet spark: job {:.2} s ({shards} shards), merge {:.2} s",
        m.job_secs, m.merge_secs
    );
    for f in &m.written.files {
        eprintln!("kvtrail: wrote {}", term(&f.display().to_string()));
    }
    eprintln!(
        "kvtrail: shard folders (cited by the merged evidence.json): {}",
        term(&m.shards_dir.display().to_string())
    );
    eprintln!(
        "kvtrail: evidence digest (blake3 of evidence.json): {}",
        m.written.digest
    );
    output::print(args.json, &m.report, |out| {
        out.write_all(report::human(&m.report).as_bytes())
    })?;
    Ok(0)
}

fn task(args: TaskArgs) -> anyhow::Result<i32> {
    let exe = std::env::current_exe()
        .map_err(|e| anyhow::anyhow!("cannot find this kvtrail binary: {e}"))?;
    let task = Task {
        exe,
        trace: args.trace,
        backend: args.backend,
        staging: args.staging,
    };
    task.run(std::io::stdin().lock(), std::io::stdout().lock())?;
    Ok(0)
}
