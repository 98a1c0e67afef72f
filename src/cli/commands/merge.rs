//! `kvtrail merge OUT_DIRS... --out DIR`: combine the `scope --pools LIST
//! --out DIR` folders of shards (disjoint pools covering the deployment)
//! into the report of a single run, written the same way (summary.json,
//! responses.csv, tenants.csv, findings.parquet: byte for byte).

use std::io::Write;
use std::path::PathBuf;

use kvtrail::report;
use kvtrail::report::text::term;
use kvtrail::scope::ScopeReport;
use kvtrail::scope::merge::{SHARD_FILE, ShardInfo, merge};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Shard output folders (each from `kvtrail scope --pools LIST --out DIR`).
    #[arg(required = true, value_name = "OUT_DIRS")]
    pub parts: Vec<PathBuf>,
    /// Write the merged report here (a new or empty folder outside the shard folders; owner-only files).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Print the merged report as JSON on stdout (default: the one-screen summary).
    #[arg(long)]
    pub json: bool,
}

fn load<T>(
    p: &std::path::Path,
    what: &str,
    parse: impl Fn(&[u8]) -> serde_json::Result<T>,
) -> anyhow::Result<T> {
    let text = std::fs::read(p).map_err(|e| {
        anyhow::anyhow!(
            "{}: {e}; each folder must come from `kvtrail scope --pools LIST --out DIR` ({what})",
            p.display()
        )
    })?;
    parse(&text).map_err(|e| {
        anyhow::anyhow!(
            "{}: not a kvtrail {what} ({e}); was it written by this kvtrail version?",
            p.display()
        )
    })
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let inputs: Vec<&std::path::Path> = args.parts.iter().map(|p| p.as_path()).collect();
    kvtrail::custody::prepare_out(&args.out, "merge", &inputs, false)?;
    let mut parts = Vec::new();
    for d in &args.parts {
        let r = load(
            &d.join("summary.json"),
            "scope summary",
            ScopeReport::from_json,
        )?;
        let s: ShardInfo = load(&d.join(SHARD_FILE), "shard file", |b| {
            serde_json::from_slice(b)
        })?;
        parts.push((r, s));
    }
    let r = merge(&parts)?;
    for f in report::write_out(&r, &args.out)? {
        eprintln!("kvtrail: wrote {}", term(&f.display().to_string()));
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
