//! `kvtrail merge OUT_DIRS... --out DIR`: combine the `scope --pools LIST
//! --out DIR` folders of shards (disjoint pools covering the deployment)
//! into the report of a single run, written the same way (summary.json,
//! responses.csv, tenants.csv, findings.parquet, requests.csv,
//! timeline.json, findings.ocsf.jsonl and timeline.jsonl: byte for byte),
//! plus report.html and an evidence.json
//! whose inputs are the shard folders. Each shard is checked against its
//! evidence.json, and all against one trace, before anything is merged;
//! the folder is written whole or not at all (`report::folder`).

use std::path::PathBuf;

use kvtrail::report;
use kvtrail::scope::merge::merge;
use kvtrail::scope::shard::load_shards;
use kvtrail::text::term;

use crate::cli::output;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Shard output folders (each from `kvtrail scope --pools LIST --out DIR`).
    #[arg(required = true, value_name = "OUT_DIRS")]
    pub parts: Vec<PathBuf>,
    /// Write the merged scope folder here (a new or empty folder outside the shard folders; owner-only files).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Print the merged report as JSON on stdout (default: the one-screen summary).
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let inputs: Vec<&std::path::Path> = args.parts.iter().map(|p| p.as_path()).collect();
    kvtrail::custody::prepare_out(&args.out, "merge", &inputs, false)?;
    let shards = load_shards(&args.parts)?;
    let parts: Vec<_> = shards
        .iter()
        .map(|s| (s.report.clone(), s.info.clone()))
        .collect();
    let r = merge(&parts)?;
    let w = report::writer::write_merged_folder(
        &args.out,
        &shards,
        &r,
        &output::command_line(),
        || Ok(()),
    )?;
    for f in w.files {
        eprintln!("kvtrail: wrote {}", term(&f.display().to_string()));
    }
    eprintln!(
        "kvtrail: evidence digest (blake3 of evidence.json): {}",
        w.digest
    );
    output::print(args.json, &r, |out| {
        out.write_all(report::human(&r).as_bytes())
    })?;
    Ok(0)
}
