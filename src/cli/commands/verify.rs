//! `kvtrail verify PATH`: a trace (recompute digests, check files and rows
//! against trace.json) or an output folder of scope/notify (detected by its
//! evidence.json: re-hash every output and input file, name every change).

use std::io::Write;
use std::path::PathBuf;

use kvtrail::custody::{FolderReport, is_output_folder, verify_folder};
use kvtrail::text::{term, term_message};
use kvtrail::trace::verify::verify;

use crate::cli::output;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Trace directory (holds trace.json), or a scope/notify output folder (holds evidence.json).
    pub trace: PathBuf,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    if is_output_folder(&args.trace) {
        return run_folder(args);
    }
    let report = verify(&args.trace)?;
    output::print(args.json, &report, |out| {
        for p in &report.problems {
            writeln!(
                out,
                "FAIL {:<12} {}: {}",
                p.kind,
                term(&p.path),
                term_message(&p.detail)
            )?;
        }
        writeln!(
            out,
            "{}: {} files, {} bytes hashed, {} rows checked, capture {}{}",
            if report.ok { "OK" } else { "FAILED" },
            report.files_checked,
            report.bytes_hashed,
            report.rows_checked,
            if report.complete {
                "complete"
            } else {
                "INCOMPLETE"
            },
            if report.seq_holes > 0 {
                format!(
                    " ({} lost in {}: no analysis of this trace is complete)",
                    count(report.lost_events, "event"),
                    count(report.seq_holes, "seq hole")
                )
            } else {
                String::new()
            }
        )
    })?;
    Ok(if report.ok { 0 } else { 1 })
}

fn print_folder(out: &mut dyn Write, r: &FolderReport, depth: usize) -> std::io::Result<()> {
    let pad = "  ".repeat(depth);
    for p in &r.problems {
        writeln!(
            out,
            "{pad}FAIL {:<9} {} {}: {}",
            p.kind,
            p.side,
            term(&p.path),
            term(&p.detail)
        )?;
    }
    for u in &r.inputs_unavailable {
        writeln!(
            out,
            "{pad}NOTE inputs not on this machine, not re-checked: {}",
            term(u)
        )?;
    }
    for p in &r.recorded_input_problems {
        writeln!(
            out,
            "{pad}NOTE recorded when the folder was written: {}",
            term(p)
        )?;
    }
    writeln!(
        out,
        "{pad}{}: {} folder, {} output files and {} input files checked; evidence digest {}",
        if r.problems.is_empty() {
            "OK"
        } else {
            "FAILED"
        },
        r.kind,
        r.outputs_checked,
        r.inputs_checked,
        r.evidence_blake3
    )?;
    for n in &r.nested {
        print_folder(out, n, depth + 1)?;
    }
    Ok(())
}

fn run_folder(args: Args) -> anyhow::Result<i32> {
    let r = verify_folder(&args.trace, true)?;
    output::print(args.json, &r, |out| print_folder(out, &r, 0))?;
    Ok(if r.ok { 0 } else { 1 })
}

/// `1 event`, `2 events`.
fn count(n: u64, what: &str) -> String {
    format!("{n} {what}{}", if n == 1 { "" } else { "s" })
}
