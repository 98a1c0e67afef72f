//! `kvtrail ingest FILE.jsonl --deployment deploy.json --out TRACE`: JSON
//! lines from an engine hook into a v1 trace (docs/jsonl.md).

use std::fs::File;
use std::io::{BufReader, Write};
use std::path::{Path, PathBuf};

use kvtrail::capture::jsonl::{IngestOptions, ingest, load_deployment};
use kvtrail::text::term;

use crate::cli::output;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// JSON-lines file, one KV event or request per line (`-` for stdin).
    pub input: PathBuf,
    /// The deployment: trace.json's `deployment` object, or a whole trace.json.
    #[arg(long)]
    pub deployment: PathBuf,
    /// New trace directory to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Count and skip malformed lines (the trace is then marked incomplete).
    #[arg(long)]
    pub skip_bad_lines: bool,
    /// OpenSSH ed25519 private key (owner-only, no passphrase): seal the finished trace (seals/, docs/evidence.md).
    #[arg(long, value_name = "FILE")]
    pub signing_key: Option<PathBuf>,
}

/// The trace a `--deployment` file belongs to, when it is a whole
/// trace.json: an input folder the new trace must stay out of.
pub(super) fn deployment_trace(deployment: &Path) -> Vec<&Path> {
    match (deployment.file_name(), deployment.parent()) {
        (Some(n), Some(dir)) if n == "trace.json" => {
            vec![if dir.as_os_str().is_empty() {
                Path::new(".")
            } else {
                dir
            }]
        }
        _ => Vec::new(),
    }
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let deployment = load_deployment(&args.deployment)?;
    let key = super::verify::load_key(args.signing_key.as_deref())?;
    kvtrail::custody::prepare_trace_out(&args.out, &deployment_trace(&args.deployment))?;
    let opts = IngestOptions {
        skip_bad_lines: args.skip_bad_lines,
        ..Default::default()
    };
    let stdin = args.input.as_os_str() == "-";
    let name = if stdin {
        std::path::PathBuf::from("<stdin>")
    } else {
        args.input.clone()
    };
    let report = if stdin {
        ingest(std::io::stdin().lock(), &name, deployment, &args.out, opts)?
    } else {
        let f = File::open(&args.input).map_err(|e| kvtrail::Error::io(&args.input, e))?;
        ingest(
            BufReader::with_capacity(1 << 20, f),
            &args.input,
            deployment,
            &args.out,
            opts,
        )?
    };
    let mut err = std::io::stderr().lock();
    for s in &report.skipped {
        writeln!(
            err,
            "skipped {}:{}: {}",
            term(&name.display().to_string()),
            s.line,
            term(&s.error)
        )?;
    }
    if report.skipped_lines > report.skipped.len() as u64 {
        writeln!(
            err,
            "... and {} more skipped lines",
            report.skipped_lines - report.skipped.len() as u64
        )?;
    }
    super::verify::seal_written(&args.out, key, "ingest")?;
    if report.kv_events == 0 {
        writeln!(
            err,
            "kvtrail: warning: {} held no KV events: the trace is marked incomplete (capture.no_kv_events); it is no evidence of what any request read. Check that the hook wrote this file",
            term(&name.display().to_string())
        )?;
    }
    output::print_human(|out| {
        writeln!(
            out,
            "{}: {} lines, {} kv events, {} requests, {} files{}",
            term(&args.out.display().to_string()),
            report.lines,
            report.kv_events,
            report.requests,
            report.files,
            if report.skipped_lines > 0 {
                format!(
                    "; {} bad lines SKIPPED: capture marked incomplete (capture.skipped_lines)",
                    report.skipped_lines
                )
            } else {
                String::new()
            }
        )
    })?;
    Ok(0)
}
