//! `kvtrail counterfactual TRACE [--json]`: re-run every affected response
//! of a reference-model trace as recorded (fidelity) and with its foreign
//! slots replaced by its own KV (did the output change?). Exit 1 when a
//! re-run does not reproduce its recorded output (the replay is not
//! faithful); a trace from another engine is skipped with exit 0.

use std::fmt::Write as _;
use std::path::PathBuf;

use kvtrail::lineage::LineageOptions;
use kvtrail::text::term;
use kvtrail::whatif::counterfactual::{CounterfactualReport, CpuModel, Fidelity, counterfactual};

use crate::cli::output;
use crate::cli::progress::BarReporter;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Trace directory written with the reference model (kvtrail simulate / replay).
    pub trace: PathBuf,
    /// Print the full report as JSON.
    #[arg(long)]
    pub json: bool,
}

fn human(r: &CounterfactualReport) -> String {
    let mut s = String::new();
    if !r.applicable {
        let _ = writeln!(
            s,
            "counterfactual replay skipped: {}",
            term(r.reason.as_deref().unwrap_or(""))
        );
        return s;
    }
    let _ = writeln!(
        s,
        "counterfactual replay ({} reference model): {}; fidelity ok {}, mismatch {}; output changed without the foreign KV: {}",
        term(&r.evaluator),
        kvtrail::whatif::count(
            r.affected_responses,
            "affected response",
            "affected responses"
        ),
        r.fidelity_ok,
        r.fidelity_mismatch,
        r.outputs_changed
    );
    for x in &r.responses {
        let fid = match x.fidelity {
            Fidelity::Ok => "ok",
            Fidelity::Mismatch => "MISMATCH",
            Fidelity::NoOutputRecorded => "no output recorded",
            Fidelity::MissingSeed => "owner without prompt hash",
        };
        let _ = writeln!(
            s,
            "  {} {} {} HTTP {}: fidelity {fid}; output changed {}; foreign {} of {} attended positions ({:.1}%)",
            x.request_id,
            term(x.external_id.as_deref().unwrap_or("-")),
            term(&x.tenant),
            x.http_status,
            match x.output_changed {
                Some(true) => "yes",
                Some(false) => "no",
                None => "-",
            },
            x.foreign_positions,
            x.attended_positions,
            x.foreign_attention_share * 100.0
        );
    }
    s
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let trace = kvtrail::trace::Trace::open(&args.trace)?;
    let r = counterfactual(
        &trace,
        &CpuModel,
        &LineageOptions::default(),
        &BarReporter::default(),
    )?;
    output::print(args.json, &r, |out| out.write_all(human(&r).as_bytes()))?;
    Ok(if r.fidelity_mismatch > 0 { 1 } else { 0 })
}
