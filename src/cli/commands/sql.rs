//! `kvtrail sql --dialect D [--trace-path URI] [--out FILE]`: print the
//! lineage of trace format v1 as SQL for DuckDB, Spark or Trino,
//! specialised on the trace's manifest (pools, from_engine_start, complete)
//! or on flags when the manifest is not at hand (a warehouse table).

use std::io::Write;
use std::path::PathBuf;

use kvtrail::sql::{Dialect, SqlOptions, generate};

/// SQL dialect on the command line.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum DialectArg {
    /// DuckDB (read_parquet over <path>/kv/**/*.parquet).
    Duckdb,
    /// Spark SQL (parquet views with recursive file lookup; local or cluster).
    Spark,
    /// Trino (tables <catalog.schema>.kv and .requests; CTAS for the findings).
    Trino,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Target engine.
    #[arg(long, value_enum)]
    pub dialect: DialectArg,
    /// Where the trace lives: a directory or URI (s3://..., gs://...) for
    /// DuckDB and Spark, `catalog.schema` for Trino (each part a plain
    /// identifier or "double-quoted"). Default: --manifest's folder.
    #[arg(long, value_name = "URI")]
    pub trace_path: Option<String>,
    /// Read pools, from_engine_start, complete and the files list from this
    /// trace.json (or trace directory; local or s3://, gs://, az://, http(s)://).
    /// Default: <trace-path>/trace.json when that is a local path or a URL.
    #[arg(long, value_name = "PATH")]
    pub manifest: Option<PathBuf>,
    /// Pool ids (comma-separated) when no manifest is read.
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub pools: Option<Vec<u16>>,
    /// Without a manifest: the capture began with the engine (never-written reads are blank).
    #[arg(long)]
    pub from_engine_start: bool,
    /// Without a manifest: the recorder closed cleanly.
    #[arg(long)]
    pub complete: bool,
    /// Without a manifest: trace.json lists its files with digests.
    #[arg(long)]
    pub files_listed: bool,
    /// Write the SQL here instead of stdout.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let dialect = match args.dialect {
        DialectArg::Duckdb => Dialect::Duckdb,
        DialectArg::Spark => Dialect::Spark,
        DialectArg::Trino => Dialect::Trino,
    };
    let manifest_path = match (&args.manifest, &args.trace_path) {
        (Some(m), _) => Some(m.clone()),
        (None, Some(p)) if args.pools.is_none() => {
            let local = PathBuf::from(p).join("trace.json");
            // A trace in object storage: its trace.json is read there.
            (local.is_file() || kvtrail::trace::files::is_remote(&local)).then_some(local)
        }
        _ => None,
    };
    let opts = match manifest_path {
        Some(m) => {
            let remote_dir = kvtrail::trace::files::is_remote(&m)
                && m.file_name().is_none_or(|n| n != "trace.json");
            let dir = if remote_dir || m.is_dir() {
                m.clone()
            } else {
                m.parent().map(PathBuf::from).unwrap_or_default()
            };
            let manifest = kvtrail::trace::Manifest::load(&dir)?;
            let path = args
                .trace_path
                .clone()
                .unwrap_or_else(|| dir.display().to_string());
            let mut o = SqlOptions::from_manifest(&manifest, dialect, &path);
            if let Some(p) = &args.pools {
                o.pools = p.clone();
            }
            o
        }
        None => {
            let Some(pools) = args.pools.clone() else {
                anyhow::bail!(
                    "no manifest: give --manifest TRACE/trace.json, a local --trace-path holding trace.json, or --pools LIST (with --from-engine-start / --complete / --files-listed as the capture was)"
                );
            };
            let Some(path) = args.trace_path.clone() else {
                anyhow::bail!("no manifest: give --trace-path (directory, URI or catalog.schema)");
            };
            SqlOptions {
                dialect,
                trace_path: path,
                pools,
                from_engine_start: args.from_engine_start,
                complete: args.complete,
                unverifiable: !args.files_listed,
            }
        }
    };
    let sql = generate(&opts)?;
    match &args.out {
        Some(f) => {
            std::fs::write(f, &sql)
                .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", f.display()))?;
            eprintln!("kvtrail: wrote {}", f.display());
        }
        None => {
            let mut out = std::io::stdout().lock();
            out.write_all(sql.as_bytes())?;
            out.flush()?;
        }
    }
    Ok(0)
}
