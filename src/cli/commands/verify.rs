//! `kvtrail verify TRACE`: recompute digests, check files and rows.

use std::io::Write;
use std::path::PathBuf;

use kvtrail::trace::verify::verify;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Trace directory (holds trace.json).
    pub trace: PathBuf,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let report = verify(&args.trace)?;
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
    } else {
        for p in &report.problems {
            writeln!(out, "FAIL {:<12} {}: {}", p.kind, p.path, p.detail)?;
        }
        writeln!(
            out,
            "{}: {} files, {} bytes hashed, {} rows checked, capture {}",
            if report.ok { "OK" } else { "FAILED" },
            report.files_checked,
            report.bytes_hashed,
            report.rows_checked,
            if report.complete {
                "complete"
            } else {
                "INCOMPLETE"
            },
        )?;
    }
    Ok(if report.ok { 0 } else { 1 })
}
