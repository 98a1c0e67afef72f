//! `kvtrail sql --dialect D [--trace-path URI] [--out FILE]`: print the
//! lineage of trace format v1 as SQL for DuckDB, Spark or Trino,
//! specialised on the trace's manifest (pools, from_engine_start, complete)
//! or on flags when the manifest is not at hand (a warehouse table).

use std::io::Write;
use std::path::PathBuf;

use kvtrail::sql::{Dialect, MAX_COPY_LEVELS, SqlOptions, generate, levels, levels_for_chain};
use kvtrail::trace::TraceRoot;

use crate::cli::progress::BarReporter;

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
    /// Pointer-jumping levels for copy chains: chains of up to 2^N - 1
    /// copies are resolved; longer ones are counted in
    /// kvtrail_coverage.copies_unresolved. Default: from the data when the
    /// trace's files can be read (a replay finds its longest copy chain);
    /// else from the manifest: enough for any chain when copies form a DAG
    /// over the pools, 6 (63 copies) when pools may copy both ways (a
    /// `cache` or `mixed` pool beside another).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u8).range(1..=MAX_COPY_LEVELS as i64))]
    pub copy_levels: Option<u8>,
    /// Spark: the folder (URI) the materialised stages are written to, as
    /// Parquet, and read back from; it must be writable by every executor
    /// (a shared file system or object store on a cluster). Default:
    /// ${spark.sql.warehouse.dir}/kvtrail-scratch/<16 hex digits of the
    /// trace path's blake3>.
    #[arg(long, value_name = "URI")]
    pub spark_scratch: Option<String>,
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
            (local.is_file() || TraceRoot::names_url(&local)).then_some(local)
        }
        _ => None,
    };
    // The trace folder whose events can size the copy levels.
    let mut data_dir = None;
    let mut opts = match manifest_path {
        Some(m) => {
            let remote_dir =
                TraceRoot::names_url(&m) && m.file_name().is_none_or(|n| n != "trace.json");
            let dir = if remote_dir || m.is_dir() {
                m.clone()
            } else {
                m.parent().map(PathBuf::from).unwrap_or_default()
            };
            // The root is kept: the events are read from the same listing.
            let (root, manifest) = kvtrail::trace::Manifest::open(&dir)?;
            let path = args
                .trace_path
                .clone()
                .unwrap_or_else(|| dir.display().to_string());
            let mut o = SqlOptions::from_manifest(&manifest, dialect, &path);
            data_dir = Some((root, dir.clone()));
            if let Some(p) = &args.pools {
                o.pools = p.clone();
                o.copy_levels = o.copy_levels.max(levels(p.len()));
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
                copy_levels: levels(pools.len()),
                spark_scratch: None,
                pools,
                from_engine_start: args.from_engine_start,
                complete: args.complete,
                unverifiable: !args.files_listed,
            }
        }
    };
    match (args.copy_levels, &data_dir) {
        (Some(n), _) => opts.copy_levels = n as usize,
        (None, Some((root, dir))) => opts.copy_levels = data_copy_levels(root, dir, &opts),
        (None, None) => {}
    }
    if let Some(scratch) = args.spark_scratch {
        if !matches!(dialect, Dialect::Spark) {
            anyhow::bail!(
                "--spark-scratch is for --dialect spark only (DuckDB keeps its stages in memory, Trino in the target schema)"
            );
        }
        opts.spark_scratch = Some(scratch);
    }
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

/// The copy levels the trace's own events need: a replay measures its
/// longest copy chain (`lineage::chains`), and the levels resolve exactly
/// that. When the events cannot be
/// read or replayed (a remote folder out of reach, rows the native reader
/// refuses), the manifest's levels stay, and stderr says why.
fn data_copy_levels(root: &TraceRoot, dir: &std::path::Path, opts: &SqlOptions) -> usize {
    let measured = kvtrail::trace::Trace::open_at(root.clone(), dir)
        .and_then(|t| kvtrail::lineage::chains::copy_chains(&t, &BarReporter::default()));
    match measured {
        Ok(ch) => {
            let k = levels_for_chain(ch.longest);
            let pairs: Vec<String> = ch.edges.iter().map(|(a, b)| format!("{a}->{b}")).collect();
            eprintln!(
                "kvtrail: copy levels from the trace's events: longest copy chain {} ({}); {k} pointer-jumping {}",
                kvtrail::words::count(ch.longest, "copy", "copies"),
                if pairs.is_empty() {
                    "no copies".to_string()
                } else {
                    format!("copies between pools {}", pairs.join(", "))
                },
                kvtrail::words::noun(k as u64, "level", "levels"),
            );
            k
        }
        Err(e) => {
            eprintln!(
                "kvtrail: the trace's events could not be replayed to size the copy levels ({}); using {} from the manifest (pass --copy-levels N to choose)",
                kvtrail::text::term_message(&e.to_string()),
                kvtrail::words::count(opts.copy_levels as u64, "level", "levels"),
            );
            opts.copy_levels
        }
    }
}
