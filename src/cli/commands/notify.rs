//! `kvtrail notify SCOPE_DIR --out DIR`: per-customer notification packs,
//! the processor notice and the breach-register entry from a scope folder.

use std::path::PathBuf;

use kvtrail::notify::{NotifyConfig, notify};
use kvtrail::report::fmt::term;

use crate::cli::output;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Scope folder (written by `kvtrail scope TRACE --out DIR`).
    pub scope_dir: PathBuf,
    /// Write the packs here (a new or empty folder outside the scope folder; owner-only files).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Replace an earlier `kvtrail notify` folder of the same scope folder (it must hold nothing but the files its evidence.json lists).
    #[arg(long)]
    pub force: bool,
    /// Operator settings: operator_name, dpo_contact, incident_id, became_aware, measures, ...
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let cfg = match &args.config {
        Some(p) => NotifyConfig::load(p)?,
        None => NotifyConfig::default(),
    };
    let o = notify(
        &args.scope_dir,
        &args.out,
        &cfg,
        args.config.as_deref(),
        &crate::cli::command_line(),
        args.force,
    )?;
    if !o.unfilled.is_empty() {
        eprintln!(
            "kvtrail notify: warning: not set in the config, shown as [to fill in: ...] in every letter: {}",
            o.unfilled.join(", ")
        );
    }
    output::print_human(|out| {
        for p in &o.packs {
            writeln!(out, "pack {}", term(p))?;
        }
        writeln!(
            out,
            "{} notification packs, register entry and evidence.json written to {}; evidence digest {}",
            o.packs.len(),
            term(&args.out.display().to_string()),
            o.evidence_digest
        )
    })?;
    Ok(0)
}
