//! `kvtrail merge OUT_DIRS... --out DIR`: combine the `scope --pools LIST
//! --out DIR` folders of shards (disjoint pools covering the deployment)
//! into the report of a single run, written the same way (summary.json,
//! responses.csv, tenants.csv, findings.parquet: byte for byte).

use std::io::Write;
use std::path::PathBuf;

use kvtrail::report;
use kvtrail::scope::ScopeReport;
use kvtrail::scope::merge::{SHARD_FILE, ShardInfo, merge};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Shard output folders (each from `kvtrail scope --pools LIST --out DIR`).
    #[arg(required = true, value_name = "OUT_DIRS")]
    pub parts: Vec<PathBuf>,
    /// Write the merged report here.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Print the merged report as JSON on stdout (default: the one-screen summary).
    #[arg(long)]
    pub json: bool,
}

fn load<T: serde::de::DeserializeOwned>(p: &std::path::Path, what: &str) -> anyhow::Result<T> {
    let text = std::fs::read_to_string(p).map_err(|e| {
        anyhow::anyhow!(
            "{}: {e}; each folder must come from `kvtrail scope --pools LIST --out DIR` ({what})",
            p.display()
        )
    })?;
    serde_json::from_str(&text).map_err(|e| {
        anyhow::anyhow!(
            "{}: not a kvtrail {what} ({e}); was it written by this kvtrail version?",
            p.display()
        )
    })
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let mut parts = Vec::new();
    for d in &args.parts {
        let r: ScopeReport = load(&d.join("summary.json"), "scope summary")?;
        let s: ShardInfo = load(&d.join(SHARD_FILE), "shard file")?;
        parts.push((r, s));
    }
    let r = merge(&parts)?;
    for f in report::write_out(&r, &args.out)? {
        eprintln!("kvtrail: wrote {}", f.display());
    }
    let mut out = std::io::stdout().lock();
    if args.json {
        out.write_all(report::to_json(&r).as_bytes())?;
    } else {
        out.write_all(report::human(&r).as_bytes())?;
    }
    out.flush()?;
    Ok(0)
}
