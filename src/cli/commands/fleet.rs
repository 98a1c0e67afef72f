//! `kvtrail fleet plan|spark`: native scope fanned out by pool.
//! `plan TRACE` prints the shards (`lineage::shard::plan_shards`: pools a
//! shard reports, pools it replays, events). `spark TRACE --out DIR`
//! plans them, submits the PySpark job fleet/spark_scope.py (built in)
//! with this binary shipped to the executors, one `scope --pools` task per
//! shard reading the trace where it lives, and merges the shards here, as
//! `kvtrail merge` does (`scope::merge`), into the single-run folder DIR;
//! the shard folders stay in `DIR.shards/` (the merged evidence.json cites
//! them). Both folders are written under temporary names next to DIR and
//! renamed at the end: on any failure neither is left (docs/fleet.md).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, anyhow, bail};
use kvtrail::lineage::shard::{ShardGroup, plan_shards};
use kvtrail::report;
use kvtrail::report::fmt::term;
use kvtrail::scope::merge::merge;
use kvtrail::scope::shard::load_shards;
use kvtrail::trace::read::Trace;
use serde::{Deserialize, Serialize};

use super::scope::BackendArg;
use crate::cli::output;

/// The PySpark job `fleet spark` submits.
pub const SPARK_JOB: &str = include_str!("../../../fleet/spark_scope.py");

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
    pub backend: BackendArg,
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
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    pub backend: BackendArg,
    /// Print the merged report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    match args.command {
        FleetCommand::Plan(a) => plan(a),
        FleetCommand::Spark(a) => spark(a),
        FleetCommand::Task(a) => task(a),
    }
}

/// What `fleet plan --json` prints.
#[derive(Serialize)]
struct PlanOut<'a> {
    trace: String,
    shards: &'a [ShardGroup],
}

fn plan_of(trace: &Path) -> anyhow::Result<Vec<ShardGroup>> {
    let t = Trace::open(trace)?;
    let shards = plan_shards(&t)?;
    if let Some(e) = kvtrail::trace::files::remote_failure(trace) {
        return Err(e.into());
    }
    Ok(shards)
}

fn ids(p: &[u16]) -> String {
    p.iter().map(u16::to_string).collect::<Vec<_>>().join(",")
}

fn plan(args: PlanArgs) -> anyhow::Result<i32> {
    let shards = plan_of(&args.trace)?;
    let value = PlanOut {
        trace: args.trace.display().to_string(),
        shards: &shards,
    };
    output::print(args.json, &value, |out| {
        for (i, s) in shards.iter().enumerate() {
            if args.list {
                writeln!(out, "{}", ids(&s.pools))?;
            } else {
                writeln!(
                    out,
                    "shard {i}: --pools {} (replays {}; {} events)",
                    ids(&s.pools),
                    ids(&s.replays),
                    s.events
                )?;
            }
        }
        Ok(())
    })?;
    Ok(0)
}

/// The plan file the job reads.
#[derive(Serialize)]
struct JobPlan<'a> {
    format: &'static str,
    trace: String,
    binary: String,
    backend: &'static str,
    direct: bool,
    staging: String,
    shards: Vec<JobShard<'a>>,
}

#[derive(Serialize)]
struct JobShard<'a> {
    index: usize,
    pools: &'a [u16],
}

/// The job's result file.
#[derive(Deserialize)]
struct JobResult {
    format: String,
    secs: f64,
    shards: Vec<JobDone>,
    errors: Vec<JobError>,
}

#[derive(Deserialize)]
struct JobDone {
    index: usize,
    dir: String,
}

#[derive(Deserialize)]
struct JobError {
    pools: Vec<u16>,
    exit: Option<i32>,
    stderr: String,
}

const HINT: &str = "\n  hint: ";

/// Removes what this run created when it fails before the end.
struct Cleanup(Vec<PathBuf>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_dir_all(p);
        }
    }
}

fn backend_name(b: BackendArg) -> &'static str {
    match b {
        BackendArg::Auto => "auto",
        BackendArg::Cpu => "cpu",
        BackendArg::Cuda => "cuda",
        BackendArg::Emu => "emu",
    }
}

/// Replaces `to` (absent, or an empty folder) by the folder `from`.
fn rename_into(from: &Path, to: &Path) -> anyhow::Result<()> {
    if to.is_dir() {
        std::fs::remove_dir(to).with_context(|| format!("{}: cannot replace", to.display()))?;
    }
    std::fs::rename(from, to)
        .with_context(|| format!("{}: cannot rename to {}", from.display(), to.display()))
}

fn spark(mut args: SparkArgs) -> anyhow::Result<i32> {
    // A link to a folder is written through, as `scope --out` does: the
    // merged folder replaces the link's target, and the shards go beside it.
    if args.out.is_symlink() {
        args.out = std::fs::canonicalize(&args.out)
            .with_context(|| format!("--out {}: a link to nothing", args.out.display()))?;
    }
    let name = args
        .out
        .file_name()
        .filter(|n| *n != "..")
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| {
            anyhow!(
                "--out {}: not a folder name{HINT}pass the merged folder's path, e.g. out/incident",
                args.out.display()
            )
        })?;
    let parent = match args.out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let shards_dir = parent.join(format!("{name}.shards"));
    if shards_dir.is_symlink() {
        bail!(
            "{}: a link; the shard folders go beside --out, where the merged evidence.json cites them{HINT}remove the link, or pass another --out",
            shards_dir.display()
        );
    }
    if let Some(c) = args.conf.iter().find(|c| !c.contains('=')) {
        bail!(
            "--conf {c}: not KEY=VALUE{HINT}pass a Spark setting such as spark.executor.memory=4g"
        );
    }
    let remote = kvtrail::trace::files::is_remote(&args.trace);
    let inputs = [args.trace.as_path()];
    kvtrail::custody::prepare_out(&args.out, "scope", &inputs, false)?;
    kvtrail::custody::prepare_out(&shards_dir, "scope", &inputs, false)?;
    let binary = match &args.binary {
        Some(b) => b.clone(),
        None => {
            std::env::current_exe().context("cannot find this kvtrail binary (pass --binary)")?
        }
    };
    let binary = std::path::absolute(&binary)?;
    if !binary.is_file() {
        bail!(
            "--binary {}: not a file{HINT}pass the kvtrail binary the executors run",
            binary.display()
        );
    }
    let trace_arg = if remote {
        args.trace.display().to_string()
    } else {
        std::path::absolute(&args.trace)?.display().to_string()
    };

    // Planned here, natively: a trace that cannot be read or replayed is
    // refused before Spark starts.
    let shards = plan_of(&args.trace)?;
    let planned = TraceView::of(&args.trace)?;
    eprintln!(
        "kvtrail: fleet spark: {} shards ({})",
        shards.len(),
        shards
            .iter()
            .map(|s| format!("--pools {}", ids(&s.pools)))
            .collect::<Vec<_>>()
            .join("; ")
    );

    std::fs::create_dir_all(&parent).map_err(|e| {
        anyhow!(
            "{}: cannot create the folder: {e}{HINT}pass --out inside a folder you can write",
            parent.display()
        )
    })?;
    let work = tempfile::Builder::new()
        .prefix("kvtrail-fleet-")
        .tempdir()
        .context("cannot create a temporary folder")?;
    let staging = tempfile::Builder::new()
        .prefix(&format!(".{name}.shards."))
        .tempdir_in(&parent)
        .with_context(|| format!("{}: cannot create a folder", parent.display()))?
        .keep();
    let mut cleanup = Cleanup(vec![std::path::absolute(&staging)?]);
    let staging = cleanup.0[0].clone();

    let job = work.path().join("spark_scope.py");
    std::fs::write(&job, SPARK_JOB).with_context(|| format!("{}", job.display()))?;
    let plan_path = work.path().join("plan.json");
    let result_path = work.path().join("result.json");
    let log_path = work.path().join("spark.log");
    let plan = JobPlan {
        format: "kvtrail-fleet-spark-plan",
        trace: trace_arg,
        binary: binary
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "kvtrail".into()),
        backend: backend_name(args.backend),
        direct: !remote,
        staging: staging.display().to_string(),
        shards: shards
            .iter()
            .enumerate()
            .map(|(index, s)| JobShard {
                index,
                pools: &s.pools,
            })
            .collect(),
    };
    std::fs::write(&plan_path, serde_json::to_vec_pretty(&plan)?)
        .with_context(|| format!("{}", plan_path.display()))?;

    let submit = args.spark_submit.clone().unwrap_or_else(|| {
        std::env::var_os("SPARK_HOME")
            .map(|h| PathBuf::from(h).join("bin/spark-submit"))
            .unwrap_or_else(|| PathBuf::from("spark-submit"))
    });
    let mut cmd = Command::new(&submit);
    if let Some(m) = &args.master {
        cmd.args(["--master", m]);
    }
    for c in &args.conf {
        cmd.args(["--conf", c]);
    }
    cmd.arg("--name")
        .arg("kvtrail fleet spark")
        .arg("--files")
        .arg(&binary)
        .arg(&job)
        .arg(&plan_path)
        .arg(&result_path)
        .env("KVTRAIL_NO_PROGRESS", "1")
        .stdin(Stdio::null());
    let log =
        std::fs::File::create(&log_path).with_context(|| format!("{}", log_path.display()))?;
    cmd.stdout(log.try_clone()?).stderr(log);
    // SIGTERM or SIGINT while the job runs stops spark-submit and leaves
    // nothing behind (the temporary folders go as this function returns).
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    let mut child = cmd.spawn().map_err(|e| {
        anyhow!(
            "cannot run {}: {e}{HINT}install Spark (pip install pyspark gives spark-submit) and set SPARK_HOME or pass --spark-submit",
            submit.display()
        )
    })?;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if stop.load(std::sync::atomic::Ordering::Relaxed) {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "interrupted: the Spark job was stopped and nothing was written{HINT}run kvtrail fleet spark again"
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };

    let result: Option<JobResult> = std::fs::read(&result_path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .filter(|r: &JobResult| r.format == "kvtrail-fleet-spark-result");
    let Some(result) = result else {
        let text = std::fs::read(&log_path)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        for l in &lines[lines.len().saturating_sub(40)..] {
            eprintln!("kvtrail: spark: {}", term(l));
        }
        bail!(
            "{} exited with {status} before the job finished (its last lines are above){HINT}check the Spark installation and master, and that PYSPARK_PYTHON names a python with pyspark",
            submit.display()
        );
    };
    if let Some(first) = result.errors.first() {
        for e in &result.errors {
            for l in e.stderr.lines() {
                eprintln!("kvtrail: shard --pools {}: {}", ids(&e.pools), term(l));
            }
        }
        let (what, hint) = shard_error(&first.stderr);
        bail!(
            "{} of {} shards failed; the first, --pools {} ({}): {what}{HINT}{hint}",
            result.errors.len(),
            shards.len(),
            ids(&first.pools),
            match first.exit {
                Some(c) => format!("kvtrail scope exited {c} on an executor"),
                None => "the Spark task itself failed".into(),
            },
        );
    }
    let mut got: Vec<usize> = result.shards.iter().map(|s| s.index).collect();
    got.sort_unstable();
    if got != (0..shards.len()).collect::<Vec<_>>()
        || result
            .shards
            .iter()
            .any(|s| s.dir != format!("shard-{:04}", s.index) || !staging.join(&s.dir).is_dir())
    {
        bail!(
            "the Spark job reported shards {got:?} of 0..{}{HINT}run it again; a shard lost on the way is never merged",
            shards.len()
        );
    }

    // The shards in their place, then the merge beside them (the merged
    // evidence.json names them relative to itself, as they will lie).
    rename_into(&staging, &shards_dir)?;
    cleanup.0 = vec![std::path::absolute(&shards_dir)?];
    let dirs: Vec<PathBuf> = (0..shards.len())
        .map(|i| shards_dir.join(format!("shard-{i:04}")))
        .collect();
    let merged = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .tempdir_in(&parent)
        .with_context(|| format!("{}: cannot create a folder", parent.display()))?
        .keep();
    cleanup.0.push(std::path::absolute(&merged)?);
    let merge_start = std::time::Instant::now();
    let loaded = load_shards(&dirs)?;
    if let Some(first) = loaded.first() {
        planned.check(&args.trace, &first.trace)?;
    }
    let parts: Vec<_> = loaded
        .iter()
        .map(|s| (s.report.clone(), s.info.clone()))
        .collect();
    let r = merge(&parts)?;
    let mut files = report::write_out(&r, &merged)?;
    let (extra, digest) =
        report::bundle::write_merge_extras(&loaded, &r, &merged, &crate::cli::command_line())?;
    files.extend(extra);
    // A signal during the merge: nothing is put in place either.
    if stop.load(std::sync::atomic::Ordering::Relaxed) {
        bail!("interrupted: nothing was written{HINT}run kvtrail fleet spark again");
    }
    rename_into(&merged, &args.out)?;
    cleanup.0.clear();
    eprintln!(
        "kvtrail: fleet spark: job {:.2} s ({} shards), merge {:.2} s",
        result.secs,
        shards.len(),
        merge_start.elapsed().as_secs_f64()
    );
    for f in files {
        let rel = f.strip_prefix(&merged).unwrap_or(&f);
        eprintln!(
            "kvtrail: wrote {}",
            term(&args.out.join(rel).display().to_string())
        );
    }
    eprintln!(
        "kvtrail: shard folders (cited by the merged evidence.json): {}",
        term(&shards_dir.display().to_string())
    );
    eprintln!("kvtrail: evidence digest (blake3 of evidence.json): {digest}");
    output::print(args.json, &r, |out| {
        out.write_all(report::human(&r).as_bytes())
    })?;
    Ok(0)
}

/// What the driver saw of the trace when it planned the shards: the
/// blake3 of trace.json and the data files present. The shards (read on
/// the executors, later, perhaps from another copy at the same path) must
/// have read the same, or their merge would be another trace's answer.
struct TraceView {
    trace_json: String,
    files: std::collections::BTreeSet<String>,
}

impl TraceView {
    fn of(trace: &Path) -> anyhow::Result<TraceView> {
        let (trace_json, _) = kvtrail::custody::hash_file(&trace.join("trace.json"))?;
        let mut files = std::collections::BTreeSet::new();
        for sub in ["requests", "kv"] {
            for p in kvtrail::trace::read::list_parquet(&trace.join(sub))? {
                let rel = p
                    .strip_prefix(trace)
                    .map(|r| r.to_string_lossy().replace('\\', "/"))
                    .unwrap_or_else(|_| p.display().to_string());
                files.insert(rel);
            }
        }
        Ok(TraceView { trace_json, files })
    }

    /// Refuses shards whose evidence records another trace.json, or other
    /// data files, than the driver planned from.
    fn check(&self, trace: &Path, read: &kvtrail::custody::Inputs) -> anyhow::Result<()> {
        let json = read.files.iter().find(|f| f.path == "trace.json");
        let data: std::collections::BTreeSet<String> = read
            .files
            .iter()
            .filter(|f| f.path != "trace.json")
            .map(|f| f.path.clone())
            .collect();
        let what = if json.is_none_or(|f| !f.blake3.eq_ignore_ascii_case(&self.trace_json)) {
            "trace.json".to_string()
        } else if data != self.files {
            let differs = data
                .symmetric_difference(&self.files)
                .next()
                .cloned()
                .unwrap_or_default();
            format!("the data files ({differs})")
        } else {
            return Ok(());
        };
        bail!(
            "{}: the shards read other {what} than this command planned from: the trace changed while the job ran, or the executors see another copy at this path; nothing was merged{HINT}do not modify a trace while kvtrail reads it (upload a changed trace to a new prefix), give the executors the same trace (an object-store URL, or a shared folder), then run kvtrail again",
            term(&trace.display().to_string())
        )
    }
}

/// One line a task prints (JSON): a chunk of a shard folder's file, a
/// shard done, or a shard failed. fleet/spark_scope.py reads them.
#[derive(Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
enum TaskLine<'a> {
    Chunk {
        index: usize,
        rel: &'a str,
        n: u64,
        data: String,
    },
    Done {
        index: usize,
        pools: &'a [u16],
        dir: &'a str,
    },
    Error {
        index: usize,
        pools: &'a [u16],
        exit: Option<i32>,
        stderr: String,
    },
}

/// Bytes of a shard file a chunk line carries (4 MiB, base64 in the line).
const TASK_CHUNK: usize = 4 << 20;
/// What a failed shard's stderr keeps (its end).
const TASK_STDERR: usize = 8000;
/// The longest "INDEX POOLS" line a task reads (a shard of every one of
/// the 65,536 pool ids is under 400 KiB).
const TASK_LINE_MAX: u64 = 1 << 20;

/// `fleet task`: the Spark task's side of the job's pipe (Spark writes the
/// task's shards on stdin, one "INDEX POOLS" line each, and collects what
/// it prints). Each shard is this binary's own `scope TRACE --pools POOLS
/// --out DIR`, in a child process whose exit code and stderr are reported.
/// A shard that fails is not retried (its errors are bad input, the same
/// on every attempt); the task itself exits 0 unless its own input or
/// output fails, which fails the Spark task.
fn task(args: TaskArgs) -> anyhow::Result<i32> {
    use std::io::{BufRead, Read, Write};
    let exe = std::env::current_exe().context("cannot find this kvtrail binary")?;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let mut emit = |line: &TaskLine| -> anyhow::Result<()> {
        serde_json::to_writer(&mut out, line)?;
        out.write_all(b"\n")?;
        out.flush()?;
        Ok(())
    };
    let mut stdin = std::io::stdin().lock();
    let mut buf = Vec::new();
    for number in 1.. {
        buf.clear();
        let n = (&mut stdin)
            .take(TASK_LINE_MAX + 1)
            .read_until(b'\n', &mut buf)
            .context("reading the task's shards on stdin")?;
        if n == 0 {
            break;
        }
        if buf.len() as u64 > TASK_LINE_MAX {
            anyhow::bail!(
                "task line {number} is longer than {TASK_LINE_MAX} bytes: not \"INDEX POOLS\""
            );
        }
        let line = String::from_utf8_lossy(&buf);
        if line.trim().is_empty() {
            continue;
        }
        let (index, pools) = parse_task_line(&line).with_context(|| {
            format!("task line {number} {:?}: not \"INDEX POOLS\"", term(&line))
        })?;
        let name = format!("shard-{index:04}");
        // Without --staging the shard is written to a temporary folder of
        // the executor's, removed once its lines are out.
        let (_tmp, dir) = match &args.staging {
            Some(s) => (None, s.join(&name)),
            None => {
                let t = tempfile::Builder::new()
                    .prefix("kvtrail-shard-")
                    .tempdir()
                    .context("cannot create a temporary folder")?;
                let d = t.path().join(&name);
                (Some(t), d)
            }
        };
        let ran = Command::new(&exe)
            .arg("scope")
            .arg(&args.trace)
            .arg("--pools")
            .arg(ids(&pools))
            .arg("--backend")
            .arg(backend_name(args.backend))
            .arg("--out")
            .arg(&dir)
            .env("KVTRAIL_NO_PROGRESS", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output();
        let failed = match ran {
            Ok(o) if o.status.success() => None,
            Ok(o) => Some((o.status.code(), tail(&o.stderr))),
            Err(e) => Some((None, format!("cannot run {}: {e}", exe.display()))),
        };
        if let Some((exit, stderr)) = failed {
            emit(&TaskLine::Error {
                index,
                pools: &pools,
                exit,
                stderr,
            })?;
            continue;
        }
        if args.staging.is_none() {
            let sent = send_folder(&dir, |rel, n, data| {
                emit(&TaskLine::Chunk {
                    index,
                    rel,
                    n,
                    data,
                })
            });
            if let Err(e) = sent {
                emit(&TaskLine::Error {
                    index,
                    pools: &pools,
                    exit: None,
                    stderr: format!("{e:#}"),
                })?;
                continue;
            }
        }
        emit(&TaskLine::Done {
            index,
            pools: &pools,
            dir: &name,
        })?;
    }
    Ok(0)
}

/// "INDEX P,P,..." as the job writes it.
fn parse_task_line(line: &str) -> Option<(usize, Vec<u16>)> {
    let (index, pools) = line.trim().split_once(' ')?;
    let pools = pools
        .split(',')
        .map(|p| p.parse().ok())
        .collect::<Option<Vec<u16>>>()?;
    Some((index.parse().ok()?, pools))
}

/// The end of a child's stderr, as text.
fn tail(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let mut start = text.len().saturating_sub(TASK_STDERR);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    text[start..].to_string()
}

/// Every file under `dir` (sorted, "/"-separated relative paths), in
/// chunks of [`TASK_CHUNK`] bytes, base64 (an empty file is one empty
/// chunk).
fn send_folder(
    dir: &Path,
    mut send: impl FnMut(&str, u64, String) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    use base64::Engine;
    use std::io::Read;
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).with_context(|| format!("{}", d.display()))? {
            let e = e?;
            let ty = e.file_type()?;
            if ty.is_dir() {
                stack.push(e.path());
            } else if ty.is_file() {
                files.push(e.path());
            }
        }
    }
    let mut rels: Vec<(String, PathBuf)> = files
        .into_iter()
        .map(|f| {
            let rel = f.strip_prefix(dir).unwrap_or(&f);
            let rel = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join("/");
            (rel, f)
        })
        .collect();
    rels.sort();
    let mut buf = Vec::with_capacity(TASK_CHUNK);
    for (rel, path) in &rels {
        let mut f = std::fs::File::open(path).with_context(|| format!("{}", path.display()))?;
        let mut n = 0u64;
        loop {
            buf.clear();
            (&mut f)
                .take(TASK_CHUNK as u64)
                .read_to_end(&mut buf)
                .with_context(|| format!("{}", path.display()))?;
            send(
                rel,
                n,
                base64::engine::general_purpose::STANDARD.encode(&buf),
            )?;
            n += 1;
            if buf.len() < TASK_CHUNK {
                break;
            }
        }
    }
    Ok(())
}

/// A shard's error message and hint, from its kvtrail's stderr.
fn shard_error(stderr: &str) -> (String, String) {
    let text = stderr
        .lines()
        .filter(|l| !l.starts_with("kvtrail: "))
        .collect::<Vec<_>>()
        .join("\n");
    let text = text.trim();
    let text = text.strip_prefix("error: ").unwrap_or(text);
    match text.split_once(HINT) {
        Some((what, hint)) => (what.replace('\n', " "), hint.replace('\n', " ")),
        None => (
            text.replace('\n', " "),
            "fix what the shard's error names (its full stderr is above), then run again".into(),
        ),
    }
}
